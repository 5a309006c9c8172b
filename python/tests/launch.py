"""Starts one process per rank, as torchrun would, with the engine's file-store rendezvous
(STRATA_RDZV_DIR) and one run id, and waits for all of them."""
import os
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    """A port p free with p + 1 (strata's store takes p + 1 where torch.distributed holds p)."""
    import socket
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):  # taken, or port 65535
                continue
            return port


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
