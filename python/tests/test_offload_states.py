"""engine.offload_states() / reload_states() (Engine::OffloadStates): the device lent to other
work between steps. DeepSpeedExamples' offload_states.py runs with its imports changed, its own
memory checks passing, and trains as it does without offloading; in one process every stage and
placement trains across an offload to the same bits, the engine refuses to train while offloaded
(naming reload_states), and include / device take DeepSpeed's values; a PEFT LoRA Llama lent
out between steps and generating, as an RL loop does, trains to the same bits."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
from strata.accelerator import get_accelerator  # noqa: E402
from strata.runtime.zero.offload_config import (OffloadDeviceEnum,  # noqa: E402
                                                OffloadStateTypeEnum)

from launch import HERE  # noqa: E402
from models import batch, ds_config, make_model  # noqa: E402
from test_ds_script import LAUNCHER_KEYS, offloadctl  # noqa: E402

STEPS = 3


def run_example(tmp_path, name, ranks, *extra):
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(HERE, "offload_states_worker.py"), "--hidden_dim", "64",
           "--nlayers", "2", "--iteration", "4", "--warmup", "1", "--out", str(out), *extra]
    if ranks == 2:
        cmd = [offloadctl(), "launch", "-n", "2", "--local-rank-arg", "--"] + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("ranks", [1, 2])
def test_deepspeed_offload_states_example_trains_as_without_offloading(tmp_path, ranks):
    if ranks == 2 and torch.cuda.is_available():
        pytest.skip("a GPU is present: two ranks would need two")
    lent = run_example(tmp_path, "lent", ranks, "--pin_memory")
    plain = run_example(tmp_path, "plain", ranks, "--no_offload")
    assert len(lent["alloc"]) == 4
    for before, after, reloaded in lent["alloc"]:
        assert after < before / 10 and reloaded == before  # the states left, and came back
    assert lent["losses"] == plain["losses"]
    assert lent["weights"] == plain["weights"]
    only_adam = run_example(tmp_path, "adam", ranks, "--included_state", "optim_states")
    assert only_adam["losses"] == plain["losses"]
    for before, after, _ in only_adam["alloc"]:
        assert after < before and after > lent["alloc"][0][1]  # the params stayed


CASES = [(0, "none"), (2, "none"), (3, "none"), (3, "cpu"), (3, "nvme")]


def train(engine, steps, lend):
    losses, freed = [], []
    for step in range(steps):
        loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if lend:
            before = get_accelerator().memory_allocated()
            engine.offload_states()
            assert engine.states_offloaded or before == get_accelerator().memory_allocated()
            freed.append(before - get_accelerator().memory_allocated())
            with pytest.raises(RuntimeError, match="reload_states"):
                engine(*batch("gpt", step))
            engine.reload_states()
            assert not engine.states_offloaded
            assert get_accelerator().memory_allocated() == before
    return losses, freed


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_training_across_an_offload_gives_the_same_bits(stage, offload, tmp_path):
    def start():
        cfg = ds_config(stage, offload, dtype="bf16", nvme_path=str(tmp_path))
        return strata.initialize(model=make_model("gpt"), config=cfg)[0]

    plain = start()
    ref_losses, _ = train(plain, STEPS, lend=False)
    ref = plain.read_master()
    plain.close()
    lent = start()
    losses, freed = train(lent, STEPS, lend=True)
    assert losses == ref_losses
    for n, v in lent.read_master().items():
        assert torch.equal(v, ref[n]), n
    # What lives on the device is what leaves: everything but a few small buffers.
    assert all(f > 0 for f in freed) or offload == "nvme"
    lent.close()


def test_include_and_device_take_deepspeeds_values():
    engine = strata.initialize(model=make_model("gpt"), config=ds_config(3, dtype="bf16"))[0]
    engine.backward(engine(*batch("gpt", 0)))
    engine.step()
    full = get_accelerator().memory_allocated()
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    adam_gone = get_accelerator().memory_allocated()
    engine.offload_states(include=["lp_params", OffloadStateTypeEnum.hp_params])
    more_gone = get_accelerator().memory_allocated()
    assert full > adam_gone > more_gone
    engine.reload_states()
    assert get_accelerator().memory_allocated() == full
    with pytest.raises(ValueError, match="NVMe"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="optim_state'.*OffloadStateTypeEnum"):
        engine.offload_states(include=["optim_state"])
    with pytest.warns(UserWarning, match="nothing moved"):
        engine.offload_states(device="none")
    assert not engine.states_offloaded
    engine.offload_states(include=[OffloadStateTypeEnum.contiguous_grad_buffer])
    assert not engine.states_offloaded  # only the buffers were dropped: nothing to reload
    engine.backward(engine(*batch("gpt", 1)))
    engine.step()
    engine.offload_states()
    with pytest.raises(RuntimeError, match="offload"):
        engine.save_checkpoint("/nonexistent-strata-dir")
    engine.reload_states()
    engine.close()



@pytest.mark.parametrize("stage", [2, 3])
def test_a_peft_lora_llama_lends_the_device_out_between_steps(stage):
    """An RL-style loop on code nobody here wrote: a transformers Llama with a PEFT LoRA adapter
    (the base frozen), each step followed by offload_states / reload_states and a greedy
    engine.generate(), gives the same losses, generations and weights as without lending."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from test_hf_trainer import SEQ, VOCAB, tiny_llama

    def run(lend):
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        engine = strata.initialize(model=model, config=ds_config(stage, dtype="bf16"))[0]
        losses, generated = [], []
        for step in range(STEPS):
            x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step))
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if lend:
                engine.offload_states()
                assert engine.states_offloaded
                engine.reload_states()
            with torch.no_grad():
                generated.append(engine.generate(input_ids=x[:, :4], max_new_tokens=4,
                                                 do_sample=False).tolist())
        master = engine.read_master()
        engine.close()
        return losses, generated, master

    ref_losses, ref_generated, ref_master = run(lend=False)
    losses, generated, master = run(lend=True)
    assert losses == ref_losses and generated == ref_generated
    assert master.keys() == ref_master.keys()
    assert any("lora_" in n for n in master)
    for n, v in master.items():
        assert torch.equal(v, ref_master[n]), n
