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
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
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
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class TiedMatmulGPT(TinyGPT):
    """TinyGPT whose output head is written in the parent's forward, `x @ self.wte.weight.t()`
    (no head module): the embedding's weight is read outside the module that owns it."""

    def __init__(self):
        super().__init__(layers=1)
        del self.head

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class BNNet(nn.Module):
    """An MLP with BatchNorm (persistent buffers: running_mean, running_var, num_batches_tracked)
    and a non-persistent buffer, which state_dict and checkpoints leave out."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.bn = nn.BatchNorm1d(24)
        self.fc2 = nn.Linear(24, 8)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


class LoraLinear(nn.Module):
    """A frozen base Linear plus a trained low-rank update (PEFT's LoRA, written out here):
    y = base(x) + (x @ A.T) @ B.T * scale. B starts non-zero so both adapters train at once."""

    def __init__(self, d_in, d_out, rank=4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.01)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * 2.0


class LoraLlama(nn.Module):
    """A Llama-shaped model (RMSNorm, SwiGLU MLP, no biases) fine-tuned with LoRA on the
    attention's q and v: every base weight frozen, the adapters trained."""

    def __init__(self, vocab=37, d=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.norm1, layer.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
            layer.q, layer.v = LoraLinear(d, d), LoraLinear(d, d)
            layer.k, layer.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            layer.gate, layer.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
            layer.down = nn.Linear(2 * d, d, bias=False)
            self.layers.append(layer)
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for n, p in self.named_parameters():
            p.requires_grad_("lora_" in n)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.embed(idx)
        for layer in self.layers:
            h = layer.norm1(x)
            q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2)
                       for f in (layer.q, layer.k, layer.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer.o(y.transpose(1, 2).reshape(b, t, -1))
            h = layer.norm2(x)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_model(kind, seed=0):
    """"mlp", "gpt", "gpt384" (hidden 384: shard boundaries on 2 ranks fall off O_DIRECT's
    4 KiB alignment, as the odd default sizes do), "tiedmm" (TiedMatmulGPT), "bn" (BNNet, the
    mlp's data), "lora" (LoraLlama: base frozen) or "gptfe" (TinyGPT, tied embedding frozen)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "lora":
        return LoraLlama()
    if kind == "gptfe":
        model = TinyGPT()
        model.wte.weight.requires_grad_(False)
        return model
    if kind == "tiedmm":
        return TiedMatmulGPT()
    if kind == "bn":
        return BNNet()
    return TinyGPT(d=384, heads=6, layers=1) if kind == "gpt384" else TinyGPT()


def batch(kind, step, micro=0, rank=0, size=4):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + 10 * rank + 1)
    if kind in ("mlp", "bn"):
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


def decay_groups(model, lr2=3e-3):
    """Two param groups as nanoGPT and HF Trainer build them: weight decay on matrices, none (and
    here another lr) on biases and norms."""
    def matrix(p):  # by the whole shape: under strata.zero.Init parameters are empty
        return len(getattr(p, "ds_shape", p.shape)) >= 2
    decay = [p for p in model.parameters() if matrix(p)]
    no_decay = [p for p in model.parameters() if not matrix(p)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                      "lr": lr2}]


def warmup(step):
    """A LambdaLR factor: linear warmup over three steps."""
    return min(1.0, (step + 1) / 3)


def reference(kind, steps, lr, wd, gas=1, world=1, seed=0, groups=False, device=None):
    """Plain torch fp32 AdamW over the same data (the mean of every rank's micro-batches).
    groups: decay_groups with a LambdaLR warmup (stepped after each step). device: where it runs
    (default the CPU); the master weights come back on the CPU."""
    model = make_model(kind, seed).to(device or "cpu")
    params = decay_groups(model) if groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup) if groups else None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(world):
            for m in range(gas):
                loss = model(*(x.to(device or "cpu") for x in batch(kind, step, m, r))) / (
                    gas * world)
                loss.backward()
                total += loss.item()
        losses.append(total)
        opt.step()
        if sched is not None:
            sched.step()
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def ds_config(stage, offload="none", dtype="fp32", gas=1, lr=1e-2, wd=0.01, nvme_path=None,
              world=1):
    # No clipping, as the torch references here: without the key DeepSpeed 0.19.8 (and strata)
    # clip at 1.0.
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": wd}},
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # release every group after use (DeepSpeed's 1e5 keeps these models whole)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload != "none":
        off = {"device": offload}
        if offload == "nvme":
            off["nvme_path"] = nvme_path
        cfg["zero_optimization"]["offload_optimizer"] = off
    return cfg


# -- models nobody here wrote the patterns of: stage 3 gathers and releases them ---------------
class NanoBlock(nn.Module):
    """An ordinary nanoGPT block: F.linear (saves weight.t(), a view of the gathered weight) and
    scaled_dot_product_attention."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=43, d=64, heads=2, layers=1, ctx=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(NanoBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class HandLinear(nn.Module):
    """x @ w.T + b written out: matmul saves w.T, a view of the gathered weight."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in) * d_in ** -0.5)
        self.b = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return x @ self.w.T + self.b


class HandGate(nn.Module):
    """Saves a slice, an einsum's permuted slice and a reshaped view of its weights."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.w = nn.Parameter(torch.randn(2 * d, d) * d ** -0.5)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        a = x @ self.w[:self.d].T
        g = torch.einsum("btd,ed->bte", x, self.w[self.d:])
        return x + a * torch.sigmoid(g) * self.scale.view(1, 1, -1)


class HandLM(nn.Module):
    def __init__(self, vocab=43, d=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = HandLinear(d, d)
        self.gates = nn.ModuleList(HandGate(d) for _ in range(2))
        self.head = HandLinear(d, vocab)

    def forward(self, idx, targets):
        x = torch.tanh(self.mix(self.emb(idx)))
        for g in self.gates:
            x = g(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


VOCAB = 43
SEQ = {"nanogpt": 128, "handmade": 16, "gpt2": 32, "llama": 32}


def make_lm(kind, seed=0):
    """"nanogpt" or "handmade" (above), or a GPT-2 / Llama from transformers (random init, small config, no
    dropout): GPT-2's Conv1D, its tied head, Llama's rotary embedding and RMSNorm."""
    torch.manual_seed(seed)
    if kind == "nanogpt":
        return NanoGPT()
    if kind == "handmade":
        return HandLM()
    import transformers
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ[kind], n_embd=64,
                                      n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=2, max_position_embeddings=SEQ[kind])
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(kind)


def lm_loss(kind, model, idx, targets):
    """The model's mean cross-entropy on (idx, targets): what engine.backward is given."""
    if kind in ("nanogpt", "handmade"):
        return model(idx, targets)
    return model(input_ids=idx, labels=targets).loss  # transformers shifts labels itself


def lm_batch(kind, step, size):
    """The global batch of `step` (size sequences); rank r of w trains on rows
    [r * size / w, (r + 1) * size / w), so every world size sees the same global batch."""
    g = torch.Generator().manual_seed(7919 * step + 13)
    idx = torch.randint(0, VOCAB, (size, SEQ[kind]), generator=g)
    return idx, (idx.clone() if kind in ("gpt2", "llama") else torch.roll(idx, -1, dims=1))


LM_OPT = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def lm_reference(kind, steps, size):
    """Plain torch AdamW (fp32, LM_OPT) on every step's whole global batch: the losses and the
    parameters after the first step and after the last."""
    model = make_lm(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LM_OPT["lr"], betas=tuple(LM_OPT["betas"]),
                            eps=LM_OPT["eps"], weight_decay=LM_OPT["weight_decay"])
    losses, first = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = lm_loss(kind, model, *lm_batch(kind, step, size))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            first = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def lm_config(stage, offload_optimizer="none", offload_param="none", dtype="fp32",
              persistence=0, overlap_comm=False, prefetch=True, micro=2, nvme_path=None):
    """A DeepSpeed config for make_lm's models; stage3_param_persistence_threshold 0 by default
    so that stage 3 releases and gathers every group again (DeepSpeed's default, 1e5 elements,
    would keep all of these small models' groups gathered)."""
    zero = {"stage": stage, "overlap_comm": overlap_comm,
            "stage3_param_persistence_threshold": persistence}
    if not prefetch:
        zero["stage3_prefetch_bucket_size"] = 0
        zero["stage3_max_reuse_distance"] = 0
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": nvme_path} if dev == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0,  # as the torch references (DeepSpeed's default: 1.0)
           "optimizer": {"type": "AdamW", "params": dict(LM_OPT)}, "zero_optimization": zero}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg
