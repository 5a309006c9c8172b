"""DeepSpeedEngine calls beyond forward/backward/step: backward(scale_wrt_gas=False),
set_gradient_accumulation_boundary, no_sync (stages 0-1; two processes in test_distributed.py),
global_samples, and what engine.module.state_dict() holds at each stage."""
import os

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, ds_config, make_model  # noqa: E402
from test_adapter import (LR, LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, WD,  # noqa: E402
                          check_against_torch)

STEPS, GAS = 3, 2


def run(stage, micro_step, steps=STEPS, gas=GAS):
    """Trains the mlp; micro_step(engine, step, m) runs one micro-step. Returns per-step loss
    sums (mean when each micro-step's loss counts 1/gas), master weights, the engine."""
    model = make_model("mlp")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, gas=gas, lr=LR, wd=WD))
    losses = []
    for step in range(steps):
        losses.append(sum(micro_step(engine, step, m) for m in range(gas)) / gas)
    return losses, engine.read_master(), engine


def plain(engine, step, m):
    loss = engine(*batch("mlp", step, m))
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_backward_scale_wrt_gas_false_sums_the_micro_steps():
    def summed(engine, step, m):
        loss = engine(*batch("mlp", step, m))
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.item()
    losses, master, engine = run(1, summed)
    engine.close()
    # torch: the micro-steps' gradients summed (each loss not divided by gas)
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    ref = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for m in range(GAS):
            loss = model(*batch("mlp", step, m))
            loss.backward()
            total += loss.item() / GAS
        ref.append(total)
        opt.step()
    assert losses == pytest.approx(ref, rel=LOSS_RTOL)
    for n, p in model.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)


def test_set_gradient_accumulation_boundary_overrides_the_count():
    def overridden(engine, step, m):
        engine.set_gradient_accumulation_boundary(m == GAS - 1)
        assert engine.is_gradient_accumulation_boundary() == (m == GAS - 1)
        return plain(engine, step, m)

    def early(engine, step, m):  # every micro-step a boundary: a step per micro-step
        engine.set_gradient_accumulation_boundary(True)
        return plain(engine, step, m)
    base_losses, base, e0 = run(2, plain)
    losses, master, e1 = run(2, overridden)
    assert losses == base_losses and e1.global_steps == e0.global_steps == STEPS
    for n in base:
        assert torch.equal(master[n], base[n]), n
    _, _, e2 = run(2, early)
    assert e2.global_steps == STEPS * GAS
    for e in (e0, e1, e2):
        e.close()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_and_matches_torch(stage):
    def first_unsynced(engine, step, m):
        if m == GAS - 1:
            return plain(engine, step, m)
        with engine.no_sync():
            loss = plain(engine, step, m)
        assert engine.module.fc1.weight.grad is not None  # kept, not reduced
        return loss
    losses, master, engine = run(stage, first_unsynced)
    assert engine.module.fc1.weight.grad is None
    engine.close()
    check_against_torch("mlp", losses, master, steps=STEPS, gas=GAS)


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_with_partitioned_gradients(stage):
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(stage))
    with pytest.raises(AssertionError, match=f"incompatible with gradient partitioning logic "
                                             f"of ZeRO stage {stage}"):
        with engine.no_sync():
            pass
    engine.close()


def test_global_samples_at_boundaries_and_after_load(tmp_path):
    """As DeepSpeed: steps x train_batch_size (micro 4 x gas 2 x 1 rank), advanced at each
    boundary only; kept by the checkpoint."""
    _, _, engine = run(3, plain, steps=2)
    assert engine.global_steps == 2 and engine.micro_steps == 4
    assert engine.global_samples == 2 * 4 * GAS
    engine.save_checkpoint(tmp_path)
    engine.backward(engine(*batch("mlp", 9)))
    engine.step()  # a micro-step short of the boundary: not counted yet
    assert engine.global_samples == 2 * 4 * GAS
    engine.backward(engine(*batch("mlp", 10)))
    engine.step()
    assert engine.global_samples == 3 * 4 * GAS
    engine.close()
    other, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3, gas=GAS))
    other.load_checkpoint(tmp_path)
    assert (other.global_steps, other.micro_steps, other.global_samples) == (2, 4, 16)
    other.close()
    # Resumed with another accumulation count (gas 1 saved, 2 now): the first micro-step after
    # the load opens a window, it does not close one (the saved count would put it at one).
    one, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3, gas=1))
    for i in range(3):
        one.backward(one(*batch("mlp", i)))
        one.step()
    one.save_checkpoint(tmp_path / "gas1")
    one.close()
    two, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3, gas=GAS))
    two.load_checkpoint(tmp_path / "gas1")
    assert not two.is_gradient_accumulation_boundary()
    two.backward(two(*batch("mlp", 3)))
    two.step()
    assert two.global_steps == 3 and not two.was_step_applied()
    two.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_module_state_dict(stage):
    """Stages 0-2: the whole parameters (the engine's current weights); stage 3: empty tensors
    outside GatheredParameters, as DeepSpeed."""
    model = make_model("mlp")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage))
    sd = model.state_dict()
    if stage < 3:
        master = engine.read_master()
        assert all(torch.equal(sd[n], master[n]) for n in master)
    else:
        assert all(t.numel() == 0 for t in sd.values())
        with strata.zero.GatheredParameters(model.parameters()):
            assert model.state_dict()["fc1.weight"].shape == (40, 16)
    engine.close()


def test_was_step_applied_and_skipped_steps_follow_the_fp16_scaler():
    """fp16 from a loss scale of 2^24: the first steps overflow and are skipped (the scale
    halves each time) until one applies. was_step_applied() says which, as DeepSpeed's, and is
    False between accumulation boundaries; skipped_steps counts the skipped ones."""
    cfg = ds_config(2, gas=2, lr=LR, wd=WD)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}
    model = make_model("mlp").half()
    engine, opt, _, _ = strata.initialize(model=model, config=cfg)
    assert not engine.was_step_applied() and engine.skipped_steps == 0
    # DeepSpeed's optimizer.loss_scaler and dynamic_loss_scale, as scripts read them.
    assert opt.dynamic_loss_scale and opt.loss_scaler.dynamic
    assert opt.loss_scaler.cur_scale == opt.loss_scaler.loss_scale == 2.0 ** 24
    applied = []
    for step in range(40):
        for m in range(2):
            x, y = batch("mlp", step, m)
            loss = engine(x.half(), y)  # the mlp takes its loss in fp32
            engine.backward(loss)
            engine.step()
            if m == 0:
                assert not engine.was_step_applied()  # not a boundary
        applied.append(engine.was_step_applied())
        assert applied[-1] == (not engine.last_step_report["skipped"])
        if applied[-1]:
            break
    assert applied[0] is False and applied[-1] is True, applied
    assert engine.skipped_steps == applied.count(False) == engine.global_steps - 1
    assert opt.loss_scaler.cur_scale == 2.0 ** (24 - applied.count(False)) == opt.cur_scale
    engine.close()


def test_fp16_accumulation_scales_the_loss_it_divides_as_deepspeed():
    """DeepSpeed's backward divides the loss by gradient_accumulation_steps, then the fp16
    optimizer scales it: the 16-bit gradients are (loss / gas) x scale, and overflow there. A
    static scale that overflows a micro-step's undivided gradient (loss x scale) but not the
    divided one trains every step, as under DeepSpeed (each step was skipped), and the fp16
    gradient torch makes in that order is finite."""
    gas, scale = 4, 2.0 ** 19  # the mlp's largest gradient at this batch: 0.22
    cfg = ds_config(2, gas=gas, lr=LR, wd=WD)
    cfg["fp16"] = {"enabled": True, "loss_scale": scale}
    model = make_model("mlp").half()
    reference = make_model("mlp").half()  # DeepSpeed's order, in fp16
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    assert engine.optimizer.cur_scale == scale
    x, y = batch("mlp", 0, 0)

    def finite_grads(loss_factor):
        reference.zero_grad()
        (reference(x.half(), y) * loss_factor).backward()
        return all(torch.isfinite(p.grad).all() for p in reference.parameters())
    assert finite_grads(scale / gas) and not finite_grads(scale)  # the premise
    for _ in range(2 * gas):
        engine.backward(engine(x.half(), y))
        engine.step()
    assert engine.skipped_steps == 0 and engine.global_steps == 2
    engine.close()


SCHEDULE = (1, 1, 2, 2, 3)  # each step's gradient_accumulation_steps


def torch_with_schedule():
    """torch AdamW stepping once per len-`gas` run of micro-batches, each loss / gas."""
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    losses = []
    for step, gas in enumerate(SCHEDULE):
        opt.zero_grad()
        total = 0.0
        for m in range(gas):
            loss = model(*batch("mlp", step, m)) / gas
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses, model


@pytest.mark.parametrize("stage,offload", [(1, "none"), (3, "cpu")])
def test_set_train_batch_size_changes_the_accumulation_as_torch(stage, offload):
    """Batch-size warm-up as DeepSpeed's scripts do it: set_train_batch_size between steps, the
    micro-batch fixed (4), the accumulation following; the boundaries land where the running
    micro-step count says (here on each schedule change, the counts chosen so)."""
    ref_losses, model = torch_with_schedule()
    engine = strata.initialize(model=make_model("mlp"),
                               config=ds_config(stage, offload, lr=LR, wd=WD))[0]
    losses = []
    for step, gas in enumerate(SCHEDULE):
        if gas != engine.gradient_accumulation_steps():
            engine.set_train_batch_size(4 * gas)
        assert engine.train_batch_size() == 4 * gas == engine.gradient_accumulation_steps() * 4
        total = 0.0
        for m in range(gas):
            loss = engine(*batch("mlp", step, m))
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary() == (m == gas - 1)
            if m < gas - 1:
                with pytest.raises(Exception, match="between steps"):
                    engine.set_train_batch_size(8)  # a gradient of this step is in
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    assert engine.global_steps == len(SCHEDULE)
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    master = engine.read_master()
    for n, p in model.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)
    with pytest.raises(ValueError, match="divisible by micro-batch data parallelism"):
        engine.set_train_batch_size(6)
    engine.set_train_micro_batch_size(2)
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.train_batch_size() == 6
    engine.close()


def test_set_train_batch_size_refused_where_gradients_are_kept_as_reduced():
    """One rank, accumulation 1, bf16 with the optimizer offloaded: each gradient is kept as
    reduced, in bf16, so the accumulation cannot grow; the run keeps training."""
    engine = strata.initialize(model=make_model("gpt"),
                               config=ds_config(2, "cpu", dtype="bf16"))[0]
    with pytest.raises(Exception, match="gradient_accumulation_steps > 1"):
        engine.set_train_batch_size(8)
    assert engine.gradient_accumulation_steps() == 1
    engine.backward(engine(*batch("gpt", 0)))
    engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_config_warnings_are_logged_once_at_initialize(caplog):
    """What `offloadctl config check` warns about reaches a script's log at initialize (rank 0,
    each warning once per process): a misspelt key, and DeepSpeed's 16-bit state keys, which
    strata reads and does not act on (it keeps fp32 masters and moments: the run needs their
    bytes)."""
    import strata.engine as strata_engine
    strata_engine._CONFIG_WARNED.clear()
    cfg = ds_config(3, dtype="bf16")
    cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    cfg["zero_optimization"]["overlap_comn"] = True
    with caplog.at_level("WARNING", logger="strata"):
        for _ in range(2):
            engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
            engine.close()
    texts = [r.getMessage() for r in caplog.records if r.name == "strata"]
    for want in ("bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states",
                 "did you mean 'overlap_comm'"):
        assert sum(want in t for t in texts) == 1, (want, texts)
    assert len(texts) == 3, texts


def _torch_style(engine, step, m):
    """DeepSpeed's torch-style backward: the script calls loss.backward() itself."""
    loss = engine(*batch("mlp", step, m))
    loss.backward()
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_backward_called_by_the_script_trains_as_engine_backward(stage):
    """loss.backward() then engine.step(), without engine.backward (DeepSpeed 0.18+ at stages 1-3;
    strata at every stage): the same bits as engine.backward's run, micro-steps averaged; the
    returned loss of engine.backward is DeepSpeed's, divided by gradient_accumulation_steps."""
    want_losses, want, engine = run(stage, plain)
    engine.close()
    losses, got, engine = run(stage, _torch_style)
    assert engine.global_steps == STEPS
    engine.close()
    assert losses == want_losses
    for n in want:
        assert torch.equal(got[n], want[n]), n
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(stage, gas=2))
    loss = engine(*batch("mlp", 0, 0))
    assert torch.equal(engine.backward(loss), loss / 2)
    engine.close()


def test_loss_backward_with_fp16_needs_engine_scale():
    """fp16 scales the loss: a direct loss.backward() is refused, naming engine.scale, before any
    gradient is taken; engine.scale(loss).backward() trains as engine.backward."""
    cfg = ds_config(2, gas=2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}

    def loss_of(engine, step, m):
        x, y = batch("mlp", step, m)
        return engine(x.half(), y)  # the mlp takes its loss in fp32

    def by_engine(engine, step, m):
        loss = loss_of(engine, step, m)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def scaled(engine, step, m):
        loss = loss_of(engine, step, m)
        engine.scale(loss).backward()
        engine.step()
        return loss.item()
    results = []
    for micro_step in (by_engine, scaled):
        engine, _, _, _ = strata.initialize(model=make_model("mlp").half(), config=cfg)
        results.append([micro_step(engine, s, m) for s in range(2) for m in range(2)])
        results.append(engine.read_master())
        assert engine.global_steps == 2
        engine.close()
    assert results[0] == results[2]
    for n in results[1]:
        assert torch.equal(results[1][n], results[3][n]), n
    engine, _, _, _ = strata.initialize(model=make_model("mlp").half(), config=cfg)
    with pytest.raises(RuntimeError, match=r"engine\.scale\(loss\)\.backward\(\)"):
        loss_of(engine, 0, 0).backward()
    engine.close()


class _CheckpointedNet(torch.nn.Module):
    """Trainable parameters only inside reentrant activation checkpoints, and in the embedding,
    whose gradient comes last: the first parameter gradient of a backward is computed in a
    checkpoint's own inner autograd pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 8)
        self.head.requires_grad_(False)

    def forward(self, x, y):
        import torch.utils.checkpoint as ckpt
        h = self.emb(x)
        for b in self.blocks:
            h = ckpt.checkpoint(lambda t, b=b: torch.tanh(b(t)), h, use_reentrant=True)
        return torch.nn.functional.mse_loss(self.head(h), y)


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_through_reentrant_checkpoints(stage):
    """The script's own backward through reentrant checkpoints: its end is autograd's outermost
    pass, not the first checkpoint's (whose end would close the micro-step half-way)."""
    out = []
    for use_engine in (True, False):
        engine, _, _, _ = strata.initialize(model=_CheckpointedNet(),
                                            config=ds_config(stage, gas=2))
        for s in range(2):
            for m in range(2):
                loss = engine(*batch("mlp", s, m))
                engine.backward(loss) if use_engine else loss.backward()
                engine.step()
        out.append(engine.read_master())
        engine.close()
    for n in out[0]:
        assert torch.equal(out[0][n], out[1][n]), n


@pytest.mark.parametrize("stage", [1, 3])
def test_autograd_grad_through_an_output_is_no_backward_of_the_script(stage):
    """torch.autograd.grad of the loss by the input (a saliency map, a gradient penalty) reaches
    no parameter: it ends no micro-step, and engine.backward after it trains as without it."""
    def with_input_grad(engine, step, m):
        x, y = batch("mlp", step, m)
        x.requires_grad_(True)
        loss = engine(x, y)
        (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
        assert gx.shape == x.shape
        engine.backward(loss)
        engine.step()
        return loss.item()
    want_losses, want, engine = run(stage, plain)
    engine.close()
    losses, got, engine = run(stage, with_input_grad)
    engine.close()
    assert losses == want_losses
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_config_file_with_comments_and_autos_left_for_a_trainer(tmp_path):
    """A config file that opens with a comment (DeepSpeed's reader and `offloadctl config check`
    take comments) is read as a file, not as JSON text; "auto" values a trainer fills are a
    ConfigError naming each key instead of a bare int() error, except in DeepSpeed's config-model
    sections, where DeepSpeed's initialize drops them (zero_optimization.stage: its default 0)."""
    import json
    path = tmp_path / "ds.json"
    path.write_text("// ZeRO-2, the mlp\n" + json.dumps(ds_config(2), indent=1) + "\n")
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=str(path))
    assert engine.zero_optimization_stage() == 2
    engine.close()
    cfg = ds_config(2)
    cfg["gradient_accumulation_steps"] = "auto"
    cfg["zero_optimization"]["stage"] = "auto"
    left = r'"auto" is left.*at gradient_accumulation_steps;'
    with pytest.raises(strata.ConfigError, match=left):
        strata.initialize(model=make_model("mlp"), config=cfg)
    del cfg["gradient_accumulation_steps"]
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    assert engine.zero_optimization_stage() == 0
    engine.close()


def test_deepspeed_engine_names_scripts_read_have_deepspeeds_types():
    """What DeepSpeed scripts read off the engine and its optimizer, with DeepSpeed's types:
    get_global_grad_norm() a tensor (RL trainers log `.item()` of it), optimizer.cur_scale
    (Megatron-style loggers), loss_scale() and dynamic_loss_scale() as methods on the config's
    fp16 section, dp_world_size, training_dataloader and deepspeed_io."""
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
    cfg = ds_config(2)
    cfg["fp16"] = {"enabled": False, "loss_scale": 128}
    engine, opt, loader, _ = strata.initialize(model=make_model("mlp"), config=cfg,
                                               training_data=data)
    assert engine.get_global_grad_norm() is None
    assert engine.loss_scale() == 128.0 and not engine.dynamic_loss_scale()
    assert opt.cur_scale == 1.0 == opt.loss_scale
    assert not opt.dynamic_loss_scale and not opt.loss_scaler.dynamic  # fp16 off
    assert engine.dp_world_size == 1 and engine.mp_world_size == 1
    assert engine.training_dataloader is loader and len(loader) == 3  # 10 samples, micro 4
    loader.data_sampler.set_epoch(1)  # DeepSpeedDataLoader's name for its sampler
    assert loader.data_sampler is loader.sampler
    assert sorted(x.item() for (b,) in loader for x in b) == list(range(10))
    assert not engine.dataloader_drop_last()
    ordered = engine.deepspeed_io(data, batch_size=3, route="eval")
    assert [x.item() for (b,) in ordered for x in b] == list(range(10))  # eval: in order
    engine.backward(engine(*batch("mlp", 0)))
    engine.step()
    norm = engine.get_global_grad_norm()
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    assert norm.item() == pytest.approx(engine.last_step_report["grad_norm"]) and norm.item() > 0
    engine.close()
    plain, _, loader, _ = strata.initialize(model=make_model("mlp"),
                                            config=dict(ds_config(2), dataloader_drop_last=True),
                                            training_data=data)
    assert plain.loss_scale() == 0.0 and plain.dynamic_loss_scale()  # DeepSpeed's default
    assert len(loader) == 2 and len(plain.deepspeed_io(data, batch_size=3)) == 3  # drop_last
    plain.close()


def test_an_iterable_dataset_on_several_ranks_is_refused(monkeypatch):
    """Every rank would iterate the whole stream (DeepSpeed's DistributedSampler refuses it for
    want of len()); on one rank it is the whole data, as there."""
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(6.0).unsqueeze(1))
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(2))
    assert [b.shape[0] for b in engine.deepspeed_io(Stream())] == [4, 2]
    monkeypatch.setattr(type(engine), "world_size", property(lambda self: 2))
    with pytest.raises(TypeError, match="IterableDataset on 2 ranks would give each rank the "
                                        "whole stream"):
        engine.deepspeed_io(Stream())
    monkeypatch.undo()
    engine.close()


def test_a_malformed_config_file_is_named_in_the_error(tmp_path):
    """initialize(config=path) and the Trainer's TrainingArguments(deepspeed=path) with a file
    that is not JSON: the error names the file and the line (the Trainer's said the file did not
    exist)."""
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2,\n')
    with pytest.raises(strata.ConfigError, match=f"invalid DeepSpeed config {bad}:\nline 2"):
        strata.initialize(model=make_model("mlp"), config=str(bad))
    st = pytest.importorskip("strata.integrations.transformers")
    with pytest.raises(ValueError, match=f"deepspeed=...\\): invalid DeepSpeed config {bad}"):
        st.TrainingArguments(output_dir=str(tmp_path), deepspeed=str(bad), use_cpu=True,
                             report_to=[])


def test_a_callable_optimizer_builds_the_client_optimizer_as_deepspeed():
    """optimizer= a callable (an optimizer class, a lambda, a partial) is called with the model's
    parameters, or model_parameters, and trains as the optimizer it returns."""
    cfg = ds_config(2)
    del cfg["optimizer"]
    runs = []
    for make in (lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD),
                 lambda m: (lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD))):
        model = make_model("mlp")
        engine, opt, _, _ = strata.initialize(model=model, config=cfg, optimizer=make(model))
        assert opt.param_groups[0]["lr"] == LR
        for step in range(2):
            engine.backward(engine(*batch("mlp", step)))
            engine.step()
        runs.append(engine.read_master())
        engine.close()
    for n, p in runs[0].items():
        assert torch.equal(p, runs[1][n]), n
    engine, opt, _, _ = strata.initialize(model=make_model("mlp"), config=cfg,
                                          optimizer=torch.optim.Adam)  # the class: its defaults
    assert opt.param_groups[0]["lr"] == 1e-3
    engine.close()


def test_a_config_passed_twice_is_refused_as_deepspeed_does(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(__import__("json").dumps(ds_config(2)))
    args = __import__("argparse").Namespace(deepspeed_config=str(path), local_rank=-1)
    with pytest.raises(ValueError, match="args.deepspeed_config"):
        strata.initialize(args=args, model=make_model("mlp"), config=ds_config(3))


def test_a_lazy_module_before_its_first_forward_is_refused_naming_it():
    """nn.LazyLinear's parameters have no shape until a forward: refused at initialize, naming
    them; after one forward the model trains as any other."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0\.weight', '0\.bias' are uninitialized .*forward"):
        strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    model(torch.zeros(1, 6))
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    loss = engine(torch.ones(2, 6)).square().mean()
    engine.backward(loss)
    engine.step()
    assert engine.read_master()["0.weight"].shape == (4, 6)
    engine.close()


class _Spectral(torch.nn.Module):
    """A Fourier-layer-style model with a parameter of `dtype` beside float32 ones."""

    def __init__(self, dtype, requires_grad=True):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.odd = torch.nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=requires_grad)

    def forward(self, x):
        return (self.fc(x) * self.odd.real.to(x.dtype)).square().mean()


@pytest.mark.parametrize("dtype,bf16,refused", [
    (torch.complex64, False, "has dtype torch.complex64"),
    (torch.complex64, True, "has dtype torch.complex64"),
    (torch.int64, False, "has dtype torch.int64"),
    (torch.bool, True, "has dtype torch.bool"),
    (torch.float64, False, "is float64; .*model.float"),
    (torch.float64, True, None)])
def test_a_parameter_the_engine_cannot_hold_is_refused_naming_it(dtype, bf16, refused):
    """The engine keeps float32 masters and float32 / 16-bit working copies: a complex, integer
    or boolean parameter (which would lose its values) and a float64 one under fp32 (its
    precision) are refused at initialize, naming the parameter; under bf16 a float64 parameter
    is cast with the others, as DeepSpeed casts the module."""
    model = _Spectral(dtype, requires_grad=dtype.is_floating_point or dtype.is_complex)
    cfg = ds_config(0, dtype="bf16" if bf16 else "fp32")
    if refused is None:
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
        loss = engine(torch.ones(2, 4, dtype=torch.bfloat16))
        engine.backward(loss)
        engine.step()
        assert engine.module.odd.dtype == torch.bfloat16 and engine.global_steps == 1
        engine.close()
        return
    with pytest.raises(ValueError, match="parameter odd " + refused):
        strata.initialize(model=model, config=cfg)
    assert model.odd.dtype == dtype  # untouched
    if dtype.is_floating_point:  # an empty one is left out of the engine: no refusal
        model.odd = torch.nn.Parameter(torch.empty(0, dtype=dtype))
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
        engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gradient_the_engine_did_not_take_is_refused_at_the_step(stage):
    """A gradient assigned to p.grad (torch.autograd.grad's, a MAML / PCGrad script's) never
    reaches the engine: the boundary step refuses, naming the parameter, where it would apply
    without it; engine.zero_grad() drops it and training goes on as a run without it."""
    want_losses, want, engine = run(stage, plain)
    engine.close()

    def assigned_first(engine, step, m):
        if step == 0 and m == GAS - 1:
            loss = engine(*batch("mlp", step, m))
            params = list(engine.module.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
            with pytest.raises(RuntimeError, match=r"gradient in fc1\.weight\.grad that the "
                                                   r"engine did not take.*autograd\.grad"):
                engine.step()
            engine.zero_grad()
        return plain(engine, step, m)
    losses, got, engine = run(stage, assigned_first)
    engine.close()
    assert losses == want_losses
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_a_window_whose_backwards_all_ran_in_no_sync_is_refused_at_the_step():
    """no_sync() keeps its gradients for the next backward outside it; a boundary step with none
    after them would step without them (DeepSpeed steps on the unreduced local gradients)."""
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(0, gas=GAS))
    for m in range(GAS):
        with engine.no_sync():
            engine.backward(engine(*batch("mlp", 0, m)))
        if m < GAS - 1:
            engine.step()
    with pytest.raises(RuntimeError, match=r"fc1\.weight\.grad .*inside no_sync\(\)"):
        engine.step()
    engine.close()
    # Only the window's last backward inside no_sync(): named the same way.
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(0, gas=GAS))
    engine.backward(engine(*batch("mlp", 0, 0)))
    engine.step()
    with engine.no_sync():
        engine.backward(engine(*batch("mlp", 0, 1)))
    with pytest.raises(RuntimeError, match=r"fc1\.weight\.grad .*inside no_sync\(\)"):
        engine.step()
    engine.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_in_place_write_to_a_trainable_parameter_is_named_once(stage, tmp_path):
    """Stages 0-2 keep fp32 masters (as DeepSpeed's ZeRO and bf16/fp16 optimizers): a trainable
    parameter written in place (nn.Embedding(max_norm=...) renormalises its rows in forward, a
    no_grad write, load_state_dict) is lost at the next step or save, which says so once, naming
    it; at stage 3 the forward that wrote it says so, or the step where a persistent parameter
    (whole between steps) was written before it. A write through
    GatheredParameters(modifier_rank=0) and plain training say nothing."""
    import warnings

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=max_norm),
                                   torch.nn.Flatten(), torch.nn.Linear(8, 1))

    def notices(seen):
        return [str(w.message) for w in seen if "modified in place" in str(w.message)]

    tokens = torch.tensor([[1, 2], [3, 4]])
    for max_norm, want in ((None, 0), (0.5, 1)):
        model = make()
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with strata.zero.GatheredParameters(model[2].bias, modifier_rank=0):
                with torch.no_grad():
                    model[2].bias.fill_(0.5)  # the sanctioned write before the first step
            for _ in range(2):
                engine.backward(engine(tokens).square().mean())
                engine.step()
        got = notices(seen)
        assert len(got) == want, got
        if want:
            assert "'0.weight'" in got[0]
            assert ("the step" if stage < 3 else "forward of module '0'") in got[0]
        engine.close()
    if stage == 3:  # a persistent parameter is whole between steps: written there, named
        max_norm = None
        model = make()
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
        engine.backward(engine(tokens).square().mean())
        with torch.no_grad():
            model[2].weight.masked_fill_(model[2].weight.abs() < 0.1, 0.0)  # AdaLoRA's masking
        with pytest.warns(UserWarning, match=r"'2\.weight' were modified in place.*the step"):
            engine.step()
        engine.close()
        return
    model = make()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
    model.load_state_dict(make().state_dict())
    with pytest.warns(UserWarning, match=r"'0\.weight', '2\.weight', '2\.bias' were modified "
                                         r"in place.*the checkpoint works from them"):
        engine.save_checkpoint(tmp_path)
    engine.close()


class _SparseNet(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8, sparse=sparse)
        self.bag = torch.nn.EmbeddingBag(20, 8, mode="sum", sparse=sparse)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, idx, y):
        h = self.emb(idx).mean(1) + self.bag(idx)
        return torch.nn.functional.mse_loss(self.head(h), y)


@pytest.mark.parametrize("stage,gas", [(0, 2), (2, 1), (3, 2)])
def test_sparse_embedding_gradients_train_as_the_dense_module(stage, gas):
    """nn.Embedding / nn.EmbeddingBag(sparse=True) give sparse gradients, which the engine takes
    dense (it reduces and steps dense gradients; DeepSpeed's sparse allreduce is for stage 0):
    the run equals torch AdamW on the same modules built with sparse=False."""
    def data(step, micro):
        g = torch.Generator().manual_seed(10 * step + micro)
        return torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 3, generator=g)

    torch.manual_seed(0)
    model = _SparseNet(sparse=True)
    torch.manual_seed(0)
    ref = _SparseNet(sparse=False)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD,
                                                                      gas=gas))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(3):
        opt.zero_grad()
        for micro in range(gas):
            loss = engine(*data(step, micro))
            engine.backward(loss)
            engine.step()
            ref_loss = ref(*data(step, micro))
            (ref_loss / gas).backward()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        opt.step()
    master = engine.read_master()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)
    engine.close()


_TIMEOUT_SCRIPT = r"""
import datetime, os, sys, torch
import strata
from strata.engine import _engine_timeout_ms
assert _engine_timeout_ms(1234) == 1234
if sys.argv[1] == "script":     # the script's own group: its timeout is the engine's
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1, timeout=datetime.timedelta(minutes=17))
elif sys.argv[1] == "init_distributed":
    strata.init_distributed(timeout=datetime.timedelta(minutes=25))
elif sys.argv[1] == "default":  # strata starts the group: DeepSpeed's DEEPSPEED_TIMEOUT
    strata.init_distributed()
print(_engine_timeout_ms(None))
"""


@pytest.mark.parametrize("how,env,want_minutes", [
    ("script", {}, 17), ("init_distributed", {}, 25), ("default", {"DEEPSPEED_TIMEOUT": "3"}, 3),
    ("default", {}, 10), ("none", {"DEEPSPEED_TIMEOUT": "7"}, 7)])
def test_engine_timeout_is_the_process_groups_as_deepspeeds(how, env, want_minutes):
    """The engine waits for a collective as long as DeepSpeed's would: the torch.distributed
    group's timeout, else DEEPSPEED_TIMEOUT minutes (10)."""
    import subprocess
    import sys
    environ = {k: v for k, v in os.environ.items() if k != "DEEPSPEED_TIMEOUT"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environ.pop(k, None)
    out = subprocess.run([sys.executable, "-c", _TIMEOUT_SCRIPT, how], env={**environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == want_minutes * 60000


class _WithDeviceMarker(torch.nn.Module):
    """A zero-element parameter beside the trained ones (the device-tracking idiom)."""

    def __init__(self, marker: bool):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        if marker:
            self.marker = torch.nn.Parameter(torch.empty(0))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_zero_element_parameter_is_left_out_as_deepspeed_does(stage, tmp_path):
    """nn.Parameter(torch.empty(0)) has nothing to train: left as it is (DeepSpeed's ZeRO leaves
    empty parameters out), where initialize refused the model ("dimension 0 is not positive").
    The rest trains as without it, and a checkpoint saves and loads."""
    masters = []
    for marker in (False, True):
        torch.manual_seed(0)
        model = _WithDeviceMarker(marker)
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage))
        torch.manual_seed(1)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 4)))
            engine.step()
        masters.append(engine.read_master())
        if marker:
            assert model.marker.shape == (0,) and "marker" in engine.module.state_dict()
            assert engine.save_checkpoint(tmp_path)
            path, _ = engine.load_checkpoint(tmp_path)
            assert path is not None and engine.read_master().keys() == masters[0].keys()
        engine.close()
    assert masters[0].keys() == masters[1].keys()
    for n in masters[0]:
        assert torch.equal(masters[0][n], masters[1][n]), n
