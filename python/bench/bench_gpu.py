"""strata on one GPU, as ratios against references measured in the same run (not a test):

  fits_in_hbm   strata ZeRO-3, nothing offloaded, against plain torch (fp32 master weights +
                torch.autocast(bf16) + torch.optim.AdamW(fused=True)) on the same Llama-shaped
                model (~1.3B params) and batch: median step (fwd+bwd+step) strata / torch
                (target <= 1.15x). A pure-bf16 torch step (no master weights) is also timed when
                the budget allows, for information only.
  zero_offload  strata ZeRO-3 (--offload-stage) with the optimizer on the CPU (ZeRO-Offload), at
                the largest model that fits host memory and the time budget (up to ~7B; the JSON
                says which), against the physical floor of that step measured in this run:
                max(GPU compute = plain torch fwd+bwd on the same model and batch,
                    PCIe = 4 B/param (bf16 grads down, bf16 params up) / pinned-copy rate,
                    CPU Adam = 28 B/param (fp32 master, m, v read+write; bf16 grad read; bf16
                               param write) / DRAM triad rate on all threads)
                step / floor (target <= 1.2x); model TFLOPS 6*N*T/step and with PaLM's attention
                term (6*N*T + 12*layers*hidden*seq*T). Stage 3 runs with overlap_step (the CPU
                Adam behind the next forward); --offload-speculative-step on adds the Adam of
                the groups whose gradients are final during the backward (offload_optimizer.
                speculative_step, which stands down after a step that was clipped).
  phases        every run's JSON has "phases": per forward / backward / optimizer call, the
                host's time in the call and (GPU) the stream's span between events recorded at
                the boundaries, medians over the timed steps, no synchronize added (Phases).
  timeline      fits_in_hbm's two runs and zero_offload's strata run also profile one step after
                the timed ones (torch.profiler; gpu_timeline.py): the GPU's busy fraction and
                its idle gaps, each with what the host was doing (waiting in a synchronize, or
                late with the next work). --trace-dir keeps the traces; --no-timeline skips it.
  --deepspeed   DeepSpeed (deepspeed.initialize, one rank) beside strata in fits_in_hbm and
                zero_offload, on the same model, batch and config: deepspeed / strata, and in
                zero_offload deepspeed / floor. Without optimizer offload it steps with
                torch.optim.AdamW (torch_adam) rather than JIT-building FusedAdam; with it,
                DeepSpeedCPUAdam, built on its first initialize (init_s, not the step).
  nvme          strata ZeRO-3 with optimizer states and parameters on NVMe (ZeRO-Infinity), sized
                so the states take <= 50 % of the free disk and the steps fit the budget:
                io_efficiency = (the step's NVMe bytes, from the engine's stats, at the disk's
                read and write rates measured in this run) / step time (1.0: as fast as the disk).

    python python/bench/bench_gpu.py --out bench_gpu.json                 # one H200, ~4 minutes
    python python/bench/bench_gpu.py --device cpu --tiny --out /tmp/b.json  # the CPU stand-in

The models are transformers' LlamaForCausalLM with random weights (nothing downloaded), vocab
32000, seq 1024, bf16, built directly on the device; the batch is random tokens and the loss
model(input_ids=x, labels=x).loss. Each run does --warmup steps, then --steps timed ones
(torch.cuda.synchronize around each); the JSON has the median and every step time. The whole
script keeps to --budget-s (from its start, imports included): a part or run that would not fit
is reported as {"skipped": "time budget ..."}, a part that fails as {"error": ...}, and the others
still run. The JSON file is rewritten after every part, so a kill leaves the parts done. With
--device cpu the engine is the HostDevice stand-in and the GPU-only figures (PCIe) are null.
"""
import time

_T0 = time.monotonic()

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import mmap  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

import strata  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timeline  # noqa: E402

GiB = 1 << 30

# name: (hidden, layers, intermediate, heads); kv heads = heads, untied embeddings.
PRESETS = {
    "tiny": (64, 2, 172, 4),
    "125m": (768, 12, 2048, 12),
    "350m": (1024, 24, 2816, 16),
    "760m": (1536, 24, 4096, 16),
    "1.3b": (2048, 24, 5504, 16),
    "2.7b": (2560, 32, 6912, 20),
    "4b": (3072, 32, 8192, 24),
    "7b": (4096, 32, 11008, 32),
}
LADDER = ["7b", "4b", "2.7b", "1.3b", "760m", "350m", "125m"]  # auto sizing, largest first

# Sizing assumptions (only used to choose sizes; every reported figure is measured).
ASSUMED_TFLOPS = 350e12  # achieved bf16 on the GPU for the compute estimate
INIT_S_PER_PARAM = 10e-9  # strata.initialize cost before part 1 measured it
# Host memory beside the engine's own state (strata.plan): torch, the CUDA context, staging, one
# parameter's fp32 copy at initialize. A model is run when both fit 90 % of MemAvailable.
HOST_OVERHEAD_BYTES = 8 * 2**30
HOST_USABLE_FRACTION = 0.9
# GPU memory of zero_offload's torch fwd+bwd reference, the larger of the part's two runs
# (strata's keeps no whole-model gradient): bf16 weights and gradients, the activations autograd
# keeps per token and layer (SDPA; RMSNorm's fp32 copies, attention and MLP inputs: about
# 32 h + 10 intermediate bytes) and the logits' (about 10 B per vocabulary entry). A model is run
# when it fits this share of the GPU's memory (an 80 GB card rules out 7B at micro-batch 8).
DEVICE_USABLE_FRACTION = 0.85
NVME_BYTES_PER_PARAM = 18  # on disk: fp32 master, m, v + bf16 params (+ slack)
NVME_STEP_READ_PER_PARAM = 16  # states 12 + params fwd 2 + bwd 2
NVME_STEP_WRITE_PER_PARAM = 14  # states 12 + params 2
ADAM_BYTES_PER_PARAM = 28  # 24 (fp32 master, m, v read+write) + bf16 grad read + bf16 param write
PCIE_BYTES_PER_PARAM = 4  # bf16 grads down + bf16 params up


class Budget:
    def __init__(self, total_s):
        self.total = total_s

    def elapsed(self):
        return time.monotonic() - _T0

    def left(self):
        return self.total - self.elapsed()


class Skip(Exception):
    """A run that does not fit the time budget."""


def parse_shape(spec):
    """A preset name or HIDDENxLAYERS (intermediate ~8/3 hidden, heads hidden/128)."""
    if spec in PRESETS:
        return spec, PRESETS[spec]
    h, layers = (int(v) for v in spec.lower().split("x"))
    inter = max(16, (h * 8 // 3 + 255) // 256 * 256)
    return spec, (h, layers, inter, max(1, h // 128))


def param_count(shape, vocab):
    h, layers, inter, _ = shape
    return 2 * vocab * h + layers * (4 * h * h + 3 * h * inter + 2 * h) + h


def build_model(shape, vocab, seq, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    h, layers, inter, heads = shape
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=max(seq, 128),
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.to(dtype)
    model.train()
    return model


def ds_config(mb, stage, opt_dev=None, param_dev=None, nvme_path=None):
    z = {"stage": stage, "overlap_comm": True}
    if opt_dev:
        z["offload_optimizer"] = {"device": opt_dev, "pin_memory": True}
        if opt_dev == "nvme":
            z["offload_optimizer"]["nvme_path"] = nvme_path
    if param_dev:
        z["offload_param"] = {"device": param_dev, "pin_memory": True}
        if param_dev == "nvme":
            z["offload_param"]["nvme_path"] = nvme_path
    return {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.1}},
            "zero_optimization": z}


class Ctx:
    """What every part shares: args, device, budget, references measured so far."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.budget = Budget(args.budget_s)
        self.init_s_per_param = None  # strata.initialize's cost, measured in part 1
        self.runs = 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        try:
            gc.collect()
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a broken CUDA context fails the next run instead
            print(f"bench_gpu: freeing memory failed: {e}", file=sys.stderr)

    def device_budget(self):
        """device_budget_bytes for strata.initialize: a share of the free GPU memory (the rest
        for torch's activations); None (the engine's default) on the CPU stand-in."""
        if not self.cuda:
            return None
        free, _ = torch.cuda.mem_get_info()
        return int(free * self.args.device_budget_frac)

    def need(self, seconds, what):
        left = self.budget.left()
        if left < seconds:
            raise Skip(f"skipped: time budget ({what} needs ~{seconds:.0f} s, {left:.0f} s left)")

    def reserve_s(self):
        return 3.0 if self.args.tiny else 8.0


def time_steps(ctx, step, warmup, steps, min_left=None, before_timed=None):
    """Median of `steps` timed calls of step() after `warmup` untimed ones; stops early (and
    says so) when the budget would run out. before_timed() runs (untimed) before the first
    timed step."""
    min_left = ctx.reserve_s() if min_left is None else min_left
    warm, times = [], []
    for i in range(warmup + steps):
        if i == warmup and before_timed is not None:
            before_timed()
        if i > 0:
            last = (times or warm)[-1]
            if ctx.budget.left() - last < min_left:
                break
        ctx.sync()
        t0 = time.perf_counter()
        step()
        ctx.sync()
        (warm if i < warmup else times).append(time.perf_counter() - t0)
    out = {"median_s": statistics.median(times) if times else None,
           "step_s": times, "warmup_s": warm}
    if len(times) < steps:
        out["truncated"] = f"time budget: {len(times)} of {steps} timed steps"
    return out


class Phases:
    """Where a step's time goes, without adding a synchronize: at each boundary between the
    forward, backward and optimizer calls the host's clock and, on a GPU, an event on the current
    stream. Per phase, the median over the timed steps of the host's time in the call (host_s)
    and of the GPU's span between the events (gpu_s; the span includes time the stream sat idle).
    A host_s close to gpu_s says the host, not the GPU, set the pace of that phase."""
    NAMES = ("forward", "backward", "step")

    def __init__(self, ctx):
        self.cuda = ctx.cuda
        self.rows = []

    def mark(self, first=False):
        if first:
            self.rows.append([])
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.rows[-1].append((time.perf_counter(), ev))

    def summary(self, timed):
        rows = [r for r in self.rows[-timed:] if len(r) == len(self.NAMES) + 1] if timed else []
        if not rows:
            return None
        out = {}
        for i, name in enumerate(self.NAMES):
            host = [r[i + 1][0] - r[i][0] for r in rows]
            d = {"host_s": statistics.median(host)}
            if self.cuda:
                d["gpu_s"] = statistics.median(
                    r[i][1].elapsed_time(r[i + 1][1]) / 1e3 for r in rows)
            out[name] = d
        return out


def profile_run(ctx, res, step, tag):
    """res["timeline"]: one more step() under the profiler (gpu_timeline.profile_step), when the
    run asked for it (tag), --no-timeline is not given and the budget has room for it."""
    if tag is None or not ctx.args.timeline:
        return
    last = (res.get("step_s") or res.get("warmup_s") or [0.0])[-1]
    try:
        ctx.need(3 * last + 5 + ctx.reserve_s(), f"timeline {tag}")
        trace = (os.path.join(ctx.args.trace_dir, f"{tag}.trace.json.gz")
                 if ctx.args.trace_dir else None)
        res["timeline"] = gpu_timeline.profile_step(step, ctx.cuda, trace)
    except Skip as e:
        res["timeline"] = {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - the figures above stand without it
        res["timeline"] = {"error": f"{type(e).__name__}: {e}"}


def time_engine_steps(ctx, engine, x, warmup, steps, before_timed=None, after_timed=None,
                      timeline=None):
    """time_steps over a DeepSpeed-style engine's forward / backward / step on the batch x, with
    its Phases and the GPU's peak memory counted from the first step; after_timed() (untimed)
    once the timed steps are done; then profile_run for the timeline tag."""
    ph = Phases(ctx)

    def step():
        ph.mark(first=True)
        loss = engine(input_ids=x, labels=x).loss
        ph.mark()
        engine.backward(loss)
        ph.mark()
        engine.step()
        ph.mark()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    res = time_steps(ctx, step, warmup, steps, before_timed=before_timed)
    ctx.sync()
    res["phases"] = ph.summary(len(res["step_s"]))
    if ctx.cuda:
        res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    if after_timed is not None:
        after_timed()
    profile_run(ctx, res, step, timeline)
    return res


def run_strata(ctx, tag, shape, mb, seq, cfg, warmup, steps, overlap_step=False,
               with_stats=False, est_s=0.0, timeline=False):
    """strata.initialize on a fresh model on the device; timed engine steps. Skipped when less
    than est_s (+ the reserve) is left."""
    a = ctx.args
    ctx.need(est_s + ctx.reserve_s(), f"strata run {tag}")
    ctx.runs += 1
    os.environ["STRATA_RUN_ID"] = f"bench-gpu-{os.getpid()}-{ctx.runs}-{tag}"
    torch.manual_seed(0)
    model = build_model(shape, a.vocab, seq, torch.bfloat16, ctx.device)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, a.vocab, (mb, seq), device=ctx.device)
    kw = {"overlap_step": True} if overlap_step else {}
    budget = ctx.device_budget()
    if budget is not None:
        kw["device_budget_bytes"] = budget
    t0 = time.perf_counter()
    engine, _, _, _ = strata.initialize(model=model, config=cfg,
                                        model_parameters=model.parameters(), device=ctx.device,
                                        **kw)
    ctx.sync()
    init_s = time.perf_counter() - t0
    try:
        before, after = {}, {}
        # The waits are the timed steps' alone: read before the profiled step.
        res = time_engine_steps(ctx, engine, x, warmup, steps,
                                before_timed=lambda: before.update(engine.stats()),
                                after_timed=lambda: after.update(engine.stats()),
                                timeline=f"strata-{tag}" if timeline else None)
        res["init_s"] = init_s
        res["params"] = n
        res["device_budget_bytes"] = budget
        res["waits_per_step"] = waits_per_step(before, after, len(res["step_s"]))
        # gpu_peak_bytes is torch's allocator alone; the engine's memory is its own pool.
        res["engine_peak_bytes"] = after.get("peak_bytes")
        if tag == "fit" and a.offload_states_timing:
            res["offload_states"] = guarded(ctx, time_offload_states, ctx, engine)
        if with_stats:
            res["_stats_before"] = before
            res["_stats_after"] = after
        return res
    finally:
        engine.close()


def time_offload_states(ctx, engine, rounds=2):
    """engine.offload_states() / reload_states() after the timed steps: the engine's device
    bytes that leave, and each round's seconds and GB/s. The first round page-locks its host
    memory; later ones reuse it (as DeepSpeed's pinned buffers)."""
    held = engine._engine.device_used_bytes
    ctx.need(rounds * 2 * held / 2e9 + 5 + ctx.reserve_s(), "offload_states timing")
    out = {"device_bytes": held, "offload_s": [], "reload_s": []}
    for _ in range(rounds):
        ctx.sync()
        t = time.perf_counter()
        engine.offload_states()
        ctx.sync()
        out["offload_s"].append(time.perf_counter() - t)
        out["freed_bytes"] = held - engine._engine.device_used_bytes
        t = time.perf_counter()
        engine.reload_states()
        ctx.sync()
        out["reload_s"].append(time.perf_counter() - t)
    out["offload_gb_s"] = [held / s / 1e9 for s in out["offload_s"]]
    out["reload_gb_s"] = [held / s / 1e9 for s in out["reload_s"]]
    return out


WAIT_KEYS = ("gather_wait_ns", "reduce_wait_ns", "grad_lease_wait_ns", "optimizer_ns",
             "optimizer_io_wait_ns", "step_ns", "speculative_optimizer_ns")


def waits_per_step(before, after, k):
    """Where the host waited, per timed step (the engine's timings and the adapter's own waits
    for the GPU, from engine.stats() before and after the k timed steps), in seconds: what
    tells a host-paced step (waits that grow with the groups) from a device-paced one."""
    if not before or not k:
        return None
    out = {key[:-3] + "_s": (after.get(key, 0) - before.get(key, 0)) / k / 1e9
           for key in WAIT_KEYS}
    a0, a1 = before.get("adapter", {}), after.get("adapter", {})
    out["adapter_device_waits"] = (a1.get("device_waits", 0) - a0.get("device_waits", 0)) / k
    out["adapter_device_wait_s"] = (a1.get("device_wait_ns", 0) -
                                    a0.get("device_wait_ns", 0)) / k / 1e9
    return out


def run_torch(ctx, shape, mb, seq, mode, warmup, steps, est_s=0.0, timeline=False):
    """Plain torch on a fresh model: mode "amp" (fp32 params + autocast bf16 + fused AdamW),
    "bf16" (bf16 params + fused AdamW, no master) or "fwd_bwd" (bf16, no optimizer step)."""
    a = ctx.args
    ctx.need(est_s + ctx.reserve_s(), f"torch run {mode}")
    torch.manual_seed(0)
    dtype = torch.float32 if mode == "amp" else torch.bfloat16
    model = build_model(shape, a.vocab, seq, dtype, ctx.device)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, a.vocab, (mb, seq), device=ctx.device)
    opt = None
    if mode != "fwd_bwd":
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=0.1, fused=True)
            fused = True
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=0.1)
            fused = False

    ph = Phases(ctx)

    def step():
        ph.mark(first=True)
        if mode == "amp":
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
        else:
            loss = model(input_ids=x, labels=x).loss
        ph.mark()
        loss.backward()
        ph.mark()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for p in model.parameters():
                p.grad = None
        ph.mark()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    res = time_steps(ctx, step, warmup, steps)
    ctx.sync()
    res["phases"] = ph.summary(len(res["step_s"]))
    res["params"] = n
    if opt is not None:
        res["fused_adamw"] = fused
    if ctx.cuda:
        res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    profile_run(ctx, res, step, f"torch-{mode}" if timeline else None)
    return res


def import_deepspeed(ctx):
    """DeepSpeed as one rank (the env it wants, set where unset): NCCL on the GPU; its CPU
    accelerator and gloo on the stand-in. DS_ACCELERATOR must be set before the import."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    if not ctx.cuda:
        env["DS_ACCELERATOR"] = "cpu"
    for k, v in env.items():
        os.environ.setdefault(k, v)
    # Installed, not strata standing in for it (strata.register_as_deepspeed after a stage-3 run).
    importlib.metadata.version("deepspeed")
    import deepspeed
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if ctx.cuda else "gloo")
    return deepspeed


def deepspeed_config(cfg):
    """strata's config for DeepSpeed: the same, except that without optimizer offload DeepSpeed
    steps with torch.optim.AdamW (torch_adam) instead of building its FusedAdam op first (a
    minute of nvcc on the GPU machine); with offload it builds DeepSpeedCPUAdam (cpu_adam, g++)
    on the first initialize, which init_s then includes."""
    cfg = json.loads(json.dumps(cfg))
    if "offload_optimizer" not in cfg["zero_optimization"]:
        cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def run_deepspeed(ctx, tag, shape, mb, seq, cfg, warmup, steps, est_s=0.0):
    """deepspeed.initialize (DeepSpeed 0.19.8) on a fresh equal model and the same batch and
    config as run_strata; timed engine steps."""
    a = ctx.args
    ctx.need(est_s + ctx.reserve_s(), f"deepspeed run {tag}")
    deepspeed = import_deepspeed(ctx)
    torch.manual_seed(0)
    model = build_model(shape, a.vocab, seq, torch.bfloat16, ctx.device)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, a.vocab, (mb, seq), device=ctx.device)
    cfg = deepspeed_config(cfg)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=model.parameters())
    ctx.sync()
    init_s = time.perf_counter() - t0
    try:
        res = time_engine_steps(ctx, engine, x, warmup, steps)
        res["init_s"] = init_s
        res["params"] = n
        opt = engine.optimizer
        res["deepspeed"] = {"version": deepspeed.__version__,
                            "accelerator": deepspeed.get_accelerator()._name,
                            "zero_optimizer": type(opt).__name__,
                            "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
                            "config_optimizer": cfg["optimizer"]}
        if ctx.cuda:
            res["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        return res
    finally:
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()
        del engine


def with_deepspeed(ctx, res, tag, shape, mb, seq, cfg, warmup, steps, est_s):
    """--deepspeed: DeepSpeed on the part's model, batch and config, and deepspeed / strata."""
    if not ctx.args.deepspeed:
        return
    res["deepspeed"] = guarded(ctx, run_deepspeed, ctx, tag, shape, mb, seq, cfg, warmup, steps,
                               est_s=est_s)
    d, s = res["deepspeed"].get("median_s"), res["strata"].get("median_s")
    res["ratio_deepspeed_over_strata"] = d / s if d and s else None


def guarded(ctx, fn, *a, **k):
    """fn's result, or {"skipped": ...} / {"error": ...}; memory freed after either."""
    try:
        return fn(*a, **k)
    except Skip as e:
        return {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        ctx.free()


def estimate_step_s(n, tokens):
    return 6.0 * n * tokens / ASSUMED_TFLOPS


def tflops(n, tokens, step_s, shape, seq):
    if not step_s:
        return None, None
    h, layers, _, _ = shape
    base = 6.0 * n * tokens
    return base / step_s / 1e12, (base + 12.0 * layers * h * seq * tokens) / step_s / 1e12


# -- references measured in this run --------------------------------------------------------
def measure_dram(ctx):
    """STREAM triad a = b + s*c (torch on the CPU, all threads), 3 arrays counted, best of 5."""
    n = (16 << 20) if ctx.args.tiny else (128 << 20)  # float32 elements per array
    threads = os.cpu_count() or 1
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = torch.ones(n)
        c = torch.full((n,), 2.0)
        a = torch.empty(n)
        torch.add(b, c, alpha=3.0, out=a)  # touch
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = min(best, time.perf_counter() - t0)
        return {"triad_bytes_per_s": 3 * 4 * n / best, "array_bytes": 4 * n, "threads": threads}
    finally:
        torch.set_num_threads(old)


def measure_pcie(ctx):
    """Pinned host <-> device copy of a ~1 GiB tensor, best of 5 each way; None on the CPU."""
    if not ctx.cuda:
        return None
    nbytes = GiB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    out = {}
    for name, dst, src in [("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)]:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best
    out["bytes"] = nbytes
    del host, dev
    return out


def measure_disk(path, nbytes, threads=4, chunk=8 << 20):
    """Sequential write (then fsync) and read of a temp file in `path`, `threads` threads on
    contiguous slices, 8 MiB requests; O_DIRECT where the file system allows it, else buffered
    with the pages dropped (posix_fadvise DONTNEED) before the read."""
    nbytes = max(chunk * threads, nbytes // (chunk * threads) * chunk * threads)
    fname = os.path.join(path, f"strata-bench-disk-{os.getpid()}.tmp")
    direct = getattr(os, "O_DIRECT", 0)
    per = nbytes // threads

    def open_file(flags):
        for extra in ([direct, 0] if direct else [0]):
            try:
                return os.open(fname, flags | extra, 0o600), bool(extra)
            except OSError:
                continue
        raise OSError(f"cannot open {fname}")

    def run(fd, write):
        errors = []

        def worker(i):
            try:
                work(i)
            except OSError as e:
                errors.append(e)

        def work(i):
            buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
            if write:
                buf.write(os.urandom(chunk))
            off = i * per
            while off < (i + 1) * per:
                k = os.pwritev(fd, [buf], off) if write else os.preadv(fd, [buf], off)
                if k <= 0:
                    raise OSError("short disk transfer")
                off += k
            buf.close()
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            raise errors[0]
        if write:
            os.fsync(fd)
        return time.perf_counter() - t0

    try:
        fd, is_direct = open_file(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.ftruncate(fd, nbytes)
            try:
                w = run(fd, True)
            except OSError:
                if not is_direct:
                    raise
                os.close(fd)
                fd, is_direct = os.open(fname, os.O_WRONLY), False
                w = run(fd, True)
        finally:
            os.close(fd)
        fd = os.open(fname, os.O_RDONLY | (direct if is_direct else 0))
        try:
            if not is_direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            r = run(fd, False)
        finally:
            os.close(fd)
    finally:
        if os.path.exists(fname):
            os.remove(fname)
    return {"write_bytes_per_s": nbytes / w, "read_bytes_per_s": nbytes / r, "bytes": nbytes,
            "threads": threads, "request_bytes": chunk,
            "method": "O_DIRECT" if is_direct else "buffered+fsync+fadvise(DONTNEED)"}


def host_available_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- parts ------------------------------------------------------------------------------------
def part_fits_in_hbm(ctx):
    a = ctx.args
    if a.tiny:
        name, shape = "tiny", PRESETS["tiny"]
    else:
        name = next((k for k, v in PRESETS.items() if v[:2] == (a.fit_hidden, a.fit_layers)),
                    None)
        name, shape = (name, PRESETS[name]) if name else \
            parse_shape(f"{a.fit_hidden}x{a.fit_layers}")
    warmup, steps = a.warmup, a.fit_steps
    mb, seq = a.fit_mb, a.seq
    n = param_count(shape, a.vocab)
    tokens = mb * seq
    res = {"model": name, "shape": dict(zip(["hidden", "layers", "intermediate", "heads"], shape)),
           "params": n, "micro_batch": mb, "seq": seq, "tokens_per_step": tokens,
           "torch_baseline": "fp32 params (master) + torch.autocast(bf16) + "
                             "torch.optim.AdamW(fused=True)",
           "strata_config": "zero stage 3, nothing offloaded, bf16, AdamW"}
    run_est = (warmup + steps) * estimate_step_s(n, tokens) * 1.5 + 3
    res["torch"] = guarded(ctx, run_torch, ctx, shape, mb, seq, "amp", warmup, steps,
                           est_s=run_est, timeline=True)
    res["strata"] = guarded(ctx, run_strata, ctx, "fit", shape, mb, seq, ds_config(mb, 3),
                            warmup, steps, est_s=run_est + n * INIT_S_PER_PARAM, timeline=True)
    t, s = res["torch"].get("median_s"), res["strata"].get("median_s")
    res["ratio_strata_over_torch"] = s / t if s and t else None
    res["target"] = "<= 1.15"
    if s and "init_s" in res["strata"]:
        ctx.init_s_per_param = res["strata"]["init_s"] / n
    # Information only: torch without master weights (pure bf16 params and AdamW states).
    if ctx.budget.left() > 0.6 * a.budget_s or a.tiny:
        res["torch_bf16_pure"] = guarded(ctx, run_torch, ctx, shape, mb, seq, "bf16", warmup,
                                         steps, est_s=run_est)
        b = res["torch_bf16_pure"].get("median_s")
        res["ratio_strata_over_torch_bf16_pure"] = s / b if s and b else None
    else:
        res["torch_bf16_pure"] = {"skipped": "time budget (information-only reference)"}
    res["tflops_strata_6nt"], res["tflops_strata_with_attn"] = tflops(n, tokens, s, shape, seq)
    with_deepspeed(ctx, res, "fit", shape, mb, seq, ds_config(mb, 3), warmup, steps, run_est)
    return res


def torch_est(runs, compute):
    return runs * compute * 0.6 + 2


def strata_est(n, init_s_per_param, runs, compute, step):
    """initialize (x2: pinning the host states, beyond what part 1's set-up measured) + steps."""
    return 2 * n * init_s_per_param + 5 + runs * max(compute * 1.2, step * 1.5)


def offload_host_bytes(n, cfg):
    """The engine's host bytes for n params under cfg at one rank: strata.plan, the resolution
    the engine itself makes. The speculative step's room is left out: it is off beside
    overlap_step, and elsewhere sized to what memory is left."""
    plan_cfg = json.loads(json.dumps(cfg))
    plan_cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = False
    js = strata.plan(n, plan_cfg, gpus=1, hbm_gb=1e6, dram_gb=1e6)
    return js["configured"]["host_bytes_per_node"]


def host_refusal(name, need, avail):
    """Why a model whose engine needs `need` host bytes is not run with `avail` available, or
    None where it fits (HOST_OVERHEAD_BYTES beside it, within HOST_USABLE_FRACTION)."""
    if avail is None or need + HOST_OVERHEAD_BYTES <= HOST_USABLE_FRACTION * avail:
        return None
    return (f"{name}: host state {need / GiB:.0f} GiB (strata.plan) + "
            f"{HOST_OVERHEAD_BYTES / GiB:.0f} GiB beside it > {HOST_USABLE_FRACTION:.0%} of "
            f"{avail / GiB:.0f} GiB available")


def fwd_bwd_device_bytes(shape, n, tokens, vocab):
    """DEVICE_USABLE_FRACTION's estimate of torch fwd+bwd's GPU bytes."""
    h, layers, inter, _ = shape
    return 4 * n + tokens * (layers * (32 * h + 10 * inter) + 10 * vocab)


def device_refusal(name, need, total):
    """Why a model whose fwd+bwd needs `need` GPU bytes is not run on a GPU of `total` bytes,
    or None where it fits DEVICE_USABLE_FRACTION of it."""
    if total is None or need <= DEVICE_USABLE_FRACTION * total:
        return None
    return (f"{name}: fwd+bwd ~{need / GiB:.0f} GiB on the GPU (weights, gradients, "
            f"activations) > {DEVICE_USABLE_FRACTION:.0%} of its {total / GiB:.0f} GiB")


def choose_offload_size(ctx, share_s, mb, seq, refs, stage):
    """The largest ladder model whose host state (strata.plan) fits MemAvailable, whose torch
    fwd+bwd fits the GPU, and whose set-up and steps fit share_s seconds (estimates from this
    run's references)."""
    a = ctx.args
    if a.tiny:
        return "tiny", PRESETS["tiny"], ["--tiny"]
    if a.offload_model != "auto":
        name, shape = parse_shape(a.offload_model)
        return name, shape, ["--offload-model"]
    avail = host_available_bytes()
    gpu_total = torch.cuda.mem_get_info()[1] if ctx.cuda else None
    init = ctx.init_s_per_param or INIT_S_PER_PARAM
    why = []
    for name in LADDER:
        shape = PRESETS[name]
        n = param_count(shape, a.vocab)
        refusal = host_refusal(name, offload_host_bytes(n, ds_config(mb, stage, "cpu")), avail)
        if refusal is None:
            refusal = device_refusal(
                name, fwd_bwd_device_bytes(shape, n, mb * seq, a.vocab), gpu_total)
        if refusal is not None:
            why.append(refusal)
            continue
        compute, step = offload_step_estimate(ctx, n, mb * seq, refs)
        est = strata_est(n, init, a.warmup + a.steps, compute, step) + torch_est(
            a.warmup + a.steps, compute)
        if a.deepspeed:  # its CPU Adam after the backward, and its op build
            est += 2 * strata_est(n, init, a.warmup + a.steps, compute, step) + 60
        if est > 0.8 * share_s:
            why.append(f"{name}: ~{est:.0f} s estimated > 80 % of this part's {share_s:.0f} s")
            continue
        return name, shape, why
    return "125m", PRESETS["125m"], why + ["125m: the smallest, tried regardless"]


def offload_step_estimate(ctx, n, tokens, refs):
    dram = refs["dram"]["triad_bytes_per_s"]
    pcie = refs["pcie"]["h2d_bytes_per_s"] if refs.get("pcie") else 25e9
    compute = estimate_step_s(n, tokens)
    return compute, max(compute, n * ADAM_BYTES_PER_PARAM / dram,
                        n * PCIE_BYTES_PER_PARAM / pcie)


def strata_offload_config(a, mb, stage):
    """zero_offload's strata config: ds_config with --offload-speculative-step written into
    offload_optimizer.speculative_step (a strata key, left unset under auto: the engine's
    default, off beside overlap_step). DeepSpeed gets ds_config itself."""
    cfg = ds_config(mb, stage, opt_dev="cpu")
    if a.offload_speculative_step != "auto":
        cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = \
            a.offload_speculative_step == "on"
    return cfg


def part_zero_offload(ctx):
    a = ctx.args
    mb, seq = a.offload_mb, a.seq
    ctx.need(10 if not a.tiny else 1, "zero_offload references")
    refs = {"dram": measure_dram(ctx), "pcie": measure_pcie(ctx)}
    # This part's share: what is left less what the nvme part needs at least.
    share = ctx.budget.left() - (0 if a.skip_nvme else a.nvme_min_s) - ctx.reserve_s()
    name, shape, why = choose_offload_size(ctx, share, mb, seq, refs, a.offload_stage)
    n = param_count(shape, a.vocab)
    tokens = mb * seq
    stage = a.offload_stage
    overlap = a.offload_overlap_step and stage == 3
    res = {"model": name, "shape": dict(zip(["hidden", "layers", "intermediate", "heads"], shape)),
           "params": n, "micro_batch": mb, "seq": seq, "tokens_per_step": tokens,
           "size_choice": why, "strata_config": f"zero stage {stage}, offload_optimizer cpu, "
           f"bf16, AdamW, overlap_step={overlap}, speculative_step={a.offload_speculative_step}",
           "references": refs}
    compute, step_est = offload_step_estimate(ctx, n, tokens, refs)
    init = ctx.init_s_per_param or INIT_S_PER_PARAM
    runs = a.warmup + a.steps
    # GPU compute alone: plain torch fwd+bwd, bf16, on an equal fresh model and the same batch.
    res["torch_fwd_bwd"] = guarded(ctx, run_torch, ctx, shape, mb, seq, "fwd_bwd", a.warmup,
                                   a.steps, est_s=0 if a.tiny else torch_est(runs, compute))
    s_est = 0 if a.tiny else strata_est(n, init, runs, compute, step_est)
    res["strata"] = guarded(ctx, run_strata, ctx, "offload", shape, mb, seq,
                            strata_offload_config(a, mb, stage), a.warmup, a.steps,
                            overlap_step=overlap, est_s=s_est, timeline=True)
    if overlap and "error" in res["strata"] and ctx.budget.left() > 0.5 * share:
        res["strata_overlap_error"] = res["strata"]
        res["strata_config"] += " failed; retried with overlap_step=False"
        res["strata"] = guarded(ctx, run_strata, ctx, "offload2", shape, mb, seq,
                                strata_offload_config(a, mb, stage), a.warmup, a.steps,
                                est_s=s_est)
    compute = res["torch_fwd_bwd"].get("median_s")
    pcie = None
    if refs["pcie"]:
        rate = min(refs["pcie"]["h2d_bytes_per_s"], refs["pcie"]["d2h_bytes_per_s"])
        pcie = n * 2 / refs["pcie"]["d2h_bytes_per_s"] + n * 2 / refs["pcie"]["h2d_bytes_per_s"]
        res["pcie_min_rate_bytes_per_s"] = rate
        res["pcie_note"] = ("2 B/param at the D2H rate + 2 B/param at the H2D rate, one after "
                            "the other (a full-duplex overlap of the two is not assumed)")
    adam = n * ADAM_BYTES_PER_PARAM / refs["dram"]["triad_bytes_per_s"]
    parts = {"gpu_compute_s": compute, "pcie_s": pcie, "cpu_adam_s": adam}
    complete = compute is not None and (pcie is not None or not ctx.cuda)
    res["floor"] = dict(parts, floor_s=max(v for v in parts.values() if v is not None)
                        if complete else None,
                        bytes_per_param={"pcie": PCIE_BYTES_PER_PARAM,
                                         "cpu_adam": ADAM_BYTES_PER_PARAM})
    step = res["strata"].get("median_s")
    floor = res["floor"]["floor_s"]
    res["ratio_step_over_floor"] = step / floor if step and floor else None
    res["target"] = "<= 1.2"
    if overlap:
        res["overlap_note"] = ("overlap_step: each optimizer step runs behind the next forward; "
                               "the median of the timed steps is a steady-state step")
    res["tflops_6nt"], res["tflops_with_attn"] = tflops(n, tokens, step, shape, seq)
    res["tflops_note"] = "6*N*T/step; with_attn adds 12*layers*hidden*seq*T (PaLM's MFU count)"
    with_deepspeed(ctx, res, "offload", shape, mb, seq, ds_config(mb, stage, opt_dev="cpu"),
                   a.warmup, a.steps, s_est)
    if res.get("deepspeed", {}).get("median_s") and floor:
        res["ratio_deepspeed_over_floor"] = res["deepspeed"]["median_s"] / floor
    return res


def nvme_bytes(stats):
    moved = (stats or {}).get("store", {}).get("bytes_moved", {})
    read = sum(v for k, v in moved.items() if k.startswith("nvme->"))
    write = sum(v for k, v in moved.items() if k.endswith("->nvme"))
    return read, write


def part_nvme(ctx):
    a = ctx.args
    mb, seq = a.nvme_mb, a.seq
    ctx.need(10 if not a.tiny else 1, "nvme")
    base = a.nvme_dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="strata-bench-nvme-", dir=base)
    try:
        free = shutil.disk_usage(work).free
        disk = measure_disk(work, (64 << 20) if a.tiny else min(a.disk_test_bytes, free // 10))
        res = {"nvme_dir": work, "disk_free_bytes": free, "disk": disk}
        left = ctx.budget.left() - ctx.reserve_s()
        rd, wr = disk["read_bytes_per_s"], disk["write_bytes_per_s"]
        init = ctx.init_s_per_param or INIT_S_PER_PARAM
        why = []
        if a.tiny:
            name, shape = "tiny", PRESETS["tiny"]
        elif a.nvme_model != "auto":
            name, shape = parse_shape(a.nvme_model)
            why.append("--nvme-model")
        else:
            name = None
            for cand in LADDER:
                n = param_count(PRESETS[cand], a.vocab)
                if n * NVME_BYTES_PER_PARAM > 0.5 * free:
                    why.append(f"{cand}: ~{n * NVME_BYTES_PER_PARAM / GiB:.0f} GiB on disk > 50 % "
                               f"of {free / GiB:.0f} GiB free")
                    continue
                step = (n * NVME_STEP_READ_PER_PARAM / rd + n * NVME_STEP_WRITE_PER_PARAM / wr
                        + estimate_step_s(n, mb * seq))
                est = (n * init + n * NVME_BYTES_PER_PARAM / wr
                       + (a.nvme_warmup + a.nvme_steps) * step * 1.5)
                if est > left:
                    why.append(f"{cand}: ~{est:.0f} s estimated > {left:.0f} s left")
                    continue
                name = cand
                break
            if name is None:
                name = "125m"
                why.append("125m: the smallest, tried regardless")
            shape = PRESETS[name]
        n = param_count(shape, a.vocab)
        res.update({"model": name, "shape": dict(zip(["hidden", "layers", "intermediate",
                                                      "heads"], shape)),
                    "params": n, "micro_batch": mb, "seq": seq, "tokens_per_step": mb * seq,
                    "size_choice": why, "strata_config": "zero stage 3, offload_optimizer nvme, "
                    "offload_param nvme, bf16, AdamW"})
        r = guarded(ctx, run_strata, ctx, "nvme", shape, mb, seq,
                    ds_config(mb, 3, opt_dev="nvme", param_dev="nvme", nvme_path=work),
                    a.nvme_warmup, a.nvme_steps, with_stats=True)
        before, after = r.pop("_stats_before", None), r.pop("_stats_after", None)
        res["strata"] = r
        step = r.get("median_s")
        if step and after is not None:
            r0, w0 = nvme_bytes(before)
            r1, w1 = nvme_bytes(after)
            k = len(r["step_s"])  # stats() taken after the warm-up steps
            rs, ws = (r1 - r0) / k, (w1 - w0) / k
            res["nvme_read_bytes_per_step"] = rs
            res["nvme_write_bytes_per_step"] = ws
            res["nvme_bytes_note"] = (f"engine stats store.bytes_moved nvme->* and *->nvme over "
                                      f"the {k} timed steps / {k}")
            disk_s = rs / rd + ws / wr
            res["disk_time_for_step_bytes_s"] = disk_s
            if rs + ws > 0:
                res["io_efficiency"] = disk_s / step
                res["io_efficiency_note"] = ("disk's time for the step's bytes (this run's "
                                             "rates) / median step; 1.0 = as fast as the disk")
            else:  # a model this small stays cached in host memory (docs/design.md)
                res["io_efficiency"] = None
                res["io_efficiency_note"] = ("no NVMe bytes per step: the engine keeps this "
                                             "model's whole NVMe-homed state cached in host "
                                             "memory (layout notes); nothing to measure")
            res["engine_stats_after"] = {k2: after.get(k2) for k2 in (
                "optimizer_ns", "optimizer_io_wait_ns", "gather_wait_ns", "gather_fetch_wait_ns",
                "step_ns", "peak_bytes")}
            res["engine_stats_after"]["store"] = {k2: after.get("store", {}).get(k2) for k2 in (
                "bytes_moved", "io_busy_ns", "peak_bytes", "budget_bytes")}
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- output ------------------------------------------------------------------------------------
def env_info(ctx):
    import transformers
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(ctx.device),
            "cpu_count": os.cpu_count(), "host_mem_available_bytes": host_available_bytes(),
            "strata": getattr(strata, "__version__", None)}
    if ctx.cuda:
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        info["cuda"] = torch.version.cuda
    return info


def fmt_s(v):
    return "-" if v is None else f"{v * 1e3:9.1f} ms"


def fmt_n(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def fmt_r(v):
    return "-" if v is None else f"{v:.2f}"


def status(d):
    if not isinstance(d, dict):
        return ""
    if "skipped" in d:
        return d["skipped"]
    if "error" in d:
        return "error: " + d["error"].splitlines()[0][:200]
    return d.get("truncated", "")


def print_phases(r):
    """One line: each phase's host time in the call and, on a GPU, the stream's span."""
    ph = r.get("phases") if isinstance(r, dict) else None
    if not ph:
        return
    parts = []
    for name in Phases.NAMES:
        d = ph[name]
        gpu = f" / gpu {d['gpu_s'] * 1e3:.1f}" if "gpu_s" in d else ""
        parts.append(f"{name} host {d['host_s'] * 1e3:.1f}{gpu}")
    print("                    " + ", ".join(parts) + " ms")


def print_timeline(r):
    """One line: the profiled step's GPU busy fraction and idle time (gpu_timeline)."""
    t = r.get("timeline") if isinstance(r, dict) else None
    line = gpu_timeline.summary_line(t)
    if line:
        print("                    " + line)
    elif isinstance(t, dict) and ("error" in t or "skipped" in t):
        print("                    timeline: " + (t.get("error") or t["skipped"])[:160])


def print_waits(r):
    """Two lines: print_timeline's, then the strata run's host waits per step (waits_per_step)
    and the speculative step's Adam time when it ran."""
    print_timeline(r)
    w = r.get("waits_per_step") if isinstance(r, dict) else None
    if not w:
        return
    s = w.get("speculative_optimizer_s", 0)
    spec = f", speculative {s * 1e3:.1f}" if s else ""
    print(f"                    waits/step: gather {w['gather_wait_s'] * 1e3:.1f}, reduce "
          f"{w['reduce_wait_s'] * 1e3:.1f}, step call {w['step_s'] * 1e3:.1f} (optimizer "
          f"{w['optimizer_s'] * 1e3:.1f}{spec}), adapter "
          f"{w['adapter_device_wait_s'] * 1e3:.1f} ms in {w['adapter_device_waits']:.0f} waits")


def print_deepspeed(p):
    if "deepspeed" not in p:
        return
    d = p["deepspeed"]
    print(f"   deepspeed step {fmt_s(d.get('median_s'))}  {status(d)}")
    print(f"   deepspeed / strata = {fmt_r(p.get('ratio_deepspeed_over_strata'))}"
          + (f";  deepspeed / floor = {fmt_r(p['ratio_deepspeed_over_floor'])}"
             if "ratio_deepspeed_over_floor" in p else ""))


def print_table(out):
    e = out["env"]
    print(f"\nstrata bench_gpu: {e.get('gpu', e['device'])}, torch {e['torch']}, transformers "
          f"{e['transformers']}, {out['elapsed_s']:.0f} s of {out['budget_s']:.0f} s budget")
    p = out["parts"].get("fits_in_hbm", {})
    if "fits_in_hbm" in out["parts"]:
        print("1. fits_in_hbm" + (f"  {status(p)}" if status(p) else ""))
    if "params" in p:
        print(f"   model {p['model']} {fmt_n(p['params'])} params, batch {p['micro_batch']} x "
              f"{p['seq']}")
        for k in ("torch", "strata", "torch_bf16_pure"):
            r = p.get(k, {})
            print(f"   {k:16s} {fmt_s(r.get('median_s'))}  {status(r)}")
            print_phases(r)
            print_waits(r)
        print(f"   strata / torch (fp32 master, amp) = {fmt_r(p.get('ratio_strata_over_torch'))}"
              f"  (target <= 1.15)")
        o = p.get("strata", {}).get("offload_states", {})
        if "device_bytes" in o:
            print(f"   offload_states {o['device_bytes'] / 1e6:.1f} MB: out " +
                  ", ".join(f"{g:.1f}" for g in o["offload_gb_s"]) + " GB/s, back " +
                  ", ".join(f"{g:.1f}" for g in o["reload_gb_s"]) + " GB/s (rounds 1, 2)")
        elif o:
            print(f"   offload_states  {status(o)}")
        print_deepspeed(p)
    p = out["parts"].get("zero_offload", {})
    if "zero_offload" in out["parts"]:
        print("2. zero_offload" + (f"  {status(p)}" if status(p) else ""))
    if "params" in p:
        f = p.get("floor", {})
        print(f"   model {p['model']} {fmt_n(p['params'])} params, batch {p['micro_batch']} x "
              f"{p['seq']}; {p['strata_config']}")
        print(f"   strata step {fmt_s(p['strata'].get('median_s'))}  {status(p['strata'])}")
        print_phases(p["strata"])
        print_waits(p["strata"])
        print(f"   floor {fmt_s(f.get('floor_s'))} = max(gpu compute {fmt_s(f.get('gpu_compute_s'))}"
              f", pcie {fmt_s(f.get('pcie_s'))}, cpu adam {fmt_s(f.get('cpu_adam_s'))})  "
              f"{status(p.get('torch_fwd_bwd'))}")
        print(f"   step / floor = {fmt_r(p.get('ratio_step_over_floor'))}  (target <= 1.2);  "
              f"TFLOPS 6NT {fmt_r(p.get('tflops_6nt'))}, with attention "
              f"{fmt_r(p.get('tflops_with_attn'))}")
        print_deepspeed(p)
    p = out["parts"].get("nvme", {})
    if "nvme" in out["parts"]:
        print("3. nvme" + (f"  {status(p)}" if status(p) else ""))
    if "params" in p:
        d = p["disk"]
        print(f"   model {p['model']} {fmt_n(p['params'])} params, batch {p['micro_batch']} x "
              f"{p['seq']}; disk write {d['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
              f"{d['read_bytes_per_s'] / 1e9:.2f} GB/s ({d['method']})")
        print(f"   strata step {fmt_s(p['strata'].get('median_s'))}  {status(p['strata'])}")
        print_waits(p["strata"])
        if "io_efficiency" in p:
            print(f"   per step NVMe read {p['nvme_read_bytes_per_step'] / 1e9:.3f} GB, write "
                  f"{p['nvme_write_bytes_per_step'] / 1e9:.3f} GB; disk time "
                  f"{fmt_s(p['disk_time_for_step_bytes_s'])}; io_efficiency "
                  f"{fmt_r(p['io_efficiency'])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny Llama (hidden 64, 2 layers), vocab 1024, seq 128, 1+2 steps")
    ap.add_argument("--out", default="bench_gpu.json")
    ap.add_argument("--budget-s", type=float,
                    default=float(os.environ.get("STRATA_BENCH_BUDGET_S", "220")),
                    help="wall-clock budget from the script's start (env STRATA_BENCH_BUDGET_S)")
    ap.add_argument("--parts", default="fits_in_hbm,zero_offload,nvme")
    ap.add_argument("--vocab", type=int, default=None, help="default 32000 (--tiny: 1024)")
    ap.add_argument("--seq", type=int, default=None, help="default 1024 (--tiny: 128)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps, default 3 (--tiny: 2)")
    ap.add_argument("--fit-hidden", type=int, default=2048)
    ap.add_argument("--fit-layers", type=int, default=24)
    ap.add_argument("--fit-mb", type=int, default=None, help="default 8 (--tiny: 2)")
    ap.add_argument("--fit-steps", type=int, default=None,
                    help="timed steps of part 1, default 10 (--tiny: 2)")
    ap.add_argument("--offload-model", default="auto",
                    help="auto (largest that fits), a preset (" + ", ".join(PRESETS) +
                         ") or HIDDENxLAYERS")
    ap.add_argument("--offload-mb", type=int, default=None, help="default 8 (--tiny: 2)")
    ap.add_argument("--offload-stage", type=int, default=3, choices=[2, 3])
    ap.add_argument("--no-offload-overlap-step", dest="offload_overlap_step",
                    action="store_false", help="stage 3: no overlap_step (default: on)")
    ap.add_argument("--offload-speculative-step", choices=["auto", "on", "off"], default="auto",
                    help="zero_offload: offload_optimizer.speculative_step for strata (the CPU "
                         "Adam of groups whose gradients are final, during the backward; auto: "
                         "the engine's default, off beside overlap_step)")
    ap.add_argument("--nvme-dir", default=os.environ.get("STRATA_BENCH_NVME_DIR"),
                    help="parent of the swap directory (default $TMPDIR or /tmp)")
    ap.add_argument("--nvme-model", default="auto")
    ap.add_argument("--nvme-mb", type=int, default=None, help="default 4 (--tiny: 2)")
    ap.add_argument("--nvme-warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    ap.add_argument("--nvme-steps", type=int, default=None, help="default 2")
    ap.add_argument("--nvme-min-s", type=float, default=45.0,
                    help="time kept for the nvme part when sizing zero_offload")
    ap.add_argument("--disk-test-bytes", type=int, default=2 * GiB)
    ap.add_argument("--deepspeed", action="store_true",
                    help="also run DeepSpeed (import deepspeed) on fits_in_hbm and zero_offload "
                         "with the same model, batch and config; nvme: not run (its async_io "
                         "op needs libaio-dev)")
    ap.add_argument("--no-timeline", dest="timeline", action="store_false",
                    help="profile no step (default: one step of each fits_in_hbm run and of "
                         "zero_offload's strata run, after the timed ones)")
    ap.add_argument("--trace-dir", default=None,
                    help="keep each profiled step's trace there (NAME.trace.json.gz)")
    ap.add_argument("--no-offload-states-timing", dest="offload_states_timing",
                    action="store_false",
                    help="skip timing engine.offload_states() / reload_states() after "
                         "fits_in_hbm's strata run (default: two rounds)")
    ap.add_argument("--device-budget-frac", type=float, default=0.55,
                    help="device_budget_bytes = this share of the GPU's free memory")
    a = ap.parse_args()
    tiny = a.tiny
    a.vocab = a.vocab or (1024 if tiny else 32000)
    a.seq = a.seq or (128 if tiny else 1024)
    a.warmup = a.warmup if a.warmup is not None else (1 if tiny else 2)
    a.steps = a.steps if a.steps is not None else (2 if tiny else 3)
    a.fit_mb = a.fit_mb or (2 if tiny else 8)
    a.fit_steps = a.fit_steps if a.fit_steps is not None else (2 if tiny else 10)
    a.nvme_warmup = a.nvme_warmup if a.nvme_warmup is not None else (1 if tiny else 2)
    a.nvme_steps = a.nvme_steps if a.nvme_steps is not None else 2
    a.offload_mb = a.offload_mb or (2 if tiny else 8)
    a.nvme_mb = a.nvme_mb or (2 if tiny else 4)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    a.skip_nvme = "nvme" not in parts
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: --device cuda and torch sees no GPU (use --device cpu --tiny)")
    if a.trace_dir:
        os.makedirs(a.trace_dir, exist_ok=True)
    ctx = Ctx(a)
    out = {"budget_s": a.budget_s, "elapsed_s": 0.0, "args": vars(a), "env": env_info(ctx),
           "parts": {}}

    def write():
        out["elapsed_s"] = ctx.budget.elapsed()
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, a.out)

    fns = {"fits_in_hbm": part_fits_in_hbm, "zero_offload": part_zero_offload, "nvme": part_nvme}
    for name in parts:
        if name not in fns:
            out["parts"][name] = {"error": f"unknown part {name} (one of {', '.join(fns)})"}
            continue
        t0 = time.perf_counter()
        out["parts"][name] = guarded(ctx, fns[name], ctx)
        out["parts"][name]["part_wall_s"] = time.perf_counter() - t0
        print(f"[{ctx.budget.elapsed():6.1f} s] {name} done"
              f"{': ' + status(out['parts'][name]) if status(out['parts'][name]) else ''}",
              flush=True)
        write()
    write()
    print_table(out)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
