"""Test models and the plain-torch reference (fp32 AdamW) the adapter is compared with."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=16, d_h=40, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, d_h)
        self.fc3 = nn.Linear(d_h, d_out)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        out = self.fc3(h)
        return F.mse_loss(out.float(), y)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has a ~0 gradient: Adam amplifies its rounding noise
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Several transformer blocks; the output head shares the embedding's weight (tied). The
    defaults (vocabulary 37, d 32) are odd sizes: shard boundaries fall off any alignment."""

    def __init__(self, vocab=37, d=32, heads=4, layers=2, ctx=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # one parameter in two modules

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def make_model(kind, seed=0):
    """"mlp", "gpt" or "gpt384" (hidden 384: shard boundaries on 2 ranks fall off O_DIRECT's
    4 KiB alignment, as the odd default sizes do)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    return TinyGPT(d=384, heads=6, layers=1) if kind == "gpt384" else TinyGPT()


def batch(kind, step, micro=0, rank=0, size=4):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + 10 * rank + 1)
    if kind == "mlp":
        return torch.randn(size, 16, generator=g), torch.randn(size, 8, generator=g)
    idx = torch.randint(0, 37, (size, 12), generator=g)  # every gpt kind has vocabulary 37
    return idx, torch.roll(idx, -1, dims=1)


def reference_bf16(kind, steps, lr, wd, seed=0):
    """bf16 forward and backward with fp32 master weights and fp32 AdamW (one process): the
    bf16 reference strata's bf16 mode is compared with."""
    model = make_model(kind, seed).to(torch.bfloat16)
    params = list(model.parameters())  # unique: the tied weight once
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        loss = model(*batch(kind, step))  # a gpt kind: integer inputs
        loss.backward()
        losses.append(loss.item())
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)  # round to nearest even, as the engine publishes its params
    names = [n for n, _ in model.named_parameters()]
    return losses, {n: m.detach().clone() for n, m in zip(names, masters)}


def reference(kind, steps, lr, wd, gas=1, world=1, seed=0):
    """Plain torch fp32 AdamW over the same data (the mean of every rank's micro-batches)."""
    model = make_model(kind, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=wd)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(world):
            for m in range(gas):
                loss = model(*batch(kind, step, m, r)) / (gas * world)
                loss.backward()
                total += loss.item()
        losses.append(total)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def ds_config(stage, offload="none", dtype="fp32", gas=1, lr=1e-2, wd=0.01, nvme_path=None,
              world=1):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": wd}},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload != "none":
        off = {"device": offload}
        if offload == "nvme":
            off["nvme_path"] = nvme_path
        cfg["zero_optimization"]["offload_optimizer"] = off
    return cfg
