"""The models, batches and configs of test_divergent_branches, shared by its worker and the
torch reference."""
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
LR = 1e-2


class Branches(nn.Module):
    """`same0` and `same1` have one size (their reductions pair silently if ranks disagree on
    which was reduced when), `other` another (a mismatch there is a wrong-sized message)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.same0 = nn.Linear(8, 8)
        self.same1 = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 4)

    def forward(self, x, y, use):
        h = torch.tanh(self.inp(x))
        for name in use:
            h = torch.tanh(getattr(self, name)(h))
        return F.mse_loss(self.out(h), y)


# What rank r runs at step s: step 0 already differs (the step the adapter learns its order in).
USE = {(0, 0): ["same0", "other"], (0, 1): ["same1"],
       (1, 0): [], (1, 1): ["same0", "same1", "other"],
       (2, 0): ["same1"], (2, 1): ["other"]}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "branch":
        return Branches()
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=64, d_model=16, encoder_layers=3, decoder_layers=3,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.5,
                     decoder_layerdrop=0.5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2)
    return BartForConditionalGeneration(cfg)


def batch(kind: str, step: int, rank: int):
    """(args, kwargs) of rank `rank`'s forward at `step`."""
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "branch":
        return (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g),
                USE[(step, rank)]), {}
    return (), {"input_ids": torch.randint(3, 64, (2, 8), generator=g),
                "labels": torch.randint(3, 64, (2, 6), generator=g)}


def forward(model, kind: str, step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s loss at `step` (model: the module, or the engine wrapping it)."""
    args, kwargs = batch(kind, step, rank)
    out = model(*args, **kwargs)
    return out if kind == "branch" else out.loss


def seed_step(step: int, rank: int) -> None:
    """Each rank's own random state for the step: BART's LayerDrop draws from it."""
    torch.manual_seed(1000 * step + 7 * rank + 1)


def config(stage: int, offload: str = "none") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg
