"""DeepSpeed's tensor-fragment reads (deepspeed.utils.safe_get_full_fp32_param,
safe_get_full_optimizer_state and the local forms) on strata: after a few steps each parameter's
fp32 master and Adam moments equal torch AdamW's own (its param and opt.state), at stages 1 and 3
with the optimizer in DRAM or on NVMe and at stage 0; a frozen parameter has its values and no
moments; the local form is the rank's part at stage 3; gradient reads and the writes are refused
by name, as are parameters no engine trains."""
import pytest

torch = pytest.importorskip("torch")
import strata as deepspeed  # noqa: E402  (deepspeed.utils.safe_get_full_fp32_param, ...)

from models import batch, ds_config, make_model  # noqa: E402

STEPS, LR, WD = 3, 1e-2, 0.01


def torch_run(kind):
    model = make_model(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(kind, step)).backward()
        opt.step()
    return model, opt


def strata_run(kind, stage, offload, tmp_path):
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    model = make_model(kind)
    engine = deepspeed.initialize(model=model, model_parameters=[
        p for p in model.parameters() if p.requires_grad], config=cfg)[0]
    for step in range(STEPS):
        loss = engine(*batch(kind, step))
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
    with pytest.raises(deepspeed.StrataError, match="grad is not an optimizer state"):
        engine._engine.read_state(gi, "grad")
    with pytest.raises(ValueError, match="unknown state kind 'moment'"):
        engine._engine.read_state(gi, "moment")
    engine.close()


def test_gradients_writes_and_foreign_parameters_are_refused(tmp_path):
    model, engine = strata_run("mlp", 2, "cpu", tmp_path)
    p = next(model.parameters())
    utils = deepspeed.utils
    for name in ("safe_get_full_grad", "safe_set_full_fp32_param",
                 "safe_set_full_optimizer_state", "safe_get_local_grad"):
        with pytest.raises(NotImplementedError, match=f"{name}: not supported by strata"):
            getattr(utils, name)(p)
    with pytest.raises(ValueError, match="not trained by a strata engine"):
        utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    engine.close()
