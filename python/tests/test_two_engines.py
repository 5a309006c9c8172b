"""Several engines in one process on two ranks (two_engines_worker.py), meeting through rank 0's
TCP store as under torchrun: a frozen teacher, a student and a critic trained against it, and a
third engine created after the student was closed. Each trained engine's weights equal torch
AdamW on both ranks' batches (DeepSpeed-Chat runs an actor, a critic, a reference and a reward
model this way; TRL a policy beside its reference)."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402,F401
from launch import launch  # noqa: E402
from two_engines_worker import LR, STEPS, data, net  # noqa: E402


def reference(seed: int) -> dict:
    model, teacher = net(seed), net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        x = torch.cat([data(step, 0), data(step, 1)])
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_engines_of_one_process_share_the_tcp_rendezvous(tmp_path):
    out = tmp_path / "weights.pt"
    outs = launch(tmp_path, "two_engines_worker.py", lambda r, nvme: [out], tcp=True)
    for rc, text in outs:
        assert rc == 0, text
    got = torch.load(out)
    for name, seed in (("student", 1), ("critic", 2), ("third", 3)):
        want = reference(seed)
        assert set(got[name]) == set(want), name
        for key, value in want.items():
            torch.testing.assert_close(got[name][key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{name} {key}")
