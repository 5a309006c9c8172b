"""A training script killed with SIGKILL mid-step leaves its swap file on the nvme_path; the same
script run again on that path trains without a manual `offloadctl clean`: the engine reclaims
the dead run's file at open and says so in one line on stderr (docs/storage.md)."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))

# The user's script: optimizer states on NVMe, `steps` steps (0: until killed). Prints
# "stepping <k>" just before each engine.step() and "done <losses>" at the end.
SCRIPT = r"""
import sys
import strata
from models import batch, ds_config, make_model

nvme, steps = sys.argv[1], int(sys.argv[2])
cfg = ds_config(3, "nvme", nvme_path=nvme)
engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
losses, step = [], 0
while steps == 0 or step < steps:
    loss = engine(*batch("mlp", step))
    engine.backward(loss)
    print(f"stepping {step}", flush=True)
    engine.step()
    losses.append(loss.item())
    step += 1
engine.close()
print("done", losses, flush=True)
"""

SWAP = "strata-swap-rank0.swp"


def start(script, nvme, steps):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(script), str(nvme), str(steps)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_mid_step(proc, at_step, timeout_s=20):
    """SIGKILL as soon as the script announces engine.step() number `at_step`."""
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.strip() == f"stepping {at_step}":
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, "the script never reached its step"
    proc.wait(timeout=timeout_s)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()


def test_rerun_after_sigkill_trains_without_a_manual_clean(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "notes.txt").write_text("the user's own file")  # not strata's: never touched

    kill_mid_step(start(script, nvme, 0), at_step=2)
    assert (nvme / SWAP).exists(), "the killed run left no swap file to reclaim"

    rerun = start(script, nvme, 3)
    out, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err
    assert "did not close cleanly" in err and f"'{nvme / SWAP}'" in err, err
    notices = [l for l in err.splitlines() if l.startswith("strata: reclaimed 1 file(s)")]
    assert len(notices) == 1, err
    done = [l for l in out.splitlines() if l.startswith("done")]
    assert done and "nan" not in done[0], out
    # The clean close removed the new swap file; the user's file is still there.
    assert sorted(p.name for p in nvme.iterdir()) == ["notes.txt"]
    assert (nvme / "notes.txt").read_text() == "the user's own file"
