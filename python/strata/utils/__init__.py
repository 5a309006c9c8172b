"""As deepspeed.utils: DeepSpeed's logger, log_dist and RepeatingLoader, its tensor-fragment
reads (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_get_full_grad and the local
forms; the writes refused, named), its ZeRO-3 leaf-module calls, and checkpoint helpers: the
Python state strata keeps in a checkpoint, and DeepSpeed's
zero_to_fp32 functions (get_fp32_state_dict_from_zero_checkpoint,
load_state_dict_from_zero_checkpoint, convert_zero_checkpoint_to_fp32_state_dict).

The Python state (client_state, micro_steps, global_samples and the module's persistent
buffers) is the engine checkpoint's client state blob (`<tag>/client_state.bin`, written by
rank 0): torch.save's zip format, read back with torch.load(weights_only=True), whose unpickler
builds only tensors, dicts, lists, tuples, numbers, strings, None and the globals allowed through
torch.serialization.add_safe_globals, so loading a checkpoint from someone else never runs code.
A blob written before this format (a plain pickle) is read by an unpickler that resolves no
global at all (plain containers, numbers and strings only); anything else is refused, naming the
checkpoint.
"""
from __future__ import annotations

import functools
import io
import logging as _logging  # `logging` is this package's submodule (DeepSpeed's path)
import os
import pickle
import re
from typing import Optional

import torch

# DeepSpeed's logger (`from deepspeed.utils import logger`): named "DeepSpeed", WARNING and above
# unless a script lowers it, as DeepSpeed's.
logger = _logging.getLogger("DeepSpeed")
if logger.level == _logging.NOTSET:
    logger.setLevel(_logging.WARNING)


_LOG_LEVELS = {"debug": _logging.DEBUG, "info": _logging.INFO, "warning": _logging.WARNING,
               "error": _logging.ERROR, "critical": _logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """As DeepSpeed's: "info" -> logging.INFO; ValueError naming the valid ones otherwise."""
    level = _LOG_LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. Valid log "
                         f"levels are {list(_LOG_LEVELS)}.")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """As DeepSpeed's (what its engine does with the config's "log_level"): the logger (default:
    DeepSpeed's) and its handlers at that level."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def _dist_message(message: str, ranks) -> Optional[str]:
    """DeepSpeed's get_dist_msg: "[Rank N] message" on the ranks listed (ranks=[-1]: every
    rank), or on the one process where torch.distributed is not started; else None."""
    dist = torch.distributed
    started = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if started else -1
    ranks = list(ranks or [])
    if not started or (ranks and (ranks[0] == -1 or rank in ranks)):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks=None, level: int = _logging.INFO) -> None:
    """As deepspeed.utils.log_dist: `message` logged with a "[Rank N] " prefix on the ranks
    listed (ranks=[-1]: every rank), or on the one process where torch.distributed is not
    started."""
    text = _dist_message(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks=None) -> None:
    """As DeepSpeed's: log_dist's message printed, whatever the logger's level."""
    text = _dist_message(message, ranks)
    if text is not None:
        print(text)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: Optional[tuple], level: int) -> None:
    log_dist(message, ranks=None if ranks is None else list(ranks), level=level)


def log_dist_once(message: str, ranks=None, level: int = _logging.INFO) -> None:
    """As DeepSpeed's: log_dist, each distinct message once per process."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


@functools.lru_cache(None)
def _warning_once(*args, **kwargs) -> None:
    logger.warning(*args, **kwargs)


# As DeepSpeed's logger: logger.warning_once(...) warns each distinct message once.
logger.warning_once = _warning_once
logger.log_dist_once = log_dist_once


class RepeatingLoader:
    """As deepspeed.utils.RepeatingLoader: iterates `loader` without end, starting it again
    when it is exhausted (a step-counted loop over a finite DataLoader)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


# -- DeepSpeed's tensor-fragment API (deepspeed.utils.safe_get_full_fp32_param, ...) ------------
# A parameter's fp32 master, Adam moments or gradient, whole or this rank's part, read from the
# engine that trains it. Collective like DeepSpeed's: every rank calls it for the same parameter.
_OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _engine_of(param, what: str):
    engine = getattr(param, "_strata_engine", None)
    if engine is None:
        raise ValueError(f"{what}: the parameter is not trained by a strata engine "
                         "(strata.initialize first)")
    return engine


def safe_get_full_fp32_param(param):
    """As DeepSpeed's: the parameter's fp32 master weights, whole, in its shape (a frozen
    parameter: its own values in fp32). Collective."""
    return _engine_of(param, "safe_get_full_fp32_param").read_param_state(param)


def safe_get_full_optimizer_state(param, optim_state_key: str):
    """As DeepSpeed's: Adam's `exp_avg` or `exp_avg_sq` of the parameter, whole, fp32, in its
    shape, as of the last step (zeros before the first); None for a frozen parameter or another
    key, as DeepSpeed returns. Collective."""
    engine = _engine_of(param, "safe_get_full_optimizer_state")
    if optim_state_key not in _OPTIMIZER_STATE_KEYS:
        return None
    return engine.read_param_state(param, optim_state_key)


def _local(param, full):
    """This rank's part of `full` (flattened), as ZeRO-3 partitions the parameter."""
    if full is None:
        return None
    part = getattr(param, "ds_tensor", None)
    engine = param._strata_engine
    if part is None or engine.zero_optimization_stage() != 3:
        raise ValueError("safe_get_local_*: only at ZeRO stage 3, as DeepSpeed's (use "
                         "safe_get_full_*)")
    begin, end = engine._part_range(param)
    return full.reshape(-1)[begin:end].clone()


def safe_get_local_fp32_param(param):
    """As DeepSpeed's (ZeRO-3): this rank's part of the fp32 master, 1-D. Collective here (the
    engine reads the whole and keeps the part)."""
    return _local(param, safe_get_full_fp32_param(param))


def safe_get_local_optimizer_state(param, optim_state_key: str):
    """As DeepSpeed's (ZeRO-3): this rank's part of `exp_avg` / `exp_avg_sq`, 1-D."""
    return _local(param, safe_get_full_optimizer_state(param, optim_state_key))


def safe_get_full_grad(param):
    """As DeepSpeed's, between engine.backward() and engine.step(): the parameter's gradient,
    whole, fp32, in its shape, reduced over the ranks (averaged over ranks and micro-steps, not
    yet clipped; with fp16 still multiplied by the loss scale, as DeepSpeed's); None for a
    frozen parameter or before a backward since the last step. Collective."""
    return _engine_of(param, "safe_get_full_grad").read_param_state(param, "grad")


def safe_get_local_grad(param):
    """As DeepSpeed's (ZeRO-3): this rank's part of safe_get_full_grad, 1-D."""
    return _local(param, safe_get_full_grad(param))


def _not_supported(name: str, instead: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name}: not supported by strata; {instead}")
    refuse.__name__ = name
    refuse.__doc__ = f"DeepSpeed's {name}: refused ({instead})."
    return refuse


_GRADS = "the engine's reduced gradients are read-only (safe_get_full_grad reads them)"
safe_set_full_grad = _not_supported("safe_set_full_grad", _GRADS)
safe_set_local_grad = _not_supported("safe_set_local_grad", _GRADS)


def _set(param, value, kind: str, what: str, part: bool = False) -> None:
    """The safe_set_* writes: kind "master32" or an optimizer state key, checked here."""
    engine = _engine_of(param, what)
    if kind != "master32" and kind not in _OPTIMIZER_STATE_KEYS:
        raise ValueError(f"{what}: optim_state_key {kind!r}: Adam's states are "
                         f"{', '.join(_OPTIMIZER_STATE_KEYS)}")
    if part and engine.zero_optimization_stage() != 3:
        raise ValueError(f"{what}: only at ZeRO stage 3, as DeepSpeed's (use "
                         f"{what.replace('local', 'full')})")
    if not param.requires_grad:
        return  # DeepSpeed's: a frozen parameter has no optimizer state to set
    engine.write_param_state(param, value, kind, part=part)


def safe_set_full_fp32_param(param, value):
    """As DeepSpeed's: sets the parameter's fp32 master weights from `value` (whole, its numel
    values); nothing for a frozen parameter. The working parameter is rounded from them at once
    (DeepSpeed leaves it to the next step; both train the same from the next step on).
    Collective: every rank calls it with the same value."""
    _set(param, value, "master32", "safe_set_full_fp32_param")


def safe_set_full_optimizer_state(param, value, optim_state_key: str):
    """As DeepSpeed's: sets Adam's `exp_avg` or `exp_avg_sq` of the parameter from `value`
    (whole); nothing for a frozen parameter. Collective: every rank calls it with the same
    value."""
    _set(param, value, optim_state_key, "safe_set_full_optimizer_state")


def safe_set_local_fp32_param(param, value):
    """As DeepSpeed's (ZeRO-3): sets this rank's part of the fp32 master (1-D, the size of
    safe_get_local_fp32_param's). Collective here: every rank calls it, each with its part."""
    _set(param, value, "master32", "safe_set_local_fp32_param", part=True)


def safe_set_local_optimizer_state(param, value, optim_state_key: str):
    """As DeepSpeed's (ZeRO-3): sets this rank's part of `exp_avg` / `exp_avg_sq` (1-D).
    Collective here: every rank calls it, each with its part."""
    _set(param, value, optim_state_key, "safe_set_local_optimizer_state", part=True)


# deepspeed.utils' ZeRO-3 leaf-module calls (`from deepspeed.utils import set_z3_leaf_modules`).
from ..zero import (get_z3_leaf_modules, set_z3_leaf_modules,  # noqa: F401
                   set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                   unset_z3_leaf_modules, z3_leaf_module)


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _refused_by_load(blob: bytes) -> Optional[str]:
    """None where torch.load(weights_only=True) reads `blob` back, else the global it refuses
    (or its error's first line)."""
    try:
        torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        return None
    except Exception as e:  # noqa: BLE001
        found = re.findall(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(e))
        return found[0] if found else str(e).splitlines()[0]


def pack_state(state: dict) -> bytes:
    """The blob of `state`; refuses (ValueError) what unpack_state would not read back, naming
    the client_state key and the type."""
    blob = _saved(state)
    if _refused_by_load(blob) is None:
        return blob
    client = state.get("client_state") or {}
    bad = [(k, _refused_by_load(_saved(v))) for k, v in client.items()]
    bad = [(k, why) for k, why in bad if why is not None] or [("?", _refused_by_load(blob))]
    listed = ", ".join(f"client_state[{k!r}] ({why})" for k, why in bad)
    raise ValueError(
        f"save_checkpoint: {listed}: load_checkpoint reads the client state with "
        "torch.load(weights_only=True), so that loading a checkpoint runs no code: store "
        "tensors, dicts, lists, tuples, numbers, strings and None (an argparse.Namespace as "
        "vars(args), a numpy array or RNG state as a tensor or a list), or allow the type on "
        "every rank that saves and loads with torch.serialization.add_safe_globals; nothing "
        "was written")


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global '{module}.{name}' refused")


def unpack_state(blob: bytes, where: str) -> dict:
    """The state a checkpoint's blob holds ({} when none); `where` names the checkpoint."""
    if not blob:
        return {}
    try:
        if blob[:4] == b"PK\x03\x04":  # torch.save's zip
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        else:  # a pickle from an older strata: containers, numbers and strings only
            state = _NoGlobalsUnpickler(io.BytesIO(blob)).load()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(
            f"strata: the client state of checkpoint {where} was not loaded: loading it could run "
            "code or it is damaged (only tensors, dicts, lists, tuples, numbers, strings and None "
            f"are read; torch.serialization.add_safe_globals allows more): {e}") from None
    if not isinstance(state, dict):
        raise RuntimeError(f"strata: the client state of checkpoint {where} is not a dict "
                           f"({type(state).__name__})")
    return state


# DeepSpeed's zero_to_fp32 functions (`from deepspeed.utils.zero_to_fp32 import ...` and, as
# before, from strata.utils itself).
from .zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: E402,F401
                           get_fp32_state_dict_from_zero_checkpoint,
                           load_state_dict_from_zero_checkpoint, read_checkpoint)


from . import logging  # noqa: E402  deepspeed.utils.logging, once the names it re-exports exist
