"""Two processes (Gloo, file-store rendezvous through STRATA_RDZV_DIR) against torch's AdamW on
the mean of both ranks' gradients; and a rank that dies makes the other fail, not hang."""
import os
import subprocess
import sys
import uuid

import pytest

torch = pytest.importorskip("torch")

from models import reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def launch(tmp_path, kind, stage, offload, world=2, steps=STEPS, die_rank=None, timeout_ms=60000):
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir(mode=0o700)
    procs = []
    run_id = uuid.uuid4().hex[:8]
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), TEST_TIMEOUT_MS=str(timeout_ms),
                   STRATA_RDZV_DIR=str(rdzv), STRATA_RUN_ID=run_id,
                   PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
        nvme = tmp_path / f"nvme{r}"
        nvme.mkdir()
        s = -1 if r == die_rank else steps
        args = [sys.executable, os.path.join(HERE, "dist_worker.py"), kind, str(stage), offload,
                str(s), str(tmp_path / f"rank{r}.pt"), str(nvme)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "nvme")])
def test_two_processes_match_torch(tmp_path, stage, offload):
    outs = launch(tmp_path, "gpt", stage, offload)
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_losses, ref_params = reference("gpt", STEPS, 1e-2, 0.01, world=2)
    mean_losses = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in res[0]["master"].items():
        assert torch.equal(p, res[1]["master"][n]), n
        torch.testing.assert_close(p, ref_params[n], atol=2e-5, rtol=1e-4, msg=n)


def test_dead_rank_fails_the_other_with_a_message(tmp_path):
    # Rank 1 leaves right after setup: rank 0's first collective fails (no hang past the timeout).
    outs = launch(tmp_path, "mlp", 3, "cpu", die_rank=1, timeout_ms=8000)
    rc0, out0 = outs[0]
    assert rc0 != 0
    assert "StrataError" in out0, out0
    print(out0[-600:])
