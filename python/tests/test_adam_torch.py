"""The engine's fp32 Adam/AdamW step against torch.optim.AdamW / torch.optim.Adam, bit for bit.

The engine computes torch's single-tensor step with torch's fp32 operations and roundings
(kernels/adam.h). One operation differs on torch builds with MKL (the x86 wheels): torch's CPU
sqrt is MKL's vsSqrt, within an ulp of the IEEE square root the engine uses. So the bitwise checks
run torch's own step with only that sqrt made IEEE (ieee_sqrt); the loss-curve check runs plain,
unmodified torch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from models import TinyGPT, batch, ds_config  # noqa: E402


class ieee_sqrt(TorchFunctionMode):
    """torch with a correctly rounded fp32 sqrt (numpy's), everything else unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.sqrt, torch.sqrt) and args[0].dtype == torch.float32:
            return torch.from_numpy(np.sqrt(args[0].detach().numpy()))
        return func(*args, **kwargs)


def test_ieee_sqrt_is_correctly_rounded():
    x = torch.rand(100003, generator=torch.Generator().manual_seed(0))
    exact = np.sqrt(x.numpy().astype(np.float64)).astype(np.float32)
    with ieee_sqrt():
        got = x.sqrt()
    assert np.array_equal(got.numpy(), exact)


def adam_config(lr, wd, decoupled, bias_correction=True):
    cfg = ds_config(0, lr=lr, wd=wd)
    params = cfg["optimizer"]["params"]
    cfg["optimizer"]["type"] = "AdamW" if decoupled else "Adam"
    if not decoupled:
        params["adam_w_mode"] = False
    if not bias_correction:
        params["bias_correction"] = False
    return cfg


class Flat(torch.nn.Module):
    """One parameter whose gradient is whatever the test sets: loss = sum(w * g)."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, g):
        return (self.w * g).sum()


def grads(n, steps, seed):
    """Gradients of every scale: ordinary, tiny (subnormal squares), huge (overflowing squares)
    and zero."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * 1e-3
        kind = torch.randint(0, 8, (n,), generator=gen)
        g[kind == 0] = 0.0
        g[kind == 1] *= 1e-27
        g[kind == 2] *= 1e-39
        g[kind == 3] *= 1e28
        out.append(g)
    return out


@pytest.mark.parametrize("decoupled,wd,lr", [(True, 0.01, 1e-3), (True, 0.0, 0.3),
                                             (False, 0.1, 3e-2), (False, 0.0, 1e-3)],
                         ids=["adamw", "adamw-no-decay", "adam-l2", "adam"])
def test_master_equals_torch_bit_for_bit(decoupled, wd, lr):
    n, steps = 4099, 5
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    gs = grads(n, steps, seed=2)
    model = Flat(w0)
    engine, _, _, _ = strata.initialize(model=model, config=adam_config(lr, wd, decoupled))
    ref = torch.nn.Parameter(w0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for step in range(steps):
        engine.backward(engine(gs[step]))
        engine.step()
        ref.grad = gs[step].clone()
        with ieee_sqrt():
            opt.step()
        master = engine.read_master()["w"]
        assert torch.equal(master, ref.detach()), (
            f"step {step + 1}: {(master != ref.detach()).sum().item()} of {n} differ")
    engine.close()


def spike_gpt():
    torch.manual_seed(0)
    return TinyGPT(d=64, heads=4, layers=2)


def torch_losses(steps, lr, sqrt_mode=None):
    model = spike_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*batch("gpt", step))
        loss.backward()
        losses.append(loss.item())
        if sqrt_mode is None:
            opt.step()
        else:
            with sqrt_mode():
                opt.step()
    return losses


def test_gpt_loss_curve_with_a_spike_equals_torch():
    """20 fp32 steps of a small GPT at a learning rate high enough for a loss spike: the losses
    are torch AdamW's bit for bit (IEEE sqrt) and to every printed digit (plain torch)."""
    steps, lr = 20, 3e-2
    engine, _, _, _ = strata.initialize(model=spike_gpt(), config=adam_config(lr, 0.01, True))
    losses = []
    for step in range(steps):
        loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    assert any(b > 1.1 * a for a, b in zip(losses, losses[1:]))  # a spike
    assert losses == torch_losses(steps, lr, ieee_sqrt)
    # Plain torch's MKL sqrt moves its own curve by ~1e-4 after larger spikes (lr 0.1 here).
    assert [f"{x:.4f}" for x in losses] == [f"{x:.4f}" for x in torch_losses(steps, lr)]
