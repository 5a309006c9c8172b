"""DeepSpeed's tensor-fragment reads (deepspeed.utils.safe_get_full_fp32_param,
safe_get_full_optimizer_state and the local forms) on strata: after a few steps each parameter's
fp32 master and Adam moments equal torch AdamW's own (its param and opt.state), at stages 1 and 3
with the optimizer in DRAM or on NVMe and at stage 0; a frozen parameter has its values and no
moments; the local form is the rank's part at stage 3; between backward and step the gradient
read equals torch's p.grad (micro-steps averaged), and is None outside that window; the writes
(safe_set_full_fp32_param, safe_set_full_optimizer_state, the local forms) set what the next
steps train from as torch's do; gradient writes are refused by name, as are parameters no
engine trains."""
import pytest

torch = pytest.importorskip("torch")
import strata as deepspeed  # noqa: E402  (deepspeed.utils.safe_get_full_fp32_param, ...)

from models import batch, ds_config, make_model  # noqa: E402

STEPS, LR, WD = 3, 1e-2, 0.01


def on(device, xs):
    return tuple(x.to(device) for x in xs)


def torch_run(kind, device="cpu"):
    model = make_model(kind).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD,
                            foreach=False)  # the engine's order on a GPU too
    for step in range(STEPS):
        opt.zero_grad()
        model(*on(device, batch(kind, step))).backward()
        opt.step()
    return model, opt


def strata_run(kind, stage, offload, tmp_path, device="cpu"):
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    model = make_model(kind).to(device)
    engine = deepspeed.initialize(model=model, model_parameters=[
        p for p in model.parameters() if p.requires_grad], config=cfg)[0]
    assert engine.device.type == device
    for step in range(STEPS):
        loss = engine(*on(device, batch(kind, step)))
        engine.backward(loss)
        engine.step()
    return model, engine


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "cpu"), (3, "none"), (3, "nvme")])
def test_masters_and_moments_equal_torch_adamws(stage, offload, tmp_path):
    ref, opt = torch_run("gpt")
    model, engine = strata_run("gpt", stage, offload, tmp_path)
    utils = deepspeed.utils
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        master = utils.safe_get_full_fp32_param(p)
        assert master.dtype == torch.float32 and master.shape == q.shape, name
        torch.testing.assert_close(master, q.detach(), atol=2e-5, rtol=1e-4, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            got = utils.safe_get_full_optimizer_state(p, key)
            torch.testing.assert_close(got, opt.state[q][key], atol=1e-6, rtol=1e-3,
                                       msg=f"{name} {key}")
        assert utils.safe_get_full_optimizer_state(p, "step") is None  # DeepSpeed: None
        if stage == 3:  # one rank: its part is all of it
            local = utils.safe_get_local_optimizer_state(p, "exp_avg")
            assert torch.equal(local, utils.safe_get_full_optimizer_state(p, "exp_avg").reshape(-1))
            assert local.numel() == p.ds_tensor.numel()
    if stage < 3:
        with pytest.raises(ValueError, match="only at ZeRO stage 3"):
            utils.safe_get_local_fp32_param(next(model.parameters()))
    engine.close()


def test_a_frozen_parameter_has_its_values_and_no_moments(tmp_path):
    model, engine = strata_run("gptfe", 3, "cpu", tmp_path)  # the tied embedding frozen
    frozen = model.wte.weight
    want = make_model("gptfe").wte.weight.detach()
    assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(frozen), want)
    assert deepspeed.utils.safe_get_full_optimizer_state(frozen, "exp_avg") is None
    # The engine's own answers (Engine::ReadOptimizerState), which the adapter keeps from users.
    gi = engine._group_of[id(frozen)]
    with pytest.raises(deepspeed.StrataError, match="is frozen and has no exp_avg"):
        engine._engine.read_state(gi, "exp_avg")
    with pytest.raises(deepspeed.StrataError, match="is frozen and has no grad"):
        engine._engine.read_state(gi, "grad")
    assert deepspeed.utils.safe_get_full_grad(frozen) is None
    with pytest.raises(deepspeed.StrataError, match="param16 is not an optimizer state"):
        engine._engine.read_state(gi, "param16")
    with pytest.raises(ValueError, match="unknown state kind 'moment'"):
        engine._engine.read_state(gi, "moment")
    engine.close()


@pytest.mark.parametrize("stage,offload,gas", [(0, "none", 1), (2, "cpu", 2), (3, "nvme", 2)])
def test_gradient_reads_equal_torchs_between_backward_and_step(stage, offload, gas, tmp_path):
    """safe_get_full_grad after the backwards of a step (gas micro-steps: their mean, as the
    step uses it) against torch's p.grad of the same micro-batches, summed and divided by gas;
    the local form at stage 3 is the rank's part; None before any backward and after the step
    (DeepSpeed: no gradient then)."""
    kind = "gpt"
    ref = make_model(kind)
    for micro in range(gas):
        (ref(*batch(kind, micro)) / gas).backward()
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path), gas=gas)
    model = make_model(kind)
    engine = deepspeed.initialize(model=model, config=cfg)[0]
    utils = deepspeed.utils
    p0 = next(model.parameters())
    assert utils.safe_get_full_grad(p0) is None  # no backward yet
    for micro in range(gas):  # DeepSpeed's loop: step() after every micro-step's backward
        engine.backward(engine(*batch(kind, micro)))
        if micro < gas - 1:
            engine.step()  # not a boundary: no optimizer step, the gradient accumulates
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        got = utils.safe_get_full_grad(p)
        assert got.dtype == torch.float32 and got.shape == q.shape, name
        torch.testing.assert_close(got, q.grad, atol=1e-6, rtol=1e-4, msg=name)
        if stage == 3:
            assert torch.equal(utils.safe_get_local_grad(p), got.reshape(-1))  # one rank
    engine.step()
    assert utils.safe_get_full_grad(p0) is None  # the step consumed it
    engine.close()


def writes_against_torch(stage, offload, tmp_path, device="cpu"):
    """After 3 steps, safe_set_full_fp32_param on one parameter and safe_set_full_optimizer_state
    (exp_avg, exp_avg_sq) on another (at stage 3 the moments through the local forms, the rank's
    part being all of it on one rank): each reads back as written, the working parameter is the
    new master at once, and two more steps train as torch AdamW does after the same writes to
    its parameter and opt.state."""
    ref, opt = torch_run("gpt", device)
    model, engine = strata_run("gpt", stage, offload, tmp_path, device)
    utils = deepspeed.utils
    (wname, w), (mname, m) = list(model.named_parameters())[1:3]
    rw, rm = dict(ref.named_parameters())[wname], dict(ref.named_parameters())[mname]
    g = torch.Generator().manual_seed(5)
    value = 0.1 * torch.randn(w.ds_shape, generator=g)
    avg = 1e-3 * torch.randn(m.ds_shape, generator=g)
    avg_sq = 1e-5 * torch.rand(m.ds_shape, generator=g)  # on the host: the engine reads them
    utils.safe_set_full_fp32_param(w, value)
    if stage == 3:
        utils.safe_set_local_optimizer_state(m, avg.reshape(-1), "exp_avg")
        utils.safe_set_local_optimizer_state(m, avg_sq.reshape(-1), "exp_avg_sq")
    else:
        utils.safe_set_full_optimizer_state(m, avg, "exp_avg")
        utils.safe_set_full_optimizer_state(m, avg_sq, "exp_avg_sq")
    with torch.no_grad():
        rw.copy_(value.to(device))
        opt.state[rm]["exp_avg"].copy_(avg.to(device))
        opt.state[rm]["exp_avg_sq"].copy_(avg_sq.to(device))
    assert torch.equal(utils.safe_get_full_fp32_param(w), value)
    assert torch.equal(utils.safe_get_full_optimizer_state(m, "exp_avg"), avg)
    assert torch.equal(utils.safe_get_full_optimizer_state(m, "exp_avg_sq"), avg_sq)
    with engine.gathered_parameters():
        assert torch.equal(w.detach().cpu(), value)  # fp32 working params: the master itself
    for step in range(STEPS, STEPS + 2):
        opt.zero_grad()
        ref(*on(device, batch("gpt", step))).backward()
        opt.step()
        engine.backward(engine(*on(device, batch("gpt", step))))
        engine.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(utils.safe_get_full_fp32_param(p), q.detach().cpu(),
                                   atol=2e-5, rtol=1e-4, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(utils.safe_get_full_optimizer_state(p, key),
                                       opt.state[q][key].cpu(), atol=1e-6, rtol=1e-3,
                                       msg=f"{name} {key}")
    engine.close()


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "none"), (3, "nvme")])
def test_writes_set_the_state_the_next_steps_train_from(stage, offload, tmp_path):
    writes_against_torch(stage, offload, tmp_path)


def test_bad_writes_and_foreign_parameters_are_refused(tmp_path):
    """Gradients stay read-only (named); a wrong size, an unknown key and the local forms below
    stage 3 are ValueErrors; a frozen parameter's write does nothing, as DeepSpeed's; a
    parameter no engine trains is named."""
    model, engine = strata_run("mlp", 2, "cpu", tmp_path)
    p = next(model.parameters())
    utils = deepspeed.utils
    for name in ("safe_set_full_grad", "safe_set_local_grad"):
        with pytest.raises(NotImplementedError, match=f"{name}: not supported by strata"):
            getattr(utils, name)(p, torch.zeros(p.ds_shape))
    with pytest.raises(ValueError, match=r"3 values given for '.*', which has \d+"):
        utils.safe_set_full_fp32_param(p, torch.zeros(3))
    with pytest.raises(ValueError, match="optim_state_key 'step'"):
        utils.safe_set_full_optimizer_state(p, torch.zeros(p.ds_shape), "step")
    with pytest.raises(ValueError, match="only at ZeRO stage 3"):
        utils.safe_set_local_fp32_param(p, torch.zeros(p.ds_shape).reshape(-1))
    with pytest.raises(ValueError, match="not trained by a strata engine"):
        utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    engine.close()
    model, engine = strata_run("gptfe", 3, "cpu", tmp_path / "frozen")
    frozen = model.wte.weight
    before = utils.safe_get_full_fp32_param(frozen)
    utils.safe_set_full_fp32_param(frozen, torch.zeros_like(before))
    assert torch.equal(utils.safe_get_full_fp32_param(frozen), before)
    gi = engine._group_of[id(frozen)]
    with pytest.raises(deepspeed.StrataError, match="is frozen and has no optimizer state"):
        engine._engine.write_state(gi, 0, "master32", lambda g, p, b, e: before.reshape(-1)[b:e]
                                   .numpy())
    engine.close()


def test_a_collective_read_on_one_rank_only_names_the_call_when_it_times_out(tmp_path):
    """safe_get_full_fp32_param under `if rank == 0:` at stage 2: a collective that rank 0 waits
    in alone (DeepSpeed hangs there too); at the timeout its error names the call and says it is
    collective, where it named only the communicator's all_gather."""
    from launch import launch
    outs = launch(tmp_path, "collective_read_worker.py", lambda r, nvme: [], timeout_ms=3000)
    for rc, out in outs:
        assert rc == 0, out
    assert "read_param_state (strata.utils.safe_get_*): a collective" in outs[0][1], outs[0][1]
