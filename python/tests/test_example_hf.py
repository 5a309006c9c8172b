"""examples/hf_finetune.py (a LoRA fine-tune of a random-init Llama through strata's Hugging Face
Trainer: ZeRO-3, parameters on cpu, the optimizer on NVMe, the config examples/
ds_hf_lora_zero3_nvme.json all "auto") for a few steps in one process: the loss falls on its
synthetic data, and it writes summary.json, the adapter and (with matplotlib) the plot."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
from strata.integrations import transformers as st  # noqa: E402

if st.unsupported_reason() is not None:  # transformers older than the integration's minimum
    pytest.skip(st.unsupported_reason(), allow_module_level=True)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
STEPS = 30


def test_hf_finetune_runs_and_loss_falls(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "hf_finetune.py"), "--steps", str(STEPS),
         "--samples", "512", "--layers", "2", "--hidden", "128", "--heads", "4",
         "--kv-heads", "2", "--out", str(out), "--nvme-path", str(tmp_path / "swap"),
         "--threads", "1", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
        env={k: v for k, v in os.environ.items()  # one process: no rank variables (accelerate
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")})  # reads them)
    assert proc.returncode == 0, proc.stdout
    with open(out / "summary.json") as f:
        summary = json.load(f)
    losses = summary["losses"]
    assert len(losses) == STEPS
    assert summary["loss_end"] < summary["loss_start"] - 0.3, losses
    assert summary["trainable_params"] < summary["params"] / 5  # LoRA: the base is frozen
    # The optimizer's state is NVMe-homed (this small an adapter's stays cached in host memory,
    # so nvme_io_bytes may be 0); the engines close at exit, leaving no swap file behind.
    assert "optimizer offload nvme" in summary["layout"]
    assert (tmp_path / "swap").is_dir() and not list((tmp_path / "swap").rglob("*.swp"))
    assert os.path.isfile(out / "adapter" / "adapter_model.safetensors")
    try:
        import matplotlib  # noqa: F401
        assert os.path.isfile(out / "hf_finetune.png")
    except ImportError:
        assert "matplotlib is not installed" in proc.stdout
    assert "loss " in proc.stdout and "step    30/30" in proc.stdout
