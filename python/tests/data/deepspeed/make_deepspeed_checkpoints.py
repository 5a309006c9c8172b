"""Generate small, real DeepSpeed checkpoints (plus reference dumps) as test fixtures.

Written for and run with **DeepSpeed 0.19.8** (torch 2.15, CPU only, gloo backend,
``DS_ACCELERATOR=cpu``).  Nothing here needs a GPU or a compiled DeepSpeed op, except the
``--offload-optimizer cpu`` variant, which uses DeepSpeedCPUAdam (JIT-built by DeepSpeed on
first use; needs ninja + a C++ compiler).

Run one fixture (N = world size, 1 or 2):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N make_deepspeed_checkpoints.py \
        --out DIR --stage {0,1,2,3} --dtype {fp32,bf16,fp16} [--offload-optimizer cpu] [--frozen] \
        [--grad-accum-fp32]

(``python -m torch.distributed.run`` works in place of ``torchrun``.) The fixtures beside this
script are, by directory name: stage0_fp32_w1 (N=1, --stage 0 --dtype fp32), stage0_bf16_w2 (2,
0, bf16), stage1_bf16_w2 (2, 1, bf16), stage1_bf16_w2_fp32accum (2, 1, bf16, --grad-accum-fp32),
stage2_fp16_w1 (1, 2, fp16), stage2_fp32_w1_offload (1, 2, fp32, --offload-optimizer cpu),
stage2_fp32_w2_frozen (2, 2, fp32, --frozen), stage3_bf16_w2 (2, 3, bf16), stage3_fp32_w2_frozen
(2, 3, fp32, --frozen), stage2_fp16_w1_overflow (1, 2, fp16, --initial-scale-power 18: steps 1,
2 and 5 skipped), stage3_fp32_w2_subgroups (2, 3, fp32, --sub-group-size 60), gpt2_stage2_fp32_w1
(1, 2, fp32, --model gpt2), gpt2_stage3_bf16_w2 (2, 3, bf16, --model gpt2), stage2_bf16_w2_fused
(2, 2, bf16, --fused-adam), stage3_bf16_w2_fused (2, 3, bf16, --fused-adam), stage1_fp32_w2_frozen
(2, 1, fp32, --frozen), stage1_bf16_w2_aligned (2, 1, bf16, --parameter-alignment); the tests keep reference.pt's tensors, counters and config (a smaller
copy: the bookkeeping keys are dropped) and not the zero_to_fp32.py DeepSpeed copies in.

What it does, deterministically (everything seeded):
  1. builds ``TinyLM`` (below; importable: ``from make_deepspeed_checkpoints import TinyLM``),
     with two optimizer param groups (weight decay 0.1 on matrices, 0.0 on biases/LayerNorm/
     scalars); ``--frozen`` freezes ``blocks.0.norm.weight`` (requires_grad=False, not passed
     to the optimizer);
  2. ``deepspeed.initialize`` with ``make_config(...)`` (AdamW via torch_adam, WarmupLR,
     gradient_clipping 1.0, micro batch 2, grad accumulation 1);
  3. trains steps 1..4 on ``get_batch(rank, step)``; loss = ``compute_loss(model, batch)``;
  4. ``engine.save_checkpoint(DIR, tag="global_step4", client_state={"epoch": 3, "note": "fixture"})``;
  5. gathers, for every named parameter, the full fp32 master weight and Adam exp_avg /
     exp_avg_sq (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``,
     collective) and bookkeeping into ``DIR/reference.pt`` (written by rank 0);
  6. trains steps 5..6 and adds ``after`` (full fp32 masters after step 6), ``after_exp_avg``,
     ``after_exp_avg_sq``, ``losses_after`` (per-rank local losses of steps 5,6, all ranks),
     ``lr_after`` and ``global_steps_after`` to ``DIR/reference.pt``.

Quirks of DeepSpeed 0.19.8 seen while generating (see also the comments in the code):
  * fp16 on CPU: DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has native fp16; we
    override ``is_fp16_supported`` (fixture generation only; the format is unaffected).
  * stage 0 + bf16/fp16 uses FP16_UnfusedOptimizer, which does one dummy optimizer.step() with
    zero grads at construction: the saved Adam ``step`` is global_steps + 1 (5 at global_step4),
    and AdamW's decoupled weight decay was applied once more (at lr 1e-2) before step 1.
  * stage 3 + bf16: under ``zero.Init`` the params are created directly in bf16 and nn.init
    draws in bf16, so the initial weights differ from ``build_model()`` (only matters for
    from-scratch comparisons, not for resuming).
  * stage 3: the per-parameter padding slots of ``fp32_flat_groups`` (and of
    ``frozen_param_fragments``) hold uninitialised memory, so those bytes differ run to run;
    every other tensor in every file is bit-identical across runs.

A test that resumes from ``global_step4`` reproduces the exact batches of steps 5 and 6 with
``get_batch(rank, 5)`` / ``get_batch(rank, 6)``.  The loss of a step is the mean over the
local micro batch; DeepSpeed averages gradients over ranks (gradient of the mean of the
per-rank losses).
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 11
D_MODEL = 6
D_HIDDEN = 7
SEQ_LEN = 5
MICRO_BATCH = 2
TRAIN_STEPS_BEFORE_SAVE = 4
TRAIN_STEPS_AFTER_SAVE = 2
TAG = "global_step4"
FROZEN_PARAM = "blocks.0.norm.weight"
MODEL_SEED = 1234


class Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(D_MODEL, D_HIDDEN)  # 42 + 7
        self.norm = nn.LayerNorm(D_HIDDEN)  # 7 + 7
        self.fc_out = nn.Linear(D_HIDDEN, D_MODEL, bias=True)  # 42 + 6

    def forward(self, h):
        return h + self.fc_out(F.gelu(self.norm(self.fc_in(h))))


class TinyLM(nn.Module):
    """367 parameters: embed [11,6], 2 blocks, final_norm [6]+[6], a scalar logit_scale [1],
    head [11,6] (no bias), persistent buffer pos_scale [5].

    Sizes are chosen so that at world 2 ZeRO-1/2 pads the no-decay group (67 -> 68) and
    blocks.1.fc_in.bias straddles the rank-0/rank-1 partition boundary of that group; at
    stage 3 every odd-numel param gets per-param padding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)  # 66
        self.blocks = nn.ModuleList([Block() for _ in range(2)])  # 2 x 111
        self.final_norm = nn.LayerNorm(D_MODEL)  # 6 + 6
        self.logit_scale = nn.Parameter(torch.ones(1))  # 1 (odd numel on purpose)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)  # 66
        # persistent buffer (saved in module state_dict)
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, SEQ_LEN), persistent=True)

    def forward(self, ids):
        h = self.embed(ids) * self.pos_scale.to(self.embed.weight.dtype)[None, :, None]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.final_norm(h)) * self.logit_scale


def build_model(frozen=False, model="tiny"):
    """The exact model (initial weights included) used for the fixture: TinyLM, or with
    model="gpt2" a transformers GPT2LMHeadModel of the same vocabulary (random init, its head
    tied to its token embedding: DeepSpeed saves the tie in shared_params)."""
    torch.manual_seed(MODEL_SEED)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        built = GPT2LMHeadModel(GPT2Config(  # no dropout: the steps after the load compare
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=8, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0))
    else:
        built = TinyLM()
    if frozen:
        built.get_parameter(FROZEN_PARAM).requires_grad_(False)
    return built


def is_no_decay(name, param):
    # under zero.Init (stage 3) p.shape is the empty local partition; ds_shape is the real shape
    shape = getattr(param, "ds_shape", param.shape)
    return len(shape) < 2 or name.endswith(".bias") or "norm." in name


def param_groups(model):
    """Two groups, as real users pass them: decay (matrices) first, then no-decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if is_no_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def param_group_names(model):
    """Names of the parameters of each group, in the order passed to the optimizer."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if is_no_decay(name, p) else decay).append(name)
    return [decay, no_decay]


def get_batch(rank, step):
    """Deterministic micro batch of `rank` at 1-based optimizer `step` (ids, targets): int64 [2, 5]."""
    g = torch.Generator().manual_seed(100_003 * step + 7 * rank + 17)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=g)
    targets = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN), generator=g)
    return ids, targets


def compute_loss(model, batch):
    ids, targets = batch
    logits = model(ids)
    logits = getattr(logits, "logits", logits)  # a transformers model's output
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_config(stage, dtype, offload_optimizer=None, grad_accum_fp32=False):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 10
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": stage
        },
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        # DeepSpeedCPUAdam (torch_adam would make DeepSpeed take torch.optim.AdamW instead)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": False}
    else:
        cfg["optimizer"]["params"]["torch_adam"] = True
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if grad_accum_fp32:
        # ZeRO 1 + bf16 + fp32 grad accumulation selects DeepSpeed's BF16_Optimizer
        # (files still named bf16_zero_pp_rank_*; different dict: fp32_groups_flat_partition...)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    return cfg


# ---------------------------------------------------------------------------------------------
# reference gathering


def _basic_optimizer(engine):
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    # ZeRO/bf16/fp16 wrappers subclass ZeROOptimizer (not torch.optim.Optimizer) and keep the
    # wrapped torch optimizer in .optimizer
    if hasattr(engine.optimizer, "optimizer"):
        return engine.optimizer.optimizer
    return opt


def full_fp32_and_states(engine, model):
    """Collective at stage 3. Returns three dicts name -> fp32 CPU tensor (full shape)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    fp32, m, v = {}, {}, {}
    base = _basic_optimizer(engine)
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", None) is not None:
        # DeepSpeed 0.19.8 bug (ZeRO 1/2, >1 param group): DeepSpeedZeroOptimizer._optimizer_step(i)
        # links the optimizer-state fragments of ALL groups right after group 0's first step,
        # when group 1 has no Adam state yet, so safe_get_full_optimizer_state() raises
        # "exp_avg not found in optimizer state fragment" for params of group >= 1.
        # Re-link now that every group has state (read-only; DeepSpeed does the same on load).
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        w = safe_get_full_fp32_param(p)
        a = safe_get_full_optimizer_state(p, "exp_avg")
        b = safe_get_full_optimizer_state(p, "exp_avg_sq")
        if w is None and hasattr(opt, "fp32_groups_flat"):
            # stage 0 + fp16/bf16 (FP16_Optimizer, "DDP_BFLOAT16"): no _hp_mapping; one flat fp32
            # master per group holding the group's params back to back
            for g, lp_group in enumerate(opt.fp16_groups):
                off = 0
                for q in lp_group:
                    if q is p:
                        flat = opt.fp32_groups_flat[g]
                        st = base.state[flat]
                        w, a, b = (t.narrow(0, off, p.numel()).view_as(p)
                                   for t in (flat, st["exp_avg"], st["exp_avg_sq"]))
                    off += q.numel()
        elif w is None and hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
            # stage 0 + fp16/bf16 with a non-fused (e.g. torch) optimizer: FP16_UnfusedOptimizer
            # keeps one fp32 master tensor per param (fp32_groups[g][i])
            for g, lp_group in enumerate(opt.fp16_groups):
                for i, q in enumerate(lp_group):
                    if q is p:
                        w = opt.fp32_groups[g][i]
                        st = base.state[w]
                        a, b = st["exp_avg"], st["exp_avg_sq"]
        elif w is None:  # stage 0 without a mixed-precision wrapper: the param is the master
            assert engine.zero_optimization_stage() == 0
            w = p.detach()
            st = base.state[p]
            a, b = st["exp_avg"], st["exp_avg_sq"]
        fp32[name] = w.detach().float().cpu().clone()
        m[name] = a.detach().float().cpu().clone()
        v[name] = b.detach().float().cpu().clone()
    return fp32, m, v


def frozen_values(engine, model):
    """Full values of frozen (non-trainable) params (collective at stage 3)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        if hasattr(p, "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().cpu().clone()
        else:
            out[name] = p.detach().float().cpu().clone()
    return out


def adam_step_value(engine):
    base = _basic_optimizer(engine)
    steps = set()
    for st in base.state.values():
        if "step" in st:
            s = st["step"]
            steps.add(float(s.item()) if torch.is_tensor(s) else float(s))
    for g in base.param_groups:  # DeepSpeedCPUAdam keeps the step in the param group
        if "step" in g:
            steps.add(float(g["step"]))
    return sorted(steps)


def loss_scale_value(engine):
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        if hasattr(opt, attr):
            try:
                return float(getattr(opt, attr))
            except Exception:
                pass
    return None


def train_step(engine, rank, step, dtype):
    batch = get_batch(rank, step)
    loss = compute_loss(engine, batch)
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, required=True, choices=[0, 1, 2, 3])
    ap.add_argument("--dtype", required=True, choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--offload-optimizer", choices=["cpu"], default=None)
    ap.add_argument("--frozen", action="store_true", help=f"freeze {FROZEN_PARAM}")
    ap.add_argument("--fused-adam", action="store_true",
                    help="DeepSpeed's FusedAdam (no torch_adam; built by DeepSpeed on first use)")
    ap.add_argument("--parameter-alignment", action="store_true",
                    help="zero_optimization.parameter_alignment (stages 1-2: padded parameters)")
    ap.add_argument("--sub-group-size", type=int, default=0,
                    help="zero_optimization.sub_group_size (stage 3: several sub-groups)")
    ap.add_argument("--initial-scale-power", type=int, default=0,
                    help="fp16: a scale that overflows, so that the first steps are skipped")
    ap.add_argument("--model", choices=["tiny", "gpt2"], default="tiny",
                    help="TinyLM, or transformers' GPT2LMHeadModel (tied head)")
    ap.add_argument("--grad-accum-fp32", action="store_true",
                    help='add "data_types": {"grad_accum_dtype": "fp32"} (stage 1 + bf16 -> BF16_Optimizer)')
    ap.add_argument("--local_rank", type=int, default=None)  # deepspeed launcher compat
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    if args.dtype == "fp16":
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if acc.device_name() == "cpu" and not acc.is_fp16_supported():
            # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has native fp16
            # (AVX512-FP16/AMX-FP16); elsewhere engine._do_sanity_check raises "Type fp16 is not
            # supported on your device." torch runs fp16 on any CPU (emulated), and the checkpoint
            # format does not depend on it, so we lift the check for fixture generation.
            acc.is_fp16_supported = lambda: True
            print("[fixture] NOTE: forcing CPU accelerator is_fp16_supported() -> True")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    cfg = make_config(args.stage, args.dtype, args.offload_optimizer, args.grad_accum_fp32)
    if args.sub_group_size:
        cfg["zero_optimization"]["sub_group_size"] = args.sub_group_size
    if args.parameter_alignment:
        cfg["zero_optimization"]["parameter_alignment"] = True
    if args.fused_adam:  # DeepSpeed's default Adam (FusedAdam): its step per parameter only
        cfg["optimizer"]["params"].pop("torch_adam", None)
    if args.dtype == "fp16" and args.initial_scale_power:
        cfg["fp16"]["initial_scale_power"] = args.initial_scale_power
    # transformers 5 refuses DeepSpeed 0.19.8's zero.Init patching of tensor construction
    # ("Signature mismatch ... tensor_pynew"): the GPT-2 model is built whole and initialize
    # partitions it.
    if args.stage == 3 and args.model != "gpt2":
        # stage 3 partitions params at construction; construct under zero.Init like HF does
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build_model(args.frozen, args.model)
    else:
        model = build_model(args.frozen, args.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)

    losses_before = []
    for step in range(1, TRAIN_STEPS_BEFORE_SAVE + 1):
        losses_before.append(train_step(engine, rank, step, args.dtype))

    engine.save_checkpoint(args.out, tag=TAG, client_state={"epoch": 3, "note": "fixture"})

    fp32, m, v = full_fp32_and_states(engine, model)
    frozen = frozen_values(engine, model)
    ref = {
        "fp32": fp32,
        "exp_avg": m,
        "exp_avg_sq": v,
        "frozen": frozen,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr(),
        "optimizer_step": adam_step_value(engine),
        "loss_scale": loss_scale_value(engine),
        "world_size": world,
        "stage": args.stage,
        "dtype": args.dtype,
        "offload_optimizer": args.offload_optimizer,
        "grad_accum_fp32": args.grad_accum_fp32,
        "optimizer_class": f"{type(engine.optimizer).__module__}.{type(engine.optimizer).__qualname__}",
        "base_optimizer_class": f"{type(_basic_optimizer(engine)).__module__}.{type(_basic_optimizer(engine)).__qualname__}",
        "frozen_param": FROZEN_PARAM if args.frozen else None,
        "model": args.model,
        "config_overrides": {"sub_group_size": args.sub_group_size,
                             "initial_scale_power": args.initial_scale_power},
        "config": cfg,
        "param_group_names": param_group_names(model),
        "param_shapes": {n: tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                         for n, p in model.named_parameters()},
        "buffers": {n: b.detach().float().cpu().clone() for n, b in model.named_buffers()},
        "tag": TAG,
        "deepspeed_version": deepspeed.__version__,
        "torch_version": str(torch.__version__),
    }
    all_losses = [None] * world
    dist.all_gather_object(all_losses, losses_before)
    ref["losses_before"] = all_losses  # [rank][step-1], steps 1..4

    losses_after = []
    for step in range(TRAIN_STEPS_BEFORE_SAVE + 1, TRAIN_STEPS_BEFORE_SAVE + TRAIN_STEPS_AFTER_SAVE + 1):
        losses_after.append(train_step(engine, rank, step, args.dtype))
    fp32_a, m_a, v_a = full_fp32_and_states(engine, model)
    all_losses = [None] * world
    dist.all_gather_object(all_losses, losses_after)
    ref["after"] = fp32_a
    ref["after_exp_avg"] = m_a
    ref["after_exp_avg_sq"] = v_a
    ref["losses_after"] = all_losses  # [rank][0..1] = steps 5, 6
    ref["lr_after"] = engine.get_lr()
    ref["global_steps_after"] = engine.global_steps
    ref["skipped_steps_after"] = engine.skipped_steps
    ref["optimizer_step_after"] = adam_step_value(engine)
    ref["loss_scale_after"] = loss_scale_value(engine)

    if rank == 0:
        torch.save(ref, os.path.join(args.out, "reference.pt"))
        with open(os.path.join(args.out, "fixture.json"), "w") as f:
            json.dump({k: ref[k] for k in ("global_steps", "global_samples", "skipped_steps", "lr",
                                           "optimizer_step", "loss_scale", "world_size", "stage", "dtype",
                                           "offload_optimizer", "grad_accum_fp32", "optimizer_class",
                                           "base_optimizer_class", "frozen_param", "config", "param_group_names",
                                           "losses_before", "losses_after", "lr_after",
                                           "deepspeed_version", "torch_version")},
                      f, indent=1, default=str)
        print(f"[fixture] wrote {args.out}: steps={ref['global_steps']} lr={ref['lr']} "
              f"adam_step={ref['optimizer_step']} loss_scale={ref['loss_scale']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
