"""A LoRA fine-tune of a Llama-shaped model with the Hugging Face Trainer, trained by strata:
ZeRO-3, the parameters' home on cpu, the optimizer state on NVMe, the base model frozen.

    python examples/hf_finetune.py                          # under a minute on 2 CPU cores
    python examples/hf_finetune.py --layers 8 --hidden 512 --steps 300
    torchrun --nproc_per_node 2 examples/hf_finetune.py     # N ranks (offloadctl launch too)

The script is a plain transformers Trainer script; `from strata.integrations.transformers import
Trainer, TrainingArguments` is the one line that differs. The DeepSpeed config is
examples/ds_hf_lora_zero3_nvme.json, "auto" wherever transformers fills a value (batch sizes,
clipping, AdamW's lr / betas / eps / weight decay, the WarmupDecayLR schedule, bf16/fp16,
bucket sizes): the TrainingArguments below decide them. Its nvme_path is replaced by --nvme-path
(default: <out>/nvme).

Model: transformers' LlamaForCausalLM from a LlamaConfig (random init; nothing is downloaded),
wrapped by PEFT's LoRA (r=8 on every attention and MLP projection): only the adapters train.
Data: --text FILE trains on that file's characters (one token per character); otherwise
synthetic token sequences with a learnable pattern (a Zipf-distributed vocabulary, each token
followed by a fixed successor three times in four), so the loss visibly falls from ln(vocab).
On a GPU when torch sees one (the model moved to cuda:LOCAL_RANK), else on the CPU.

Rank 0 prints a progress bar (loss, lr, tokens/s) and a summary, and writes summary.json,
hf_finetune.png (loss and learning-rate curves; skipped with a message when matplotlib is
missing) and the adapter (adapter/, PEFT's save_pretrained format) into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


# -- data ------------------------------------------------------------------------------------
def synthetic_tokens(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """n sequences of seq tokens: each token is followed by succ[token] with probability 3/4,
    else by a fresh draw from a Zipf(1) distribution over the vocabulary. A model learns first
    the frequencies, then the successor map: the loss falls well below ln(vocab)."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    zipf = zipf[torch.randperm(vocab, generator=g)]
    succ = torch.randperm(vocab, generator=g)
    x = torch.empty(n, seq, dtype=torch.long)
    x[:, 0] = torch.multinomial(zipf, n, replacement=True, generator=g)
    for t in range(1, seq):
        fresh = torch.multinomial(zipf, n, replacement=True, generator=g)
        follow = torch.rand(n, generator=g) < 0.75
        x[:, t] = torch.where(follow, succ[x[:, t - 1]], fresh)
    return x


def text_tokens(path: str, n: int, seq: int, seed: int):
    """n random windows of seq characters of the file, and the vocabulary size."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if len(text) <= seq:
        raise ValueError(f"--text {path}: {len(text)} characters, not more than --seq {seq}")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - seq + 1, (n,), generator=g)
    return torch.stack([data[i:i + seq] for i in ix]), len(chars)


class Sequences(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}  # the model shifts the labels


# -- reporting -------------------------------------------------------------------------------
def bar(step: int, total: int, loss: float, lr: float, tok_s: float, width: int = 30) -> str:
    done = int(width * step / max(1, total))
    return (f"\rstep {step:>5}/{total} [{'#' * done}{'.' * (width - done)}] "
            f"loss {loss:6.3f} | lr {lr:.2e} | {tok_s / 1e3:6.2f}k tok/s")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def plot(path: str, losses: list, lrs: list) -> bool:
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
    a.set_ylabel("training loss")
    a.set_title("loss (LoRA, base frozen)")
    b.plot(range(1, len(lrs) + 1), lrs, lw=1, color="tab:orange")
    b.set_xlabel("step")
    b.set_ylabel("learning rate")
    b.set_title("schedule (WarmupDecayLR from the config)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_progress(transformers, tokens_per_step: int):
    class Progress(transformers.TrainerCallback):
        """A one-line bar on rank 0 (every step on a terminal, every 20th step otherwise); keeps
        every step's loss and learning rate (logging_steps=1)."""

        def __init__(self):
            self.losses, self.lrs, self.seconds, self.waits = [], [], [], []
            self.t_last = None
            self.trainer = None  # set once the Trainer exists: its engine's step report

        def on_train_begin(self, args, state, control, **kw):
            self.t_last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs:
                return
            now = time.perf_counter()
            steps = max(1, state.global_step - len(self.losses))
            dt = max(now - self.t_last, 1e-9)
            tok_s = tokens_per_step * steps / dt
            self.t_last = now
            self.seconds.append(dt / steps)
            engine = getattr(self.trainer, "strata_engine", None)
            report = engine.last_step_report if engine is not None else None
            if report is not None:  # the engine's waits in its last step (seconds)
                t = report["timings"]
                self.waits.append({k: t[k + "_ns"] * 1e-9 for k in (
                    "step", "optimizer_io_wait", "gather_wait", "reduce_wait") if k + "_ns" in t})
            self.losses.append(float(logs["loss"]))
            self.lrs.append(float(logs.get("learning_rate", 0.0)))
            if not state.is_world_process_zero:
                return
            last = state.global_step >= state.max_steps
            tty = sys.stderr.isatty()
            end = "\n" if last or (not tty and state.global_step % 20 == 0) else ""
            if tty or end:
                print(bar(state.global_step, state.max_steps, self.losses[-1], self.lrs[-1],
                          tok_s), end=end, file=sys.stderr, flush=True)

    return Progress()


# -- training --------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "ds_hf_lora_zero3_nvme.json"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped query)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP size (0: 8/3 * hidden)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary (synthetic data)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (tokens)")
    ap.add_argument("--batch", type=int, default=8, help="per-device micro-batch")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4096, help="training sequences")
    ap.add_argument("--text", default=None,
                    help="train on this UTF-8 text file's characters instead of synthetic tokens")
    ap.add_argument("--bf16", action="store_true", help="bf16 (TrainingArguments(bf16=True))")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join("runs", "hf_finetune"))
    ap.add_argument("--nvme-path", default=None,
                    help="replaces the config's offload_optimizer.nvme_path (default <out>/nvme)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (this rank's GPU, LOCAL_RANK) or cpu (default: cuda when torch "
                         "sees a GPU)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank (default 1: the default model gains little from "
                         "more, and several collapse when other work shares the cores; 0: the "
                         "cores divided among the local ranks)")
    args = ap.parse_args()

    import warnings
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft's call
    import transformers
    from peft import LoraConfig, get_peft_model
    from strata.integrations.transformers import Trainer, TrainingArguments

    transformers.logging.set_verbosity_warning()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    cuda = args.device == "cuda"

    # the data
    if args.text:
        x, vocab = text_tokens(args.text, args.samples, args.seq, args.seed)
    else:
        vocab = args.vocab
        x = synthetic_tokens(args.samples, args.seq, vocab, args.seed)
    dataset = Sequences(x)

    # the DeepSpeed config: its NVMe directory under --out unless --nvme-path
    from strata.config import load_config
    cfg = load_config(args.config)  # comments taken, as strata.initialize takes them
    off = cfg.get("zero_optimization", {}).get("offload_optimizer", {})
    if off.get("device") == "nvme":
        off["nvme_path"] = os.path.abspath(args.nvme_path or os.path.join(args.out, "nvme"))
        os.makedirs(off["nvme_path"], exist_ok=True)

    # the model: a Llama from its config, LoRA adapters, the base frozen
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    mcfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate or (8 * args.hidden // 3 + 63) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq)
    base = transformers.LlamaForCausalLM(mcfg)
    model = get_peft_model(base, LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cuda:
        model = model.to(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")

    targs = TrainingArguments(
        output_dir=args.out, deepspeed=cfg, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.0, warmup_steps=max(1, args.steps // 10),
        max_grad_norm=1.0, bf16=args.bf16, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=not cuda, dataloader_num_workers=0, seed=args.seed,
        disable_tqdm=True)
    tokens_per_step = args.batch * args.grad_accum * args.seq * targs.world_size
    progress = make_progress(transformers, tokens_per_step)
    trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[progress])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # the bar instead
    progress.trainer = trainer
    rank0 = trainer.is_world_process_zero()
    if rank0:
        print(f"strata + transformers Trainer: Llama {n_params / 1e6:.2f}M params, "
              f"{n_train / 1e3:.1f}k trainable (LoRA r={args.lora_r}), vocab {vocab}, "
              f"{targs.world_size} rank(s) on {targs.device.type}, "
              f"{'text ' + args.text if args.text else 'synthetic tokens'}", flush=True)

    t0 = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - t0
    engine = trainer.strata_engine
    stats = engine.stats()
    layout = engine.layout()
    trainer.save_model(os.path.join(args.out, "adapter"))  # collective: every rank calls it

    if rank0:
        losses, lrs = progress.losses, progress.lrs
        k = max(1, min(10, len(losses) // 5))
        start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
        st = stats["store"]
        tokens = args.steps * tokens_per_step
        summary = {
            "params": n_params, "trainable_params": n_train, "ranks": targs.world_size,
            "device": targs.device.type, "steps": args.steps, "vocab": vocab,
            "loss_start": start, "loss_end": end, "train_loss": result.training_loss,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "bytes_moved": st["bytes_moved"], "peak_bytes": st["peak_bytes"],
            "nvme_io_bytes": st["io_bytes"], "layout": layout["text"],
            "config": os.path.abspath(args.config), "losses": losses, "learning_rates": lrs,
            "step_seconds": progress.seconds, "engine_step_waits_s": progress.waits,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        png = os.path.join(args.out, "hf_finetune.png")
        wrote = plot(png, losses, lrs)
        print(f"\nloss {start:.3f} -> {end:.3f} over {args.steps} steps ({elapsed:.1f} s, "
              f"{tokens / elapsed / 1e3:.2f}k tokens/s; ln(vocab) = "
              f"{torch.log(torch.tensor(float(vocab))).item():.3f})")
        print(f"ZeRO stage {layout['stage']}, optimizer on {layout['offload_optimizer']}, "
              f"params on {layout['offload_param']}, {layout['dtype']}")
        moved = ", ".join(f"{k} {human(v)}" for k, v in sorted(st["bytes_moved"].items()))
        print(f"bytes moved (rank 0): {moved or 'none'}; NVMe IO {human(st['io_bytes'])}" +
              (" (the NVMe-homed state fits the host cache: its files are written when it is "
               "flushed or evicted; summary.json's layout says why)"
               if st["io_bytes"] == 0 and st.get("peak_bytes", {}).get("nvme", 0) > 0 else ""))
        print(f"wrote {os.path.join(args.out, 'summary.json')}, "
              f"{os.path.join(args.out, 'adapter')}/" + (f" and {png}" if wrote else ""))


if __name__ == "__main__":
    main()
