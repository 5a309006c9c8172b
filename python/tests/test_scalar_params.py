"""0-dim parameters (CLIP's and SigLIP's logit_scale, a learned temperature): trained as torch
trains them at every stage, saved and loaded, and given back by zero_to_fp32 with their shape
(), so a strict load_state_dict takes them."""
import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import ds_config  # noqa: E402
from test_adapter import LR, WD  # noqa: E402

STEPS = 3


class Contrastive(torch.nn.Module):
    """Two towers and a learned temperature, as CLIP: the root owns only the 0-dim scale."""

    def __init__(self):
        super().__init__()
        self.text = torch.nn.Linear(6, 4)
        self.image = torch.nn.Linear(5, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))

    def forward(self, t, i):
        a = torch.nn.functional.normalize(self.text(t), dim=-1)
        b = torch.nn.functional.normalize(self.image(i), dim=-1)
        logits = self.logit_scale.exp() * a @ b.t()
        labels = torch.arange(len(t))
        return torch.nn.functional.cross_entropy(logits, labels)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


def torch_run():
    torch.manual_seed(0)
    model = Contrastive()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*data(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "none"), (3, "cpu")])
def test_a_0_dim_parameter_trains_saves_and_loads_as_torch(stage, offload, tmp_path):
    want_losses, want = torch_run()
    torch.manual_seed(0)
    model = Contrastive()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, offload, lr=LR,
                                                                      wd=WD))
    losses = []
    for step in range(STEPS):
        loss = engine(*data(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(want_losses, rel=1e-6)
    master = engine.read_master()
    assert master["logit_scale"].shape == ()
    for n, w in want.items():
        torch.testing.assert_close(master[n], w, atol=1e-6, rtol=1e-5, msg=n)
    engine.save_checkpoint(tmp_path)
    engine.close()

    from strata.utils import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert sd["logit_scale"].shape == ()
    fresh = Contrastive()
    fresh.load_state_dict(sd)  # strict: every shape as the module's
    assert torch.equal(fresh.logit_scale.detach(), master["logit_scale"])

    torch.manual_seed(1)  # other initial weights: the load must replace them
    again, _, _, _ = strata.initialize(model=Contrastive(), config=ds_config(
        stage, offload, lr=LR, wd=WD))
    again.load_checkpoint(tmp_path)
    loaded = again.read_master()
    for n in master:
        assert torch.equal(loaded[n], master[n]), n
    again.close()


def test_clip_from_transformers_at_stage_3_matches_torch():
    """transformers' CLIPModel (random weights, tiny): its logit_scale among the rest."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=4),
        projection_dim=8)

    def inputs(step):
        g = torch.Generator().manual_seed(step)
        return dict(input_ids=torch.randint(0, 50, (2, 6), generator=g),
                    pixel_values=torch.randn(2, 3, 8, 8, generator=g), return_loss=True)

    torch.manual_seed(0)
    ref = transformers.CLIPModel(cfg)
    torch.manual_seed(0)
    model = transformers.CLIPModel(cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    for step in range(STEPS):
        opt.zero_grad()
        want = ref(**inputs(step)).loss
        want.backward()
        opt.step()
        got = engine(**inputs(step)).loss
        engine.backward(got)
        engine.step()
        assert got.item() == pytest.approx(want.item(), rel=1e-5), step
    master = engine.read_master()
    engine.close()
    torch.testing.assert_close(master["logit_scale"], ref.logit_scale.detach(), atol=1e-6,
                               rtol=1e-5)
