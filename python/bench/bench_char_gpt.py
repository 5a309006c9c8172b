"""strata's step against plain torch on one CPU process, phase by phase (not a test).

A char GPT (examples/train_gpt.py's CharGPT; default 4 blocks, d_model 512, context 128, batch
4: about 12.7M parameters, fp32) trains on random tokens twice from the same weights and data:

  torch   the model + torch.optim.AdamW (no engine);
  strata  strata.initialize: ZeRO-3, optimizer state on NVMe (a temporary directory), parameters
          on cpu, 1 rank.

In each of --rounds rounds both are built afresh and take their steps in turn (a torch step, a
strata step, on the same batch): --warmup untimed pairs, then --steps timed ones, so a slow
moment of a shared machine hits both. With --overlap-step they run in blocks instead (torch's
steps, then strata's): strata's optimizer step, running behind its next forward, would otherwise
run during torch's step too. Printed: the medians over all timed steps of forward
(engine(x, y) / model(x, y)), backward (engine.backward / loss.backward), step (engine.step /
opt.step + zero_grad) and their total, and per phase the median of the per-pair ratios strata /
torch (steadier than a ratio of medians when the machine's load moves). Target: total <= 1.2x.

    PYTHONPATH=build/python .venv/bin/python python/bench/bench_char_gpt.py [--threads 2]
        [--set zero_optimization.offload_optimizer.super_offload=false] [--json out.json]

--set KEY=VALUE (repeatable) changes the strata config (a dotted path; the value parsed as JSON,
else a string); --overlap-step passes initialize(overlap_step=True). --stats prints the engine's
stats (timings, store counters) after the last strata round.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
from train_gpt import CharGPT  # noqa: E402

import strata  # noqa: E402

PHASES = ("forward", "backward", "step", "total")


def strata_config(args, nvme):
    cfg = {"train_micro_batch_size_per_gpu": args.batch,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                 "offload_param": {"device": "cpu"}}}
    if args.clip:
        cfg["gradient_clipping"] = args.clip
    for kv in args.set:
        key, _, raw = kv.partition("=")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


def make_model(args):
    torch.manual_seed(0)
    return CharGPT(args.vocab, args.d_model, args.heads, args.layers, args.ctx)


def batches(args):
    g = torch.Generator().manual_seed(1)
    while True:
        x = torch.randint(0, args.vocab, (args.batch, args.ctx), generator=g)
        yield x, torch.roll(x, -1, dims=1)


class Trainer:
    """One configuration: its step split into forward / backward / step, timed."""

    def __init__(self, forward, backward, step):
        self.forward, self.backward, self.step = forward, backward, step
        self.data = None

    def run(self, args, out=None):
        x, y = next(self.data)
        t0 = time.perf_counter()
        loss = self.forward(x, y)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.step()
        t3 = time.perf_counter()
        if out is not None:
            for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                out[k].append(v)


def torch_trainer(args):
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step():
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Trainer(lambda x, y: model(x, y), lambda loss: loss.backward(), step), None


def strata_trainer(args, nvme, tag):
    os.environ["STRATA_RUN_ID"] = f"bench-char-gpt-{tag}"
    engine, _, _, _ = strata.initialize(model=make_model(args), config=strata_config(args, nvme),
                                        overlap_step=args.overlap_step)
    return Trainer(lambda x, y: engine(x, y), engine.backward, engine.step), engine


def run_round(args, res, ratios, r):
    """Both configurations, step by step in turn (the same data), so a slow moment of a shared
    machine hits both; each pair gives a ratio per phase."""
    nvme = tempfile.mkdtemp(prefix="strata-bench-gpt-", dir=args.nvme_dir)
    try:
        trainers = {}
        if args.only != "strata":
            trainers["torch"] = torch_trainer(args)
        if args.only != "torch":
            trainers["strata"] = strata_trainer(args, nvme, r)
        for t, _ in trainers.values():
            t.data = batches(args)
        n = args.warmup + args.steps
        pairs = [{name: {k: [] for k in PHASES} for name in trainers} for _ in range(n)]
        if args.overlap_step:
            # The step strata runs behind its next forward would also run during torch's step if
            # the two alternated (and slow it): torch's steps first, then strata's, in blocks.
            for name, (t, _) in trainers.items():
                for i in range(n):
                    t.run(args, pairs[i][name])
        else:
            for i in range(n):
                for name, (t, _) in trainers.items():
                    t.run(args, pairs[i][name])
        for pair in pairs[args.warmup:]:
            for name in trainers:
                for k in PHASES:
                    res[name][k] += pair[name][k]
            if len(trainers) == 2:
                for k in PHASES:
                    ratios[k].append(pair["strata"][k][0] / pair["torch"][k][0])
        engine = trainers.get("strata", (None, None))[1]
        stats = engine.stats() if engine is not None else None
        if engine is not None:
            engine.close()
        return stats
    finally:
        shutil.rmtree(nvme, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=93)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: none)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a strata config key, dotted (repeatable)")
    ap.add_argument("--overlap-step", action="store_true")
    ap.add_argument("--nvme-dir", default=None, help="where the swap directory goes (tmp)")
    ap.add_argument("--only", choices=("torch", "strata"), default=None)
    ap.add_argument("--stats", action="store_true", help="print the engine's stats")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {"torch": {k: [] for k in PHASES}, "strata": {k: [] for k in PHASES}}
    ratios = {k: [] for k in PHASES}
    stats = None
    for r in range(args.rounds):
        stats = run_round(args, res, ratios, r)
    med = {name: {k: statistics.median(v) for k, v in ph.items() if v}
           for name, ph in res.items()}
    n = sum(p.numel() for p in make_model(args).parameters())
    print(f"char GPT {n / 1e6:.2f}M params ({args.layers} blocks, d_model {args.d_model}, "
          f"context {args.ctx}, batch {args.batch}), {args.threads} threads; median of "
          f"{args.rounds} x {args.steps} steps, seconds")
    print(f"  {'':8s}" + "".join(f"{k:>10s}" for k in PHASES))
    for name in ("torch", "strata"):
        if med[name]:
            print(f"  {name:8s}" + "".join(f"{med[name][k]:10.4f}" for k in PHASES))
    ratio = {}
    if med["torch"] and med["strata"]:
        ratio = {k: statistics.median(v) for k, v in ratios.items()}
        print(f"  {'ratio':8s}" + "".join(f"{ratio[k]:9.2f}x" for k in PHASES) +
              "   (median of the per-step ratios strata / torch; target total <= 1.2x)")
    if args.stats and stats is not None:
        print(json.dumps(stats, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "args": vars(args), "median_s": med, "ratio": ratio,
                       "samples_s": res, "ratios": ratios, "strata_stats": stats}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
