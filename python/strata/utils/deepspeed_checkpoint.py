"""Reading a checkpoint that DeepSpeed's engine.save_checkpoint wrote, without DeepSpeed.

A run that DeepSpeed trained resumes under strata from its own checkpoint: StrataEngine's
load_checkpoint recognizes the directory (`mp_rank_00_model_states.pt` or
`zero_pp_rank_0_mp_rank_00_model_states.pt`, no strata manifest) and takes from it what this module
reads: every parameter's fp32 master and Adam moments whole, the counters, the LR scheduler's
position, the fp16 loss scaler, the optimizer groups' hyperparameters, the buffers and the client
state. The layouts read, as DeepSpeed writes them:

  ZeRO stage 1 and 2, and bf16 without ZeRO (BF16_Optimizer): one
    `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per rank; each optimizer group is one flat
    fp32 vector cut into a partition per rank (`single_partition_of_fp32_groups`), the group's
    parameters packed in `param_shapes`' order, the last rank's partition padded by its
    `group_paddings`; Adam's moments (`base_optimizer_state`) are laid out as the padded partition.
  ZeRO stage 3: one optimizer file per rank holding `fp32_flat_groups` (its sub-groups' flat
    partitions) and Adam's state per sub-group; every parameter is cut on its own into
    ceil(numel / world) elements per rank, in `param_shapes`' order across the sub-groups.
  No ZeRO: the module's weights, or the fp32 copies of DeepSpeed's fp16/bf16 optimizer wrapper
    (`fp32_groups`, or `fp32_groups_flat` one vector per group), and the torch optimizer's
    state_dict, all in `mp_rank_00_model_states.pt`, the state keyed by the parameter's place in
    the param groups (which the engine supplies: the script passes the same groups).

The files are torch pickles: they are read with torch.load(weights_only=True), DeepSpeed's own
classes in them (its loss scaler, its ZeRO stage enum, the fragment addresses of
param_slice_mappings) standing in as plain records, and every other global refused. Tensors are
memory-mapped and each parameter is assembled when asked for, so a model's whole state is never
in memory at once. Not read (refused, naming what): pipeline or tensor parallel checkpoints (an
mp_world_size above 1), MoE checkpoints (expert files), elastic ZeRO checkpoints and universal
checkpoints (ds_to_universal.py's output: strata reads the checkpoint they come from at any world
size).
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Optional

import torch

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
KINDS = ("fp32", "exp_avg", "exp_avg_sq")

# The top-level keys of the model states file that DeepSpeed's load_checkpoint keeps for itself;
# every other key is handed back as the client state, as DeepSpeed's does.
_DEEPSPEED_KEYS = ("module", "sparse_tensor_module_names", "skipped_steps", "global_steps",
                   "dp_world_size", "mp_world_size", "data_sampler", "random_ltd",
                   "lr_scheduler", "optimizer")


class _Record:
    """A DeepSpeed object in a checkpoint (its loss scaler, a fragment address): its attributes."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


class _Enum(int):
    """DeepSpeed's ZeroStageEnum (an int enum): its value."""


_STAND_INS = [
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_Enum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether `path` (a tag directory) holds a checkpoint DeepSpeed's save_checkpoint wrote."""
    return (not os.path.isfile(os.path.join(path, "manifest.json"))
            and (os.path.isfile(os.path.join(path, MODEL_FILE))
                 or os.path.isfile(os.path.join(path, ZERO3_MODEL_FILE))))


def _load(path: str):
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # pickle's UnpicklingError, a torn zip: both name nothing else
        raise RuntimeError(f"strata: DeepSpeed checkpoint file {path} cannot be read: {e}") from e


def _rank_files(path: str, pattern: str) -> list[str]:
    """The per-rank files matching `pattern` ("zero_pp_rank_{}..."), in rank order, checked to be
    ranks 0..N-1 with none missing."""
    found = {}
    for f in glob.glob(os.path.join(glob.escape(path), "*" + pattern.format("*"))):
        m = re.search(pattern.format(r"(\d+)").replace(".", r"\.") + "$", os.path.basename(f))
        if m:
            found.setdefault(int(m.group(1)), []).append(f)
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
        raise RuntimeError(f"strata: DeepSpeed checkpoint {path}: the files of rank(s) {missing} "
                           f"are missing ({pattern.format('N')})")
    for r in ranks:
        if len(found[r]) > 1:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {path}: rank {r} has "
                               f"{len(found[r])} files: {sorted(found[r])}")
    return [found[r][0] for r in ranks]


class _Flat:
    """Tensors laid end to end, sliced without concatenating them all."""

    def __init__(self, parts: list):
        self.parts = [p.reshape(-1) for p in parts]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    def numel(self) -> int:
        return self.starts[-1]

    def slice(self, begin: int, n: int) -> torch.Tensor:
        if begin < 0 or begin + n > self.numel():
            raise IndexError(f"[{begin}:{begin + n}] of {self.numel()} elements")
        out = []
        for p, s in zip(self.parts, self.starts):
            lo, hi = max(begin, s), min(begin + n, s + p.numel())
            if lo < hi:
                out.append(p[lo - s:hi - s])
        return out[0] if len(out) == 1 else torch.cat(out) if out else torch.empty(0)


class DeepSpeedCheckpoint:
    """One tag directory of a DeepSpeed checkpoint. `tensor(name, kind)` assembles a trainable
    parameter's state whole (fp32, its shape): kind "fp32" (the master weights), "exp_avg" or
    "exp_avg_sq". `frozen(name)` is a frozen parameter's values. The counters, the scheduler's
    state, the loss scaler and the param groups' hyperparameters are attributes."""

    def __init__(self, path: str):
        self.path = path
        zero3 = os.path.join(path, ZERO3_MODEL_FILE)
        first = zero3 if os.path.isfile(zero3) else os.path.join(path, MODEL_FILE)
        model = _load(first)
        if not isinstance(model, dict) or "module" not in model:
            raise RuntimeError(f"strata: {first} is not a DeepSpeed model states file (no "
                               "'module' entry)")
        if int(model.get("mp_world_size", 1) or 1) != 1:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {path} was saved with "
                               f"mp_world_size {model['mp_world_size']} (tensor or pipeline "
                               "parallel): not read; only data parallel checkpoints are")
        experts = glob.glob(os.path.join(glob.escape(path), "*expert*"))
        if experts:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {path} holds MoE expert files "
                               f"({os.path.basename(experts[0])}, ...): not read")
        self.model_state = model
        self.global_steps = int(model.get("global_steps", 0))
        batch = (model.get("ds_config") or {}).get("train_batch_size")
        self.global_samples = int(model.get("global_samples", self.global_steps * (
            batch if isinstance(batch, int) else 0)))
        self.skipped_steps = int(model.get("skipped_steps", 0))
        self.lr_scheduler = model.get("lr_scheduler")
        names = model.get("buffer_names") or []
        self.buffers = {k: v for k, v in model["module"].items() if k in set(names)}
        self.shared = dict(model.get("shared_params") or {})  # tied name -> the name it holds
        self._frozen_shapes = dict(model.get("frozen_param_shapes") or {})
        self._frozen: list = []  # the dicts frozen() assembles from
        self._shapes: dict[str, torch.Size] = {}
        self._where: dict[str, tuple] = {}  # name -> how tensor() finds it
        optim_files = _rank_files(path, "zero_pp_rank_{}_mp_rank_00_optim_states.pt")
        if optim_files:
            self._read_zero(model, optim_files)
        elif model.get("param_shapes") is None:
            self._read_unpartitioned(model)
        elif os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt")):
            raise RuntimeError(f"strata: {path} is a DeepSpeed universal checkpoint "
                               "(ds_to_universal.py): not read; load the checkpoint it was "
                               "converted from, which strata reads at any world size")
        else:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {path} has no optimizer files "
                               "(*zero_pp_rank_N_mp_rank_00_optim_states.pt)")

    # -- what the engine asks -------------------------------------------------------------------

    def client_state(self, optimizer_states: bool = True, lr_states: bool = True,
                     module_only: bool = False) -> dict:
        """What DeepSpeed's load_checkpoint returns as the client state: every key of the model
        states file but the ones that load took (the scheduler's and the optimizer's only when
        they were loaded; with load_module_only only the module)."""
        taken = {"module"} if module_only else set(_DEEPSPEED_KEYS) - {
            k for k, loaded in (("lr_scheduler", lr_states), ("optimizer", optimizer_states))
            if not loaded}
        return {k: v for k, v in self.model_state.items() if k not in taken}

    def names(self) -> list[str]:
        """The trainable parameters' names, as the model's named_parameters() gives them."""
        return list(self._shapes)

    def frozen_names(self) -> list[str]:
        return list(self._frozen_shapes)

    def shape(self, name: str) -> torch.Size:
        """A parameter's shape, trainable or frozen."""
        if name in self._shapes:
            return self._shapes[name]
        if name in self._frozen_shapes:
            return torch.Size(self._frozen_shapes[name])
        return self.model_state["module"][name].shape

    def tensor(self, name: str, kind: str) -> torch.Tensor:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {KINDS}")
        how = self._where[name]
        shape = self._shapes[name]
        n = shape.numel()
        if how[0] == "flat":  # stage 1/2, bf16: (group, offset) in the group's whole vector
            _, group, offset = how
            out = self._group_flat[kind][group].slice(offset, n)
        elif how[0] == "zero3":  # (offset in each rank's sub-groups, ceil(n / world))
            _, offset, part = how
            out = torch.cat([flat.slice(offset, part) for flat in self._rank_flat[kind]])[:n]
        else:  # unpartitioned: the tensor itself (no moments where no optimizer was saved)
            out = how[1][kind]
            if out is None:
                out = torch.zeros(shape)
        return out.reshape(shape).to(torch.float32)

    def frozen(self, name: str) -> torch.Tensor:
        """A frozen parameter's values, assembled when asked (without ZeRO: the module's
        weights, any parameter)."""
        if name in self._frozen_shapes:
            shape = torch.Size(self._frozen_shapes[name])
            parts = [f[name].reshape(-1) for f in self._frozen]
            return torch.cat(parts)[:shape.numel()].reshape(shape)
        return self.model_state["module"][name]

    # -- layouts --------------------------------------------------------------------------------

    def _read_zero(self, model: dict, optim_files: list[str]) -> None:
        self.optim_files = optim_files
        ranks = [_load(f) for f in optim_files]
        osd = [r.get("optimizer_state_dict") if isinstance(r, dict) else None for r in ranks]
        if any(o is None for o in osd):
            raise RuntimeError(f"strata: {optim_files[0]}: no 'optimizer_state_dict' entry: not a "
                               "DeepSpeed ZeRO optimizer file")
        world = len(ranks)
        count = osd[0].get("partition_count", world)
        count = max(count) if isinstance(count, (list, tuple)) else int(count)
        if count != world:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path} was saved by {count} "
                               f"ranks and holds {world} optimizer files")
        self.world_size = world
        self.stage = int(osd[0].get("zero_stage", 0))  # bf16 without ZeRO: no entry
        param_shapes = model.get("param_shapes")
        if param_shapes is None:
            raise RuntimeError(f"strata: {self.path}: the model states file has no "
                               "'param_shapes' entry")
        if isinstance(param_shapes, dict):
            param_shapes = [param_shapes]
        self._read_scaler(osd[0])
        if self.stage == 3:
            self._read_zero3(model, osd, param_shapes)
        else:
            self._read_zero12(osd, param_shapes)
        self._read_frozen(model)

    def _read_frozen(self, model: dict) -> None:
        """Frozen parameters: whole in the model states file, or at stage 3 a fragment per rank
        (ceil(numel / world), padded) in each rank's own model states file (self._frozen: the
        fragments' dicts, rank order). DeepSpeed records them so at stages 2-3 only; at stage 1
        (and BF16_Optimizer) a frozen parameter is a module entry no optimizer group holds."""
        if model.get("frozen_param_shapes") is None and self.stage < 3:
            module, buffers = model["module"], set(self.buffers)
            self._frozen_shapes = {n: t.shape for n, t in module.items() if n not in self._shapes
                                   and n not in buffers and n not in self.shared}
            self._frozen = [module]
            return
        self._frozen = [model.get("frozen_param_fragments") or {}]
        if self.stage == 3 and self._frozen_shapes:
            files = _rank_files(self.path, "zero_pp_rank_{}_mp_rank_00_model_states.pt")
            self._frozen += [(_load(f).get("frozen_param_fragments") or {}) for f in files[1:]]
        for name in self._frozen_shapes:
            if not all(name in f for f in self._frozen):
                raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path} lists frozen "
                                   f"parameter '{name}' without its values")

    def _read_zero12(self, osd: list, param_shapes: list) -> None:
        base = [o["base_optimizer_state"] for o in osd]
        if isinstance(base[0], list):
            raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path} is an elastic "
                               "checkpoint (zero_optimization.elastic_checkpoint): not read")
        fp32 = [o["single_partition_of_fp32_groups"] for o in osd]
        stripped = osd[0].get("zero_stage") is not None  # ZeRO 1/2 saves them without padding
        # zero_optimization.parameter_alignment: padding after each parameter, in the layout.
        aligned = osd[0].get("param_alignment_paddings") or [[] for _ in param_shapes]
        self._group_flat = {k: [] for k in KINDS}
        for gi in range(len(param_shapes)):
            parts = {k: [] for k in KINDS}
            for r, o in enumerate(osd):
                pad = int(o.get("group_paddings", [0] * len(param_shapes))[gi])
                state = base[r]["state"].get(gi, {})
                f = fp32[r][gi].reshape(-1)
                keep = f.numel() - (0 if stripped else pad)
                parts["fp32"].append(f[:keep])
                for k in ("exp_avg", "exp_avg_sq"):
                    t = state.get(k)
                    if t is not None and t.numel() < keep:
                        raise RuntimeError(
                            f"strata: DeepSpeed checkpoint {self.optim_files[r]}: optimizer "
                            f"group {gi}'s {k} holds {t.numel()} elements, its fp32 partition "
                            f"{keep}")
                    t = torch.zeros(keep) if t is None else t.reshape(-1)[:keep]
                    parts[k].append(t)
            for k in KINDS:
                self._group_flat[k].append(_Flat(parts[k]))
            offset = 0
            pads = list(aligned[gi]) if gi < len(aligned) else []
            for i, (name, shape) in enumerate(param_shapes[gi].items()):
                self._add(name, shape, ("flat", gi, offset))
                offset += self._shapes[name].numel() + (int(pads[i]) if i < len(pads) else 0)
            if offset > self._group_flat["fp32"][gi].numel():
                raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path}: optimizer group "
                                   f"{gi}'s parameters take {offset} elements, its partitions "
                                   f"hold {self._group_flat['fp32'][gi].numel()}")
        self._read_hyper(base[0])

    def _read_zero3(self, model: dict, osd: list, param_shapes: list) -> None:
        world = self.world_size
        self._rank_flat = {k: [] for k in KINDS}
        for o in osd:
            groups = o["fp32_flat_groups"]
            state = o["optimizer_state_dict"]["state"]
            self._rank_flat["fp32"].append(_Flat(groups))
            for k in ("exp_avg", "exp_avg_sq"):
                self._rank_flat[k].append(_Flat([
                    state.get(j, {}).get(k, torch.zeros(g.numel())) for j, g in
                    enumerate(groups)]))
        offset = 0
        for shapes in param_shapes:
            for name, shape in shapes.items():
                n = torch.Size(shape).numel()
                part = math.ceil(n / world)
                self._add(name, shape, ("zero3", offset, part))
                offset += part
        for r, f in enumerate(self.optim_files):
            for k in KINDS:
                if self._rank_flat[k][r].numel() != offset:
                    raise RuntimeError(
                        f"strata: DeepSpeed checkpoint {f}: the parameters take {offset} "
                        f"elements per rank, its {k} partitions hold "
                        f"{self._rank_flat[k][r].numel()}")
        self._read_hyper(osd[0]["optimizer_state_dict"])

    def _read_unpartitioned(self, model: dict) -> None:
        """No ZeRO: the weights are the module's (fp32), or the fp16/bf16 optimizer's fp32
        copies; the optimizer's state is keyed by place in the param groups, which only the
        engine knows (place_optimizer_state)."""
        self.world_size = int(model.get("dp_world_size", 1) or 1)
        self.stage = 0
        module = model["module"]
        for name, t in module.items():
            if name not in self.buffers:
                self._add(name, t.shape, ("whole", {"fp32": t, "exp_avg": None,
                                                    "exp_avg_sq": None}))
        opt = model.get("optimizer")
        self._unpartitioned_optimizer = opt
        self.param_group_hyper = self.param_group_lrs = None
        self.optimizer_step, self.loss_scale = 0, None  # no optimizer saved: Adam starts afresh
        if opt is None:
            return
        inner = opt.get("optimizer_state_dict", opt)  # DeepSpeed's fp16/bf16 wrappers nest it
        self._read_hyper(inner)
        if "cur_scale" in opt:
            self.loss_scale = {
                "scale": float(opt["cur_scale"]), "iteration": int(opt.get("cur_iter", 0)),
                "last_overflow": int(opt.get("last_overflow_iter", -1)),
                # Not saved by these optimizers: the config's whole hysteresis (Fit caps it).
                "hysteresis": 1 << 30}

    def place_optimizer_state(self, groups: list[list[str]]) -> None:
        """No ZeRO: `groups` names the parameters of each optimizer param group in order, as the
        optimizer that saved the checkpoint listed them (its state is keyed by that place)."""
        opt = getattr(self, "_unpartitioned_optimizer", None)
        if opt is None:
            return
        inner = opt.get("optimizer_state_dict", opt)
        ours = [len(g) for g in groups]
        if "fp32_groups_flat" in opt:  # FP16_Optimizer: one flat fp32 vector per group
            saved = [t.numel() for t in opt["fp32_groups_flat"]]
            ours = [sum(self._shapes[n].numel() for n in g if n in self._shapes) for g in groups]
            what = "elements"
        else:
            saved = [len(g.get("params", [])) for g in inner.get("param_groups", [])]
            what = "parameters"
        if saved != ours:
            raise RuntimeError(
                f"strata: DeepSpeed checkpoint {self.path}: its optimizer's param groups hold "
                f"{saved} {what}, this engine's {ours}: pass the optimizer the same param "
                "groups as the run that saved it")
        state = inner.get("state", {})
        place = 0
        for gi, names in enumerate(groups):
            offset = 0
            for i, name in enumerate(names):
                how = self._where.get(name)
                if how is None:
                    raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path} has no "
                                       f"weights for '{name}'")
                n = self._shapes[name].numel()
                if "fp32_groups_flat" in opt:
                    flat, st = opt["fp32_groups_flat"][gi].reshape(-1), state.get(gi, {})
                    got = {"fp32": flat[offset:offset + n]}
                    got.update({k: st[k].reshape(-1)[offset:offset + n] for k in
                                ("exp_avg", "exp_avg_sq") if k in st})
                else:
                    got = {k: state.get(place, {}).get(k) for k in ("exp_avg", "exp_avg_sq")}
                    if "fp32_groups" in opt:  # FP16_UnfusedOptimizer: an fp32 copy each
                        got["fp32"] = opt["fp32_groups"][gi][i]
                for k, t in got.items():
                    if t is not None and t.numel() != n:
                        raise RuntimeError(
                            f"strata: DeepSpeed checkpoint {self.path}: the optimizer's {k} "
                            f"at place {place} has {t.numel()} elements, '{name}' {n}: the "
                            "script's param groups list the parameters in another order")
                    if t is not None:
                        how[1][k] = t
                offset += n
                place += 1

    def _add(self, name: str, shape, how: tuple) -> None:
        if name in self._shapes:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path} lists '{name}' twice")
        self._shapes[name] = torch.Size(shape)
        self._where[name] = how

    def _read_hyper(self, opt_state: dict) -> None:
        """The torch optimizer's param_groups: betas, eps, weight_decay, lr, and Adam's step."""
        from ..engine import _group_hyper
        groups = opt_state.get("param_groups", [])
        self.param_group_hyper = [_group_hyper(g) for g in groups]
        self.param_group_lrs = [float(g["lr"]) if "lr" in g else None for g in groups]
        # The step per parameter (torch's Adam, FusedAdam, which leaves its groups' "step" at 0);
        # in the groups only where no parameter has one (DeepSpeedCPUAdam).
        steps = {int(s["step"]) for s in opt_state.get("state", {}).values() if "step" in s}
        steps = steps or {int(g["step"]) for g in groups if "step" in g}
        if len(steps) > 1:
            raise RuntimeError(f"strata: DeepSpeed checkpoint {self.path}: Adam's step differs "
                               f"between its parameters ({sorted(steps)}); strata keeps one")
        self.optimizer_step = steps.pop() if steps else None

    def _read_scaler(self, osd: dict) -> None:
        s = osd.get("loss_scaler")
        self.loss_scale = None
        if s is not None and osd.get("dynamic_loss_scale") is not None:
            self.loss_scale = {
                "scale": float(getattr(s, "cur_scale", 0) or 0),
                "iteration": int(getattr(s, "cur_iter", 0) or 0),
                "last_overflow": int(getattr(s, "last_overflow_iter", -1)),
                "hysteresis": int(getattr(s, "cur_hysteresis", 0) or 0),
            }

    def schedule_position(self) -> Optional[int]:
        """The config scheduler's steps taken (DeepSpeed's last_batch_iteration + 1), or None."""
        s = self.lr_scheduler
        if isinstance(s, dict) and "last_batch_iteration" in s:
            return int(s["last_batch_iteration"]) + 1
        return None


def fp32_state_dict(path: str, exclude_frozen_parameters: bool = False) -> dict:
    """The model's state_dict from the DeepSpeed checkpoint in `path` (a tag directory), as
    DeepSpeed's zero_to_fp32 builds it: each trainable parameter's fp32 master, the frozen ones'
    values (unless excluded), the tied names (the same tensor) and the persistent buffers as
    saved. Without ZeRO, the module's weights as saved, widened to fp32 (DeepSpeed's own
    zero_to_fp32 refuses those)."""
    ck = DeepSpeedCheckpoint(path)
    out = {name: ck.tensor(name, "fp32") for name in ck.names()}
    if not exclude_frozen_parameters:
        out.update({name: ck.frozen(name).float() for name in ck.frozen_names()})
    for alias, owner in ck.shared.items():
        if owner in out:
            out[alias] = out[owner]
    out.update(ck.buffers)
    return out
