"""torch.compile with strata, as DeepSpeed users reach it: the model compiled before initialize,
engine.compile(backend, compile_kwargs) (DeepSpeedEngine.compile, which accelerate calls for a
dynamo backend), at stage 3 with a parameter read outside its module (a tied head): the engine's
hooks run eagerly between the graphs, and the losses are the uncompiled run's."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import strata  # noqa: E402

from models import ds_config  # noqa: E402


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, idx):
        h = torch.tanh(self.mid(self.emb(idx)))
        logits = h @ self.emb.weight.t()  # the embedding read in the parent's forward
        return F.cross_entropy(logits.view(-1, 11), idx.view(-1))


def _losses(how, stage=3, steps=3):
    torch.manual_seed(0)
    model = TiedHead()
    if how == "before":
        model = torch.compile(model, backend="eager")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage))
    if how == "engine":
        engine.compile(backend="eager", compile_kwargs={"dynamic": False})
        assert engine.is_compiled
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randint(0, 11, (2, 5), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


@pytest.mark.parametrize("how", ["before", "engine"])
def test_a_compiled_model_at_stage3_trains_as_the_uncompiled_one(how):
    torch._dynamo.reset()
    assert _losses(how) == _losses("none")


def test_engine_compile_refuses_deepspeeds_compile_passes():
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=TiedHead(), config=ds_config(3))
    assert not engine.is_compiled
    with pytest.raises(NotImplementedError, match="schedule"):
        engine.compile(schedule=[(0, ["a pass"])])
    engine.close()
