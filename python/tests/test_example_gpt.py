"""tools/main.sh's job, examples/train_gpt.py on 2 ranks with its own config (ZeRO-3, the
optimizer on NVMe, the parameters on cpu, groups under 1024 elements persistent, the rest
released after use): the same losses as with every group kept gathered (threshold 1e9)."""
import json
import os
import random

import pytest

torch = pytest.importorskip("torch")

from launch import launch  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
STEPS = 12


def train(tmp, config, text):
    out = tmp / "out"
    outs = launch(tmp, os.path.join(EXAMPLES, "train_gpt.py"), lambda r, nvme: [
        "--config", config, "--text", text, "--steps", STEPS, "--out", out,
        "--nvme-path", tmp / "swap", "--threads", 1], world=2, timeout_s=600)
    for rc, log in outs:
        assert rc == 0, log
    with open(out / "summary.json") as f:
        return json.load(f)["losses"]


def test_default_config_trains_like_every_group_kept(tmp_path):
    rng = random.Random(5)
    words = ["the", "king", "shall", "speak", "to", "thee", "of", "love", "and", "war", "my"]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)))
    config = os.path.join(EXAMPLES, "ds_gpt_zero3_nvme.json")
    with open(config) as f:
        kept = json.load(f)
    assert kept["zero_optimization"]["stage3_param_persistence_threshold"] < 10**5
    kept["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9
    kept_path = tmp_path / "kept.json"
    kept_path.write_text(json.dumps(kept))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    losses = train(tmp_path / "a", config, text)
    kept_losses = train(tmp_path / "b", kept_path, text)
    assert len(losses) == STEPS
    assert losses == pytest.approx(kept_losses, rel=1e-5)
    assert losses[-1] < losses[0]
