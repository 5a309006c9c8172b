"""Ranks that run different modules in one step (a branch on the rank's data, LayerDrop drawn
from each rank's own seed): at ZeRO stages 0-2 every rank reduces the groups in one agreed order,
a group a rank did not use reduced with zeros at its turn, so training matches torch's AdamW on
the mean of the ranks' gradients (before, the reductions paired as each rank's groups completed:
same-sized groups summed with each other's gradients, silently, and differently sized ones
aborted the process inside Gloo). At stage 3, where every module's parameters are gathered when
it runs, such a model fails with an error that names the cause instead of training on parameters
stitched from several groups."""
import pytest

torch = pytest.importorskip("torch")

from divergent_models import LR, STEPS, forward, make_model, seed_step  # noqa: E402
from launch import launch as run_ranks  # noqa: E402

CASES = ["branch:0", "branch:1:cpu", "branch:2", "bart:2", "bart:1:cpu", "branch:3", "bart:3"]


def reference(kind: str, world: int = 2):
    """torch's AdamW on the mean of the ranks' gradients, each rank's step drawn as the worker's;
    a parameter no rank used gets a zero gradient (the engine steps every parameter)."""
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(world):
            seed_step(step, r)
            loss = forward(model, kind, step, r)
            (loss / world).backward()
            total += loss.item() / world
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses, dict(model.named_parameters())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("divergent")
    outs = run_ranks(tmp, "divergent_worker.py", lambda r, nvme: [tmp, *CASES], 2, 8000)
    return tmp, outs


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith(":3")])
def test_ranks_running_different_modules_train_as_torch(runs, case):
    tmp, outs = runs
    for rc, out in outs:
        assert rc == 0, out
    for r in range(2):
        assert not (tmp / f"{case}.rank{r}.err").exists(), (tmp / f"{case}.rank{r}.err").read_text()
    res = [torch.load(tmp / f"{case}.rank{r}.pt") for r in range(2)]
    ref_losses, ref_params = reference(case.split(":")[0])
    mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
    for n, p in res[0]["master"].items():
        assert torch.equal(p, res[1]["master"][n]), n
        torch.testing.assert_close(p, ref_params[n].detach(), atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith(":3")])
def test_stage_3_names_the_cause_instead_of_mixing_groups(runs, case):
    """bart:3's ranks pair gathers of different sizes: Gloo's transport aborted the process (a
    message larger than the receiving buffer) before each operation's tag carried its size."""
    tmp, outs = runs
    for rc, out in outs:
        assert rc == 0, out
    cause = "must gather and reduce the same groups in the same order"
    msgs = []
    for r in range(2):
        err = tmp / f"{case}.rank{r}.err"
        assert err.exists(), f"rank {r} trained a stage-3 model whose ranks ran other modules"
        msgs.append(err.read_text())
    # The first rank at its deadline names the cause; Gloo then closes its connections, so the
    # other may instead see its peer leave.
    assert any(cause in m.lower() for m in msgs), msgs
    for m in msgs:
        assert cause in m.lower() or "a peer exited" in m, msgs
