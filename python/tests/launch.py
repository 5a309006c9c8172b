"""Starts one process per rank, as torchrun would, with the engine's file-store rendezvous
(STRATA_RDZV_DIR) and one run id, and waits for all of them."""
import os
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, script, argv, world=2, timeout_ms=60000, timeout_s=280, tcp=False):
    """Runs `script` (in this directory) on `world` ranks; argv(rank, nvme_dir) gives a rank's
    arguments (nvme_dir: a directory of its own under tmp_path). Returns [(returncode, output)].
    tcp: the ranks meet through rank 0's TCP store on MASTER_ADDR:MASTER_PORT (torchrun's way)
    instead of the file store."""
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir(mode=0o700)
    run_id = uuid.uuid4().hex[:8]
    meet = {"STRATA_RDZV_DIR": str(rdzv)}
    if tcp:
        meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "STRATA_RDZV_SECRET": uuid.uuid4().hex}
    running = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   TEST_TIMEOUT_MS=str(timeout_ms), STRATA_RUN_ID=run_id, **meet,
                   PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        if tcp:
            env.pop("STRATA_RDZV_DIR", None)
        nvme = tmp_path / f"nvme{r}"
        nvme.mkdir()
        args = [sys.executable, os.path.join(HERE, script), *map(str, argv(r, nvme))]
        running.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in running:
        out, _ = p.communicate(timeout=timeout_s)
        outs.append((p.returncode, out))
    return outs
