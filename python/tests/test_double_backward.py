"""Backward passes that build graphs, and graphs kept past a step. A gradient penalty
(torch.autograd.grad(..., create_graph=True): R1 on the input, WGAN-GP, a penalty on the
parameters' gradients) builds, during its backward, a graph that keeps views of the gathered
parameters; at stage 3 the groups that backward gathers stay gathered until the micro-step's
backward ends, so the later backward reads them as gathered then. A backward through a graph
saved before engine.step() fails as torch's does (the parameters' version counters advance at
each applied step)."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import ds_config  # noqa: E402
from test_adapter import LR, WD  # noqa: E402

STEPS = 3


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 16)
        self.l2 = torch.nn.Linear(16, 16)
        self.l3 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def loss_of(model, step, penalty):
    x, y = data(step)
    x.requires_grad_(True)
    out = model(x)
    if penalty == "r1":  # on the input's gradient, beside the task loss
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return torch.nn.functional.mse_loss(out, y) + 0.5 * (gx.norm(dim=1) - 1).pow(2).mean()
    if penalty == "only":  # WGAN-GP's critic term alone: no path through the forward graph
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return (gx.norm(dim=1) - 1).pow(2).mean()
    # on the parameters' gradients
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(torch.nn.functional.mse_loss(out, y), params,
                                create_graph=True)
    return torch.nn.functional.mse_loss(out, y) + sum(g.pow(2).sum() for g in grads)


def torch_run(penalty):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-3,
                            weight_decay=WD)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, step, penalty)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # A parameter the loss does not reach (l3.bias under the penalty alone) has no gradient:
    # torch's AdamW skips it, strata steps it with zeros (weight decay), as DeepSpeed does.
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()
                    if p.grad is not None}


def config(stage, offload_param):
    cfg = ds_config(stage, lr=LR, wd=WD)
    cfg["optimizer"]["params"]["eps"] = 1e-3
    if offload_param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": offload_param}
    return cfg


@pytest.mark.parametrize("penalty", ["r1", "only", "params"])
@pytest.mark.parametrize("stage,offload_param", [(2, "none"), (3, "none"), (3, "cpu")])
def test_a_gradient_penalty_trains_as_torch(stage, offload_param, penalty):
    want_losses, want = torch_run(penalty)
    torch.manual_seed(0)
    model = MLP()
    engine, _, _, _ = strata.initialize(model=model, config=config(stage, offload_param))
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine, step, penalty)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    master = engine.read_master()
    engine.close()
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for n, w in want.items():
        torch.testing.assert_close(master[n], w, atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_backward_through_a_graph_saved_before_the_step_fails_as_in_torch(stage):
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=MLP(), config=config(stage, "none"))
    x, y = data(0)
    kept = torch.nn.functional.mse_loss(engine(x), y)  # a graph kept past the step
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.backward(kept)
    engine.close()


def test_a_second_backward_in_a_full_window_is_refused_before_it_runs():
    """retain_graph and a second backward before engine.step(): refused, naming what to do,
    before any gradient of it is taken; engine.zero_grad() drops the window and training goes
    on."""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=MLP(), config=config(3, "none"))
    x, y = data(0)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"after 1 backward\(s\) since the last engine.step"):
        engine.backward(loss)
    with pytest.raises(RuntimeError, match="fill gradient_accumulation_steps"):
        loss.backward()  # the script's own backward too
    engine.zero_grad()
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loop_that_steps_once_per_window_is_refused_naming_step_after_every_backward(stage):
    """nanoGPT's loop converted as `engine.backward` each micro-step and `engine.step()` once
    per window (gas 2): step() counts micro-steps, so the first window ends short of its
    boundary and the next backward overfills it. Refused by name before it runs, where the
    engine's ReduceGradients said "group '<root>' was already reduced 2 times"."""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=MLP(), config=ds_config(stage, gas=2, lr=LR, wd=WD))

    def loss(m):
        x, y = data(m)
        return torch.nn.functional.mse_loss(engine(x), y)
    for m in range(2):
        engine.backward(loss(m))
    engine.step()
    assert not engine.was_step_applied()
    with pytest.raises(RuntimeError, match="though engine.step\\(\\) ran since: step\\(\\) "
                                           "counts micro-steps, so call it after every backward"):
        engine.backward(loss(2))
    engine.close()


def test_the_window_check_leaves_no_sync_and_passes_that_give_no_gradient_alone():
    """Backwards inside no_sync() (stages 0-1) keep their gradients in p.grad and reduce
    nothing: they do not fill the window, as in DeepSpeed. A pass through an engine whose
    window is full but whose parameters get no gradient (a GAN's generator step with
    inputs= its own parameters, through the discriminator) is not refused."""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=MLP(), config=config(0, "none"))
    x, y = data(0)
    with engine.no_sync():
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1
    engine.close()

    gen, _, _, _ = strata.initialize(model=torch.nn.Linear(4, 6), config=config(3, "none"))
    disc, _, _, _ = strata.initialize(model=MLP(), config=config(3, "none"))
    z = torch.randn(8, 4)
    fake = gen(z)
    disc.backward(disc(x).mean() - disc(fake.detach()).mean())  # the discriminator's window
    torch.autograd.backward(disc(fake).mean(), inputs=list(gen.module.parameters()))
    disc.step()
    gen.step()
    assert disc.global_steps == 1 and gen.global_steps == 1
    gen.close()
    disc.close()


def test_a_frozen_engine_inside_a_penalty_releases_its_groups_after_each_backward():
    """A forward-only stage-3 engine (a frozen feature network) in a gradient penalty: what its
    create_graph backward gathered is held through the later backward, then released; nothing
    piles up over iterations."""
    torch.manual_seed(0)
    cfg = config(3, "none")
    del cfg["optimizer"]
    feat, _, _, _ = strata.initialize(model=MLP(), config=cfg)
    head = torch.nn.Linear(1, 1)
    for step in range(3):
        x = torch.randn(4, 6, requires_grad=True)
        out = head(feat(x)).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (out + (g.norm() - 1) ** 2).backward()
        assert all(p.numel() == 0 for p in feat.module.parameters()), step
    feat.close()
