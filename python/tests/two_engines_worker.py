"""Each rank of test_two_engines: several engines in one process on 2 ranks that meet through
the TCP rendezvous store (no STRATA_RDZV_DIR), as DeepSpeed-Chat's actor, critic and reference
model, or a student and its teacher: a frozen teacher (forward only, no optimizer), a student
trained to match it and a critic trained beside it, all at ZeRO stage 3; the student closed and a
third trained engine created after it. `two_engines_worker.py OUT` writes each trained engine's
parameters to OUT (rank 0)."""
import os
import sys

import torch

import strata

LR = 1e-2
STEPS = 3
BATCH = 4  # per rank


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def data(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 8, generator=g)


def config(train: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if train:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    return cfg


def distill(engine, teacher, x):
    with torch.no_grad():
        target = teacher(x)
    loss = torch.nn.functional.mse_loss(engine(x), target)
    engine.backward(loss)
    engine.step()


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    timeout = int(os.environ.get("TEST_TIMEOUT_MS", "60000"))
    teacher_model = net(0).requires_grad_(False)
    teacher, *_ = strata.initialize(model=teacher_model, config=config(False), timeout_ms=timeout)
    student, *_ = strata.initialize(model=net(1), config=config(True), timeout_ms=timeout)
    critic, *_ = strata.initialize(model=net(2), config=config(True), timeout_ms=timeout)
    for step in range(STEPS):
        x = data(step, rank)
        distill(student, teacher, x)
        distill(critic, teacher, x)
    result = {"student": student.read_master(), "critic": critic.read_master()}
    student.destroy()
    third, *_ = strata.initialize(model=net(3), config=config(True), timeout_ms=timeout)
    for step in range(STEPS):
        distill(third, teacher, data(step, rank))
    result["third"] = third.read_master()
    if rank == 0:
        torch.save(result, out)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
