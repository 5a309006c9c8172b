"""strata's step against plain torch (and DeepSpeed) on one CPU process, phase by phase (not a test).

A char GPT (examples/train_gpt.py's CharGPT; default 4 blocks, d_model 512, context 128, batch
4: about 12.7M parameters, fp32) trains on random tokens from the same weights and data:

  torch      the model + torch.optim.AdamW (no engine);
  strata     strata.initialize: ZeRO-3, optimizer state on NVMe (a temporary directory), parameters
             on cpu, 1 rank;
  deepspeed  (with --deepspeed) deepspeed.initialize with the same config (ZeRO-3,
             offload_optimizer nvme in its own temporary directory, offload_param cpu, AdamW lr 1e-3
             weight_decay 0.1, fp32, 1 rank over gloo; gradient_clipping written out as --clip,
             0 = none, in both configs, since their default is 1.0), DS_ACCELERATOR=cpu: DeepSpeedCPUAdam
             (adamw mode) with its optimizer state swapped through the async_io op.

In each of --rounds rounds all are built afresh and take their steps in turn (a torch step, a
strata step, a deepspeed step, on the same batch): --warmup untimed steps each, then --steps timed
ones, so a slow moment of a shared machine hits all. With --overlap-step they run in blocks instead
(torch's steps, then strata's, then deepspeed's): strata's optimizer step, running behind its next
forward, would otherwise run during the others' steps too. Printed: the medians over all timed
steps of forward (engine(x, y) / model(x, y)), backward (engine.backward / loss.backward), step
(engine.step / opt.step + zero_grad) and their total, and per phase the median of the per-step
ratios strata / torch (steadier than a ratio of medians when the machine's load moves; target:
total <= 1.2x), with --deepspeed also deepspeed / strata (target: total >= 1.5x) and
deepspeed / torch; then each runner's loss at the first and last step of the last round (all
start from the same weights and see the same batches, so they should agree closely).

    PYTHONPATH=build/python .venv/bin/python python/bench/bench_char_gpt.py [--threads 2]
        [--set zero_optimization.offload_optimizer.super_offload=false] [--json out.json]

--set KEY=VALUE (repeatable) changes the strata config (a dotted path; the value parsed as JSON,
else a string); --ds-set KEY=VALUE the DeepSpeed one the same way; --offload-optimizer cpu|nvme
sets zero_optimization.offload_optimizer.device for both (default nvme). --overlap-step passes
initialize(overlap_step=True) to strata. --stats prints the engine's stats (timings, store
counters) after the last strata round. --only torch|strata|deepspeed runs one alone; --runners
torch,deepspeed,strata picks the runners and their order in each step.

DeepSpeed (0.19.8 measured) lives in a scratch venv outside the repo that borrows this venv's
torch (same interpreter, so strata's native module and DeepSpeed load in one process):

    DSV=../ds-venv                                     # anywhere outside the repository
    .venv/bin/python -m venv $DSV                      # the same interpreter as .venv
    echo "$PWD/.venv/lib/python3.11/site-packages" \
        > $DSV/lib/python3.11/site-packages/main-venv.pth
    $DSV/bin/pip install --no-deps deepspeed==0.19.8
    $DSV/bin/pip install hjson ninja py-cpuinfo msgpack einops
    apt-get install -y libaio-dev                      # async_io (nvme offload)
    PYTHONPATH=build/python $DSV/bin/python python/bench/bench_char_gpt.py --deepspeed

DS_ACCELERATOR=cpu and MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK (one rank) are
set here when unset. The first run JIT-compiles DeepSpeed's cpu_adam, async_io, shm_comm and
pin_memory ops (about 6 minutes on 2 cores, cached in ~/.cache/torch_extensions afterwards), inside
the first deepspeed.initialize: run once (e.g. --only deepspeed --rounds 1 --steps 1) before
timing. Measured on 2 cores, whichever runner steps right after deepspeed has a slower forward
(about +15-20 ms: torch's by default), which flatters strata / torch in a --deepspeed run; take
strata / torch from a run without --deepspeed (or --runners deepspeed,strata,torch, where strata
pays it instead), and deepspeed / strata from the default order.
"""
import argparse
import importlib.metadata
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


def base_config(args, nvme):
    cfg = {"train_micro_batch_size_per_gpu": args.batch,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3,
                                 "offload_optimizer": {"device": args.offload_optimizer,
                                                       "nvme_path": nvme},
                                 "offload_param": {"device": "cpu"}}}
    # Written out: without the key DeepSpeed 0.19.8 and strata clip at 1.0, torch here does not.
    cfg["gradient_clipping"] = args.clip
    return cfg


def strata_config(args, nvme):
    return apply_sets(base_config(args, nvme), args.set)


def deepspeed_config(args, nvme):
    return apply_sets(base_config(args, nvme), args.ds_set)


def apply_sets(cfg, sets):
    for kv in sets:
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
        self.losses = []

    def run(self, args, out=None):
        x, y = next(self.data)
        t0 = time.perf_counter()
        loss = self.forward(x, y)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.step()
        t3 = time.perf_counter()
        self.losses.append(float(loss.detach()))
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
                                        overlap_step=args.overlap_step, device="cpu")
    return Trainer(lambda x, y: engine(x, y), engine.backward, engine.step), engine


def import_deepspeed():
    """DeepSpeed on its CPU accelerator, one rank over gloo (the env it wants, set if unset)."""
    for k, v in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"),
                 ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    try:  # installed, not strata standing in for it (strata.register_as_deepspeed)
        importlib.metadata.version("deepspeed")
        import deepspeed
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        sys.exit(f"--deepspeed: {e}; make the scratch venv the docstring describes and run this "
                 "script with its python")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def deepspeed_trainer(args, nvme):
    deepspeed = import_deepspeed()
    engine, _, _, _ = deepspeed.initialize(model=make_model(args),
                                           config=deepspeed_config(args, nvme))
    return Trainer(lambda x, y: engine(x, y), engine.backward, engine.step), engine


def deepspeed_summary(engine):
    """What DeepSpeed actually ran: its optimizer classes, offload and aio settings."""
    import deepspeed
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    swapper = getattr(opt, "optimizer_swapper", None)
    return {"version": deepspeed.__version__,
            "accelerator": deepspeed.get_accelerator()._name,
            "dist_backend": torch.distributed.get_backend(),
            "zero_stage": engine.zero_optimization_stage(),
            "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
            "zero_optimizer": type(opt).__name__,
            "optimizer": type(inner).__name__,
            "adamw_mode": getattr(inner, "adam_w_mode", None),
            "optimizer_swapper": type(swapper).__name__ if swapper is not None else None,
            "offload_optimizer": str(engine.zero_offload_optimizer()),
            "offload_param": str(engine.zero_offload_param()),
            "aio": engine.aio_config()}


RATIOS = (("strata", "torch", "target total <= 1.2x"),
          ("deepspeed", "strata", "target total >= 1.5x"),
          ("deepspeed", "torch", ""))


def run_round(args, res, ratios, losses, r):
    """All configurations, step by step in turn (the same data), so a slow moment of a shared
    machine hits all; each step gives a ratio per phase for each pair of runners."""
    dirs = []
    try:
        trainers = {}
        for name in args.runners:
            nvme = tempfile.mkdtemp(prefix=f"{name}-bench-gpt-", dir=args.nvme_dir)
            dirs.append(nvme)
            if name == "torch":
                trainers[name] = torch_trainer(args)
            elif name == "strata":
                trainers[name] = strata_trainer(args, nvme, r)
            else:
                trainers[name] = deepspeed_trainer(args, nvme)
        for t, _ in trainers.values():
            t.data = batches(args)
        n = args.warmup + args.steps
        steps = [{name: {k: [] for k in PHASES} for name in trainers} for _ in range(n)]
        if args.overlap_step:
            # The step strata runs behind its next forward would also run during the others' steps
            # if they alternated (and slow them): each runner's steps in a block.
            for name, (t, _) in trainers.items():
                for i in range(n):
                    t.run(args, steps[i][name])
        else:
            for i in range(n):
                for name, (t, _) in trainers.items():
                    t.run(args, steps[i][name])
        for step in steps[args.warmup:]:
            for name in trainers:
                for k in PHASES:
                    res[name][k] += step[name][k]
            for a, b, _ in RATIOS:
                if a in trainers and b in trainers:
                    for k in PHASES:
                        ratios[f"{a}/{b}"][k].append(step[a][k][0] / step[b][k][0])
        for name, (t, _) in trainers.items():
            losses[name] = t.losses
        stats = {}
        if "strata" in trainers:
            engine = trainers["strata"][1]
            stats["strata"] = engine.stats()
            engine.close()
        if "deepspeed" in trainers:
            engine = trainers["deepspeed"][1]
            stats["deepspeed"] = deepspeed_summary(engine)
            engine.destroy()
        return stats
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


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
    ap.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a DeepSpeed config key, dotted (repeatable)")
    ap.add_argument("--offload-optimizer", choices=("nvme", "cpu"), default="nvme",
                    help="zero_optimization.offload_optimizer.device for strata and DeepSpeed")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also run DeepSpeed (deepspeed.initialize, DS_ACCELERATOR=cpu)")
    ap.add_argument("--overlap-step", action="store_true")
    ap.add_argument("--nvme-dir", default=None, help="where the swap directory goes (tmp)")
    ap.add_argument("--only", choices=("torch", "strata", "deepspeed"), default=None)
    ap.add_argument("--runners", default=None, metavar="A,B,..",
                    help="which run and in what order in each step (torch,strata,deepspeed)")
    ap.add_argument("--stats", action="store_true", help="print the engine's stats")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.runners:
        args.runners = args.runners.split(",")
        if not args.runners or not set(args.runners) <= {"torch", "strata", "deepspeed"} \
                or len(set(args.runners)) != len(args.runners):
            ap.error("--runners: a comma list of distinct torch, strata, deepspeed")
    else:
        args.runners = ([args.only] if args.only else
                        ["torch", "strata"] + (["deepspeed"] if args.deepspeed else []))
    res = {name: {k: [] for k in PHASES} for name in args.runners}
    ratios = {f"{a}/{b}": {k: [] for k in PHASES} for a, b, _ in RATIOS}
    losses = {}
    stats = {}
    for r in range(args.rounds):
        stats = run_round(args, res, ratios, losses, r)
    med = {name: {k: statistics.median(v) for k, v in ph.items() if v}
           for name, ph in res.items()}
    n = sum(p.numel() for p in make_model(args).parameters())
    print(f"char GPT {n / 1e6:.2f}M params ({args.layers} blocks, d_model {args.d_model}, "
          f"context {args.ctx}, batch {args.batch}), {args.threads} threads; median of "
          f"{args.rounds} x {args.steps} steps, seconds")
    print(f"optimizer offload: {args.offload_optimizer}"
          + (f"; strata --set {args.set}" if args.set else "")
          + (f"; deepspeed --ds-set {args.ds_set}" if args.ds_set else ""))
    print(f"  {'':24s}" + "".join(f"{k:>10s}" for k in PHASES))
    for name in args.runners:
        print(f"  {name:24s}" + "".join(f"{med[name][k]:10.4f}" for k in PHASES))
    ratio = {}
    for a, b, target in RATIOS:
        key = f"{a}/{b}"
        if not ratios[key]["total"]:
            continue
        ratio[key] = {k: statistics.median(v) for k, v in ratios[key].items()}
        print(f"  {key + ' ratio':24s}" + "".join(f"{ratio[key][k]:9.2f}x" for k in PHASES) +
              f"   (median of the per-step ratios {a} / {b}" + (f"; {target})" if target else ")"))
    if losses:
        print(f"loss (last round), step 1 .. {args.warmup + args.steps}:")
        for name, ls in losses.items():
            print(f"  {name:10s} first {ls[0]:.6f}  last {ls[-1]:.6f}  mean {statistics.mean(ls):.6f}")
        names = list(losses)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                d = max(abs(u - v) for u, v in zip(losses[a], losses[b]))
                print(f"  max |loss {a} - loss {b}| over the steps: {d:.2e}")
    if "deepspeed" in stats:
        print("deepspeed ran: " + json.dumps(stats["deepspeed"], default=str))
    if args.stats and "strata" in stats:
        print(json.dumps(stats["strata"], indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "args": vars(args), "median_s": med,
                       "ratio": ratio.get("strata/torch", {}), "ratio_pairs": ratio,
                       "samples_s": res, "ratios": ratios["strata/torch"], "ratios_pairs": ratios,
                       "losses": losses,
                       "strata_stats": stats.get("strata"),
                       "deepspeed_config": stats.get("deepspeed")}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
