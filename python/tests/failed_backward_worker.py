"""A small net whose backward can be made to raise part way (after two of its three layers got
their gradients), trained through strata with one batch failing or dropped, and torch's AdamW
on the same batches without that one; also each rank of test_failed_backward's two-rank case:
`failed_backward_worker.py OUT STAGE OFFLOAD HOW` writes the run's parameters to OUT."""
import os
import sys
import warnings

import torch

import strata

LR = 1e-2
BATCHES = 5
BAD = 2  # the batch whose backward raises, or that the script drops


class Boom(torch.autograd.Function):
    """Identity; its backward raises while `armed` (a simulated out-of-memory error)."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("CUDA out of memory (simulated)")
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(8, 16)
        self.l1 = torch.nn.Linear(16, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = Boom.apply(torch.tanh(self.l0(x)))  # raises after l2's and l1's gradients
        return self.l2(torch.tanh(self.l1(h)))


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(BATCHES)]


def config(stage: int, offload: str, gas: int = 1) -> dict:
    zero = {"stage": stage}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}


def reference(device: str = "cpu") -> dict:
    """torch's AdamW on every batch but BAD."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    for i, x in enumerate(x.to(device) for x in batches()):
        if i != BAD:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(stage: int, offload: str, how: str, save_dir=None, timeout_ms: int = 60000,
          device: str = "cpu") -> dict:
    """Trains on every batch; BAD's backward raises (how: "engine" for engine.backward, "torch"
    for the script's own loss.backward(); "+zero_grad": the script then calls zero_grad), or
    ("drop", "drop_opt") completes and the script drops it with engine.zero_grad() /
    optimizer.zero_grad(), or ("skip") the script runs no backward for it. "+step": the loop
    calls engine.step() for BAD too ("skip" always does). With save_dir, a checkpoint is saved
    right after BAD. Returns the fp32 masters by name (on the CPU). device "cuda": the model and
    batches on the GPU."""
    torch.manual_seed(0)
    engine, opt, _, _ = strata.initialize(model=Net().to(device), config=config(stage, offload),
                                          timeout_ms=timeout_ms)
    for i, x in enumerate(x.to(device) for x in batches()):
        loss = engine(x).square().mean()
        if i == BAD and how == "skip":  # a loss spike: no backward, the loop's step() still
            engine.step()
            continue
        Boom.armed = i == BAD and not how.startswith("drop")
        try:
            if how.startswith("torch"):
                loss.backward()
            else:
                engine.backward(loss)
        except RuntimeError as e:
            assert i == BAD and "simulated" in str(e), e
            if "+zero_grad" in how:
                engine.zero_grad()
            if save_dir is not None:
                assert engine.save_checkpoint(save_dir)
            if how.endswith("+step"):
                engine.step()
            continue
        finally:
            Boom.armed = False
        if i == BAD:
            assert how.startswith("drop"), "the backward did not raise"
            (opt if how.startswith("drop_opt") else engine).zero_grad()
            if save_dir is not None:
                assert engine.save_checkpoint(save_dir)
            if how.endswith("+step"):
                engine.step()
            continue
        engine.step()
    out = {n: strata.utils.safe_get_full_fp32_param(p).detach().to("cpu").clone()
           for n, p in engine.module.named_parameters()}
    out["__steps__"] = engine.global_steps
    engine.close()
    return out


if __name__ == "__main__":
    out, stage, offload, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    warnings.simplefilter("error")  # a warning here would mean earlier micro-steps dropped
    got = train(stage, offload, how, timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))
    torch.save(got, out)
