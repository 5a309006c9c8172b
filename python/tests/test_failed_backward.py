"""A backward that raises part way (the out-of-memory error a script catches to skip its batch)
and a micro-batch the script drops after its backward (engine.zero_grad() with no step): the
gradients taken since the last step are dropped, and training goes on as torch's AdamW does
without that batch, at every stage, with the script's own loss.backward() too, on one and two
ranks. Before, every later backward failed ('a second gradient for group ...'), Save and Load
refused, and engine.step() applied the failed batch's partial gradients."""
import pytest

torch = pytest.importorskip("torch")

import strata  # noqa: E402
from failed_backward_worker import (BAD, BATCHES, LR, Boom, Net, batches, config,  # noqa: E402
                                    reference, train)
from launch import launch as run_ranks  # noqa: E402


def assert_trained_without_the_bad_batch(got: dict, device: str = "cpu") -> None:
    want = {n: p.to("cpu") for n, p in reference(device).items()}
    assert got.pop("__steps__") == BATCHES - 1
    assert got.keys() == want.keys()
    for n, p in want.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("stage,offload,how", [
    (0, "none", "engine"), (1, "cpu", "torch"), (2, "none", "engine+zero_grad"),
    (2, "cpu", "torch+zero_grad"), (3, "none", "torch"), (3, "cpu", "engine")])
def test_a_backward_that_raises_is_dropped_and_training_goes_on(tmp_path, stage, offload, how):
    # Saved right after the failure: nothing of the failed backward is pending.
    got = train(stage, offload, how, save_dir=tmp_path)
    assert_trained_without_the_bad_batch(got)
    assert (tmp_path / "latest").read_text().strip() == f"global_step{BAD}"


@pytest.mark.parametrize("stage,how", [(0, "drop"), (2, "drop_opt"), (3, "drop"),
                                       (1, "drop+step"), (3, "engine+zero_grad+step")])
def test_zero_grad_after_a_backward_without_a_step_drops_that_batch(tmp_path, stage, how):
    """"+step": the loop calls engine.step() for the dropped batch too; it does nothing."""
    got = train(stage, "none", how, save_dir=tmp_path)
    assert_trained_without_the_bad_batch(got)


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "cpu")])
def test_a_step_with_no_backward_since_the_last_applies_nothing(stage, offload):
    """A loop that skips a bad batch's backward but still calls step(): torch's optimizer skips
    a parameter without .grad; the engine would step every parameter on a zero gradient (Adam's
    momentum moving it). Nothing is applied, was_step_applied() is False, warned once."""
    with pytest.warns(UserWarning, match="no backward since the last step: nothing is applied"):
        got = train(stage, offload, "skip")
    assert_trained_without_the_bad_batch(got)


def window_after(drop: str, step_after: bool = False):
    """gradient_accumulation_steps 2, stage 2: with `drop`, batch 0's micro-step and a second one
    that raises ("raise") or that the script drops ("zero_grad"), followed by engine.step() where
    `step_after`; then batches 2 and 3, each followed by engine.step(). Returns (global steps,
    grad norm, the masters)."""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=Net(), config=config(2, "none", gas=2))
    x = batches()
    if drop:
        engine.backward(engine(x[0]).square().mean())
        engine.step()  # not a boundary: the window holds batch 0
        loss = engine(x[1]).square().mean()
        with pytest.warns(UserWarning, match="1 earlier micro-step"):
            if drop == "raise":
                Boom.armed = True
                try:
                    with pytest.raises(RuntimeError, match="simulated"):
                        engine.backward(loss)
                finally:
                    Boom.armed = False
            else:
                engine.backward(loss)
                engine.zero_grad()  # the window is full and not stepped: dropped
        if step_after:  # the loop's step() for the dropped micro-step: no count, no step
            engine.step()
            assert not engine.was_step_applied()
    for b in x[2:4]:
        engine.backward(engine(b).square().mean())
        engine.step()
    out = (engine.global_steps, engine.get_global_grad_norm().item(),
           {n: strata.utils.safe_get_full_fp32_param(p).clone()
            for n, p in engine.module.named_parameters()})
    engine.close()
    return out


@pytest.mark.parametrize("drop", ["raise", "zero_grad"])
@pytest.mark.parametrize("step_after", [False, True])
def test_a_drop_late_in_an_accumulation_window_drops_the_window_and_the_next_is_whole(drop,
                                                                                     step_after):
    """The window's earlier micro-step goes too (warned); the next window takes two whole
    micro-steps and divides by two, as a run that never saw the dropped ones, also where the
    loop calls step() for the dropped micro-step."""
    steps, norm, params = window_after(drop, step_after)
    want_steps, want_norm, want = window_after("")
    assert steps == want_steps == 1
    assert norm == want_norm
    for n, p in want.items():
        assert torch.equal(params[n], p), n


def test_zero_grad_every_micro_step_keeps_accumulating():
    """A loop that calls zero_grad() after each micro-step's backward inside the window,
    stepping the engine at the boundary only (as accelerate's may): DeepSpeed's zero_grad clears
    p.grad only, and the window's gradients stay."""
    def run(zero_grad: bool):
        torch.manual_seed(0)
        engine, _, _, _ = strata.initialize(model=Net(), config=config(2, "none", gas=4))
        for i, b in enumerate(batches()[:4]):
            engine.set_gradient_accumulation_boundary(i == 3)
            engine.backward(engine(b).square().mean())
            if i == 3:
                engine.step()
            elif zero_grad:
                engine.zero_grad()
        norm = engine.get_global_grad_norm().item()
        engine.close()
        return norm
    assert run(True) == run(False) > 0


@pytest.mark.parametrize("stage,offload,how", [(2, "none", "engine"), (3, "cpu", "torch")])
def test_two_ranks_whose_backwards_raise_at_the_same_point_train_on(tmp_path, stage, offload,
                                                                    how):
    """Both ranks fail at the same place (as with a batch too large for either): their
    reductions still pair after the drop. Each rank trains on the same batches, so the mean
    gradient is one rank's."""
    outs = run_ranks(tmp_path, "failed_backward_worker.py",
                     lambda r, nvme: [tmp_path / f"rank{r}.pt", stage, offload, how], 2, 20000)
    for rc, out in outs:
        assert rc == 0, out
    for r in range(2):
        assert_trained_without_the_bad_batch(torch.load(tmp_path / f"rank{r}.pt"))


class _Interrupting(torch.nn.Module):
    """Net's layers; its middle block raises `error` in its forward while `armed`."""

    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(8, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.l2 = torch.nn.Linear(16, 4)
        self.error = None

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.l0(x))))
        if self.error is not None:
            raise self.error
        return self.l2(h)


def test_a_keyboard_interrupt_in_a_stage3_forward_leaves_nothing_gathered():
    """torch runs the engine's post-hooks (always_call) for an Exception only: a
    KeyboardInterrupt caught by the script (Ctrl-C in a notebook) left each interrupted call on
    the engine's stack with its group gathered and its saved-tensor hooks pushed, so a parameter
    the script read afterwards outside any forward was gathered and registered as external.
    Now each forward that raises undoes its calls; training goes on as if it never ran."""
    torch.manual_seed(0)
    model = _Interrupting()
    torch.manual_seed(0)
    control = _Interrupting()
    cfg = config(3, "none")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    ref, _, _, _ = strata.initialize(model=control, config=cfg)
    x = batches()[0]
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    for k in range(6):
        model.error = KeyboardInterrupt()
        with pytest.raises(KeyboardInterrupt):
            with torch.enable_grad() if k % 2 else torch.no_grad():
                engine(x)
        model.error = None
    assert engine._call_stack == []
    assert engine._refs == [0] * len(engine._refs)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks
    assert model.l2.weight.shape == (0,)  # released, as it is outside a forward
    assert "_strata_external" not in model.mid.__dict__
    # Through the module itself (generate() calls it so): engine.forward does not see the
    # interrupt; the next root call, or the step, undoes what it left open.
    model.error = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        engine.module(x)
    model.error = None
    assert engine._call_stack
    with torch.no_grad():
        engine.module(x)
    assert engine._call_stack == [] and engine._refs == [0] * len(engine._refs)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks
    for e in (engine, ref):
        for b in batches()[:2]:
            e.backward(e(b).square().mean())
            e.step()
    got, want = engine.read_master(), ref.read_master()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    engine.close()
    ref.close()


def test_an_error_after_the_engine_stepped_ends_the_micro_step():
    """A client scheduler whose step() raises once inside engine.step() (or a monitor's write):
    the optimizer step has been applied, so the micro-step is over. Before, the next backward
    was refused ('a backward after 1 backward(s) since the last engine.step()') though the
    script had called step(); now training goes on and counts every step."""
    torch.manual_seed(0)
    model = Net()
    cfg = config(2, "none")
    del cfg["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    fail_at = {2}

    def factor(step):
        if step in fail_at:
            fail_at.clear()
            raise ValueError("scheduler failed (simulated)")
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                        config=cfg)
    raised = 0
    for b in batches():
        engine.backward(engine(b).square().mean())
        try:
            engine.step()
        except ValueError:
            raised += 1
    assert raised == 1
    assert engine.global_steps == BATCHES and engine.micro_steps == BATCHES
    assert engine.global_samples == BATCHES * 4  # micro-batch 4, one rank
    engine.close()
