"""Resuming under strata from a checkpoint real DeepSpeed wrote (engine.load_checkpoint on a
DeepSpeed directory; strata.utils.deepspeed_checkpoint reads it). The fixtures under
data/deepspeed/ were written by DeepSpeed 0.19.8 with make_deepspeed_checkpoints.py there (its
docstring says how): TinyLM trained 4 steps at ZeRO stage 0-3, fp32/bf16/fp16, 1 or 2 ranks, then
saved (and transformers' GPT-2 with its tied head), with DeepSpeed's own safe_get_full_* read-out
of every state and its next 2 steps in reference.pt. strata must hold exactly those states after loading, at any stage and placement,
and train on as DeepSpeed did."""
import os
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
from strata.utils import (safe_get_full_fp32_param,  # noqa: E402
                          safe_get_full_optimizer_state)

from launch import launch  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
sys.path.insert(0, DATA)
import make_deepspeed_checkpoints as fixture  # noqa: E402

FIXTURES = sorted(d for d in os.listdir(DATA) if os.path.isdir(os.path.join(DATA, d)))


def reference(name: str) -> dict:
    return torch.load(os.path.join(DATA, name, "reference.pt"), weights_only=True)


def strata_config(ref: dict, stage: int, offload: str = "none") -> dict:
    """The fixture's DeepSpeed config at strata's `stage` and `offload` (optimizer and, at stage
    3, params)."""
    cfg = fixture.make_config(0, ref["dtype"])
    cfg["optimizer"]["params"].pop("torch_adam", None)
    cfg["zero_optimization"] = {"stage": stage}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": offload}
    return cfg


def build(ref: dict, stage: int, offload: str = "none"):
    model = fixture.build_model(ref["frozen_param"] is not None, ref["model"])
    engine, _, _, _ = strata.initialize(model=model, model_parameters=fixture.param_groups(model),
                                        config=strata_config(ref, stage, offload))
    return model, engine


def check_loaded(model, engine, ref: dict) -> None:
    """Every state as DeepSpeed read it out, bit for bit, and the counters."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(safe_get_full_fp32_param(p), ref["frozen"][name].float()), name
            continue
        assert torch.equal(safe_get_full_fp32_param(p), ref["fp32"][name]), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(safe_get_full_optimizer_state(p, kind), ref[kind][name]), \
                (name, kind)
    assert engine.global_steps == ref["global_steps"]
    assert engine.skipped_steps == ref["skipped_steps"]
    assert engine.global_samples == ref["global_samples"]
    assert engine.get_lr() == pytest.approx(ref["lr"], rel=1e-12)
    if ref["dtype"] == "fp16":
        assert engine.optimizer.loss_scale == ref["loss_scale"]


def train_on(model, engine, ref: dict) -> list:
    """DeepSpeed's steps 5 and 6 at one rank: every DeepSpeed rank's micro-batch in one (the loss
    a mean over equal parts, so the gradient is DeepSpeed's average over its ranks)."""
    losses = []
    for step in (5, 6):
        parts = [fixture.get_batch(r, step) for r in range(ref["world_size"])]
        batch = tuple(torch.cat(t) for t in zip(*parts))
        loss = fixture.compute_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_after(after: dict, ref: dict) -> None:
    """The fp32 weights after DeepSpeed's steps 5 and 6. fp32: each within 1e-6, only the order
    in which the ranks' gradients are summed differs. 16-bit: the forward's rounding differs
    (with the thread count too), DeepSpeed averages bf16 gradients in bf16 where strata does in
    fp32, and Adam turns the rounding noise of a gradient that is noise (an attention key's
    bias) into lr-sized steps; so the whole model's difference, against the two steps' change:
    under 5 % (measured 0.005-2 % at one and two threads; the same run with Adam's moments not
    loaded is off by 134-170 %)."""
    if ref["dtype"] == "fp32":
        for name, v in after.items():
            torch.testing.assert_close(v, ref["after"][name], rtol=1e-6, atol=1e-6, msg=name)
        return
    off = sum((v - ref["after"][n]).pow(2).sum() for n, v in after.items()).sqrt()
    moved = sum((ref["after"][n] - ref["fp32"][n]).pow(2).sum() for n in after).sqrt()
    assert off < 0.05 * moved, (off, moved)


def check_trained_on(model, engine, ref: dict) -> None:
    check_after({n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()
                 if p.requires_grad}, ref)
    assert engine.global_steps == ref["global_steps_after"]
    assert engine.skipped_steps == ref["skipped_steps_after"]
    assert engine.get_lr() == pytest.approx(ref["lr_after"], rel=1e-12)
    if ref["dtype"] == "fp16":
        assert engine.optimizer.loss_scale == ref["loss_scale_after"]


# strata's stage and placement differ from DeepSpeed's: the states are read whole and laid out
# as this engine keeps them.
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "cpu")])
def test_a_deepspeed_checkpoint_resumes_where_deepspeed_left_off(name, stage, offload):
    ref = reference(name)
    model, engine = build(ref, stage, offload)
    path, client = engine.load_checkpoint(os.path.join(DATA, name))
    assert path == os.path.join(DATA, name, "global_step4")
    assert (client["epoch"], client["note"]) == (3, "fixture")  # and DeepSpeed's other keys
    assert client["ds_version"] == ref["deepspeed_version"]
    check_loaded(model, engine, ref)
    train_on(model, engine, ref)
    check_trained_on(model, engine, ref)
    engine.close()


@pytest.mark.parametrize("name", ["gpt2_stage3_bf16_w2", "stage2_fp32_w2_frozen",
                                  "stage1_bf16_w2_fp32accum"])
def test_zero_to_fp32_reads_a_deepspeed_checkpoint(tmp_path, name):
    """strata.utils' zero_to_fp32 (DeepSpeed's API) on DeepSpeed's own checkpoint: the fp32
    masters, the frozen values, the tied head (the same tensor) and the buffers."""
    from strata.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                           get_fp32_state_dict_from_zero_checkpoint)
    ref = reference(name)
    sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(DATA, name))
    model = fixture.build_model(ref["frozen_param"] is not None, ref["model"])
    assert set(sd) == set(model.state_dict())
    for n in ref["fp32"]:
        assert torch.equal(sd[n], ref["fp32"][n]), n
    for n in ref["frozen"]:
        assert torch.equal(sd[n], ref["frozen"][n]), n
    if ref["model"] == "gpt2":
        assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    convert_zero_checkpoint_to_fp32_state_dict(os.path.join(DATA, name), tmp_path / "out.bin")
    model.load_state_dict(torch.load(tmp_path / "out.bin", weights_only=True))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["fp32"].get(n, ref["frozen"].get(n))), n


def test_load_options_leave_what_they_name_fresh():
    ref = reference("stage3_bf16_w2")
    model, engine = build(ref, 2)
    engine.load_checkpoint(os.path.join(DATA, "stage3_bf16_w2"), load_optimizer_states=False,
                           load_lr_scheduler_states=False)
    for name, p in model.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p), ref["fp32"][name]), name
        assert not safe_get_full_optimizer_state(p, "exp_avg").any(), name
        assert not safe_get_full_optimizer_state(p, "exp_avg_sq").any(), name
    assert engine.global_steps == ref["global_steps"]
    assert engine.get_lr() == [0.0, 0.0]  # WarmupLR from its start: warmup_min_lr
    engine.close()

    model, engine = build(ref, 3)
    _, client = engine.load_checkpoint(os.path.join(DATA, "stage3_bf16_w2"),
                                       load_module_only=True)
    assert client["epoch"] == 3
    for name, p in model.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p), ref["fp32"][name]), name
    assert engine.global_steps == 0
    engine.close()


def copy_of(tmp_path, name: str) -> str:
    dst = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), dst)
    return str(dst)


def test_a_missing_rank_file_a_damaged_file_and_a_foreign_global_are_refused(tmp_path):
    ref = reference("stage2_fp32_w2_frozen")
    ck = copy_of(tmp_path, "stage2_fp32_w2_frozen")
    os.remove(os.path.join(ck, "global_step4", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    model, engine = build(ref, 2)
    with pytest.raises(RuntimeError, match="was saved by 2 ranks and holds 1 optimizer files"):
        engine.load_checkpoint(ck)

    ck = copy_of(tmp_path / "b", "stage2_fp32_w2_frozen")
    optim = os.path.join(ck, "global_step4", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with open(optim, "r+b") as f:
        f.truncate(os.path.getsize(optim) // 2)
    with pytest.raises(RuntimeError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt cannot be"):
        engine.load_checkpoint(ck)

    # A pickle that would run code when loaded: refused, not run.
    ck = copy_of(tmp_path / "c", "stage2_fp32_w2_frozen")
    model_file = os.path.join(ck, "global_step4", "mp_rank_00_model_states.pt")
    state = torch.load(model_file, weights_only=False)
    state["evil"] = _Evil(tmp_path / "ran")
    torch.save(state, model_file)
    with pytest.raises(RuntimeError, match="mp_rank_00_model_states.pt cannot be read"):
        engine.load_checkpoint(ck)
    assert not os.path.exists(tmp_path / "ran")
    # Nothing was changed by the refusals: the engine's own initial weights are still there.
    fresh = fixture.build_model(frozen=True)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(safe_get_full_fp32_param(p), q.detach()), name
    engine.close()


def test_a_universal_checkpoint_is_refused_pointing_at_its_source(tmp_path):
    ref = reference("stage2_fp32_w2_frozen")
    ck = copy_of(tmp_path, "stage2_fp32_w2_frozen")
    tag = os.path.join(ck, "global_step4")
    for f in os.listdir(tag):  # what ds_to_universal.py leaves: the model states and zero/
        if "optim_states" in f:
            os.remove(os.path.join(tag, f))
    os.makedirs(os.path.join(tag, "zero"))
    torch.save({"param_groups": []}, os.path.join(tag, "zero", "optimizer_state.pt"))
    model, engine = build(ref, 2)
    with pytest.raises(RuntimeError, match="universal checkpoint .* load the checkpoint it was "
                                           "converted from"):
        engine.load_checkpoint(ck)
    engine.close()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_model_that_differs_is_refused_naming_the_parameters_unless_not_strict(caplog):
    ref = reference("stage3_bf16_w2")
    model = fixture.build_model()
    model.extra = torch.nn.Linear(2, 2)
    engine, _, _, _ = strata.initialize(model=model, model_parameters=fixture.param_groups(model),
                                        config=strata_config(ref, 3))
    with pytest.raises(RuntimeError, match=r"missing: \['extra.weight', 'extra.bias'\]"):
        engine.load_checkpoint(os.path.join(DATA, "stage3_bf16_w2"))
    extra = safe_get_full_fp32_param(model.extra.weight)
    engine.load_checkpoint(os.path.join(DATA, "stage3_bf16_w2"), load_module_strict=False)
    assert "2 of the model's parameter(s) not in it" in caplog.text
    assert torch.equal(safe_get_full_fp32_param(model.extra.weight), extra)
    assert torch.equal(safe_get_full_fp32_param(model.head.weight), ref["fp32"]["head.weight"])
    engine.close()

    model = fixture.build_model()
    model.head = torch.nn.Linear(6, 12, bias=False)
    engine, _, _, _ = strata.initialize(model=model, model_parameters=fixture.param_groups(model),
                                        config=strata_config(ref, 3))
    with pytest.raises(RuntimeError, match=r"size mismatch for head.weight: \[11, 6\] in the "
                                           r"checkpoint, \[12, 6\] in the model"):
        engine.load_checkpoint(os.path.join(DATA, "stage3_bf16_w2"), load_module_strict=False)
    engine.close()


def test_a_save_without_the_frozen_parameters_keeps_the_models_own(tmp_path, caplog):
    """DeepSpeed's save_checkpoint(exclude_frozen_parameters=True), as transformers asks for a
    PEFT model: the frozen parameters are not in it; strict, the error says why; not strict,
    the model keeps its own values for them (its pretrained weights), without a warning."""
    ref = reference("stage2_fp32_w2_frozen")
    ck = copy_of(tmp_path, "stage2_fp32_w2_frozen")
    model_file = os.path.join(ck, "global_step4", "mp_rank_00_model_states.pt")
    state = torch.load(model_file, weights_only=True)
    state["frozen_param_shapes"], state["frozen_param_fragments"] = {}, {}
    torch.save(state, model_file)
    model, engine = build(ref, 3, "cpu")
    with pytest.raises(RuntimeError, match="all missing ones are frozen here: a checkpoint "
                                           "saved with exclude_frozen_parameters=True"):
        engine.load_checkpoint(ck)
    own = safe_get_full_fp32_param(model.get_parameter(fixture.FROZEN_PARAM))
    with caplog.at_level("INFO", logger="strata"):
        engine.load_checkpoint(ck, load_module_strict=False)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "1 of the model's parameter(s) not in it" in caplog.text
    assert torch.equal(safe_get_full_fp32_param(model.get_parameter(fixture.FROZEN_PARAM)), own)
    assert torch.equal(safe_get_full_fp32_param(model.head.weight), ref["fp32"]["head.weight"])
    engine.close()


def masters(model) -> dict:
    return {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}


def test_refusals_come_before_anything_is_written():
    """Mid-accumulation, another number of param groups, a buffer the checkpoint lacks: refused
    with the engine as it was."""
    ref = reference("stage2_fp32_w2_frozen")
    ck = os.path.join(DATA, "stage2_fp32_w2_frozen")
    model, engine = build(ref, 2)
    before = masters(model)
    engine.backward(fixture.compute_loss(engine, fixture.get_batch(0, 1)))
    with pytest.raises(RuntimeError, match="mid-accumulation"):
        engine.load_checkpoint(ck)
    engine.step()
    assert engine.global_steps == 1  # the refused load left the window to its step
    after_step = masters(model)
    model.register_buffer("extra", torch.zeros(2))
    with pytest.raises(RuntimeError, match="buffers differ"):
        engine.load_checkpoint(ck)
    assert all(torch.equal(masters(model)[n], v) for n, v in after_step.items())
    engine.close()

    model = fixture.build_model(True)
    engine, _, _, _ = strata.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=strata_config(ref, 3))
    before = masters(model)
    with pytest.raises(RuntimeError, match="has 2 optimizer param groups, this engine's "
                                           "optimizer 1"):
        engine.load_checkpoint(ck)
    assert all(torch.equal(masters(model)[n], v) for n, v in before.items())
    engine.load_checkpoint(ck, load_optimizer_states=False)  # the weights alone: any groups
    assert torch.equal(masters(model)["head.weight"], ref["fp32"]["head.weight"])
    engine.close()


def test_without_zero_the_weights_alone_load_with_any_param_groups():
    """load_module_only / load_optimizer_states=False without ZeRO: DeepSpeed takes the module's
    weights, the optimizer's state (keyed by place in the groups) is not needed."""
    ref = reference("stage0_fp32_w1")
    model = fixture.build_model()
    engine, _, _, _ = strata.initialize(model=model,
                                        model_parameters=fixture.param_groups(model)[::-1],
                                        config=strata_config(ref, 0))
    engine.load_checkpoint(os.path.join(DATA, "stage0_fp32_w1"), load_module_only=True)
    assert all(torch.equal(masters(model)[n], v) for n, v in ref["fp32"].items())
    engine.close()


def test_without_zero_the_param_groups_must_list_the_parameters_as_saved():
    ref = reference("stage0_fp32_w1")
    model = fixture.build_model()
    groups = fixture.param_groups(model)[::-1]
    engine, _, _, _ = strata.initialize(model=model, model_parameters=groups,
                                        config=strata_config(ref, 0))
    with pytest.raises(RuntimeError, match="pass the optimizer the same param groups"):
        engine.load_checkpoint(os.path.join(DATA, "stage0_fp32_w1"))
    engine.close()


# Two strata ranks, each on its DeepSpeed rank's batches: DeepSpeed's steps 5 and 6.
@pytest.mark.parametrize("name,stage", [("gpt2_stage3_bf16_w2", 3), ("stage2_fp32_w2_frozen", 1)])
def test_two_ranks_resume_on_their_own_batches(tmp_path, name, stage):
    out = tmp_path / "out"
    results = launch(tmp_path, "deepspeed_checkpoint_worker.py",
                     lambda r, nvme: [os.path.join(DATA, name), stage, out])
    for rc, text in results:
        assert rc == 0, text
    ref = reference(name)
    got = torch.load(f"{out}.rank0.pt", weights_only=True)
    check_after(got["after"], ref)
    assert got["loaded_equal"] and got["global_steps"] == ref["global_steps_after"]
