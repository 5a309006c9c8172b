"""The adapter's costs, as ratios against references measured in the same run (not a test):

  hook overhead   strata ZeRO-3 with params and optimizer on the device tier (HostDevice) against
                  plain torch DDP (gloo) + torch.optim.AdamW on the same model and ranks (target
                  <= 1.15x);
  NVMe cost       strata ZeRO-3, optimizer on NVMe against optimizer on cpu (target <= 1.2x).

    torchrun --standalone --nproc_per_node 2 python/bench/bench_adapter.py [--hidden 256 --layers 6]

The model is examples/train_gpt.py's CharGPT on random tokens. Each configuration runs --warmup
steps, then --steps timed ones; the median step time is reported (rank 0 prints the table).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
from train_gpt import CharGPT  # noqa: E402

import strata  # noqa: E402
from strata.engine import _share_rendezvous_secret  # noqa: E402


def config(stage, opt_dev, nvme, mb):
    z = {"stage": stage, "overlap_comm": True, "stage3_param_persistence_threshold": 1024}
    if opt_dev != "none":
        z["offload_optimizer"] = {"device": opt_dev, "nvme_path": nvme, "buffer_count": 4}
    return {"train_micro_batch_size_per_gpu": mb, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": z}


def batches(args, rank):
    g = torch.Generator().manual_seed(rank + 1)
    while True:
        x = torch.randint(0, args.vocab, (args.mb, args.ctx), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def time_steps(step, args, rank):
    data = batches(args, rank)
    times = []
    for i in range(args.warmup + args.steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step(*next(data))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_ddp(args, rank):
    torch.manual_seed(0)
    model = CharGPT(args.vocab, args.hidden, args.heads, args.layers, args.ctx)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return time_steps(step, args, rank)


def run_strata(args, rank, opt_dev, nvme, tag):
    os.environ["STRATA_RUN_ID"] = f"bench-{tag}"
    torch.manual_seed(0)
    model = CharGPT(args.vocab, args.hidden, args.heads, args.layers, args.ctx)
    engine, _, _, _ = strata.initialize(model=model, config=config(3, opt_dev, nvme, args.mb),
                                        device="cpu")  # the stand-in, as DDP runs on gloo

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    t = time_steps(step, args, rank)
    engine.close()
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=93)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--nvme-path", default=None)
    args = ap.parse_args()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    _share_rendezvous_secret()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    nvme = args.nvme_path or tempfile.mkdtemp(prefix=f"strata-bench-r{rank}-")
    res = {}
    # Interleaved twice so a slow phase of a shared machine hits every configuration.
    for rep in range(2):
        for name, fn in [("ddp", lambda: run_ddp(args, rank)),
                         ("strata_device", lambda: run_strata(args, rank, "none", nvme, f"d{rep}")),
                         ("strata_opt_cpu", lambda: run_strata(args, rank, "cpu", nvme, f"c{rep}")),
                         ("strata_opt_nvme", lambda: run_strata(args, rank, "nvme", nvme, f"n{rep}"))]:
            res.setdefault(name, []).append(fn())
    if rank == 0:
        med = {k: min(v) for k, v in res.items()}
        n = sum(p.numel() for p in CharGPT(args.vocab, args.hidden, args.heads, args.layers,
                                             args.ctx).parameters())
        print(f"model {n / 1e6:.2f}M params, {torch.distributed.get_world_size()} ranks, "
              f"micro-batch {args.mb} x {args.ctx}; median step (best of 2 rounds):")
        for k, v in med.items():
            print(f"  {k:16s} {v * 1e3:8.1f} ms")
        print(f"hook overhead  strata stage 3 (device tier) / torch DDP = "
              f"{med['strata_device'] / med['ddp']:.2f}x (target <= 1.15x)")
        print(f"NVMe cost      optimizer on nvme / on cpu = "
              f"{med['strata_opt_nvme'] / med['strata_opt_cpu']:.2f}x (target <= 1.2x)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
