"""Parameters read outside the module that owns them: a tied output head written as
`x @ self.wte.weight.t()` in the parent's forward. Stages 0-2 keep every parameter whole; stage 3
gathers a parameter read while released inside the engine's forward (registering it as an
external parameter of the running module, with a one-time notice), or ahead of time through
strata.zero.register_external_parameter. Two processes: test_distributed.py (tiedmm cases)."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, ds_config, make_model  # noqa: E402
from test_adapter import LR, WD, check_against_torch, train  # noqa: E402

NOTICE = "registered as an external parameter"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_matmul_head_matches_torch(stage):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses, params, _ = train("tiedmm", ds_config(stage, lr=LR, wd=WD), steps=3)
    check_against_torch("tiedmm", losses, params, steps=3)
    notices = [str(w.message) for w in seen if NOTICE in str(w.message)]
    if stage < 3:
        assert notices == []  # whole everywhere: nothing to gather
    else:  # once, on the first forward: named parameter and module
        assert len(notices) == 1, notices
        assert "'wte.weight'" in notices[0] and "module '<root>'" in notices[0]


def test_registered_external_parameter_is_gathered_without_notice():
    model = make_model("tiedmm")
    strata.zero.register_external_parameter(model, model.wte.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice
        losses, params, _ = train("tiedmm", ds_config(3, lr=LR, wd=WD), steps=2, model=model)
    check_against_torch("tiedmm", losses, params, steps=2)


def test_unregister_external_parameter_and_read_outside_forward_at_stage3():
    model = make_model("tiedmm")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    strata.zero.register_external_parameter(model, model.wte.weight)  # after initialize too
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append(model.wte.weight.numel()))
    engine(*batch("tiedmm", 0))
    assert seen == [37 * 32]  # the root's call holds it for the whole forward
    strata.zero.unregister_external_parameter(model, model.wte.weight)
    with pytest.warns(UserWarning, match=NOTICE):  # read again: gathered, registered again
        loss = engine(*batch("tiedmm", 0))
    engine.backward(loss)
    engine.step()
    assert model.wte.weight.numel() == 0  # outside forward: empty at stage 3, as DeepSpeed
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        strata.zero.register_external_parameter(model, torch.zeros(2))
    engine.close()


class _Returns(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self):
        return self.w


class _UsesReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.src = _Returns()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) @ self.src()).square().mean()


def test_parameter_returned_by_a_submodule_stays_gathered_for_the_caller():
    """As DeepSpeed: a parameter a module's forward returns belongs to the calling module."""
    def run(stage):
        torch.manual_seed(0)
        model = _UsesReturned()
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
        losses = []
        for step in range(2):
            loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        master = engine.read_master()
        engine.close()
        return losses, master
    with pytest.warns(UserWarning, match="returned by a submodule"):
        losses3, master3 = run(3)
    losses0, master0 = run(0)
    assert losses3 == pytest.approx(losses0, rel=1e-6)
    for n in master0:
        torch.testing.assert_close(master3[n], master0[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_0_to_2_keep_parameters_whole(stage, tmp_path):
    """Outside forward, after step, save and load the parameters are whole and hold the
    engine's current weights; after close they keep their last values."""
    model = make_model("tiedmm")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))

    def check():
        master = engine.read_master()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), master[n]), n
    check()
    loss = engine(*batch("tiedmm", 0))
    engine.backward(loss)
    engine.step()
    check()
    with engine.gathered_parameters():
        check()
    check()
    engine.save_checkpoint(tmp_path)
    check()
    engine.load_checkpoint(tmp_path)
    check()
    # A write after the first step sets the working params only (as DeepSpeed): the whole
    # parameters hold it, the master keeps its value.
    master = engine.read_master()["ln_f.weight"]
    with pytest.warns(UserWarning, match="writes the working parameters only"):
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            with torch.no_grad():
                model.ln_f.weight.fill_(0.25)
    assert model.ln_f.weight.numel() > 0 and torch.all(model.ln_f.weight == 0.25)
    assert torch.equal(engine.read_master()["ln_f.weight"], master)
    with torch.no_grad():  # back to the master's values for the checks below
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            model.ln_f.weight.copy_(master)
    check()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
