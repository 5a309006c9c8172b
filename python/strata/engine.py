"""The PyTorch adapter: `strata.initialize`, a drop-in for `deepspeed.initialize`.

How parameters move (per-module hooks; public torch APIs only):
  - groups: each module that owns parameters directly (recurse=False) is one engine group, in
    module registration order, split where its parameters sit in different optimizer groups
    ("<module>#<k>") or are frozen ("<module>#frozen": requires_grad=False, params only, no
    gradient or optimizer state); a parameter shared by several modules (tied embeddings) belongs
    to the first and is gathered, and its gradient reduced, once. Every module that uses a
    group's parameter (the owner and the modules it is tied into) gets the hooks below.
  - stages 0-2: every parameter is whole at all times, as in DeepSpeed: each group is gathered
    once (its .data a zero-copy view of the engine's replica, the working dtype) and never
    released; Step, Save, Load and InitParameters, which the engine refuses while a group is
    gathered ("gathered group(s) not released"), release every group and gather it again after
    (the views then hold the new values). Only the gradient hooks below run; no forward hooks.
  - stage 3, forward: a forward pre-hook (prepend=True, with_kwargs=True) gathers the module's
    groups and its external parameters' (engine.gather: each parameter's .data becomes a
    zero-copy view of the engine's gathered buffer; the engine prefetches what its recorded trace
    says comes next) and passes the inputs that need a gradient through _ReleaseAfterBackward; a
    forward hook (always_call=True) releases the groups and passes the outputs through
    _GatherForBackward. The root module is always hooked.
  - stage 3, parameters used outside their module: strata.zero.register_external_parameter adds
    a parameter to a module's gathers. Unregistered, a parameter read while released during the
    engine's forward (module._parameters is a _ParamDict: `self.emb.weight` in the parent's
    forward) or returned by a module's forward is gathered for the running module call and
    registered to that module, with a one-time notice naming both (DeepSpeed's ZeROOrderedDict
    and returned-parameter rules). Outside forward a stage-3 parameter is empty, as DeepSpeed.
  - backward: when a gradient reaches a module's outputs its groups are gathered again; when it
    reaches the module's inputs (the module's backward is done) they are released. Each
    parameter's post-accumulate-grad hook (register_post_accumulate_grad_hook: once per
    backward, after a tied parameter's uses are summed) copies p.grad into the engine's bucket
    for its group (engine.grad_buffer), frees p.grad, and reduces the group once all of its
    parameters are in (engine.reduce_gradients; asynchronous with overlap_comm).
  - engine.backward(loss) runs (loss x loss scale).backward(), then flushes: groups with a
    missing gradient (a parameter unused this micro-step) are reduced with zeros there, and at
    stage 3 any group still gathered (a module whose inputs needed no gradient) is released.
  - engine.gathered_parameters() or strata.zero.GatheredParameters make stage-3 parameters
    whole (at stages 0-2 they are already).
  - tensors autograd saves for backward (stage 3): an op may save a view of a gathered
    parameter rather than the parameter (F.linear saves weight.t(); weight[idx], a user's
    x @ w.T), and such a view holds the forward's memory, which the engine reuses once the group
    is released. So while a hooked module runs forward, saved-tensor hooks
    (torch.autograd.graph.saved_tensors_hooks) keep a saved tensor that shares a gathered
    parameter's memory as (parameter, offset, shape, strides), never the memory; backward
    rebuilds the view over the parameter as gathered for backward. It costs no memory (no buffer
    outlives its release), and whatever op saved the view, backward reads the gathered values.
    gathered_parameters() blocks push the same hooks. If a backward would read a parameter
    whose group is not gathered then (its module's outputs were not seen by the hooks, or the
    block has ended), it fails naming the module (or block) and the parameter; a frozen
    parameter (a reference or teacher model's, a frozen base weight) is gathered for the
    purpose instead, its values copied. A stage-3 parameter saved whole where it is not gathered
    in the saving engine's memory (another engine's, or one released by then) is given back
    with its values as gathered then (_SavedPartitioned). Hooks already on
    the stack (activation checkpointing, save_on_cpu) still see every tensor; other saved
    tensors get the in-place modification check autograd skips once hooks are in place.
Collectives: with several ranks the groups are reduced in one order on every rank (_in_turn:
reductions pair by their order), rank 0's order of the first micro-step once agreed, so ranks may
use different modules in a step at stages 0-2 (a group unused on a rank is reduced with zeros at
its turn). Stage-3 gathers follow each rank's forward, so there every rank must run the same
modules, as under DeepSpeed (transformers' generate needs synced_gpus=True there). Where ranks'
collectives differ, either one that does not pair waits until the engine's timeout
(_engine_timeout_ms: timeout_ms, else the torch.distributed group's, as DeepSpeed's) and then
fails with DeadlineExceeded naming the rule (a rank cannot tell a peer
that runs other modules from one that is slow), or, where they happen to pair (the same sizes in
the same number), Step's comparison of the ranks' traces fails naming it.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import dis
import gc
import inspect
import itertools
import json
import logging
import math
import os
import sys
import time
import warnings
import weakref
from typing import Any, Iterable, Optional

import torch

from . import _strata
from .autocast import TorchAutocast
from .config import ConfigError, ConfigLike, check_config, config_bool, config_json, load_config
from .deepspeed_name import register_as_deepspeed
from .monitor import MonitorMaster
from .optim import ParamGroups
from .utils import pack_state, unpack_state
from .utils.timer import EngineTimers, SynchronizedWallClockTimer, ThroughputTimer
from .utils.zero_to_fp32 import write_recovery_script
from .zero import (GatheredParameters, ZeroParamStatus, _mark_partitioned, _owned_parts,
                   apply_leaf_module_config, z3_leaf_module)

_AVAILABLE, _NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
_MODULE_GETATTR = torch.nn.Module.__getattr__.__code__

logger = logging.getLogger("strata")
_CONFIG_WARNED: set = set()  # config warnings already logged by this process


def _log_config_warnings(check: dict, rank: int) -> None:
    """Logs, on rank 0 and once per process, each of `check`'s warnings (a key strata does not
    act on, a misspelt one, ...): what `offloadctl config check` prints for the same config."""
    for w in check["warnings"] if rank == 0 else ():
        if w["text"] not in _CONFIG_WARNED:
            _CONFIG_WARNED.add(w["text"])
            logger.warning("strata config: %s", w["text"])


def _deepspeed_default_timeout() -> datetime.timedelta:
    """DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes, else 10."""
    value = os.environ.get("DEEPSPEED_TIMEOUT", "10")
    try:
        minutes = int(value)
    except ValueError:
        raise ValueError(f"DEEPSPEED_TIMEOUT={value!r}: expected a whole number of minutes") from None
    if minutes <= 0:
        raise ValueError(f"DEEPSPEED_TIMEOUT={value!r}: expected minutes > 0")
    return datetime.timedelta(minutes=minutes)


def _process_group_timeout() -> Optional[datetime.timedelta]:
    """The timeout torch.distributed's default group was started with, where one is up."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def _engine_timeout_ms(timeout_ms: Optional[int]) -> int:
    """How long the engine waits for a collective or an IO before DeadlineExceeded: timeout_ms
    when given; else the timeout of torch.distributed's default group (init_distributed(timeout=),
    the Trainer's ddp_timeout, a script's init_process_group(timeout=)), in which DeepSpeed's own
    collectives run; else DeepSpeed's default (DEEPSPEED_TIMEOUT minutes, 10)."""
    if timeout_ms is not None:
        if int(timeout_ms) <= 0:
            raise ValueError(f"timeout_ms={timeout_ms}: expected milliseconds > 0")
        return int(timeout_ms)
    timeout = _process_group_timeout() or _deepspeed_default_timeout()
    return max(1, int(timeout.total_seconds() * 1000))


def _env_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


# What stays free on the GPU for torch (activations, its caching allocator, the CUDA context)
# when initialize is given no device_budget_bytes: this fraction of the GPU's memory, at least
# _CUDA_RESERVE_MIN bytes.
_CUDA_RESERVE_FRACTION = 0.2
_CUDA_RESERVE_MIN = 4 << 30
_HOST_DEFAULT_BUDGET = 8 << 30  # HostDevice's "HBM" when none is given


def _engine_device(model: torch.nn.Module, device=None) -> torch.device:
    """The device the engine runs on: `device` when given (cuda picks LOCAL_RANK's GPU, else
    torch's current one), else the GPU the model's parameters or buffers are on (strata.zero.Init
    keeps it on the emptied parameters), else, as DeepSpeed moves the model to the rank's GPU,
    LOCAL_RANK's GPU where torch sees one, else the host (cpu)."""
    if device is None:
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.is_cuda:
                device = t.device
                break
        else:
            if not torch.cuda.is_available():
                return torch.device("cpu")
            device = torch.device("cuda")
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"strata.initialize: device {device} is not supported (cuda or cpu)")
    if not torch.cuda.is_available():
        raise RuntimeError("strata.initialize: device cuda asked for, and torch sees no GPU")
    if device.index is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local else torch.cuda.current_device())
    return device


def _device_budget(cuda: Optional[torch.device], budget: Optional[int]) -> int:
    """The engine's device-tier budget in bytes: `budget` when given; on a GPU what it has free
    less the reserve for torch (_CUDA_RESERVE_*); on the host stand-in _HOST_DEFAULT_BUDGET."""
    if budget is not None:
        if budget <= 0:
            raise ValueError(f"strata.initialize: device_budget_bytes must be > 0, got {budget}")
        return int(budget)
    if cuda is None:
        return _HOST_DEFAULT_BUDGET
    free, total = torch.cuda.mem_get_info(cuda)
    reserve = max(int(total * _CUDA_RESERVE_FRACTION), _CUDA_RESERVE_MIN)
    if free <= reserve:
        raise RuntimeError(
            f"strata.initialize: {cuda} has {free >> 20} MiB free, not more than the "
            f"{reserve >> 20} MiB strata leaves to torch; pass device_budget_bytes= to choose")
    return free - reserve


def _as_tensor(view) -> torch.Tensor:
    """A torch tensor over an engine view (no copy). Through the DLPack capsule: torch asks a
    CUDA producer for __dlpack__(stream=...), which the engine's views need not take (a
    gathered view's work is done when gather returns; a gradient buffer taken with a stream is
    ordered by the adapter: _grad_buffer)."""
    return torch.from_dlpack(view.__dlpack__())


def _forward_code(cls):
    """The code object of cls.forward, under its decorators (functools.wraps'
    __wrapped__, as transformers' forwards carry)."""
    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    return getattr(fn, "__code__", None)


def _name_list(names: list, shown: int) -> str:
    """'a', 'b' and N more: the first `shown` names quoted."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def _refuse_lazy_parameters(model: torch.nn.Module) -> None:
    """A lazy module's parameters (nn.LazyLinear, nn.LazyConv2d, ...) have no shape until its
    first forward: the engine partitions and allocates by shape at initialize."""
    lazy = [n for n, p in model.named_parameters() if torch.nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"strata.initialize: parameter(s) {_name_list(lazy, 5)} "
            "are uninitialized (a lazy module such as nn.LazyLinear): run one forward pass of "
            "the model on a sample batch before strata.initialize, so that they have shapes")


def _refuse_unsupported_dtypes(model: torch.nn.Module, low_precision: bool) -> None:
    """The engine keeps every parameter as a float32 master and a float32 / bfloat16 / float16
    working copy: an integer, boolean or complex parameter would lose its values, and a float64
    one its precision, without a word. Under bf16 / fp16 a float64 parameter is cast with the
    rest, as DeepSpeed casts the module's floating-point parameters."""
    for name, p in model.named_parameters():
        if _is_empty(p):
            continue  # left out of the engine
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(
                f"strata.initialize: parameter {name} has dtype {p.dtype}; strata trains "
                "floating-point parameters (float32, bfloat16, float16). Hold an integer or "
                "boolean table in a buffer (register_buffer), and a complex weight as a real "
                "parameter of shape (..., 2) viewed with torch.view_as_complex in the forward")
        if p.dtype == torch.float64 and not low_precision:
            raise ValueError(
                f"strata.initialize: parameter {name} is float64; strata's engine keeps float32 "
                "weights (the config enables neither bf16 nor fp16) and would round it. Cast the "
                "model to float32 (model.float()) before strata.initialize")


def _cast_buffers(model: torch.nn.Module, buffer_dtype: Optional[str]) -> None:
    """The config's data_types.buffer_dtype, as DeepSpeed's engine applies it: the module's
    floating-point buffers cast to it (BatchNorm's running statistics beside bf16 weights);
    None keeps them as loaded (DeepSpeed casts only the parameters). `buffer_dtype`: the
    checker's canonical name (it reads DeepSpeed's spellings)."""
    if buffer_dtype is None:
        return
    dtype = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[buffer_dtype]
    for b in model.buffers():
        if b.is_floating_point() and b.dtype != dtype:
            b.data = b.data.to(dtype)


@contextlib.contextmanager
def _named_collective(what: str):
    """A collective's timeout inside the block names `what`: a call made on some ranks only (an
    `if rank == 0:` around a collective read) waits for the others until the timeout, and the
    communicator's error alone names the collective's sequence number, not the call."""
    try:
        yield
    except _strata.StrataError as e:
        if not str(e).startswith("DeadlineExceeded"):
            raise
        raise _strata.StrataError(
            f"{e} (in {what}: a collective, which every rank calls for the same parameter; "
            "a call on some ranks only waits for the others until the timeout)") from e


def _full_shape(p: torch.nn.Parameter) -> list:
    """The parameter's shape while whole (ds_shape once strata has emptied it)."""
    return list(getattr(p, "ds_shape", p.shape))


def _is_empty(p: torch.nn.Parameter) -> bool:
    """Whether the parameter has no elements even whole (nn.Parameter(torch.empty(0)), a device
    marker): left out of the engine, as DeepSpeed's ZeRO leaves empty parameters out."""
    return torch.Size(_full_shape(p)).numel() == 0


class _Group:
    __slots__ = ("name", "params", "optimizer_group", "trainable")

    def __init__(self, name: str, params: list, optimizer_group: int = 0,
                 trainable: bool = True):
        self.name = name
        self.params = params  # [(qualified name, nn.Parameter)]
        self.optimizer_group = optimizer_group
        self.trainable = trainable  # False: frozen (requires_grad=False), params only


def _module_owners(model: torch.nn.Module, leaves: bool = True):
    """(name, module, owner) for each module of `model` in named_modules' (pre-)order: the owner
    is the name of the ZeRO-3 leaf module whose subtree holds it (strata.zero.
    set_z3_leaf_modules; with `leaves`), else its own name."""
    leaf = None  # the leaf whose subtree is being walked
    for mname, module in model.named_modules():
        if leaf is not None and mname.startswith(leaf + "." if leaf else ""):
            yield mname, module, leaf
            continue
        leaf = mname if leaves and z3_leaf_module(module) else None
        yield mname, module, mname


def _make_groups(model: torch.nn.Module, optimizer_group_of: Optional[dict] = None,
                 leaves: bool = False) -> list[_Group]:
    """One group per module that owns parameters, split by optimizer group (optimizer_group_of:
    id(param) -> index; a module's parameters in groups 0 and 1 give "<module>" and
    "<module>#1") and by requires_grad (the frozen ones: "<module>#frozen", no optimizer
    state). With `leaves` (stage 3), a ZeRO-3 leaf module (strata.zero.set_z3_leaf_modules) owns
    every parameter of its subtree: gathered at once, as one group."""
    seen: set[int] = set()
    groups = []
    owners: dict[str, dict] = {}  # owner's name -> its parameters by (frozen, group), in order
    for mname, module, owner in _module_owners(model, leaves):
        own = owners.setdefault(owner, {})
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: owned by the first module that registered it
            if _is_empty(p):
                continue  # nothing to train: left as it is
            seen.add(id(p))
            og = 0 if optimizer_group_of is None or not p.requires_grad else \
                optimizer_group_of[id(p)]
            own.setdefault((not p.requires_grad, og), []).append(
                (f"{mname}.{pname}" if mname else pname, p))
    for mname, own in owners.items():
        base = mname or "<root>"
        for k, ((frozen, og), params) in enumerate(sorted(own.items())):
            name = base if k == 0 else f"{base}#frozen" if frozen else f"{base}#{og}"
            groups.append(_Group(name, params, og, not frozen))
    if not groups:
        raise ValueError("the model has no parameters")
    return groups


def _persistent_buffers(model: torch.nn.Module) -> dict:
    """The buffers model.state_dict() holds (persistent ones), by qualified name."""
    out = {}
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = b
    return out


def _tied_names(model: torch.nn.Module) -> dict:
    """{name: the name it is tied to} for each parameter state_dict lists under a second name."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.update({name: first[id(p)]} if id(p) in first else {})
        first.setdefault(id(p), name)
    return out


def _map_tensors(obj, fn):
    """obj with fn applied to every tensor inside tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


def _grad_tensors(obj, out: list) -> None:
    """Appends the tensors inside obj (tuples, lists, dicts) that need a gradient, in
    _map_tensors' order. Runs on every hooked module call: no closures, no rebuilding."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _grad_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _grad_tensors(o, out)


def _through(function, call, obj):
    """obj with the tensors that need a gradient passed through `function` (one node for all, so
    its backward runs once, when every one of their gradients is in)."""
    found = []
    _grad_tensors(obj, found)
    if not found:
        return obj, False
    outs = function.apply(call, *found)
    if obj is found[0]:  # a module's output that is one tensor
        return outs[0], True
    it = iter(outs)
    return _map_tensors(obj, lambda t: next(it) if t.requires_grad else t), True


class _ModuleCall:
    """One call of a hooked module: its groups, whether backward holds them gathered, and the
    saved-tensor hooks its forward pushed (None when none were pushed)."""
    __slots__ = ("engine", "groups", "held", "saved_hooks", "acquired", "versions")

    def __init__(self, engine, groups):
        self.engine = engine
        self.groups = groups
        self.held = False
        self.saved_hooks = None
        self.acquired = False  # its gather succeeded (the post-hook undoes nothing otherwise)
        self.versions = ()  # (parameter, version counter) at the call's start (stage 3)


# Attributes a released stage-3 parameter answers as its gathered self does: the released
# tensor keeps its dtype and device, and the ds_* attributes live on the Parameter.
_METADATA_ATTRS = frozenset({
    "dtype", "device", "is_cuda", "is_cpu", "layout", "requires_grad", "is_floating_point",
    "is_complex", "element_size", "itemsize", "ds_id", "ds_shape", "ds_numel", "ds_status"})
_NEXT_ATTR: dict = {}  # code object -> {instruction offset: attribute the next one loads}


def _reads_metadata_only(frame) -> bool:
    """Whether the value `frame`'s current instruction produces is only asked for one of
    _METADATA_ATTRS: the next instruction loads that attribute from it
    (`self.lm_head.weight.dtype`, `getattr(m, "weight").device`)."""
    code = frame.f_code
    table = _NEXT_ATTR.get(code)
    if table is None:
        table, prev = {}, None
        for ins in dis.get_instructions(code):
            if prev is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                table[prev] = ins.argval
            prev = ins.offset
        _NEXT_ATTR[code] = table
    return table.get(frame.f_lasti) in _METADATA_ATTRS


class _ParamDict(dict):
    """A stage-3 module's _parameters: a parameter of the engine read while released, inside the
    engine's forward (a tied head's `x @ self.emb.weight.t()` in the parent), is gathered for the
    running module call (StrataEngine._gather_external), as DeepSpeed's ZeROOrderedDict does.
    Module.__getattr__ reads parameters through __getitem__; iteration (named_parameters,
    state_dict) does not gather, nor does a read of the parameter's dtype, device or ds_*
    attributes alone (transformers' `self.lm_head.weight.dtype`: _reads_metadata_only)."""

    def __init__(self, engine, params):
        super().__init__(params)
        self.engine = engine

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        if p is None:
            return p
        if torch.compiler.is_compiling():
            # Traced by torch.compile: the engine's state stays out of the graph; a released
            # (empty) parameter is gathered at a graph break, eagerly.
            if p.numel() == 0:
                self._gather_eagerly(p)
        elif self.engine._call_stack:
            self._gather_if_released(p, metadata_frame=3)
        return p

    def _gather_if_released(self, p, metadata_frame: Optional[int]) -> None:
        """Gathers `p` for the running call where it is released, unless the reading code (the
        frame `metadata_frame` up from the check; None: not looked at) reads metadata only."""
        e = self.engine
        gi = e._group_of.get(id(p))
        if gi is not None and e._refs[gi] == 0 and (
                metadata_frame is None or not self._metadata_read(metadata_frame)):
            e._gather_external(p, "is read", stacklevel=4)

    @torch.compiler.disable
    def _gather_eagerly(self, p) -> None:
        if self.engine._call_stack:
            self._gather_if_released(p, metadata_frame=None)

    @staticmethod
    def _metadata_read(frames: int) -> bool:
        """Whether the code reading the parameter asks it only for metadata (the frame that
        subscripted this dict, `frames` up from here, or the one that called
        Module.__getattr__)."""
        frame = sys._getframe(frames)
        if frame.f_code is _MODULE_GETATTR:
            frame = frame.f_back
        return frame is not None and _reads_metadata_only(frame)


def _top_saved_tensors_hooks():
    """The (pack, unpack) pair on top of autograd's saved-tensor hooks stack, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _SavedTensor:
    """A saved tensor that is not a parameter's: kept as autograd would keep it, with the
    in-place modification check autograd does only when no hooks are in place."""
    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()  # shares data and version counter; no cycle through grad_fn
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.tensor.type()} {list(self.tensor.shape)}] is at "
                f"version {self.tensor._version}; expected version {self.version} instead")
        return self.tensor


class _SavedParam:
    """A saved tensor that shares a gathered parameter's memory: the parameter and the view's
    place in it (byte offset from the parameter's first element, dtype, shape, strides). Backward
    rebuilds the view over the parameter's memory as gathered then. `outer` keeps what the hooks
    below ours made of the tensor (they see every tensor; the view is rebuilt all the same)."""
    __slots__ = ("engine", "gi", "pi", "module", "byte_offset", "dtype", "size", "stride",
                 "outer", "version")

    def __init__(self, engine, gi, pi, module, t, byte_offset, outer):
        self.engine = engine
        self.gi = gi
        self.pi = pi
        # The parameter's version counter, as autograd checks a saved variable's: engine.step()
        # advances it (StrataEngine._after_applied_step), so does an in-place write.
        self.version = engine._groups[gi].params[pi][1]._version
        self.module = module
        self.byte_offset = byte_offset
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.outer = outer

    def unpack(self) -> torch.Tensor:
        return self.engine._rebuild_saved_param(self)


class _SavedPartitioned:
    """A stage-3 parameter saved whole (the Parameter itself, as a custom autograd Function's
    save_for_backward keeps it) where it is not gathered in the saving engine's memory: one of
    another engine's (a frozen reference or teacher model's lm_head read by a fused loss) or one
    released by then. Unpacking gives its values as gathered then: a view while its engine has
    it gathered, else a copy gathered for the purpose (its engine's collective, in backward's
    order on every rank). Without this, autograd would give back the empty tensor the
    parameter is outside a gather, and a backward that gathers what it unpacks (TRL's fused
    losses, through maybe_gather_lm_head_ctx) could not, the unpacked tensor being a plain one."""
    __slots__ = ("param", "outer")

    def __init__(self, p: torch.nn.Parameter, outer):
        self.param = p
        self.outer = outer

    def unpack(self) -> torch.Tensor:
        p = self.param
        if p.ds_status == _AVAILABLE and p.numel() == p.ds_numel:
            return p.detach()
        with GatheredParameters([p]):
            return p.detach().clone()


class _CallIdentity(torch.autograd.Function):
    """Identity on tensors that carries a module call into backward (subclasses act there)."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call = call
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)


class _GatherForBackward(_CallIdentity):
    """Identity on a module's outputs; its backward gathers the module's groups again."""

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        if not call.held:
            call.engine._acquire(call.groups)
            call.held = True
            call.engine._held_calls.add(call)
        return (None, *grads)


class _ReleaseAfterBackward(_CallIdentity):
    """Identity on a module's inputs; its backward (the module's backward is done) releases."""

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        engine = call.engine
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): the graph this backward builds keeps views
            # of the gathered parameters, which a later backward reads; from here to the end of
            # the micro-step's backward (_flush) or the step, nothing gathered is released.
            engine._graph_built_in_backward = True
        if call.held and not engine._graph_built_in_backward:
            engine._release(call.groups)
            call.held = False
            engine._held_calls.discard(call)
        return (None, *grads)


class _DeviceWaits:
    """The adapter's own waits for the GPU (torch stream synchronizes and _HeldBack's event
    waits): how many and for how long, reported by stats()["adapter"]. A count that grows with
    the number of groups per step says where the host may have kept the GPU waiting."""
    __slots__ = ("count", "ns")

    def __init__(self):
        self.count = 0
        self.ns = 0

    def wait(self, sync) -> None:
        t0 = time.perf_counter_ns()
        sync()
        self.ns += time.perf_counter_ns() - t0
        self.count += 1


class _HeldBack:
    """Engine calls held back by one group, so that the host never waits for the GPU's whole
    queue (on a GPU): a group's reduction (with overlap_comm, where the engine does not order
    torch's stream itself: several ranks) or release (where it frees or reuses memory) runs only
    once the next group's is due too, after waiting for an event recorded behind the group's own
    kernels. The GPU keeps running the next group's work
    meanwhile, where a stream synchronize would drain it. At most `limit` held: the working set
    counts one more gradient buffer (Engine::GradBuffer, sched/placement.h) and a second gathered
    group (sched::Stage3Peak's floor of two). `limit` 0 calls at once, with `wait` (a stream
    synchronize) first. `event()` records an event on torch's current stream (torch.cuda.Event;
    tests inject theirs); each needs .synchronize(), timed in `waits` (_DeviceWaits)."""
    __slots__ = ("call", "wait", "limit", "event", "waits", "held")

    def __init__(self, call, wait, limit: int = 0, event=None, waits=None):
        self.call = call
        self.wait = wait
        self.limit = limit
        self.event = event
        self.waits = waits if waits is not None else _DeviceWaits()
        self.held: list = []  # [(group, event)], oldest first

    def add(self, gi: int) -> None:
        if self.limit == 0:
            self.wait()
            self.call(gi)
            return
        self.held.append((gi, self.event()))
        while len(self.held) > self.limit:
            self._call_oldest()

    def take(self, gi: int) -> None:
        """gi's held call, now (after its event), if gi is held."""
        for i, (g, ev) in enumerate(self.held):
            if g == gi:
                del self.held[i]
                self.waits.wait(ev.synchronize)
                self.call(gi)
                return

    def drain(self) -> None:
        while self.held:
            self._call_oldest()

    def _call_oldest(self) -> None:
        gi, ev = self.held.pop(0)
        self.waits.wait(ev.synchronize)
        self.call(gi)


def _hook_outputs(out, hook, depth: int = 0) -> None:
    """`hook` on each tensor of a forward's output that autograd will reach (in tuples, lists
    and dicts, a transformers ModelOutput among them, two levels deep)."""
    if isinstance(out, torch.Tensor):
        if out.grad_fn is not None:  # not a leaf: a returned Parameter would keep the hook
            out.register_hook(hook)
    elif depth < 2 and isinstance(out, (tuple, list)):
        for v in out:
            _hook_outputs(v, hook, depth + 1)
    elif depth < 2 and isinstance(out, dict):
        for v in out.values():
            _hook_outputs(v, hook, depth + 1)


def _no_wait() -> None:
    """_HeldBack's wait where the engine orders torch's stream on the device itself."""


def _cuda_event(device):
    def record():
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev
    return record


class StrataEngine(torch.nn.Module):
    """The training engine deepspeed.initialize returns (DeepSpeedEngine's names)."""

    def __init__(self, model: torch.nn.Module, config: dict, rank: int, world_size: int,
                 nvme_paths: Optional[list] = None, device_budget_bytes: Optional[int] = None,
                 timeout_ms: Optional[int] = None, overlap_step: bool = False,
                 param_groups: Optional[ParamGroups] = None, lr_scheduler=None, device=None):
        super().__init__()
        timeout_ms = _engine_timeout_ms(timeout_ms)
        _refuse_lazy_parameters(model)
        # Before anything is measured: dropped engines' device memory and swap files freed, and
        # an engine still holding this model's parameters closed with its weights kept.
        _collect_unreachable_engines()
        _close_engines_holding(model)
        _refuse_parameters_a_closed_engine_emptied(model)
        self.module = model
        self._dtypes = {n: p.dtype for n, p in model.named_parameters()}  # before the engine's
        # Where the engine runs: a torch.device, cuda (CudaDevice + NCCL) or cpu (HostDevice +
        # Gloo, the stand-in); _cuda is the GPU, None on the host.
        self.device = _engine_device(model, device)
        self._cuda = self.device if self.device.type == "cuda" else None
        self._device_waits = _DeviceWaits()  # the adapter's own waits for the GPU (stats())
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
            model.to(self._cuda)  # buffers (and parameters not yet placed) on the engine's GPU
        device_budget_bytes = _device_budget(self._cuda, device_budget_bytes)
        # No trainer fills what is left "auto" here (the integrations resolve first): as
        # DeepSpeed's initialize, the keys of its config-model sections take their defaults.
        check = check_config(config, world_size=world_size, trainer_fills_auto=False)
        if not check["ok"]:
            raise ConfigError("invalid DeepSpeed config:\n" +
                              "\n".join(e["text"] for e in check["errors"]))
        config = _without_paths(config, check["dropped_auto"])
        self._config = config
        if check["unresolved_auto"]:
            raise ConfigError(
                "invalid DeepSpeed config: \"auto\" is left for a trainer to fill (the Hugging "
                "Face Trainer, accelerate) at " + ", ".join(check["unresolved_auto"]) +
                "; give values, or train through strata.integrations.transformers' Trainer or "
                "accelerate, which fill them")
        eff = json.loads(check["effective_json"])
        _log_config_warnings(check, rank)
        if config.get("log_level") is not None:  # as DeepSpeed's engine: its logger's level
            from .utils import set_log_level_from_string
            set_log_level_from_string(config["log_level"])
        _refuse_unsupported_dtypes(model, any(
            bool((eff.get(k) or {}).get("enabled")) for k in ("bf16", "fp16")))
        _cast_buffers(model, (json.loads(check["normalized_json"]).get("data_types") or {})
                      .get("buffer_dtype"))
        # DeepSpeed's monitors (tensorboard, csv_monitor, wandb): the lr at each step, and what
        # the script writes (engine.monitor.write_events). Once the config is known good, before
        # the engine exists: one that cannot start (its package missing) leaves nothing open.
        self.monitor = MonitorMaster(config, rank)
        stage3 = int((eff.get("zero_optimization") or {}).get("stage") or 0) == 3
        if stage3:  # DeepSpeed's ZeRO-3 leaf modules: the config's, or its MoE-block defaults
            leaf_cfg = (config.get("zero_optimization") or {}).get("leaf_module", {})
            apply_leaf_module_config(model, {} if leaf_cfg == "auto" else leaf_cfg)
        self._groups = _make_groups(model, None if param_groups is None else param_groups.index,
                                    leaves=stage3)
        self._trainable = [(n, p) for g in self._groups if g.trainable for n, p in g.params]
        self._param_versions: Optional[list] = None  # _check_param_writes' reference
        self._warned_inplace = False  # its notice, once
        self._effective = eff
        self._autocast = TorchAutocast(config, self.device.type)  # the forward's autocast
        self._gas = int(eff.get("gradient_accumulation_steps") or 1)
        self._micro_batch = eff.get("train_micro_batch_size_per_gpu")
        master_port = _engine_store_port(world_size)
        spec = [(g.name, [(n, _full_shape(p)) for n, p in g.params]) for g in self._groups]
        self._nvme_dirs = _config_nvme_dirs(eff) if nvme_paths is None else set(
            os.path.realpath(os.fspath(d)) for d in nvme_paths)
        self._engine = _strata.Engine(
            spec, config_json(config), rank, world_size, nvme_paths or [], device_budget_bytes,
            timeout_ms, "auto", master_port, overlap_step,
            optimizer_groups=[] if param_groups is None else param_groups.hyper,
            group_optimizer=[g.optimizer_group for g in self._groups],
            group_trainable=[g.trainable for g in self._groups],
            device="host" if self._cuda is None else "cuda",
            device_ordinal=0 if self._cuda is None else self._cuda.index)
        self._closed = False
        # initialize froze the model (no optimizer, no model_parameters): backward refuses.
        self._forward_only = False
        self._named_scheduler = None  # initialize's: a torch scheduler named in the config
        self._dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}[self._engine.dtype]
        self._init_weights()
        for g in self._groups:
            for _, p in g.params:
                p._strata_engine = self  # strata.zero.GatheredParameters finds the engine
                p.ds_shape = torch.Size(_full_shape(p))
                p.ds_numel = p.ds_shape.numel()
        self._group_of = {}
        self._index_in_group = {}
        for gi, g in enumerate(self._groups):
            for pi, (_, p) in enumerate(g.params):
                self._group_of[id(p)] = gi
                self._index_in_group[id(p)] = pi
        self._refs = [0] * len(self._groups)
        # Storage address of each gathered parameter -> (group, index): what the saved-tensor
        # hooks recognise as parameter memory.
        self._gathered_at: dict[int, tuple[int, int]] = {}
        # id(p) -> the view of the engine's copy a gathered parameter was given (_acquire):
        # _adopt_assigned_data tells a .data the script replaced from it.
        self._engine_views: dict[int, torch.Tensor] = {}
        self._warned_assigned = False
        self._module_names = {id(m): n or "<root>" for n, m in model.named_modules()}
        modules = dict(model.named_modules())
        self._leaf_of = {id(m): modules[owner] for n, m, owner in _module_owners(model)
                         if owner != n}  # a module inside a ZeRO-3 leaf -> the leaf
        self._grad_views: dict[int, list] = {}
        self._grad_streams: dict[int, object] = {}  # stream-ordered: each buffer's torch stream
        self._grads_missing = [len(g.params) for g in self._groups]
        self._reduced = [not g.trainable for g in self._groups]  # frozen: never reduced
        # The order the groups are reduced in (_in_turn): reverse registration order (backward's,
        # mostly) until the first micro-step's order is known, then rank 0's order of it on every
        # rank (engine.agree_reduction_order). One rank reduces each group as it completes.
        self._reduce_order = [gi for gi in reversed(range(len(self._groups)))
                              if self._groups[gi].trainable]
        self._turn = 0  # _reduce_order's next group to reduce this micro-step
        self._ordered = world_size > 1
        self._completed: Optional[list] = [] if self._ordered else None  # until agreed
        self._held_calls: set = set()  # module calls whose groups backward holds gathered
        self._graph_built_in_backward = False  # _ReleaseAfterBackward's, until the flush
        self._graph_hold_armed = False  # _end_graph_hold's: the building pass has ended
        # Stages 0-2 keep every parameter whole (a view of the engine's replica) from here on;
        # stage 3 gathers per module (the hooks) and empties them outside.
        self._whole = self._engine.layout()["stage"] < 3
        self._param_signature = self._parameters_now()  # _check_parameters_unchanged
        _watch_registrations()
        self._param_epoch = _PARAMS_REGISTERED[0]
        if not self._whole:  # DeepSpeed's ds_* (strata.zero); _acquire / _release keep ds_status
            # Libraries that see ds_* import deepspeed to gather: they get strata.
            register_as_deepspeed(required=False)
            for gi in range(len(self._groups)):
                for p, begin, end in self._part_ranges(gi, world_size, rank):
                    _mark_partitioned(p, end - begin)
        # Stage 3's persistent groups (stage3_param_persistence_threshold, DeepSpeed's
        # ds_persist): kept gathered between steps, one reference each held by the engine, so
        # their parameters stay whole outside forward as DeepSpeed's do (_gather_whole).
        self._pinned = [not self._whole and bool(self._engine.is_persistent(gi))
                        for gi in range(len(self._groups))]
        for gi, pinned in enumerate(self._pinned):
            for _, p in self._groups[gi].params if pinned else ():
                p.ds_persist = True
        # On a GPU the host stays ahead of the device: no wait before a release that frees
        # nothing (gathers_alias_home); gradient buffers, reductions and releases ordered with
        # torch's stream on the device where the engine can (orders_caller_streams: one rank),
        # else one reduction held back with overlap_comm and one release held back.
        self._release_waits = self._cuda is not None and not self._engine.gathers_alias_home
        self._stream_ordered = self._cuda is not None and self._engine.orders_caller_streams
        if self._stream_ordered:
            self._held = _HeldBack(self._reduce_ordered, _no_wait, 0, None, self._device_waits)
        else:
            hold = self._cuda is not None and bool(
                (eff.get("zero_optimization") or {}).get("overlap_comm"))
            self._held = _HeldBack(self._engine.reduce_gradients, self._wait_torch,
                                   1 if hold else 0, _cuda_event(self._cuda) if hold else None,
                                   self._device_waits)
        # Releases that must wait for torch's kernels (their memory is freed or reused): ordered
        # on the device where the engine orders torch's stream, else one held back the same way.
        hold = self._release_waits and not self._stream_ordered
        self._held_releases = _HeldBack(
            self._engine.release, self._wait_torch, 1 if hold else 0,
            _cuda_event(self._cuda) if hold else None, self._device_waits)
        self._call_stack: list = []  # the module calls running forward, innermost last
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's
        self._no_sync = False
        self._hooked: set = set()  # ids of the modules with forward hooks
        # Classes of the modules that got an external-parameter notice: one per class, not per
        # layer (a 24-layer model reads the same way in each).
        self._noticed_classes: set = set()
        self._hooks = []
        self._install_hooks()
        self._release_all()  # stage 3: parameters are empty until gathered
        self._gather_whole()
        self.micro_steps = 0
        self._boundary_shift = 0  # micro_steps' offset of the windows after a drop (% gas)
        self._step_after_drop = False  # a drop since the last step() and no backward after it
        self._kept_by_no_sync = False  # the last backward ran inside no_sync()
        self._warned_gradless = False  # _skip_gradless_step's warning, once
        self.global_steps = 0
        self.tput_timer = ThroughputTimer(self.train_batch_size())
        # DeepSpeed's engine.timers (a script's own timers too) and, with wall_clock_breakdown,
        # the phases' timers it logs (strata.utils.timer).
        self.timers = SynchronizedWallClockTimer(use_host_timer=self._cuda is None)
        self.engine_timers = EngineTimers(enable_micro_timers=self.wall_clock_breakdown(),
                                          enable_global_timers=self.wall_clock_breakdown())
        self.engine_timers_cache = {}
        self.global_samples = 0
        self._step_applied = False  # was_step_applied()
        self._step_has_grads = False  # a backward since the last boundary step
        self._window_backwards = 0  # backwards finished since the last boundary step
        self.has_moe_layers = False  # DeepSpeed's attribute (its MoE layers are not supported)
        self._unstepped_backward = False  # one finished, and no engine.step() since
        self._in_engine_backward = False  # engine.backward runs (else: the script's own backward)
        self._torch_backward_queued = False  # _after_torch_backward waits for autograd's pass
        self._torch_backward_took = False  # a parameter gradient arrived in that pass
        # The forward outputs' hook (_output_grad_hook), holding the engine weakly: a graph (a
        # loss a script keeps) must not keep the engine alive past its close or its process.
        self._output_hook = _weak_method(self._output_grad_hook)
        self._scaled_by_script = False  # engine.scale(loss) given since the last backward
        self._warned_param_write = False  # _write_params' notice, once
        self._released_for_writes = False  # inside _many_writes: released for the block
        self._last_report: Optional[dict] = None
        self._grad_norm: Optional[torch.Tensor] = None  # get_global_grad_norm()
        self.collate_fn = None  # initialize's, deepspeed_io's default
        self.training_dataloader = None  # initialize's training_data, as DeepSpeed's
        self.optimizer = _EngineOptimizer(self, param_groups)
        self.lr_scheduler = None
        self._client_lrs = False  # lrs written by the script or its scheduler drive the engine
        # A write into param_groups under the config's scheduler: for the next applied step only
        # (DeepSpeed's scheduler object overwrites it after that step).
        self._lr_override = False
        self._betas_override = False  # the same for betas (OneCycle's cycle_momentum)
        self._known_lrs: list = []
        self._known_hyper: list = []
        self._pull_lrs()
        if lr_scheduler is not None:
            try:
                self.lr_scheduler = (lr_scheduler(self.optimizer) if callable(lr_scheduler) and
                                     not hasattr(lr_scheduler, "step") else lr_scheduler)
            except BaseException:
                self.close()  # a builder that fails leaves no engine running behind its error
                raise
            self._client_lrs = True
        elif config.get("scheduler"):
            self.lr_scheduler = _EngineScheduler(self)
        self._serial = next(_ENGINE_SERIALS)  # creation order: the same on every rank
        _LIVE_ENGINES.add(self)

    def _init_weights(self) -> None:
        parts = [[getattr(p, "_strata_part", None) for _, p in g.params] for g in self._groups]

        flat = {}  # the parameter being sent, flat (copied once where it is not contiguous)

        def module_values(gi, pi, begin, end):
            if (gi, pi) not in flat:
                flat.clear()
                p = self._groups[gi].params[pi][1].detach()
                flat[(gi, pi)] = (p if p.is_contiguous() else p.contiguous()).reshape(-1)
            return flat[(gi, pi)][begin:end].to("cpu", torch.float32).numpy()

        if not any(x is not None for gp in parts for x in gp):
            # As DeepSpeed, which broadcasts rank 0's module weights at initialize: rank 0's are
            # the weights, scattered by the engine. Each range is converted to fp32 on the host
            # when the engine sends it, never the whole model at once (4 bytes per parameter
            # beside the engine's own host state, where ZeRO-Offload runs out of memory first).
            self._engine.init_from_rank0_fill(module_values)
            flat.clear()
            return
        # strata.zero.Init kept only this rank's range of each group: the engine asks for exactly
        # the ranges it stores (stage 3), which are those. A module split by optimizer groups
        # (weights and biases in two param_groups) is two engine groups whose ranges differ from
        # zero.Init's: its parameters are gathered whole first (one at a time, collective; the
        # split is the same on every rank).
        self._gather_split_parts(parts)
        self._broadcast_whole(parts)
        for gi, g in enumerate(self._groups):
            if all(x is None for x in parts[gi]):
                continue  # built outside zero.Init: whole
            ids = tuple(id(p) for _, p in g.params)
            for (name, _), part in zip(g.params, parts[gi]):
                if part is None or part.group_ids != ids:
                    raise ValueError(
                        f"strata.zero.Init: parameter {name} was partitioned in another group "
                        "than the engine's (each module's own parameters, in registration order); "
                        "do not move parameters between modules after construction")

        def fill(gi, pi, begin, end):
            part = parts[gi][pi]
            if part is None:
                return module_values(gi, pi, begin, end)
            if begin < part.begin or end > part.end:
                raise ValueError(
                    f"strata.zero.Init: {self._groups[gi].params[pi][0]}[{begin}:{end}] is not in "
                    f"this rank's partition [{part.begin}:{part.end}] (zero.Init needs stage 3 and "
                    "the world size the engine runs with)")
            return part.shard[begin - part.begin:end - part.begin].numpy()

        self._engine.init_from_fill(fill)
        for gi, g in enumerate(self._groups):
            for (_, p), part in zip(g.params, parts[gi]):
                if part is not None:
                    del p._strata_part

    def _broadcast_whole(self, parts: list) -> None:
        """Beside zero.Init's partitions, the parameters built outside it (a head replaced after
        it, a PEFT adapter, resize_token_embeddings' new embedding) take rank 0's values, as
        DeepSpeed broadcasts them before partitioning: each rank fills its own ranges from its
        copy, which may differ (a seed per rank). One parameter at a time, collective."""
        from .zero import _broadcast
        world = self._engine.world_size
        if world == 1:
            return
        for gi, g in enumerate(self._groups):
            for (_, p), part in zip(g.params, parts[gi]):
                if part is None:
                    with torch.no_grad():
                        got = _broadcast(p.detach(), 0, world, "strata.initialize of a model "
                                         "partly built under strata.zero.Init")
                        if got.data_ptr() != p.data_ptr():
                            p.copy_(got.view(p.shape))

    def _gather_split_parts(self, parts: list) -> None:
        """zero.Init parts of groups that optimizer groups split or leaf modules merged, made
        whole (parts[gi][pi] None)."""
        from .zero import _gather_parts
        split = [(gi, pi) for gi, g in enumerate(self._groups)
                 for pi, (_, p) in enumerate(g.params)
                 if parts[gi][pi] is not None and self._optimizer_split(gi, parts[gi][pi])]
        for gi, pi in split:
            p = self._groups[gi].params[pi][1]
            (full,) = _gather_parts([p], self._engine.rank, self._engine.world_size)
            p.data = full.view(_full_shape(p))
            del p._strata_part
            parts[gi][pi] = None

    def _optimizer_split(self, gi: int, part) -> bool:
        """Whether zero.Init partitioned group gi's parameter in another group than the engine's:
        one that optimizer groups split (the engine's is a strict subset of the partition's), or
        one that a ZeRO-3 leaf module merged with others (a strict superset)."""
        ids = {id(p) for _, p in self._groups[gi].params}
        return ids != set(part.group_ids)

    def _install_hooks(self) -> None:
        for g in self._groups:
            if not g.trainable:
                continue  # frozen: no gradient
            for _, p in g.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    _weak_method(self._grad_hook) if self.world_size == 1 else self._grad_hook))
        if self._whole:
            return  # stages 0-2: parameters stay whole, nothing to gather per module
        for mname, module, owner in _module_owners(self.module):
            if owner != mname:
                continue  # inside a ZeRO-3 leaf: the leaf's hooks gather its whole subtree
            if (module is self.module or z3_leaf_module(module)
                    or module.__dict__.get("_strata_external")
                    or next(module.parameters(recurse=False), None) is not None):
                self._hook_module(module)

    def _hook_module(self, module: torch.nn.Module) -> None:
        """Stage 3: forward hooks on `module` (once), and its parameters watched: one read while
        released inside this engine's forward is gathered (_ParamDict)."""
        if self._whole or id(module) in self._hooked:
            return
        self._hooked.add(id(module))
        own = tuple(sorted({self._group_of[id(p)]
                            for p in module.parameters(recurse=z3_leaf_module(module))
                            if id(p) in self._group_of}))
        if own and type(module._parameters) is dict:
            module.__dict__["_parameters"] = _ParamDict(self, module._parameters)
        # Under torch.compile the hooks run eagerly, between graphs (as DeepSpeed's ZeRO-3 hooks):
        # traced, their bookkeeping would be guarded on and recompiled at every call.
        self._hooks.append(module.register_forward_pre_hook(
            torch.compiler.disable(self._make_pre_hook(own)), prepend=True, with_kwargs=True))
        self._hooks.append(module.register_forward_hook(
            torch.compiler.disable(self._post_hook), with_kwargs=True, always_call=True))

    def _make_pre_hook(self, own):
        def pre_hook(module, args, kwargs):
            if module is self.module and self._call_stack:
                # A root call opens a forward: calls still open are a raising forward's whose
                # post-hooks torch skipped (a KeyboardInterrupt in engine.module(...) or
                # generate(), where engine.forward does not see it).
                self._unwind_calls(0)
            call = _ModuleCall(self, self._call_groups(module, own))
            module.__dict__.setdefault("_strata_calls", []).append(call)
            self._acquire(call.groups)  # a failure reaches the post-hook (always_call) too
            call.acquired = True
            call.versions = [(p, p._version) for gi in call.groups
                             for _, p in self._groups[gi].params]
            self._call_stack.append((module, call))
            if torch.is_grad_enabled():
                name = self._module_names.get(id(module), type(module).__name__)
                call.saved_hooks = self._push_saved_tensor_hooks(f"module '{name}'")
                (args, kwargs), _ = _through(_ReleaseAfterBackward, call, (args, kwargs))
            return args, kwargs
        return pre_hook

    def _call_groups(self, module, own) -> list:
        """The groups a call of `module` gathers: its own and its external parameters'."""
        ext = module.__dict__.get("_strata_external")
        if not ext:
            return list(own)
        return sorted(set(own) | {self._group_of[i] for i in ext if i in self._group_of})

    def _post_hook(self, module, args, kwargs, output):
        calls = module.__dict__.get("_strata_calls")
        if not calls:
            return output  # hooked during this call (_gather_external): its pre-hook did not run
        call = calls.pop()
        if not call.acquired:
            return output  # the pre-hook's gather failed: its error is the one raised
        if self._call_stack and self._call_stack[-1][1] is call:
            self._call_stack.pop()
        if call.saved_hooks is not None:
            call.saved_hooks.__exit__(None, None, None)
        if self._call_stack:
            self._adopt_returned_params(output)
        self._check_forward_writes(module, call)
        self._release(call.groups)
        if torch.is_grad_enabled():
            output, _ = _through(_GatherForBackward, call, output)
        return output

    def _check_forward_writes(self, module, call: _ModuleCall) -> None:
        """Stage 3: warns (once per engine) where a module's forward wrote one of its gathered
        parameters in place (nn.Embedding(max_norm=...)'s renormalisation): the engine's
        parameters come from the fp32 masters, so the write is lost, as in DeepSpeed's ZeRO-3
        (stages 0-2: _check_param_writes)."""
        if self._warned_inplace:
            return
        written = [self._param_name(p) for p, v in call.versions if p._version != v]
        if not written:
            return
        self._warned_inplace = True
        name = self._module_names.get(id(module), type(module).__name__)
        warnings.warn(
            f"strata: parameter(s) {_name_list(written, 3)} were modified in place by the "
            f"forward of module '{name}' (a no_grad in-place op, nn.Embedding(max_norm=...)'s "
            "renormalisation); at ZeRO stage 3, as in DeepSpeed's, the engine's parameters "
            "come from its fp32 master weights, so the change is lost. Keep parameters unwritten "
            "in forward (nn.Embedding without max_norm, renormalising in the loss instead), or "
            "write them inside strata.zero.GatheredParameters(params, modifier_rank=0)",
            stacklevel=3)

    # -- external parameters (stage 3; strata.zero.register_external_parameter) --------------
    def _gather_external(self, p: torch.nn.Parameter, what: str, stacklevel: int = 3) -> None:
        """p is read (or returned) inside the forward of a module that does not own it: gathered
        for the running call (whose backward gathers it again with the call's groups) and
        registered as an external parameter of that module, with a notice for the first such
        parameter of the module (PEFT's LoRA layers read each adapter's weight.dtype in a parent
        with no parameters of its own: one notice, not one per adapter)."""
        running, _ = self._call_stack[-1]
        self._hold_in_running_call(p)
        # Registered on the innermost module whose forward reads it, which strata may not hook
        # (a layer without parameters of its own, as DeepSpeed hooks every module): registered
        # on `running`, an ancestor, it would be gathered through the whole of that forward.
        module = self._reading_module(running, p) if what == "is read" else running
        if module is not running:
            self._hook_module(module)  # its later calls gather it; this call holds it as above
        external = module.__dict__.setdefault("_strata_external", {})
        if id(p) not in external:
            external[id(p)] = p
            noticed = module.__dict__.get("_strata_noticed") or \
                type(module) in self._noticed_classes
            module.__dict__["_strata_noticed"] = True
            if noticed:
                return
            self._noticed_classes.add(type(module))
            mname = self._module_names.get(id(module), type(module).__name__)
            pname = self._param_name(p)
            warnings.warn(
                f"strata: parameter '{pname}' {what} in the forward of module '{mname}', which "
                f"does not own it: gathered there and registered as an external parameter of "
                f"'{mname}' (strata.zero.register_external_parameter(module, param) does it "
                "ahead and silences this; other parameters read the same way there or in the "
                f"other modules of class {type(module).__name__} are registered without another "
                "notice)", stacklevel=stacklevel)

    def _hold_in_running_call(self, p: torch.nn.Parameter) -> None:
        """p's group gathered and held by the hooked module call in progress, with the call's own
        groups, until its end, and gathered again for its backward. Nothing outside the engine's
        forward, or where the call holds it already."""
        if self._whole or not self._call_stack or id(p) not in self._group_of:
            return
        call = self._call_stack[-1][1]
        gi = self._group_of[id(p)]
        if gi not in call.groups:
            call.groups.append(gi)
            self._acquire((gi,))

    def _reading_module(self, running: torch.nn.Module, p) -> torch.nn.Module:
        """The innermost module of this engine's model whose forward is on the Python stack
        below `running`'s (the hooked call in progress) and reads `p` without owning it (its
        ZeRO-3 leaf where it is inside one), else `running`."""
        frame = sys._getframe(2)
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is running:
                break
            if (isinstance(obj, torch.nn.Module) and id(obj) in self._module_names
                    and frame.f_code is _forward_code(type(obj))):
                if any(q is p for q in obj._parameters.values()):
                    break  # its own forward called directly (hooks bypassed): not a reader
                return self._leaf_of.get(id(obj), obj)
            frame = frame.f_back
        return running

    def _adopt_returned_params(self, output) -> None:
        """A parameter a module's forward returns (as DeepSpeed), or a view of one (a slice of a
        positional table, w.t(): a tensor over the gathered memory), stays gathered for the
        caller: released here, the next gather would reuse the memory under the caller."""
        if isinstance(output, dict):
            output = tuple(output.values())  # also transformers' ModelOutput
        held = self._call_stack[-1][1].groups  # the caller's call holds these already
        for t in (output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.nn.Parameter) and id(t) in self._group_of:
                if self._group_of[id(t)] not in held:
                    self._gather_external(t, "is returned by a submodule")
                continue
            hit = self._param_memory(t)
            if hit is not None and hit[0] not in held:
                p = self._groups[hit[0]].params[hit[1]][1]
                self._gather_external(p, "is returned by a submodule (a view of it)")

    def _param_name(self, p) -> str:
        return self._groups[self._group_of[id(p)]].params[self._index_in_group[id(p)]][0]

    # -- tensors saved for backward (module docstring) ---------------------------------------
    def _push_saved_tensor_hooks(self, where: str):
        """Pushes a pack/unpack pair for a module call or a gathered_parameters block (`where`
        names it in errors). The hooks below are kept as `outer` (ours from an enclosing call of
        this engine are skipped: its pair would do the same work)."""
        outer = _top_saved_tensors_hooks()
        if outer is not None and getattr(outer[0], "_strata_engine", None) is self:
            outer = outer[0]._strata_outer
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t):
            hit = self._param_memory(t)
            # A parameter reaches an outer hook as a detached alias: the hook may keep the tensor
            # it is given (checkpoint's recomputation keeps a frozen one as it is) past the
            # release that empties the parameter itself (p.data), and then see it empty.
            packed = (outer_pack(t.detach() if hit is not None else t)
                      if outer_pack is not None else None)
            if hit is not None:
                return _SavedParam(self, hit[0], hit[1], where, t, hit[2], packed)
            if isinstance(t, torch.nn.Parameter) and hasattr(t, "ds_status"):
                return _SavedPartitioned(t, packed)
            return packed if outer_pack is not None else _SavedTensor(t)

        def unpack(x):
            if isinstance(x, (_SavedParam, _SavedTensor, _SavedPartitioned)):
                return x.unpack()
            return outer_unpack(x)

        pack._strata_engine = self
        pack._strata_outer = outer
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        return hooks

    def _param_memory(self, t):
        """(group, index, byte offset) when t shares a gathered parameter's memory, else None."""
        if not self._gathered_at or not isinstance(t, torch.Tensor) or t.is_sparse:
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # no plain storage (nested, functorch or fake tensors)
        hit = self._gathered_at.get(storage.data_ptr())
        if hit is None:
            return None
        gi, pi = hit
        base = self._groups[gi].params[pi][1].data
        offset = t.storage_offset() * t.element_size() - base.storage_offset() * base.element_size()
        return gi, pi, offset

    def _rebuild_saved_param(self, s: _SavedParam) -> torch.Tensor:
        name, p = self._groups[s.gi].params[s.pi]
        if p._version != s.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: parameter '{name}' is at version {p._version}; expected "
                f"version {s.version} instead (strata: engine.step() or an in-place write "
                f"changed it after the forward of {s.module} saved it; run the backward before "
                "the step)")
        base = p.data
        if (self._refs[s.gi] <= 0 or base.numel() != p.ds_numel) and not p.requires_grad:
            with GatheredParameters([p]):  # frozen: its values, gathered for the purpose
                base = p.data.clone()
        elif self._refs[s.gi] <= 0 or base.numel() != p.ds_numel:
            raise RuntimeError(
                f"strata: the backward of {s.module} reads parameter '{name}' (group "
                f"'{self._groups[s.gi].name}'), which is not gathered at that point: strata "
                "gathers a module's parameters for backward when a gradient reaches one of its "
                "outputs (tensors, or tuples, lists or dicts of them), and releases them when "
                "engine.gathered_parameters() ends. Return a module's outputs as tensors, or run "
                "backward inside the gathered_parameters() block")
        with torch.no_grad():
            view = torch.empty(0, dtype=s.dtype, device=base.device)
            first = base.storage_offset() * base.element_size() + s.byte_offset
            view.set_(base.untyped_storage(), first // view.element_size(), s.size, s.stride)
        return view

    # -- parameters --------------------------------------------------------------------------
    def _acquire(self, groups) -> None:
        for gi in groups:
            if self._refs[gi] == 0:
                self._held_releases.take(gi)  # released but held back: released now
            if self._refs[gi] == 0 and not self._engine.is_gathered(gi):
                views = self._engine.gather(gi)
                for pi, ((_, p), v) in enumerate(zip(self._groups[gi].params, views)):
                    p.data = _as_tensor(v)
                    self._engine_views[id(p)] = p.data
                    if not self._whole:
                        p.ds_status = _AVAILABLE
                    if p.data.numel():
                        self._gathered_at[p.data.untyped_storage().data_ptr()] = (gi, pi)
            self._refs[gi] += 1

    def _release(self, groups) -> None:
        for gi in groups:
            self._refs[gi] -= 1
            if self._refs[gi] <= 0:
                self._release_group(gi)

    def _release_group(self, gi: int, waited: bool = False) -> None:
        self._refs[gi] = 0
        empty = torch.empty(0, dtype=self._dtype, device=self.device)
        for _, p in self._groups[gi].params:
            view = self._engine_views.pop(id(p), None)
            if view is not None and view.numel():
                self._gathered_at.pop(view.untyped_storage().data_ptr(), None)
            p.data = empty
            if not self._whole:
                p.ds_status = _NOT_AVAILABLE
        if self._engine.is_gathered(gi):
            if not self._release_waits or waited:
                self._engine.release(gi)
            elif self._stream_ordered:
                self._engine.release(gi, self._caller_stream())  # after them, on the device
            else:
                self._held_releases.add(gi)  # after the kernels that read the group have run

    def _release_groups(self, groups) -> None:
        """Releases every group listed, after one wait for torch's stream: what follows (a step,
        Save, Load, InitParameters) may rewrite the parameters even where release frees
        nothing. A closed engine refuses before a parameter is touched (close() left them
        holding their weights)."""
        if self._closed:
            raise _strata.StrataError("FailedPrecondition: the engine was closed")
        if self._whole:
            self._adopt_assigned_data()
        self._wait_torch()
        self._held_releases.drain()  # their events are complete now
        for gi in groups:
            self._release_group(gi, waited=True)

    def _adopt_assigned_data(self) -> None:
        """Stages 0-2: a parameter whose .data the script replaced (`p.data = t`, the idiom that
        copies a policy's weights into a reference or EMA model; module.to() and .half() do the
        same) holds values the engine's copy does not, and its release would drop them. They are
        copied into the engine's copy and the parameter aliases it again: a frozen parameter
        keeps them, as under DeepSpeed; a trainable one until the next step, which works from the
        fp32 masters (noticed once, as an in-place write is)."""
        trainable = []
        with torch.no_grad():
            for g in self._groups:
                for name, p in g.params:
                    view = self._engine_views.get(id(p))
                    data = p.data
                    if view is None or (data.data_ptr() == view.data_ptr()
                                        and data.shape == view.shape
                                        and data.stride() == view.stride()):
                        continue  # its own (a 0-element parameter has no copy to replace)
                    if data.shape != view.shape:
                        raise RuntimeError(
                            f"parameter {name}: its .data was replaced by a tensor of shape "
                            f"{tuple(data.shape)}, the parameter's is {tuple(view.shape)}; "
                            "resize before strata.initialize")
                    # A view of the same memory (p.data = p.data.t()) overlaps it: copied first.
                    same = data.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
                    view.copy_(data.clone() if same else data)
                    p.data = view
                    if p.requires_grad:
                        trainable.append(name)
        if trainable and not self._warned_assigned:
            self._warned_assigned = True
            warnings.warn(
                f"strata: the .data of trainable parameter(s) {_name_list(trainable, 3)} was "
                "replaced (p.data = ...); the engine's copy takes the values, and the next step "
                "works from the fp32 master weights (as DeepSpeed's ZeRO and bf16/fp16 "
                "optimizers), so they last until then. Set trainable weights with "
                "engine.load_checkpoint, or inside strata.zero.GatheredParameters(params, "
                "modifier_rank=0) before the first step", stacklevel=4)

    def _wait_torch(self) -> None:
        """On a GPU: the work torch queued on its current stream has run. Every engine call
        returns with its own device work complete (python/src/engine_binding.cc), so this is the
        one ordering the adapter adds: before the engine reads a gradient buffer, frees a gathered
        group or updates parameters in place. Work on other streams is ordered onto the current
        one by the script, as torch requires (torch.cuda.current_stream().wait_stream(s)). On the
        hot path it is an event a group back instead (_HeldBack), or nothing where a release
        frees nothing (gathers_alias_home)."""
        if self._cuda is not None:
            self._device_waits.wait(torch.cuda.current_stream(self._cuda).synchronize)

    def _release_all(self) -> None:
        self._forget_held_calls()
        self._release_groups(range(len(self._groups)))

    def _forget_held_calls(self) -> list:
        """The module calls backward holds gathered, no longer held (their groups are released
        by the caller), and the create_graph hold ended. Returns them."""
        calls = list(self._held_calls)
        for call in calls:
            call.held = False
        self._held_calls.clear()
        self._graph_built_in_backward = self._graph_hold_armed = False
        return calls

    def _gather_whole(self) -> None:
        """Stages 0-2: every group gathered, for good (the views alias the engine's replica);
        stage 3: the persistent groups (_pinned), until the next call that releases all. Step,
        Save, Load and InitParameters need every group released (the engine refuses otherwise:
        "gathered group(s) not released"), so those calls release first and this gathers again
        after them (collective at stage 3: every rank in the same order)."""
        self._acquire(tuple(gi for gi in range(len(self._groups))
                            if (self._whole or self._pinned[gi]) and self._refs[gi] == 0))
        self._param_versions = [p._version for _, p in self._trainable]

    @contextlib.contextmanager
    def _whole_after(self):
        """The block (a Step, Save, Load or write that needs every group released), then
        _gather_whole. Where the block raised, its error is the one raised: the gather after it
        would fail too where that error failed the engine, which then refuses every call."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self._gather_whole()
            raise
        self._gather_whole()

    def _after_applied_step(self) -> None:
        """The engine rewrote the trainable parameters in its own memory, which torch does not
        see: their version counters advance, as an optimizer's in-place update advances them, so
        a backward through a graph saved before the step fails as in torch instead of reading
        the new weights."""
        for _, p in self._trainable:
            torch.autograd.graph.increment_version(p)

    def _check_param_writes(self, before: str) -> None:
        """Warns (once per engine) where a trainable parameter was written in place since the
        engine last wrote the parameters (torch's version counter: a no_grad in-place op,
        load_state_dict, nn.Embedding(max_norm=...)'s renormalisation, at stage 3 a write into a
        persistent parameter, whole between steps, or into an empty one; not writes through
        .data): `before` (the step, a save) works from the fp32 masters, which do not have it."""
        if self._param_versions is None or self._warned_inplace:
            return
        written = [n for (n, p), v in zip(self._trainable, self._param_versions)
                   if p._version != v]
        if not written:
            return
        self._warned_inplace = True
        warnings.warn(
            f"strata: trainable parameter(s) {_name_list(written, 3)} "
            "were modified in place since the engine last set them (a no_grad in-place op, "
            "module.load_state_dict, nn.Embedding(max_norm=...)); strata, as DeepSpeed's ZeRO "
            "and bf16/fp16 optimizers, keeps fp32 master weights, and " + before + " works from "
            "them, so the change is lost. Set weights with engine.load_checkpoint, or inside "
            "strata.zero.GatheredParameters(params, modifier_rank=0) before the first step",
            stacklevel=3)

    def _gathered_by_calls(self) -> bool:
        """Stage 3: a group gathered beyond the engine's own pins (a forward, a
        gathered_parameters block)."""
        return any(r > int(pin) for r, pin in zip(self._refs, self._pinned))

    @contextlib.contextmanager
    def gathered_parameters(self, groups: Optional[Iterable[int]] = None):
        """The full parameters (working dtype) of `groups` (default: all) inside the block."""
        if self._whole:  # stages 0-2: already whole, and they stay so
            yield
            return
        groups = tuple(range(len(self._groups)) if groups is None else groups)
        self._acquire(groups)
        hooks = None
        try:
            if torch.is_grad_enabled():  # what autograd saves in the block follows the gather
                hooks = self._push_saved_tensor_hooks("an engine.gathered_parameters() block")
            yield
        finally:
            if hooks is not None:
                hooks.__exit__(None, None, None)
            self._release(groups)

    def _param_views(self, gi: int, kind: str = "master32"):
        """(name, parameter, its whole values as fp32 in `kind`) for group gi's parameters: the
        engine's state read whole (collective, Engine::ReadOptimizerState), split by parameter."""
        flat = torch.from_numpy(self._engine.read_state(gi, kind))
        off = 0
        for name, p in self._groups[gi].params:
            shape = _full_shape(p)
            n = int(torch.Size(shape).numel())
            yield name, p, flat[off:off + n].view(shape)
            off += n

    def read_master(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master weights by qualified name (collective)."""
        return {name: v.clone() for gi in range(len(self._groups))
                for name, _, v in self._param_views(gi)}

    def _part_ranges(self, gi: int, world: int, rank: int):
        """(parameter, begin, end) for group gi's parameters: the rank's elements [begin, end) of
        each at stage 3 (zero._owned_parts)."""
        params = self._groups[gi].params
        numels = [int(torch.Size(_full_shape(p)).numel()) for _, p in params]
        for (_, p), (begin, end) in zip(params, _owned_parts(numels, world, rank)):
            yield p, begin, end

    def _part_range(self, param: torch.nn.Parameter) -> tuple:
        """This rank's [begin, end) of the parameter's elements at stage 3."""
        gi = self._group_of[id(param)]
        for p, begin, end in self._part_ranges(gi, self.world_size, self.global_rank):
            if p is param:
                return begin, end
        raise AssertionError("a parameter of the group is missing from it")

    def read_param_state(self, param: torch.nn.Parameter, kind: str = "master32"):
        """One parameter's optimizer state whole, fp32 in its shape: kind "master32" (the master
        weights; a frozen parameter's own values), "exp_avg" or "exp_avg_sq" (None for a frozen
        parameter, which has no moments), or "grad": the gradient accumulated since the last
        step, reduced over the ranks (Engine::ReadOptimizerState: averaged over ranks and
        micro-steps, not clipped, with fp16 still loss-scaled), None for a frozen parameter or
        before a backward since the last step. Collective: every rank calls it for the same
        parameter, as DeepSpeed's safe_get_full_* (strata.utils)."""
        gi = self._group_of.get(id(param))
        if gi is None:
            raise ValueError("read_param_state: the parameter is not one of this engine's")
        if kind != "master32" and not self._groups[gi].trainable:
            return None
        if kind == "grad" and not self._step_has_grads:
            return None
        with _named_collective("read_param_state (strata.utils.safe_get_*)"):
            for _, p, v in self._param_views(gi, kind):
                if p is param:
                    return v.clone()
        raise AssertionError("a parameter of the group is missing from it")

    def write_param_state(self, param: torch.nn.Parameter, value, kind: str = "master32",
                          part: bool = False) -> None:
        """Sets one trainable parameter's optimizer state from `value`, every other value kept:
        kind "master32" (the fp32 master weights; the working parameter is rounded from them at
        once, where DeepSpeed leaves it to the next step), "exp_avg" or "exp_avg_sq". `value`:
        the parameter whole (its numel values, any shape, any float dtype), or with part=True
        this rank's ZeRO-3 part of it (1-D). Engine::WriteOptimizerState; collective: every
        rank calls it for the same parameter (with the same value where whole), as DeepSpeed's
        safe_set_full_* (strata.utils)."""
        gi = self._group_of.get(id(param))
        if gi is None:
            raise ValueError("write_param_state: the parameter is not one of this engine's")
        if kind not in ("master32", "exp_avg", "exp_avg_sq"):
            raise ValueError(f"write_param_state: kind {kind!r} cannot be written (master32, "
                             "exp_avg, exp_avg_sq)")
        if not self._whole and self._gathered_by_calls():
            raise RuntimeError("write_param_state: parameters are gathered (a forward, or a "
                               "gathered_parameters / GatheredParameters block, is running); "
                               "set optimizer state outside them")
        begin, end = self._part_range(param) if part else (0, param.ds_numel)
        flat = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(-1)
        if flat.numel() != end - begin:
            raise ValueError(
                f"write_param_state: {flat.numel()} values given for "
                f"'{self._param_name(param)}', which has {end - begin}" +
                (f" in this rank (elements [{begin}:{end}] of the flat parameter: strata "
                 "partitions each module's parameters together, so ranks' parts differ in size, "
                 "unlike DeepSpeed's ceil(numel / world) each; safe_get_local_* returns this "
                 "rank's part)" if part else ""))

        def fill(g, p, b, e):
            if b < begin or e > end:
                raise ValueError(f"write_param_state: [{b}:{e}] of '{self._param_name(param)}' "
                                 f"is outside this rank's part [{begin}:{end}]")
            return flat[b - begin:e - begin].numpy()

        with (contextlib.nullcontext() if self._released_for_writes else
              self._many_writes("write_param_state (strata.utils.safe_set_*)")):
            self._engine.write_state(gi, self._index_in_group[id(param)], kind, fill)

    @contextlib.contextmanager
    def _many_writes(self, what: str):
        """The groups released for the block (WriteOptimizerState rewrites the params: nothing
        may be gathered) and gathered again after it: write_param_state calls inside it (a load
        writing every parameter's states) release and gather once for all of them."""
        self._release_all()
        with self._whole_after(), _named_collective(what):
            self._released_for_writes = True
            try:
                yield
            finally:
                self._released_for_writes = False

    def _write_master(self, values: dict[int, torch.Tensor]) -> None:
        """Replaces the weights of the parameters in `values` (id(p) -> full fp32 tensor), every
        other one kept (collective; the engine allows it before its first step only)."""
        masters = {gi: self._engine.read_master(gi) for gi in range(len(self._groups))}
        offsets = []
        for gi, g in enumerate(self._groups):
            off, row = 0, []
            for _, p in g.params:
                row.append(off)
                off += int(torch.Size(_full_shape(p)).numel())
            offsets.append(row)

        def fill(gi, pi, begin, end):
            p = self._groups[gi].params[pi][1]
            v = values.get(id(p))
            o = offsets[gi][pi]
            kept = masters[gi][o + begin:o + end]
            if v is None:
                return kept
            written = v.reshape(-1)[begin:end].to("cpu", torch.float32)
            if self._dtype == torch.float32:
                return written.numpy()
            # The block hands back every member of its groups from the 16-bit working copy: an
            # element still equal to its master's rounding keeps the fp32 master, unrounded.
            master = torch.from_numpy(kept)
            return torch.where(written == master.to(self._dtype).float(), master,
                               written).numpy()

        with self._pinned_values_kept({self._group_of[pid] for pid in values}):
            with self._released_for_rewrite():  # InitParameters rewrites the params
                self._engine.init_from_fill(fill)

    def _write_params(self, values: dict[int, torch.Tensor], warn: bool = True) -> None:
        """GatheredParameters(modifier_rank=...) after the engine's first step, as DeepSpeed: the
        working parameters of the groups in `values` (id(p) -> full fp32 tensor, every member of
        each group) are written, the fp32 masters kept, so the next step recomputes them
        (collective). Warns once per engine (warn=False: frozen groups, which keep them)."""
        groups = sorted({self._group_of[pid] for pid in values})
        if warn and not self._warned_param_write:
            self._warned_param_write = True
            warnings.warn(
                "strata: GatheredParameters(modifier_rank=...) after the engine's first step "
                "writes the working parameters only, as DeepSpeed does: a trainable parameter's "
                "fp32 master keeps its value and the next step recomputes the parameter from it "
                "(a change written to be saved, such as a LoRA adapter fused into its frozen "
                "base weights before the model is saved, stands until then; frozen parameters "
                "keep what was written)", stacklevel=4)

        def fill(gi, pi, begin, end):
            return values[id(self._groups[gi].params[pi][1])].reshape(-1)[begin:end].to(
                "cpu", torch.float32).numpy()

        with self._pinned_values_kept(set(groups)):
            with self._released_for_rewrite():  # WriteParams rewrites the params
                self._engine.write_params(groups, fill)

    @contextlib.contextmanager
    def _released_for_rewrite(self):
        """Every group released for the block (the engine rewrites the parameters only with
        nothing gathered), then gathered again as before it: the persistent ones, and those an
        enclosing GatheredParameters block holds, with their holds (an inner block's
        modifier_rank write inside an outer block leaves the outer one's parameters whole)."""
        held = {gi: refs for gi, refs in enumerate(self._refs) if refs > 0}
        self._release_all()
        with self._whole_after():
            yield
        for gi, refs in held.items():
            if self._refs[gi] == 0:
                self._acquire((gi,))
            self._refs[gi] = refs

    @contextlib.contextmanager
    def _pinned_values_kept(self, written: set):
        """Stage 3, around a release and re-gather of every group: the persistent groups' values
        as the script left them (those in `written` apart). They are whole between steps, as
        DeepSpeed's persistent parameters, and a write into their .data stands until the next
        step, as there: DeepSpeed-Chat fuses a small layer's LoRA in place, then a large one's
        in a GatheredParameters(modifier_rank=0) block. With several ranks the re-gather is a
        fresh copy from the engine, which had dropped the in-place write."""
        kept = []
        if not self._whole:
            for gi, pinned in enumerate(self._pinned):
                if pinned and gi not in written and self._engine.is_gathered(gi):
                    kept += [(p, p.data.clone()) for _, p in self._groups[gi].params]
        yield
        with torch.no_grad():
            for p, data in kept:
                if p.data.shape == data.shape:
                    p.data.copy_(data)

    # -- gradients -----------------------------------------------------------------------------
    def _grad_hook(self, p: torch.nn.Parameter) -> None:
        if not self._in_engine_backward and not self._torch_backward_took:
            self._begin_torch_backward()
        if self._no_sync:
            return  # kept in p.grad: autograd adds the next backward's to it
        gi = self._group_of[id(p)]
        if self._reduced[gi] or self._grads_missing[gi] == 0:
            raise RuntimeError(
                f"strata: a second gradient for group '{self._groups[gi].name}' in one "
                "micro-step: its parameters got gradients from two autograd passes, as with a "
                "second backward before engine.step() (call engine.step() after each backward, "
                "or use gradient_accumulation_steps), or reentrant activation checkpoints "
                "(use_reentrant=True, DeepSpeed's checkpointing.checkpoint) whose parameters are "
                "also used outside them or in a second one (a block applied twice): use "
                "use_reentrant=False, whose gradients come in one pass. DeepSpeed's ZeRO "
                "stage 2 (and 1 with overlap_comm) refuses this too, 'Gradient computed twice'")
        if self._in_turn(gi):  # else kept in p.grad until its turn
            views = self._grad_views.get(gi)
            if views is None:
                views = self._grad_buffer(gi)
                self._grad_views[gi] = views
            self._copy_grad(gi, views[self._index_in_group[id(p)]], p.grad)
            p.grad = None
        self._grads_missing[gi] -= 1
        if self._grads_missing[gi] == 0:
            self._group_complete(gi)

    def _in_turn(self, gi: int) -> bool:
        """Whether group gi's gradients go into its buffer now. With several ranks the groups
        are reduced in one order on every rank (their reductions pair up by order: a group one
        rank did not use this micro-step, reduced as the others complete, would be paired with
        another group's); a group complete before its turn keeps its gradients in p.grad until
        then, as DDP's buckets wait for the ones before them."""
        return not self._ordered or (self._turn < len(self._reduce_order) and
                                     self._reduce_order[self._turn] == gi)

    def _group_complete(self, gi: int) -> None:
        """Every parameter of group gi has its gradient: reduce it, and each group after it in
        the order that was waiting for its turn."""
        if self._completed is not None:
            self._completed.append(gi)
        if not self._ordered:
            self._reduce(gi)
            return
        order = self._reduce_order
        while self._turn < len(order) and self._grads_missing[order[self._turn]] == 0:
            self._take_kept_grads(order[self._turn])
            self._reduce(order[self._turn])
            self._turn += 1

    def _begin_torch_backward(self) -> None:
        """The script's own `loss.backward()` (DeepSpeed's torch-style backward): what
        engine.backward does after autograd runs once autograd's pass ends (a callback queued on
        its engine, as DeepSpeed's and FSDP's post-backward). Its gradients are averaged over
        micro-steps and ranks as engine.backward's. A loss scale (fp16) must have been applied
        by engine.scale(loss): refused before any gradient is taken otherwise."""
        scale = self._engine.backward_scale
        if scale != 1.0 and not self._scaled_by_script:
            raise RuntimeError(
                f"strata: loss.backward() was called directly while fp16 training scales the "
                f"loss (by {scale:g} now); call engine.backward(loss), or "
                "engine.scale(loss).backward()")
        self._check_loaded("backward")
        self._check_requires_grad()
        self._check_window_open()
        self._torch_backward_took = True
        self._queue_torch_backward_end()

    def _queue_torch_backward_end(self) -> None:
        """_after_torch_backward once at the end of this autograd pass: queued by a forward
        output's gradient in the outermost pass (a reentrant checkpoint's recomputation runs
        its own pass inside it), else by the first parameter gradient. A pass that fails never
        calls back; the next forward clears the flags."""
        if not self._torch_backward_queued:
            self._torch_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_torch_backward)

    def _after_torch_backward(self) -> None:
        self._torch_backward_queued = False
        self._end_graph_hold()
        if not self._torch_backward_took:
            return  # no parameter gradient: torch.autograd.grad through an output, say
        self._torch_backward_took = False
        self._scaled_by_script = False
        self._flush()
        self._backward_done()

    def _end_graph_hold(self) -> None:
        """At the end of an autograd pass through this engine's outputs: a pass that built a
        graph in backward (_graph_built_in_backward) arms the hold; the end of the next such pass,
        which read what that graph kept, releases what it held (so does the flush, and the step),
        also where no parameter gradient arrives (a frozen network inside a penalty)."""
        if not self._graph_built_in_backward:
            return
        if not self._graph_hold_armed:
            self._graph_hold_armed = True
            return
        for call in self._forget_held_calls():
            self._release(call.groups)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """As DeepSpeed's: the loss times the loss scale (fp16; 1 otherwise), for a script that
        calls `engine.scale(loss).backward()` itself instead of engine.backward(loss)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale: the loss must be a scalar tensor with a grad_fn")
        self._scaled_by_script = True
        scale = self._engine.backward_scale  # fp16: the loss scale / gradient_accumulation_steps
        return loss * scale if scale != 1.0 else loss

    def _check_requires_grad(self) -> None:
        """requires_grad is fixed at initialize: a frozen group has no optimizer state to start
        training, a trainable one would silently stop."""
        for g in self._groups:
            for name, p in g.params:
                if p.requires_grad != g.trainable:
                    raise RuntimeError(
                        f"strata: parameter {name} had requires_grad={g.trainable} at "
                        f"initialize and has {p.requires_grad} now; freezing or unfreezing a "
                        "parameter after strata.initialize is not supported (set requires_grad "
                        "before initialize, or save a checkpoint and initialize a new engine)")

    def _take_kept_grads(self, gi: int) -> None:
        """Gradients no_sync() kept of a group this backward did not reach: into its buffer."""
        for pi, (_, p) in enumerate(self._groups[gi].params):
            if p.grad is not None:
                if gi not in self._grad_views:
                    self._grad_views[gi] = self._grad_buffer(gi)
                self._copy_grad(gi, self._grad_views[gi][pi], p.grad)
                p.grad = None

    def _current_stream(self):
        """torch's current stream on the engine's GPU (tests inject theirs)."""
        return torch.cuda.current_stream(self._cuda)

    def _caller_stream(self) -> Optional[int]:
        """torch's current stream on the engine's GPU where the engine orders it on the device
        (orders_caller_streams), else None (the engine then returns with its work done, and the
        adapter waits for torch's before a reduction: _HeldBack)."""
        if not self._stream_ordered:
            return None
        return self._current_stream().cuda_stream

    def _grad_buffer(self, gi: int) -> list:
        """Group gi's gradient views. Where stream-ordered, the buffer's zeroing is ordered
        before the current stream only, which is kept as the buffer's stream: _copy_grad orders
        a copy from another stream with it, and the reduction is ordered after it."""
        stream = None
        if self._stream_ordered:
            self._grad_streams[gi] = self._current_stream()
            stream = self._grad_streams[gi].cuda_stream
        return [_as_tensor(v) for v in self._engine.grad_buffer(gi, stream)]

    def _copy_grad(self, gi: int, view: torch.Tensor, grad: torch.Tensor) -> None:
        """grad into its buffer view. A backward node may run on another stream than the one
        the buffer was taken on (autograd runs each node on its forward op's stream): that copy
        waits for the buffer's stream (its zeroing) and the buffer's stream for the copy (its
        reduction). A sparse gradient (nn.Embedding(sparse=True)) is made dense: the engine
        reduces and steps dense gradients, and Adam on its dense sum is torch's on the
        sparse=False module."""
        if grad.layout != torch.strided:
            grad = grad.to_dense()
        if view.shape != grad.shape:  # a parameter resized in place (its .data replaced)
            raise RuntimeError(
                f"strata: a gradient of shape {tuple(grad.shape)} for a parameter of group "
                f"'{self._groups[gi].name}' that the engine holds as {tuple(view.shape)}: the "
                "parameter was resized after strata.initialize (as "
                "model.resize_token_embeddings(...) does at stages 0-2). The engine holds, "
                "trains and saves the parameters it was initialized with, in their shapes: "
                "resize before strata.initialize")
        own = self._grad_streams.get(gi)  # None unless stream-ordered
        current = None if own is None else self._current_stream()
        if current is None or current == own:
            view.copy_(grad)
            return
        current.wait_stream(own)
        view.copy_(grad)
        own.wait_stream(current)
        # The caller drops grad next: its memory goes back to torch's pool on the stream it was
        # made on, which may be neither of these; it is not reused before this copy has read it.
        if grad.is_cuda:
            grad.record_stream(current)

    def _reset_micro_step(self) -> None:
        self._grads_missing = [len(g.params) for g in self._groups]
        self._reduced = [not g.trainable for g in self._groups]
        self._turn = 0

    def _agree_order(self) -> None:
        """After the first micro-step's reductions: the order its groups completed in on rank 0
        (those it did not use after, in the order so far) becomes every rank's."""
        done = set(self._completed)
        mine = self._completed + [gi for gi in self._reduce_order if gi not in done]
        self._completed = None
        self._reduce_order = list(self._engine.agree_reduction_order(mine))

    def _reduce_ordered(self, gi: int) -> None:
        """The reduction after torch's copies into the buffer, ordered on the device after the
        buffer's stream (_grad_buffer): no wait."""
        self._engine.reduce_gradients(gi, self._grad_streams.pop(gi).cuda_stream)

    def _reduce(self, gi: int) -> None:
        self._grad_views.pop(gi, None)  # the views die with the buffer
        self._reduced[gi] = True
        self._held.add(gi)  # once the copies into the gradient buffer have run

    def _flush(self) -> None:
        """After autograd: every group reduced once this micro-step (none inside no_sync()),
        every group released."""
        for gi in self._reduce_order:
            if not self._reduced[gi] and not self._no_sync:
                self._take_kept_grads(gi)
                if gi not in self._grad_views:
                    self._grad_buffer(gi)  # zeros: no parameter of it was used
                self._reduce(gi)
        self._held.drain()
        if self._completed is not None and not self._no_sync:
            self._agree_order()
        self._reset_micro_step()
        self._forget_held_calls()  # a retained graph's next backward gathers them again
        if self._whole:
            return  # stages 0-2: every group stays gathered
        self._release_groups([gi for gi in range(len(self._groups)) if not self._pinned[gi] and
                              (self._refs[gi] or self._engine.is_gathered(gi))])
        for gi, pinned in enumerate(self._pinned):
            if pinned and self._refs[gi] > 1:
                self._refs[gi] = 1  # the engine's own reference (module calls left none)

    # -- the training loop (DeepSpeedEngine's API) --------------------------------------------
    def _check_loaded(self, what: str) -> None:
        if self._engine.states_offloaded:
            raise RuntimeError(f"engine.{what}: the engine's states are offloaded "
                               "(offload_states()); call engine.reload_states() first")

    def forward(self, *args, **kwargs):
        self._check_loaded("forward")
        if self._param_epoch != _PARAMS_REGISTERED[0] or not _REGISTRATION_HOOK:
            self._check_parameters_unchanged()
            self._param_epoch = _PARAMS_REGISTERED[0]
        self._settle_failed_backward()
        if self.training and not self.tput_timer.started:
            self.tput_timer.start()
        depth = len(self._call_stack)
        with self._timed(self.engine_timers.forward_timers):
            try:
                with self._autocast.context():
                    out = self.module(*args, **kwargs)
            except BaseException:
                self._unwind_calls(depth)
                raise
            if torch.is_grad_enabled():
                _hook_outputs(out, self._output_hook)
        return out

    def _unwind_calls(self, depth: int) -> None:
        """Undoes the pre-hooks of the module calls a raising forward left open above `depth`.
        torch runs the post-hooks (always_call) for an Exception only: a KeyboardInterrupt (a
        Ctrl-C in a notebook) skipped them, leaving the calls on the stack (so a parameter read
        after it counted as read inside a forward and was gathered), their groups gathered
        and their saved-tensor hooks pushed for good."""
        while len(self._call_stack) > depth:
            module, call = self._call_stack.pop()
            calls = module.__dict__.get("_strata_calls")
            if calls and calls[-1] is call:
                calls.pop()
            if call.saved_hooks is not None:
                call.saved_hooks.__exit__(None, None, None)
            self._release(call.groups)

    @contextlib.contextmanager
    def _timed(self, names: list):
        """The engine's phase timers (wall_clock_breakdown) around the block; a block that
        raises stops them too, so the next phase starts them afresh."""
        for name in names:
            self.timers(name).start()
        try:
            yield
        finally:
            for name in names:
                if self.timers(name).started_:
                    self.timers(name).stop()

    def get_wall_clock_timers(self) -> dict:
        """As DeepSpeed's: {timer name: milliseconds} of the phases' timers at the last step()
        (wall_clock_breakdown; {} without it)."""
        return self.engine_timers_cache

    def _log_timers(self, boundary: bool) -> None:
        """After each step(), as DeepSpeed's engine with wall_clock_breakdown: the micro-step
        timers logged (and reset) at every step, the global ones at each boundary."""
        if not self.wall_clock_breakdown():
            return
        self.engine_timers_cache = {name: self.timers(name).elapsed(reset=False)
                                    for name in self.engine_timers.active_timers()}
        self.timers.log(names=self.engine_timers.micro_timers)
        if boundary:
            self.timers.log(self.engine_timers.global_timers)

    def _parameters_now(self) -> list:
        """Each parameter of the module, and at stages 0-2 its shape (whole there)."""
        if self._whole:
            return [(id(p), p.shape) for p in self.module.parameters()]
        return [(id(p), None) for p in self.module.parameters()]

    def _check_parameters_unchanged(self) -> None:
        """The module's parameters are among the ones initialize registered, in their shapes:
        the engine holds, trains and saves those, so a parameter set on the model after it, or
        resized in place (model.resize_token_embeddings does one or the other), would not train
        (at stage 3 it would differ per rank) or would fail later with a bare size mismatch.
        Parameters removed (a PEFT merge_and_unload) are no error: the rest trains as before."""
        now = self._parameters_now()
        if now == self._param_signature:
            return
        then = dict(self._param_signature)
        why = ("as model.resize_token_embeddings(...) or a module replaced after initialize "
               "does. The engine holds, trains and saves the parameters it was initialized with, "
               "in their shapes: make such changes before strata.initialize, or initialize a new "
               "engine from a checkpoint of this one")
        for name, p in self.module.named_parameters():
            if id(p) not in then:
                raise RuntimeError(f"strata: parameter '{name}' was set on the model after "
                                   f"strata.initialize, {why}")
            if self._whole and then[id(p)] != p.shape:
                raise RuntimeError(
                    f"strata: parameter '{name}' changed shape from {tuple(then[id(p)])} to "
                    f"{tuple(p.shape)} after strata.initialize, {why}")
        # Only removed (adapters merged and unloaded): what remains trains as before.
        self._param_signature = now

    def _output_grad_hook(self, grad):
        """A forward output's gradient: the script's own backward begins here, in autograd's
        outermost pass (a parameter's hook may first run inside a reentrant checkpoint's)."""
        if not self._in_engine_backward:
            self._queue_torch_backward_end()

    def __getattr__(self, name: str):
        """As DeepSpeedEngine's: a name the engine does not define is the module's, so scripts
        written for a DeepSpeed engine call engine.generate(...), read engine.config or call
        engine.gradient_checkpointing_enable(). The engine's own names come first (forward, step,
        train, ...); dunder names are never passed on."""
        try:
            return super().__getattr__(name)  # torch's: parameters, buffers, submodules
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")) \
                and name in dir(module):
            return getattr(module, name)  # an error inside the module's attribute propagates
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss.backward() with the loss scale, then the flush; the engine averages over ranks
        and micro-steps (gradient_accumulation_steps), as DeepSpeed's scale_wrt_gas does.
        scale_wrt_gas=False: the micro-steps' gradients are summed instead (the loss is
        multiplied by gradient_accumulation_steps here, which the engine's average undoes).
        Returns, as DeepSpeed's, the loss divided by gradient_accumulation_steps (with
        scale_wrt_gas; the loss itself without). A script may instead call loss.backward()
        itself, then engine.step() (DeepSpeed's torch-style backward; fp16 through
        engine.scale(loss).backward())."""
        if self._forward_only:
            raise RuntimeError(
                "strata: engine.backward on an engine initialized without an optimizer and "
                "without model_parameters: it runs its model forward only, and initialize froze "
                "its parameters (requires_grad=False); pass an optimizer (or a config "
                "\"optimizer\" section) to train it")
        self._check_loaded("backward")
        self._check_requires_grad()
        self._check_window_open()
        scale = self._engine.backward_scale * (1 if scale_wrt_gas else self._gas)
        self._in_engine_backward = True
        with self._timed(self.engine_timers.backward_timers):
            try:
                with self._timed(self.engine_timers.backward_inner_timers):
                    (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            except BaseException as e:
                with contextlib.suppress(Exception):  # the backward's own error is the one to see
                    self._drop_failed_backward()
                self._explain_released_read(e)
                raise
            finally:
                self._in_engine_backward = False
            with self._timed(self.engine_timers.backward_reduce_timers):
                self._flush()
        self._backward_done()
        return loss / self._gas if scale_wrt_gas and self._gas != 1 else loss

    def _explain_released_read(self, error: BaseException) -> None:
        """Autograd's shape error for a gradient of an empty stage-3 parameter (one read outside
        the engine's forward, where it is released: an L2 term summed over engine.parameters())
        names neither the parameter nor the cause; a note on the error says both."""
        text = str(error)
        if self.zero_optimization_stage() == 3 and isinstance(error, RuntimeError) and \
                "returned an invalid gradient" in text and \
                ("got [0]" in text or "compatible with [0]" in text):
            error.add_note(
                "strata: at ZeRO stage 3 a parameter is empty where it is released (ds_shape "
                "holds its shape), as in DeepSpeed: outside the engine's forward, and inside it "
                "where reached by iteration (engine.parameters(), named_parameters()) rather "
                "than as a module's attribute; this loss read one so (a penalty summed over the "
                "parameters, say). Compute the term and run the backward inside one "
                "strata.zero.GatheredParameters(params) block")

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next engine.step() runs the optimizer: every gradient_accumulation_steps
        micro-steps, or as set_gradient_accumulation_boundary said."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps - self._boundary_shift + 1) % self._gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """As DeepSpeed's: overrides is_gradient_accumulation_boundary() from now on (set it before
        each micro-step; True on the last one). The engine still divides the gradients by
        gradient_accumulation_steps and takes at most that many micro-steps per step."""
        self._boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """As DeepSpeed's: stages 0-1 only (an AssertionError at stage 2-3, as DeepSpeed asserts);
        the backwards inside leave each gradient in p.grad (summed by autograd over them) instead
        of reducing it, and the next backward outside reduces the sum once. The engine still
        divides by gradient_accumulation_steps: the micro-steps inside count towards it."""
        stage = self._engine.layout()["stage"]
        if stage >= 2:  # DeepSpeed's assertions, raised whatever python -O says
            raise AssertionError("no_sync context manager is incompatible with gradient "
                                 f"partitioning logic of ZeRO stage {stage}")
        if self._no_sync:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def step(self, lr_kwargs=None) -> None:
        """The optimizer step at the accumulation boundary; a no-op between. Each optimizer
        group's lr comes from the config's schedule, or, once the script or a client scheduler
        has written optimizer.param_groups[i]["lr"], from there (read at every step). A client
        scheduler (initialize(lr_scheduler=...)) is stepped here after each applied (not
        skipped) step, as DeepSpeed does."""
        if lr_kwargs is not None:
            raise NotImplementedError("step(lr_kwargs=...) is not supported by strata")
        self._check_loaded("step")
        self._settle_failed_backward()
        self._unwind_calls(0)  # none open at a step, unless a forward was interrupted
        with self._timed(self.engine_timers.step_timers):
            boundary = self._micro_step()
        self._log_timers(boundary)

    def _micro_step(self) -> bool:
        """step()'s work: the optimizer step at a boundary, the counters; whether it was one."""
        self._step_applied = False
        if self._step_after_drop:
            # The dropped micro-step's own step() (a loop that calls zero_grad() on a bad batch
            # and step() after it): the new window _discard_gradients began starts after it.
            self._step_after_drop = False
            self.micro_steps += 1
            self._boundary_shift = self.micro_steps % self._gas
            self.tput_timer.stop(global_step=False)
            return False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._refuse_untaken_grads()
        try:
            if boundary and self._step_has_grads:
                self._apply_step()
            elif boundary:
                self._skip_gradless_step()
        finally:
            # Once the engine has stepped (it took the window's gradients), the micro-step is
            # over even when what follows raised (a client scheduler's step, a monitor's
            # write): a script that catches that error goes on with the next window.
            if not (boundary and self._step_has_grads):
                self._unstepped_backward = False
                if boundary:
                    self._window_backwards = 0
                self.micro_steps += 1
                self.tput_timer.stop(global_step=boundary)
        return boundary

    def _apply_step(self) -> None:
        """The boundary step of a window that took gradients: the engine's optimizer step (or
        its fp16 skip), then the counters, the schedule and the monitor."""
        self._check_param_writes("the step")
        self._release_all()
        self._push_lrs()
        self._last_report = self._engine.step()
        self._step_has_grads = False  # taken: the window is over whatever follows
        if not self._last_report["skipped"]:
            self._after_applied_step()
        self._gather_whole()  # stages 0-2: the parameters whole again (new values)
        self.global_steps = self._last_report["global_step"]
        self._step_applied = not self._last_report["skipped"]
        if self._step_applied:
            self._grad_norm = torch.tensor(self._last_report["grad_norm"], dtype=torch.float32)
        if self._micro_batch:  # DeepSpeed's train_batch_size, once per boundary
            self.global_samples += int(self._micro_batch) * self._gas * self._engine.world_size
        self._after_step(self._last_report["skipped"])
        if self.monitor.enabled:  # as DeepSpeed's step: the next lr, the fp16 scale
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.fp16_enabled():
                events.append(("Train/Samples/loss_scale", self._engine.loss_scale,
                               self.global_samples))
            self.monitor.write_events(events)

    def _skip_gradless_step(self) -> None:
        """A boundary step with no gradient since the last one (no backward ran: a loop that
        skips a bad batch's backward but calls step()): nothing to apply. torch's optimizer
        skips a parameter without .grad; the engine would step every parameter on a zero
        gradient (Adam's momentum and the weight decay moving it). The weights, the optimizer
        state, global_steps and the schedule stay; was_step_applied() is False."""
        self._release_all()  # what a forward without backward kept gathered (stage 3)
        self._gather_whole()
        if not self._warned_gradless:
            self._warned_gradless = True
            warnings.warn("strata: engine.step() at an accumulation boundary with no backward "
                          "since the last step: nothing is applied (the weights, optimizer "
                          "state, global_steps and schedule stay; was_step_applied() is False)",
                          stacklevel=3)

    def _refuse_untaken_grads(self) -> None:
        """At a boundary step every gradient of the window is the engine's: after its backwards
        p.grad is None. One left there was never taken (a gradient assigned to p.grad, from
        torch.autograd.grad; a backward inside no_sync() with none after it), and the step
        would apply without it."""
        for name, p in self._trainable:
            if p.grad is not None:
                how = ("the window's backwards all ran inside no_sync(): run its last backward "
                       "outside no_sync(), which reduces what no_sync() kept"
                       if self._no_sync_kept() else
                       "gradients reach the engine through engine.backward(loss) (or "
                       "loss.backward() on the engine's output); one assigned to p.grad, from "
                       "torch.autograd.grad say, is not applied by engine.step()")
                raise RuntimeError(
                    f"strata: engine.step() at an accumulation boundary found a gradient in "
                    f"{name}.grad that the engine did not take: {how}. engine.zero_grad() "
                    "drops it")

    def _no_sync_kept(self) -> bool:
        """A backward ran inside no_sync() and none outside it after it took its gradients."""
        return self._kept_by_no_sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """p.grad = None for every parameter, as DeepSpeed's: the gradients the engine holds for
        this accumulation window stay (a loop that calls zero_grad every micro-step, as
        accelerate's may, keeps accumulating). Two cases drop them (_discard_gradients): after a
        backward that raised, and after a backward that filled the window with no
        engine.step() since, the micro-batch a script skips (a loss spike, a NaN); that window
        could not take another micro-step otherwise."""
        self._settle_failed_backward()
        if self._unstepped_backward and self._window_backwards >= self._gas:
            self._discard_gradients("engine.zero_grad() after a backward that engine.step() "
                                    "did not follow")
        for g in self._groups:
            for _, p in g.params:
                p.grad = None

    def _check_window_open(self) -> None:
        """Before a backward: the window has room (the engine reduces each group at most
        gradient_accumulation_steps times between steps)."""
        if not self._no_sync and self._window_backwards >= self._gas and \
                not self._unstepped_backward:
            # step() ran, short of the boundary: a loop that calls it once per window.
            raise RuntimeError(
                f"strata: a backward after {self._window_backwards} backward(s) in this "
                f"accumulation window, which fill gradient_accumulation_steps ({self._gas}), "
                "though engine.step() ran since: step() counts micro-steps, so call it after "
                "every backward (it runs the optimizer at each window's last one); a loop that "
                f"calls it once per window reaches a boundary every {self._gas}th window only")
        if not self._no_sync and self._unstepped_backward and self._window_backwards >= self._gas:
            raise RuntimeError(
                f"strata: a backward after {self._window_backwards} backward(s) since the last "
                f"engine.step(), which fill gradient_accumulation_steps ({self._gas}): call "
                "engine.step() after each backward (it runs the optimizer at the accumulation "
                "boundary), or sum the losses into one backward; engine.zero_grad() drops this "
                "window's gradients (a GAN's generator loss whose backward also ran through "
                "the discriminator's engine)")

    def _backward_done(self) -> None:
        self._step_has_grads = True
        self._step_after_drop = False
        self._kept_by_no_sync = self._no_sync  # the last backward's gradients stayed in p.grad
        self._unstepped_backward = True
        if not self._no_sync:  # no_sync()'s keep their gradients in p.grad: nothing reduced
            self._window_backwards += 1

    def _settle_failed_backward(self) -> None:
        """The script's own loss.backward() began (a parameter gradient arrived) and never
        ended (autograd's end-of-pass callback did not run: it raised part way): dropped here,
        at the engine's next call that would meet its state."""
        if self._torch_backward_took:
            self._drop_failed_backward()
        # A pass that raised before any parameter gradient left only its queued flag: cleared,
        # or the next pass would queue no end and never flush.
        self._torch_backward_queued = False

    def _drop_failed_backward(self) -> None:
        """After a backward that raised part way (engine.backward's, or the script's own
        loss.backward(), found at the next forward or zero_grad): its gathered groups released,
        and the gradients it and this window's earlier micro-steps gave dropped, so that the
        script can skip the batch (catching an out-of-memory error, say) and train on."""
        try:
            self._release_all()
            self._gather_whole()
        finally:
            self._discard_gradients("a backward raised")

    def _discard_gradients(self, why: str) -> None:
        """Drops every gradient taken since the last step: the engine's (discard_gradients,
        with the reductions in flight completed first), the adapter's micro-step state, and
        p.grad kept for a later turn. With several ranks every rank must do it at the same point
        (each one's backward raised at the same place), as DeepSpeed needs every rank in every
        collective, else the ranks' collectives no longer pair (a timeout, or Step's error).
        Earlier micro-steps of the accumulation window are dropped with it (a warning says how
        many): their sum cannot be taken apart; a new window of gradient_accumulation_steps
        micro-steps starts at the next one."""
        self._wait_torch()  # torch's kernels no longer write the buffers freed below
        for stream in self._grad_streams.values():  # a backward on a stream of its own
            stream.synchronize()
        self._held.held.clear()  # complete groups whose reductions were held: dropped too
        self._grad_views.clear()
        self._grad_streams.clear()
        for g in self._groups:
            for _, p in g.params:
                p.grad = None
        self._engine.discard_gradients()
        self._reset_micro_step()
        if self._completed is not None:
            self._completed = []  # the order is agreed after a micro-step that completes
        self._torch_backward_queued = self._torch_backward_took = False
        earlier = self._window_backwards - (1 if self._unstepped_backward else 0)
        if earlier > 0:
            warnings.warn(
                f"strata: {why}: the gradients of this accumulation window's {earlier} earlier "
                "micro-step(s) are dropped with it (the engine holds their sum only); a new "
                "window of gradient_accumulation_steps micro-steps starts at the next one",
                stacklevel=3)
        self._step_has_grads = False
        self._unstepped_backward = False
        self._window_backwards = 0
        self._boundary_shift = self.micro_steps % self._gas
        self._step_after_drop = True
        self._kept_by_no_sync = False

    def _lr_state(self) -> dict:
        """What a checkpoint keeps of the lrs the script drives: each group's lr and a client
        scheduler's state_dict (numbers only: loads with weights_only)."""
        if not isinstance(self.lr_scheduler, _EngineScheduler):
            # What a scheduler the script steps wrote since the last step (a StepLR milestone,
            # ReduceLROnPlateau on the eval loss before the save): the next step's, so saved.
            self._push_lrs()
        # Each group's betas / eps / weight_decay, as DeepSpeed's optimizer state_dict keeps its
        # param_groups: a run resumed with other values in its config takes the saved ones.
        out = {"param_group_hyper": [
            {k: list(v) if k == "betas" else v for k, v in _group_hyper(g).items()}
            for g in self.optimizer.param_groups]}
        if not self._client_lrs:
            return out  # the config's schedule: its position is the engine's step count
        out["param_group_lrs"] = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            out["lr_scheduler"] = self.lr_scheduler.state_dict()
        return out

    def _load_hyper(self, state: dict) -> None:
        """The saved betas / eps / weight_decay (with the optimizer states, as DeepSpeed's)."""
        hyper = state.get("param_group_hyper")
        if hyper is None:
            return
        if len(hyper) != len(self.optimizer.param_groups):
            raise RuntimeError(f"load_checkpoint: the checkpoint has {len(hyper)} optimizer "
                               f"groups' betas, the optimizer {len(self.optimizer.param_groups)}")
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update({k: tuple(v) if k == "betas" else v for k, v in h.items()})
        self._push_lrs()  # what changed, now (the lrs as they are)

    def _load_lr_state(self, state: dict) -> None:
        lrs = state.get("param_group_lrs")
        if lrs is None:
            self._pull_lrs()  # the config's schedule, at the loaded step
            return
        if len(lrs) != len(self.optimizer.param_groups):
            raise RuntimeError(f"load_checkpoint: the checkpoint has {len(lrs)} optimizer "
                               f"groups' lrs, the optimizer {len(self.optimizer.param_groups)}")
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._client_lrs = True
        if "lr_scheduler" in state and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _push_lrs(self) -> None:
        """Hands the engine the param_groups' lrs once someone other than the engine wrote them
        (a client scheduler, the script's own loop); from then on at every step. Betas, eps and
        weight_decay written there (torch's OneCycleLR and CyclicLR cycle betas[0] with the lr)
        are handed over whenever they change."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._known_lrs):
            raise RuntimeError(
                f"strata: the optimizer has {len(groups)} param_groups and the engine was "
                f"initialized with {len(self._known_lrs)}: a group added after "
                "strata.initialize (optimizer.add_param_group) is not supported; the engine "
                "partitions and holds the groups it was initialized with (give every group to "
                "the optimizer before initialize)")
        lrs = [float(g["lr"]) for g in groups]
        if self._client_lrs or lrs != self._known_lrs:
            if isinstance(self.lr_scheduler, _EngineScheduler) and not self._client_lrs:
                self._lr_override = True  # _after_step hands the lrs back to the schedule
            else:
                self._client_lrs = True
            self._engine.set_lrs(lrs)
        hyper = [_group_hyper(g) for g in groups]
        if hyper != self._known_hyper:
            changed = []
            for now, known in zip(hyper, self._known_hyper):
                d = {k: v for k, v in now.items() if known.get(k) != v}
                if "betas" in d:
                    d["beta1"], d["beta2"] = d.pop("betas")
                changed.append(d)
            self._engine.set_hyperparameters(changed)
            self._known_hyper = hyper
            if isinstance(self.lr_scheduler, _EngineScheduler) and \
                    any("beta1" in d for d in changed):
                self._betas_override = True  # _after_step hands them back to the schedule

    def _pull_lrs(self) -> None:
        """Writes the lrs (and the betas: OneCycle's momentum) of the engine's schedule into
        param_groups (the script reads them)."""
        self._known_lrs = list(self._engine.lrs)
        groups = self.optimizer.param_groups
        for g, lr, betas in zip(groups, self._known_lrs, self._engine.betas):
            g["lr"] = lr
            if "betas" in g:
                g["betas"] = tuple(betas)
        self._known_hyper = [_group_hyper(g) for g in groups]

    def get_mom(self) -> list:
        """As DeepSpeed's: each optimizer group's betas (OneCycle cycles betas[0])."""
        return [g["betas"] for g in self.optimizer.param_groups]

    def _after_step(self, skipped: bool) -> None:
        if self._lr_override and not skipped:
            self._engine.set_lrs([])  # the config's schedule again, as DeepSpeed's steps on
            self._lr_override = False
        if self._betas_override and not skipped:  # OneCycle's momentum, as the lrs above
            self._engine.use_schedule_betas()
            self._betas_override = False
        if not self._client_lrs:
            self._pull_lrs()
        if skipped:
            return
        # torch's schedulers (on the returned optimizer or the client's) warn unless the
        # optimizer they wrap was stepped.
        self.optimizer._mark_stepped()
        # A ReduceLROnPlateau steps on a metric the script has (its eval loss): the script, or
        # the Trainer after each evaluation, steps it; the engine reads the lrs it writes.
        if self._client_lrs and self.lr_scheduler is not None and \
                not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.lr_scheduler.step()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """As DeepSpeed's: whether the last step() updated the parameters (False between
        accumulation boundaries, and for a step skipped on an fp16 overflow)."""
        return self._step_applied

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on an fp16 overflow so far (checkpoints keep the count), as
        DeepSpeedEngine.skipped_steps."""
        return int(self._engine.stats()["skipped_steps"])

    def get_global_grad_norm(self) -> Optional[torch.Tensor]:
        """The last applied step's global gradient norm (before clipping), a 0-dim fp32 tensor
        as DeepSpeed's ZeRO optimizers give (scripts call .item() on it); None before the first
        step. A step skipped on an fp16 overflow keeps the previous value, as DeepSpeed's."""
        return self._grad_norm

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self._micro_batch

    def torch_autocast_enabled(self) -> bool:
        return self._autocast.enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return self._autocast.dtype

    def torch_autocast_lower_precision_safe_modules(self) -> Optional[list]:
        return self._autocast.lower_precision_safe_modules

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """As DeepSpeed's: the global batch changes through gradient_accumulation_steps, the
        micro-batch staying (batch-size warm-up, curricula). Between steps; the reduced
        gradients are then divided by the new count (Engine::SetGradientAccumulationSteps). As in
        DeepSpeed the boundary stays (micro_steps + 1) % gradient_accumulation_steps == 0 on the
        running micro-step count, so the first step after a change may be short."""
        micro = self._micro_batch
        if not micro:
            raise ValueError("set_train_batch_size: the config sets no "
                             "train_micro_batch_size_per_gpu to divide the batch by")
        if int(train_batch_size) != train_batch_size or train_batch_size <= 0 or \
                train_batch_size % (int(micro) * self.world_size) != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism"
                             f" (set_train_batch_size({train_batch_size}): micro-batch {micro} x "
                             f"{self.world_size} rank(s))")
        gas = int(train_batch_size) // (int(micro) * self.world_size)
        if self._step_has_grads:  # stages 0-1 hold them in p.grad, where the engine sees none
            raise RuntimeError("set_train_batch_size: a backward of this step has run; call it "
                               "between steps only (after engine.step() at a boundary)")
        self._engine.set_gradient_accumulation_steps(gas)
        self._gas = gas

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """As DeepSpeed's: the micro-batch changes, gradient_accumulation_steps staying (the
        global batch follows). The engine's arithmetic does not depend on it: it is what
        train_batch_size() and the sample counts report."""
        if int(micro_batch_size) != micro_batch_size or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): a positive count")
        self._micro_batch = int(micro_batch_size)

    def loss_scale(self) -> float:
        """As DeepSpeedEngine.loss_scale(): the config's fp16 "loss_scale" (0: dynamic). The
        scale in use is engine.optimizer.cur_scale."""
        return float((self._effective.get("fp16") or {}).get("loss_scale", 0.0))

    def dynamic_loss_scale(self) -> bool:
        """As DeepSpeed's: whether the config's fp16 "loss_scale" is 0 (dynamic)."""
        return self.loss_scale() == 0

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size: every rank (strata has no model parallelism)."""
        return self._engine.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: Optional[int] = None):
        """As DeepSpeed's: a DataLoader of this rank's share of `dataset`, micro-batches of
        train_micro_batch_size_per_gpu (or batch_size), through a DistributedSampler (shuffled,
        seed 0, for training; in order for route "eval" / "predict") unless data_sampler is
        given or the dataset is iterable, dataloader_drop_last from the config, and initialize's
        collate_fn unless one is given."""
        iterable = _check_dataset(dataset)
        if iterable and self.world_size > 1:
            raise TypeError(
                f"strata: an IterableDataset on {self.world_size} ranks would give each rank the "
                "whole stream (DeepSpeed's loader refuses it too: its DistributedSampler needs "
                "len()); split the stream by rank yourself (each rank iterating its own part) "
                "and build the DataLoader, or pass a map-style dataset")
        if data_sampler is None and not iterable:
            data_sampler = torch.utils.data.distributed.DistributedSampler(
                dataset, num_replicas=self.world_size, rank=self.global_rank,
                shuffle=route == "train")
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu() or 1,
            sampler=data_sampler, collate_fn=collate_fn or self.collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self._cuda is not None,
            drop_last=self.dataloader_drop_last())
        # DeepSpeedDataLoader's name for its sampler: scripts call
        # loader.data_sampler.set_epoch(epoch).
        loader.data_sampler = data_sampler
        return loader

    @property
    def global_rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's LOCAL_RANK; 0 without one), as
        DeepSpeedEngine.local_rank: scripts pick their device with it."""
        return _local_rank()

    def fp16_enabled(self) -> bool:
        return bool((self._effective.get("fp16") or {}).get("enabled"))

    def bfloat16_enabled(self) -> bool:
        return bool((self._effective.get("bf16") or {}).get("enabled"))

    def zero_optimization_stage(self) -> int:
        return int(self._zero_value("stage") or 0)

    def train_batch_size(self) -> int:
        """micro batch x gradient_accumulation_steps x world size."""
        return int(self._micro_batch or 1) * self._gas * self.world_size

    # DeepSpeedEngine's config accessors, from the effective config (defaults filled in).
    def gradient_clipping(self) -> float:
        return float(self._effective.get("gradient_clipping") or 0.0)

    def steps_per_print(self):
        """The config's steps_per_print; None when absent (DeepSpeed's default: no progress lines).
        strata prints no progress lines at any value."""
        if self._config.get("steps_per_print") == math.inf:
            return math.inf  # DeepSpeed's "never", as accelerate writes it
        value = self._effective.get("steps_per_print")
        return None if value is None else int(value)

    def wall_clock_breakdown(self) -> bool:
        return bool(self._config.get("wall_clock_breakdown", False))

    def dataloader_drop_last(self) -> bool:
        return config_bool(self._config.get("dataloader_drop_last", False))

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() == 3

    def _zero_value(self, key: str):
        return (self._effective.get("zero_optimization") or {}).get(key)

    def _zero_section(self, key: str) -> dict:
        return self._zero_value(key) or {}

    def zero_offload_optimizer(self) -> Optional[dict]:
        """The offload_optimizer section in effect (defaults filled in), None when the optimizer
        state stays on the device (DeepSpeed returns its config object or None)."""
        sec = self._zero_section("offload_optimizer")
        return sec if sec.get("device", "none") != "none" else None

    def zero_offload_param(self) -> Optional[dict]:
        """The offload_param section in effect, None when the parameters stay on the device."""
        sec = self._zero_section("offload_param")
        return sec if sec.get("device", "none") != "none" else None

    def zero_cpu_offload(self) -> bool:
        """The optimizer state offloaded to host memory (DeepSpeed: offload_optimizer.device is
        cpu; nvme is not)."""
        return self._zero_section("offload_optimizer").get("device") == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._zero_value("stage3_gather_16bit_weights_on_model_save"))

    def zero_sub_group_size(self) -> int:
        return int(self._zero_value("sub_group_size") or 0)

    def zero_param_persistence_threshold(self) -> int:
        return int(self._zero_value("stage3_param_persistence_threshold") or 0)

    def zero_max_live_parameters(self) -> int:
        return int(self._zero_value("stage3_max_live_parameters") or 0)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self._zero_value("stage3_prefetch_bucket_size") or 0)

    def zero_reduce_bucket_size(self) -> int:
        return int(self._zero_value("reduce_bucket_size") or 0)

    def zero_allgather_bucket_size(self) -> int:
        return int(self._zero_value("allgather_bucket_size") or 0)

    def zero_overlap_comm(self) -> bool:
        return bool(self._zero_value("overlap_comm"))

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._zero_value("contiguous_gradients"))

    def zero_reduce_scatter(self) -> bool:
        return bool(self._zero_value("reduce_scatter"))

    def gradient_predivide_factor(self) -> float:
        return float(self._effective.get("gradient_predivide_factor", 1.0))

    def memory_breakdown(self) -> bool:
        return bool(self._config.get("memory_breakdown", False))

    def flops_profiler_enabled(self) -> bool:
        """The config's flag (strata runs no FLOPs profiler: the section is not acted on)."""
        return bool((self._config.get("flops_profiler") or {}).get("enabled", False))

    def sparse_gradients_enabled(self) -> bool:
        return False

    def amp_enabled(self) -> bool:
        return False  # `amp` is refused at initialize

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's communication_data_type, else the
        working dtype (fp16 / bf16 / fp32), as DeepSpeed's."""
        named = self._config.get("communication_data_type")
        if named:
            return {"fp16": torch.float16, "bf16": torch.bfloat16, "bfp16": torch.bfloat16,
                    "fp32": torch.float32}.get(str(named).lower(), torch.float32)
        return self._dtype

    def get_batch_info(self) -> tuple:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), as
        numbers (DeepSpeed's returns its three accessors)."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def optimizer_name(self) -> Optional[str]:
        """The client optimizer's class name, else the config's optimizer type, as DeepSpeed
        (which lowercases the names of its own optimizers: "adam", "adamw")."""
        if self.optimizer._client is not None:
            return type(self.optimizer._client).__name__
        name = (self._config.get("optimizer") or {}).get("type")
        return name.lower() if isinstance(name, str) and name.lower() in ("adam", "adamw") \
            else name

    def optimizer_params(self) -> Optional[dict]:
        return (self._config.get("optimizer") or {}).get("params")

    def _scheduler_section(self) -> dict:
        # A torch.optim.lr_scheduler class named in the config went to the client path.
        return self._config.get("scheduler") or self._named_scheduler or {}

    def scheduler_name(self) -> Optional[str]:
        return self._scheduler_section().get("type")

    def scheduler_params(self) -> Optional[dict]:
        return self._scheduler_section().get("params")

    def get_data_parallel_rank(self) -> int:
        return self.global_rank  # every rank is a data-parallel rank (no model parallelism)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_parallel_rank(self) -> int:
        return 0

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False):
        """As DeepSpeed's: the module's state_dict (at stage 3 the parameters are empty outside
        a gather: save_16bit_model or zero.GatheredParameters give their values), less the
        frozen parameters when asked."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad and prefix + n in sd:
                    del sd[prefix + n]
        return sd

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin"):
        """DeepSpeed's old name of save_16bit_model, kept for the scripts that call it."""
        return self.save_16bit_model(save_dir, save_filename)

    def empty_partition_cache(self) -> None:
        """As DeepSpeed's: frees the device memory of parameters kept gathered (ZeRO-3's
        persistence and reuse, prefetched ones, hpZ's slices) and of spare gradient buffers, and
        hands the device's cache of it back (offload_states with nothing to move); the next
        forward gathers what it needs again. Between steps."""
        self.offload_states(include=["contiguous_grad_buffer"])  # nothing to move
        self._gather_whole()

    @property
    def last_step_report(self) -> Optional[dict]:
        return self._last_report

    def stats(self) -> dict:
        """Per-tier bytes (moved, used, peak, budget), comm bytes, wait and optimizer times, and
        the adapter's own waits for the GPU (adapter: device_waits, device_wait_ns; 0 on the
        host)."""
        s = self._engine.stats()
        s["layout"] = self._engine.layout()
        s["adapter"] = {"device_waits": self._device_waits.count,
                        "device_wait_ns": self._device_waits.ns}
        return s

    def layout(self) -> dict:
        return self._engine.layout()

    # -- lending the device out between steps (Engine::OffloadStates) -----------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """As DeepSpeedEngine.offload_states: the engine's states that live on the device move
        into host memory (page-locked with pin_memory) and every device copy it keeps (gathered
        parameters, gradient buffers, cached copies) is dropped, so the device's memory is free
        for other work (an RL trainer's generation, an evaluation) until reload_states().
        include: DeepSpeed's OffloadStateTypeEnum values (strata.runtime.zero.offload_config;
        names or members), default all. device "cpu" (OffloadDeviceEnum.cpu); "none" moves
        nothing, as DeepSpeed; "nvme" is refused, as DeepSpeed. The copies are done when it
        returns (non_blocking is accepted and changes nothing). Until reload_states, forward,
        backward, step and checkpoints raise, naming offload_states. Between steps only."""
        device = getattr(device, "value", device)
        if device == "none":
            warnings.warn("offload_states: no device given (OffloadDeviceEnum.none); nothing "
                          "moved, as DeepSpeed", stacklevel=2)
            return
        if device != "cpu":
            raise ValueError(f"offload_states: device {device!r}: the states go to the CPU "
                             "(OffloadDeviceEnum.cpu); DeepSpeed refuses NVMe here too")
        kinds = None
        if include is not None:
            kinds = []
            for state in include:
                name = getattr(state, "value", state)
                if name not in _STATE_KINDS:
                    raise ValueError(f"offload_states: include has {state!r}; expected "
                                     f"OffloadStateTypeEnum values ({', '.join(_STATE_KINDS)})")
                kinds += _STATE_KINDS[name]
        self._held.drain()
        self._release_all()  # stages 0-2 too: their views alias what leaves the device
        self._engine.offload_states(kinds, pin_memory)

    def reload_states(self, non_blocking: bool = False) -> None:
        """As DeepSpeedEngine.reload_states: what offload_states moved comes back to the device
        (the same bits); training goes on as if it never left. Raises (RuntimeError naming the
        tier) when the device has no room yet: what fit is back, and another call finishes."""
        self._engine.reload_states()
        self._gather_whole()

    @property
    def states_offloaded(self) -> bool:
        """True from offload_states() until reload_states() brought everything back."""
        return bool(self._engine.states_offloaded)

    def destroy(self) -> None:
        """DeepSpeedEngine.destroy, which scripts call when they are done with the engine: close()."""
        self.close()

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None,
                schedule=None, compiled_autograd_enabled: bool = False, **kwargs) -> None:
        """DeepSpeedEngine.compile (what accelerate calls for a dynamo backend): torch.compile on
        the module in place (nn.Module.compile), with `backend` (torch's default where None)
        and compile_kwargs; the engine's hooks run between the compiled graphs. DeepSpeed's
        compile passes (`schedule`, DeepCompile) and compiled autograd are not supported."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepSpeed's compile passes "
                                      "(DeepCompile) are not supported by strata")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True) is not "
                                      "supported by strata (its gradient hooks run eagerly)")
        options = {**(compile_kwargs or {}), **kwargs}
        if backend is not None:
            options["backend"] = backend
        self.module.compile(**options)
        self._compiled = True

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a strata engine, and a model whose parameters it trains (each names it), cannot be "
            "pickled or deep-copied: save engine.module.state_dict() (at stage 3 inside "
            "strata.zero.GatheredParameters), engine.save_16bit_model() or "
            "engine.save_checkpoint(); or close the engine first (close() at stages 0-2, "
            "close_keeping_weights() at stage 3), which gives the model back whole")

    @property
    def is_compiled(self) -> bool:
        """Whether compile() was called (DeepSpeedEngine.is_compiled)."""
        return getattr(self, "_compiled", False)

    def close_keeping_weights(self) -> None:
        """close(), the parameters left holding the weights (the fp32 masters, in the dtype each
        parameter had before initialize) at every stage, whole (collective: the masters are
        read whole on every rank)."""
        masters = self.read_master()
        self.close()
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if name in masters:
                    p.data = masters[name].to(p.device, self._dtypes.get(name, p.dtype))
                    p.__dict__.pop("_strata_engine", None)  # the model's again (it pickles)

    def close(self) -> None:
        """Removes the hooks and frees the engine. Stages 0-2: the parameters keep their last
        values (copied out of the engine); stage 3: they stay empty."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for module in self.module.modules():
            if isinstance(module._parameters, _ParamDict):
                module.__dict__["_parameters"] = dict(module._parameters)
        empty = torch.empty(0, dtype=self._dtype, device=self.device)
        for g in self._groups:
            for _, p in g.params:
                # Stage 3: nothing may keep a view of the engine's memory (a persistent group's).
                p.data = p.data.clone() if self._whole else empty
                if not self._whole:
                    p.ds_status = _NOT_AVAILABLE
                else:  # holding its weights, the parameter is the model's again (it pickles)
                    p.__dict__.pop("_strata_engine", None)
        self._engine_views.clear()  # views of memory the engine frees now
        self._gathered_at.clear()
        try:
            self._wait_torch()  # those copies, and any kernel still reading the engine's memory
        finally:
            self._closed = True
            self._engine.close()

    # -- checkpoints (Engine::Save / Engine::Load; docs/checkpoints.md) ---------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False,
                        keep_last: Optional[int] = None,
                        recycle_files: Optional[bool] = None) -> bool:
        """Every rank writes its part of `<save_dir>/<tag>/` (default tag global_step<N>) and
        `latest` names it (save_latest=False: `latest` stays as it was; the new checkpoint
        loads by its tag). exclude_frozen_parameters=True (what transformers' Trainer asks for
        a PEFT model) leaves the frozen parameters out: the checkpoint holds the trained ones,
        their optimizer state and the rest, and load_checkpoint(load_module_strict=False) takes
        the frozen values from the model it loads into (strata::SaveOptions::exclude_frozen).
        client_state (a dict of tensors, dicts,
        lists, tuples, numbers, strings, None: what torch.load(weights_only=True) reads, so
        loading runs no code) comes
        back from load_checkpoint, and the module's persistent buffers (state_dict's: BatchNorm
        running statistics) are restored by it (rank 0's, with the Python state in the engine's
        client state blob; strata.utils). Collective, between backwards: inside an
        accumulation window it saves the state of the last step, without the window's
        gradients, and training goes on with them, as DeepSpeed's. A tag saved again is
        replaced, in one step (a crash leaves the old checkpoint or the new one under it).
        keep_last (strata's, not DeepSpeed's): keep only the newest N checkpoints in save_dir
        (0: all), reusing the oldest one's files for the new save when recycle_files
        (strata::SaveOptions, include/strata/checkpoint.h). Left as None, both come from the
        config's "checkpoint" section (keep_last 0 = keep all, recycle_files true)."""
        if keep_last is not None and int(keep_last) < 0:
            raise ValueError(f"save_checkpoint(keep_last={keep_last}): must be >= 0")
        self._settle_failed_backward()
        if tag is None:
            tag = f"global_step{self.global_steps}"
        state = {"client_state": dict(client_state or {}), "micro_steps": self.micro_steps,
                 "global_samples": self.global_samples,
                 "buffers": {n: b.detach().cpu().clone()
                             for n, b in _persistent_buffers(self.module).items()},
                 "tied": _tied_names(self.module), **self._lr_state()}
        blob = pack_state(state)
        self._check_param_writes("the checkpoint")
        self._release_all()  # Save refuses while a group is gathered
        with self._whole_after():
            self._engine.save(os.fspath(save_dir), str(tag), blob,
                              keep_last=None if keep_last is None else int(keep_last),
                              recycle_files=None if recycle_files is None else bool(recycle_files),
                              exclude_frozen=bool(exclude_frozen_parameters),
                              update_latest=bool(save_latest))
        if self._engine.rank == 0:  # DeepSpeed's recovery script, strata's in its place
            write_recovery_script(save_dir)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Restores `<load_dir>/<tag>` (default: the tag `latest` names) into this engine;
        returns (load_path, client_state) as DeepSpeed does, (None, None) when there is no
        checkpoint. Training then continues bit for bit (any world size or stage).
        load_optimizer_states=False: the weights (fp32 masters), counters and schedule, with a
        fresh Adam (m, v zero; bias correction from step 1); load_lr_scheduler_states=False: the
        config's schedule (or a client scheduler) starts again (strata::LoadOptions).
        load_module_only=True (fine-tuning): only the weights (the fp32 masters) and the
        buffers, before the engine's first step; the optimizer, LR schedule and counters stay
        fresh. A checkpoint saved with exclude_frozen_parameters=True holds no frozen
        parameters: it loads with load_module_strict=False, the model keeping its own values for
        them (as DeepSpeed's missing keys), and is refused naming them otherwise."""
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported")
        self._settle_failed_backward()
        load_dir = os.fspath(load_dir)
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                warnings.warn(f"strata: no checkpoint to load: {latest} does not exist")
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        from .utils.deepspeed_checkpoint import is_deepspeed_checkpoint
        if is_deepspeed_checkpoint(os.path.join(load_dir, str(tag))):
            return self._load_deepspeed(os.path.join(load_dir, str(tag)), load_module_strict,
                                        load_optimizer_states, load_lr_scheduler_states,
                                        load_module_only)
        if load_module_only:
            return self._load_module_only(load_dir, str(tag), load_module_strict)
        self._release_all()  # Load refuses while a group is gathered
        with self._whole_after():
            try:
                blob = self._engine.load(load_dir, str(tag),
                                         optimizer_states=load_optimizer_states,
                                         lr_schedule=load_lr_scheduler_states,
                                         keep_excluded=not load_module_strict)
            except _strata.StrataError as e:
                if load_module_strict or "model spec differs" not in str(e):
                    raise
                raise _strata.StrataError(
                    f"{e}\n(load_module_strict=False relaxes the buffers and keeps the frozen "
                    "parameters a checkpoint left out, nothing else: a model whose "
                    "parameters changed takes the checkpoint's matching weights with "
                    "load_module_only=True, before its first step, also with "
                    "load_module_strict=False where the checkpoint lacks some)") from None
        state = unpack_state(blob, os.path.join(load_dir, str(tag)))
        self._load_buffers(state.get("buffers"), load_module_strict)
        if load_optimizer_states:
            self._load_hyper(state)
        if load_lr_scheduler_states:
            self._load_lr_state(state)
        elif not self._client_lrs:
            self._pull_lrs()
        self._counters_loaded(int(state.get("global_samples", 0)))
        return os.path.join(load_dir, str(tag)), state.get("client_state", {})

    def _counters_loaded(self, global_samples: int) -> None:
        """The adapter's counters after a load set the engine's."""
        self.global_steps = self._engine.global_step
        # A whole number of this engine's accumulation windows: the next micro-step starts one,
        # with the gradient_accumulation_steps now in force (DeepSpeed does not restore its
        # counter, which a fresh engine starts at 0); the saved count would put the boundary
        # mid-window where the run resumes with another gradient_accumulation_steps.
        self.micro_steps = self.global_steps * self._gas
        self._boundary_shift = 0
        self._step_after_drop = False
        self.global_samples = global_samples

    def _load_deepspeed(self, path: str, strict: bool, optimizer_states: bool, lr_states: bool,
                        module_only: bool):
        """load_checkpoint of a checkpoint DeepSpeed's save_checkpoint wrote
        (strata.utils.deepspeed_checkpoint reads it): every parameter's fp32 master and Adam
        moments written whole (write_param_state), frozen parameters' values, the buffers, then
        the counters, the LR schedule's position, the fp16 loss scaler and the groups'
        hyperparameters (Engine::RestoreProgress), so the run goes on as under DeepSpeed, at any
        stage, placement and world size. Everything that can refuse is checked before the first
        write. Each rank reads every file (memory-mapped, one parameter at a time). Collective."""
        from .utils.deepspeed_checkpoint import DeepSpeedCheckpoint
        if self._step_has_grads:
            raise RuntimeError("load_checkpoint: mid-accumulation (a backward since the last "
                               "step); a checkpoint loads at an accumulation boundary, after the "
                               "engine.step() that applied the gradients")
        ck = DeepSpeedCheckpoint(path)
        moments = optimizer_states and not module_only
        ours = {name: (g, p) for g in self._groups for name, p in g.params}
        if ck.stage == 0 and moments and self.optimizer is not None:  # keyed by place in groups
            name_of = {id(p): n for n, (_, p) in ours.items()}
            ck.place_optimizer_state([[name_of[id(p)] for p in g["params"] if id(p) in name_of]
                                      for g in self.optimizer.param_groups])
        self._check_deepspeed_match(ck, ours, strict, moments)
        trained, frozen = set(ck.names()), set(ck.frozen_names())
        theirs = trained | frozen
        self._load_buffers(ck.buffers, strict)  # before any write: it may refuse
        with self._many_writes("load_checkpoint (its states' writes)"):
            for name, (g, p) in ours.items():
                if name not in theirs or not g.trainable:
                    continue
                value = ck.tensor(name, "fp32") if name in trained else ck.frozen(name)
                self.write_param_state(p, value, "master32")
                for kind in ("exp_avg", "exp_avg_sq"):
                    own = moments and name in trained
                    self.write_param_state(p, ck.tensor(name, kind) if own else
                                           torch.zeros(value.shape), kind)
        for gi, g in enumerate(self._groups):  # frozen groups, one at a time, whole
            if not g.trainable and any(n in theirs for n, _ in g.params):
                self._write_params({id(p): ck.frozen(n) if n in frozen else
                                    ck.tensor(n, "fp32") if n in trained else
                                    self.read_param_state(p) for n, p in g.params}, warn=False)
        if module_only:
            return path, ck.client_state(module_only=True)
        applied = ck.global_steps - ck.skipped_steps
        position = ck.schedule_position() if lr_states else 0
        scaler = ck.loss_scale if self.fp16_enabled() else None
        self._release_all()  # RestoreProgress, as Load, refuses while a group is gathered
        with self._whole_after():
            self._engine.restore_progress(
                global_step=ck.global_steps, skipped_steps=ck.skipped_steps,
                optimizer_step=(ck.optimizer_step if ck.optimizer_step is not None else applied)
                if moments else 0,
                schedule_position=applied if position is None else position,
                loss_scale=scaler["scale"] if scaler else 0.0,
                scaler_iteration=scaler["iteration"] if scaler else 0,
                scaler_last_overflow=scaler["last_overflow"] if scaler else -1,
                scaler_hysteresis_left=scaler["hysteresis"] if scaler else 0)
        if moments and ck.param_group_hyper:
            self._load_hyper({"param_group_hyper": ck.param_group_hyper})
        # The lr of the next step: the config's schedule at its restored position, or else, as
        # DeepSpeed restores its optimizer's param_groups, the saved lrs (a client scheduler's
        # last write: a Trainer's or accelerate's scheduler, whose own state DeepSpeed leaves
        # to them, is saved beside the checkpoint and loaded by them).
        saved_lrs = ck.param_group_lrs if moments and lr_states and ck.param_group_lrs and \
            None not in ck.param_group_lrs else None
        if saved_lrs is not None and not isinstance(self.lr_scheduler, _EngineScheduler):
            state = {"param_group_lrs": saved_lrs}
            if ck.lr_scheduler is not None and self.lr_scheduler is not None:
                state["lr_scheduler"] = ck.lr_scheduler
            self._load_lr_state(state)
        elif not self._client_lrs:
            self._pull_lrs()
        self._counters_loaded(ck.global_samples)
        return path, ck.client_state(optimizer_states, lr_states)

    def _check_deepspeed_match(self, ck, ours: dict, strict: bool, moments: bool) -> None:
        """_load_deepspeed's refusals, before anything is written: parameters missing on either
        side (unless not strict), another shape, another number of optimizer groups."""
        trained = set(ck.names())
        theirs = trained | set(ck.frozen_names())
        missing = [n for n in ours if n not in theirs]
        unexpected = sorted(n for n in theirs if n not in ours and n not in ck.shared)
        resized = [f"{n}: {list(ck.shape(n))} in the checkpoint, {_full_shape(p)} in the model"
                   for n, (_, p) in ours.items() if n in theirs and
                   list(ck.shape(n)) != _full_shape(p)]
        if resized:
            raise RuntimeError(f"load_checkpoint: DeepSpeed checkpoint {ck.path}: size mismatch "
                               f"for {'; '.join(resized)}")
        groups = len(self.optimizer.param_groups) if self.optimizer is not None else 0
        if moments and ck.param_group_hyper and len(ck.param_group_hyper) != groups:
            raise RuntimeError(f"load_checkpoint: DeepSpeed checkpoint {ck.path} has "
                               f"{len(ck.param_group_hyper)} optimizer param groups, this "
                               f"engine's optimizer {groups}: pass the groups the run that "
                               "saved it passed (load_optimizer_states=False takes the weights "
                               "alone)")
        # A save with exclude_frozen_parameters=True (a PEFT model's, as transformers asks)
        # leaves out frozen parameters, whose values the model has from its pretrained weights.
        frozen_left_out = bool(missing) and all(not ours[n][0].trainable for n in missing)
        if strict and (missing or unexpected):
            hint = (" (all missing ones are frozen here: a checkpoint saved with "
                    "exclude_frozen_parameters=True)" if frozen_left_out else "")
            raise RuntimeError(f"load_checkpoint: DeepSpeed checkpoint {ck.path} does not match "
                               f"the model (missing: {missing}; unexpected: {unexpected}){hint}; "
                               "load_module_strict=False loads the common ones")
        if missing or unexpected:
            (logger.info if frozen_left_out and not unexpected else logger.warning)(
                "strata: load_checkpoint(load_module_strict=False) from DeepSpeed checkpoint "
                "%s: %d of the model's parameter(s) not in it (%s), %d in it not in the model "
                "(%s)", ck.path, len(missing), _name_list(missing, 3), len(unexpected),
                _name_list(unexpected, 3))

    def _load_module_only(self, load_dir: str, tag: str, strict: bool):
        """The checkpoint's fp32 weights (strata.utils.read_checkpoint: each rank streams the
        whole model's fp32 weights from the rank files, 4 bytes per parameter) written as the
        initial weights
        (InitParameters: before the engine's first step only), and its buffers; the optimizer,
        the schedule and the counters stay as they are (fresh)."""
        from .utils.zero_to_fp32 import read_checkpoint_parts
        path = os.path.join(load_dir, tag)
        weights, state, left_out = read_checkpoint_parts(load_dir, tag)
        values, missing, resized = {}, [], []
        for g in self._groups:
            for name, p in g.params:
                w = weights.get(name)
                if w is None:
                    missing.append(name)
                elif list(w.shape) != _full_shape(p):
                    resized.append(f"{name}: {list(w.shape)} in the checkpoint, "
                                   f"{_full_shape(p)} in the model")
                else:
                    values[id(p)] = w
        if resized:  # torch's load_state_dict(strict=False) refuses these too
            raise RuntimeError(
                f"load_checkpoint(load_module_only=True): {path}: size mismatch for "
                f"{'; '.join(resized)} (load_module_strict=False skips missing and unexpected "
                "names, not another shape: load the checkpoint into the model as saved, then "
                "resize it, as resize_token_embeddings does)")
        unexpected = sorted(set(weights) - {n for g in self._groups for n, _ in g.params})
        if strict and (missing or unexpected):
            excluded = (f" ({len(left_out)} frozen parameter(s) left out at save: "
                        "exclude_frozen_parameters=True)" if left_out else "")
            raise RuntimeError(
                f"load_checkpoint(load_module_only=True): {path} does not match the model "
                f"(missing: {missing}{excluded}; unexpected: {unexpected}); "
                "load_module_strict=False loads the common ones")
        if missing or unexpected:
            logger.warning("strata: load_checkpoint(load_module_only=True, "
                           "load_module_strict=False) from %s loaded %d of the model's %d "
                           "parameter(s); %d not in the checkpoint (%s), %d in it not in the "
                           "model (%s)", path, len(values), len(values) + len(missing),
                           len(missing), _name_list(missing, 3), len(unexpected),
                           _name_list(unexpected, 3))
        self._write_master(values)
        self._load_buffers(state.get("buffers"), strict)
        return path, state.get("client_state", {})

    def _load_buffers(self, saved: Optional[dict], strict: bool) -> None:
        """The module's persistent buffers from a checkpoint's (rank 0's, as saved)."""
        if saved is None:
            return  # a checkpoint from before buffers were saved
        own = _persistent_buffers(self.module)
        missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_checkpoint: the checkpoint's buffers differ from the module's (missing: "
                f"{missing}, unexpected: {unexpected}); load_module_strict=False loads the "
                "common ones")
        with torch.no_grad():
            for name in own.keys() & saved.keys():
                if own[name].shape != saved[name].shape:
                    raise RuntimeError(f"load_checkpoint: buffer {name} has shape "
                                       f"{list(saved[name].shape)} in the checkpoint, "
                                       f"{list(own[name].shape)} in the module")
                own[name].copy_(saved[name])

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's state_dict with the working (16-bit, or fp32) parameters, written by rank 0:
        safetensors when save_filename ends in .safetensors, else torch.save. Collective."""
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(os.fspath(save_dir), save_filename)
        sd = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if sd is not None:
            tmp = path + ".tmp"
            if save_filename.endswith(".safetensors"):
                _write_safetensors(tmp, sd, {"format": "pt",
                                             "global_step": str(self.global_steps)})
            else:
                torch.save(sd, tmp)
            os.replace(tmp, path)
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False,
                                             all_ranks: bool = False):
        """As DeepSpeed's (which accelerate's get_state_dict and several trainers call): the
        module's state_dict with the working parameters gathered, copied to the CPU (tied names
        share one copy), on rank 0 and None on the others, or on every rank with all_ranks.
        At any stage. Collective."""
        with self.gathered_parameters():
            if self.global_rank != 0 and not all_ranks:
                return None
            tied = _tied_names(self.module)
            sd = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            out = {}
            for k, v in sd.items():
                out[k] = out[tied[k]] if tied.get(k) in out else v.detach().to("cpu", copy=True)
            return out


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
              torch.int8: "I8", torch.bool: "BOOL"}


def _write_safetensors(path: str, tensors: dict, metadata: dict) -> None:
    """The safetensors format: u64 LE header size, JSON header, the tensors' bytes back to back
    (each key its own bytes: tied weights are written twice, as state_dict names them)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    blobs, off = [], 0
    for k, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"save_16bit_model: no safetensors dtype for {k} ({t.dtype})")
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())


# DeepSpeed's OffloadStateTypeEnum values -> the engine's state kinds (contiguous_grad_buffer:
# the gradient buffers, which offload_states drops in any case).
_STATE_KINDS = {"lp_params": ["param16"], "hp_params": ["master32"],
                "optim_states": ["exp_avg", "exp_avg_sq"], "lp_grads": ["grad"],
                "contiguous_grad_buffer": []}


# The engines alive in this process (accelerator.memory_allocated counts their device bytes).
_LIVE_ENGINES: "weakref.WeakSet[StrataEngine]" = weakref.WeakSet()
# Parameters registered on any module of this process since the first engine (torch's global
# registration hook): an engine's forward compares its module's parameters with what it holds
# only when this moved, so the common forward pays nothing for _check_parameters_unchanged.
_PARAMS_REGISTERED = [0]
_REGISTRATION_HOOK: list = []


def _count_registration(module, name, param) -> None:
    _PARAMS_REGISTERED[0] += 1


def _watch_registrations() -> None:
    register = getattr(torch.nn.modules.module, "register_module_parameter_registration_hook",
                       None)
    if not _REGISTRATION_HOOK and register is not None:
        _REGISTRATION_HOOK.append(register(_count_registration))
    elif register is None:
        _PARAMS_REGISTERED[0] += 1  # no hook in this torch: every forward checks
_ENGINE_SERIALS = itertools.count()


def _weak_method(method):
    """A function calling `method` while its object lives, holding no reference to it. A tensor
    hook that held the engine would keep it alive for good: the hook is kept by the
    parameter's gradient accumulator in C++, where the garbage collector does not look, so a
    trainer dropped without closing its engine would leave the engine (its device memory, its
    swap files) behind until the process ends. Used on one rank only: on several, freeing an
    engine finalizes its communicator, which waits for every rank to do the same, and a
    collector's timing differs per rank (such an engine stays until close() or the end)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _close_open_engines() -> None:
    """At interpreter exit: the one-rank engines still open close, newest first, removing their
    swap files as close() does, so that a script that ends without close() leaves nothing the
    next run would take for a crashed run's leftovers. On several ranks closing finalizes the
    communicators, which waits for the other ranks: those engines are left to the process's end,
    and only their rank's swap files are removed (unlinked while open: their space is freed as
    the process ends)."""
    for e in sorted(_LIVE_ENGINES, key=lambda e: e._serial, reverse=True):
        if e._closed:
            continue
        try:
            if e.world_size == 1:
                e.close()
            else:
                for path in e._engine.swap_files:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        except Exception as err:  # noqa: BLE001 (exiting: say it, do not mask the exit)
            print(f"strata: closing an engine at exit failed: {err}", file=sys.stderr)


def _destroy_gloo_group() -> None:
    """At interpreter exit: a default group on gloo alone that the script left up (started by
    strata's init_distributed, by the script, by accelerate) is destroyed while the interpreter
    still runs. Gloo's threads drop the last references to the tensors of the last collectives
    behind the caller; one that does so once the interpreter is finalizing needs the GIL, is
    ended by Python, and the process aborts ("terminate called without an active exception")
    after the script succeeded. A group with NCCL in it is left to the script's own
    destroy_process_group(), as torch leaves it; so is a group of several processes when the
    script ends on an uncaught exception (a peer may still be in a collective, which destroying
    would wait for); a group of one has no peer, and a failed script's exit code stays 1."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return
    if hasattr(sys, "last_value") and dist.get_world_size() > 1:
        return
    config = str(dist.get_backend_config())
    if "gloo" not in config or "nccl" in config:
        return
    _release_pinned_group(dist.group.WORLD)
    dist.destroy_process_group()


def _release_pinned_group(group) -> None:
    """torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default
    argument, evaluated when the module is first imported (by torch._dynamo, which the first
    torch Optimizer imports): imported while `group` was up, ten functions hold it for the life
    of the process. Set to None, as they are when imported before any group, so that the
    destroyed group's threads end."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


def _at_exit() -> None:
    """The engines first (closing one may still use the group), then the group."""
    _close_open_engines()
    try:
        _destroy_gloo_group()
    except Exception as err:  # noqa: BLE001 (exiting: say it, do not mask the exit)
        print(f"strata: ending torch.distributed at exit failed: {err}", file=sys.stderr)


atexit.register(_at_exit)


def open_engines_of(model: torch.nn.Module) -> list:
    """The open engines that hold some of `model`'s parameters, oldest first."""
    holders = {id(e): e for p in model.parameters()
               if (e := getattr(p, "_strata_engine", None)) is not None and not e._closed}
    return sorted(holders.values(), key=lambda e: e._serial)


def _close_engines_holding(model: torch.nn.Module) -> None:
    """Closes, oldest first, the open engines that hold some of `model`'s parameters (a model
    trained before, passed to initialize again: a notebook cell run twice, a second Trainer),
    writing their weights back into the parameters first (at stage 3 closing leaves them empty),
    with a warning. Collective as initialize is: every rank holds the same engines."""
    for e in open_engines_of(model):
        warnings.warn("strata.initialize: the model's parameters are in an engine that is still "
                      "open; it is closed first and its weights are kept in the parameters "
                      "(close() or destroy() an engine when done with it)", stacklevel=4)
        e.close_keeping_weights()


def _refuse_parameters_a_closed_engine_emptied(model: torch.nn.Module) -> None:
    """At ZeRO stage 3 close() (and destroy()) leaves the parameters empty: a model trained and
    closed so holds no weights to start a new engine from."""
    names = [n for n, p in model.named_parameters()
             if p.numel() == 0 and getattr(p, "ds_numel", 0) > 0
             and (e := getattr(p, "_strata_engine", None)) is not None and e._closed]
    if names:
        raise ValueError(
            f"strata.initialize: {len(names)} parameter(s) of the model are empty "
            f"({_name_list(names, 3)}): the ZeRO stage-3 engine that trained it was closed with "
            "close() or destroy(), which leave them so. Close it with close_keeping_weights() to "
            "keep its weights in the model, or load them into a fresh model from a checkpoint "
            "(engine.load_checkpoint, strata.zero.GatheredParameters)")


def _collect_unreachable_engines() -> None:
    """Runs the garbage collector where an open engine of this process may be unreachable: a
    trainer replaced by a new one (a notebook cell run again), whose engines reference cycles
    keep alive until the collector runs, still holds its swap files (a new engine of the same
    rank and nvme_path is refused while they are in use) and its device memory (the new one's
    budget). Collected, they close."""
    if any(not e._closed for e in list(_LIVE_ENGINES)):
        gc.collect()


def _config_nvme_dirs(config: dict) -> set:
    """The nvme_path directories (real paths) a config's offload sections name."""
    dirs = set()
    zero = config.get("zero_optimization") or {}
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        paths = section.get("nvme_path") if isinstance(section, dict) else None
        if paths and section.get("device") == "nvme":
            for d in (paths if isinstance(paths, (list, tuple)) else [paths]):
                dirs.add(os.path.realpath(os.fspath(d)))
    return dirs


def nvme_dirs_in_use() -> set:
    """The nvme_path directories (real paths) of this process's open engines: each holds its
    rank's swap file in them, so another engine of that rank cannot start there until it
    closes."""
    _collect_unreachable_engines()
    return {d for e in list(_LIVE_ENGINES) if not e._closed for d in e._nvme_dirs}


def _engine_device_bytes(cuda_index: Optional[int], peak: bool) -> int:
    total = 0
    for e in list(_LIVE_ENGINES):
        index = None if e._cuda is None else e._cuda.index
        if index == cuda_index and not e._closed:
            total += e._engine.device_peak_bytes if peak else e._engine.device_used_bytes
    return total


def _group_hyper(group: dict) -> dict:
    """The Adam hyperparameters besides lr that a script or scheduler may write into a torch
    param group, as the engine takes them."""
    out = {}
    if "betas" in group:
        out["betas"] = tuple(float(b) for b in group["betas"])
    for k in ("eps", "weight_decay"):
        if k in group:
            out[k] = float(group[k])
    return out


class _EngineOptimizer(torch.optim.Optimizer):
    """What deepspeed.initialize returns as the optimizer: the engine's Adam, driven by
    engine.step(). param_groups are the groups' hyperparameters (the client optimizer's own list
    when one was passed): a torch LR scheduler may be built on it, and the lr a script or
    scheduler writes there is what the next engine.step() uses. The Adam state lives in the
    engine (partitioned, offloaded): engine.save_checkpoint / load_checkpoint save and restore it,
    so state_dict() and load_state_dict() refuse rather than return an empty state."""

    def __init__(self, engine: StrataEngine, groups: Optional[ParamGroups]):
        if groups is None:
            dicts = [{"params": [p for g in engine._groups for _, p in g.params]}]
        else:
            dicts = groups.dicts
        effective = engine._config.get("optimizer", {}).get("params", {})
        defaults = {"lr": float(effective.get("lr", 1e-3)),
                    "betas": tuple(effective.get("betas", (0.9, 0.999))),
                    "eps": float(effective.get("eps", 1e-8)),
                    "weight_decay": float(effective.get("weight_decay", 0.0))}
        super().__init__([dict(d) for d in dicts], defaults)
        self._client = None if groups is None else groups.client
        if self._client is not None:
            # The client's own groups (a scheduler built on the client writes there).
            self.defaults = dict(self._client.defaults)
            self.param_groups = self._client.param_groups
        self._engine = engine
        self._stepping = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_engine", None) is None:  # torch's __init__ adding the groups
            return super().add_param_group(param_group)
        raise RuntimeError("optimizer.add_param_group after strata.initialize is not supported: "
                           "the engine partitions and holds the groups it was initialized with "
                           "(give every group to the optimizer before initialize; DeepSpeed's "
                           "ZeRO optimizers have no add_param_group)")

    def step(self, closure=None):
        if not self._stepping:
            raise RuntimeError("call engine.step(), not optimizer.step(): the strata engine runs "
                               "the optimizer at engine.step() (it steps a scheduler passed to "
                               "initialize too)")

    def _mark_stepped(self) -> None:
        """Marks this optimizer (and a client's) as stepped for torch's LR schedulers."""
        self._stepping = True
        try:
            self.step()  # through a scheduler's wrapper, which records the call
        finally:
            self._stepping = False
        if self._client is not None:
            self._client._opt_called = True

    def state_dict(self):
        raise RuntimeError("the optimizer state lives in the strata engine (partitioned, "
                           "offloaded): save and restore it with engine.save_checkpoint() and "
                           "engine.load_checkpoint()")

    def load_state_dict(self, state_dict):
        self.state_dict()

    @property
    def loss_scale(self) -> float:
        """The loss scale in use (fp16's dynamic scale; 1 otherwise), as DeepSpeed's."""
        return self._engine._engine.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scale

    @property
    def overflow(self) -> bool:
        """As DeepSpeed's optimizers': whether the last optimizer step was skipped on an fp16
        overflow (accelerate's wrapper then holds a scheduler back)."""
        report = self._engine._last_report
        return bool(report and report["skipped"])

    @property
    def dynamic_loss_scale(self) -> bool:
        """As DeepSpeed's ZeRO optimizers': fp16 with a dynamic scale (its loss_scale 0)."""
        return self._engine.fp16_enabled() and self._engine.dynamic_loss_scale()

    @property
    def loss_scaler(self) -> "_LossScalerView":
        """DeepSpeed's optimizer.loss_scaler as scripts read it (cur_scale, loss_scale, dynamic):
        a read-only view of the engine's scaler."""
        return _LossScalerView(self)


class _LossScalerView:
    """engine.optimizer.loss_scaler: the scale in use and whether it moves; the engine's loss
    scaler (fp16's dynamic scaling) owns and updates it."""

    def __init__(self, optimizer: "_EngineOptimizer"):
        self._optimizer = optimizer

    @property
    def cur_scale(self) -> float:
        return self._optimizer.loss_scale

    @property
    def loss_scale(self) -> float:
        return self._optimizer.loss_scale

    @property
    def dynamic(self) -> bool:
        return self._optimizer.dynamic_loss_scale


class _EngineScheduler:
    """The config's scheduler (DeepSpeed's WarmupLR, WarmupDecayLR, ...), which the engine runs:
    engine.step() advances it after each applied step (a skipped one does not), as DeepSpeed's
    engine steps its scheduler object. Its position reads and moves as that object's:
    last_batch_iteration (-1 before the first step), step() / step(k), state_dict() and
    load_state_dict(); the lr of the next step follows (Engine::SetSchedulePosition)."""

    def __init__(self, engine: StrataEngine):
        self._engine = engine

    @property
    def last_batch_iteration(self) -> int:
        return self._engine._engine.schedule_position - 1

    @last_batch_iteration.setter
    def last_batch_iteration(self, k: int) -> None:
        if int(k) < -1:
            raise ValueError(f"last_batch_iteration {k}: the schedule starts at -1")
        self._engine._engine.schedule_position = int(k) + 1
        if not self._engine._client_lrs:  # param_groups show the next step's lr at once
            self._engine._pull_lrs()

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """As DeepSpeed's: one schedule step more than engine.step() took (or to k), on top of
        them; a script that also steps the scheduler advances it twice per step, as there."""
        self.last_batch_iteration = self.last_batch_iteration + 1 \
            if last_batch_iteration is None else last_batch_iteration

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]


# The schedulers DeepSpeed defines (deepspeed/runtime/lr_schedules.py), which the engine runs.
_DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _torch_scheduler_of(cfg: dict):
    """A config "scheduler" whose type DeepSpeed does not define: as DeepSpeed, the class of that
    name in torch.optim.lr_scheduler built on the returned optimizer with "params" as keyword
    arguments (a builder for StrataEngine, which steps it after each applied step). None for
    DeepSpeed's own, which the engine runs."""
    section = cfg.get("scheduler")
    if not section or section.get("type") in _DEEPSPEED_SCHEDULERS:
        return None
    name = section.get("type")
    cls = getattr(torch.optim.lr_scheduler, name, None) if isinstance(name, str) else None
    if not isinstance(cls, type) or name.startswith("_"):
        raise ValueError(f"config \"scheduler.type\": {name!r} is neither a DeepSpeed scheduler "
                         f"({', '.join(_DEEPSPEED_SCHEDULERS)}) nor a class of "
                         "torch.optim.lr_scheduler")
    params = dict(section.get("params") or {})

    def build(optimizer):
        try:
            return cls(optimizer, **params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"config \"scheduler.params\": torch.optim.lr_scheduler.{name}: "
                             f"{e}") from e
    return build


def _start_engine(model, cfg, groups, dist_init_required, nvme_paths, device_budget_bytes,
                  timeout_ms, overlap_step, lr_scheduler, device) -> "StrataEngine":
    """initialize's engine, for `groups` (ParamGroups), torch.distributed started as DeepSpeed's
    initialize starts it."""
    if groups.optimizer_section is not None:
        cfg["optimizer"] = groups.optimizer_section
    if dist_init_required is not False and _launched():
        # As DeepSpeed's initialize under its launcher: torch.distributed is up for the script
        # afterwards (its get_rank, barriers and metrics), whether or not it called
        # init_distributed itself. One process without a launcher is left as it is (strata.comm's
        # calls start a group of one when first used).
        init_distributed(dist_init_required=dist_init_required)
    _share_rendezvous_secret()
    rank, world = _env_rank_world()
    return StrataEngine(model, cfg, rank, world, nvme_paths=nvme_paths,
                        device_budget_bytes=device_budget_bytes, timeout_ms=timeout_ms,
                        overlap_step=overlap_step, param_groups=groups,
                        lr_scheduler=lr_scheduler, device=device)


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None,
               model_parameters: Optional[Iterable] = None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config: Optional[ConfigLike] = None, config_params=None,
               *, nvme_paths: Optional[list] = None, device_budget_bytes: Optional[int] = None,
               timeout_ms: Optional[int] = None, overlap_step: bool = False, device=None):
    """As deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The optimizer is the config's "optimizer" section (Adam / AdamW), or a client optimizer
    (`optimizer=`: torch.optim.Adam / AdamW, strata.optim.CPUAdam / FusedAdam, with its
    param_groups; the config then has no "optimizer" section), or the config's with
    `model_parameters` given as torch param-group dicts (strata/optim.py). It runs inside the
    engine, per group with the group's hyperparameters. The LR: the config's "scheduler" section
    (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest; another type is, as in
    DeepSpeed, that class of torch.optim.lr_scheduler with "params"), or `lr_scheduler=` (an object with step() that
    writes the optimizer's param_groups[i]["lr"], e.g. a torch.optim.lr_scheduler built on the
    client optimizer, or a callable that builds one from the returned optimizer), which
    engine.step() steps after each applied step, as DeepSpeed does; or whatever the script writes
    into the returned optimizer's param_groups, read at every step.
    overlap_step=True runs each optimizer step behind the next forward (EngineOptions::
    overlap_step: stage 3 with the optimizer offloaded; the same numbers; a failure of the step
    is raised by the next engine call that waits for it rather than by step()).
    The device: where the model's parameters are (a model on a GPU trains on that GPU, NCCL
    between ranks), or `device=` ("cuda", "cuda:N", "cpu"; the model is moved there); a model on
    the CPU moves, as DeepSpeed moves it, to the rank's GPU (LOCAL_RANK) where torch sees one, and
    otherwise runs on the host stand-in with Gloo (device="cpu" keeps it there on a GPU machine).
    device_budget_bytes bounds the engine's device memory (default on a GPU: its free memory less
    20 % of its size, at least 4 GiB, left to torch).
    Under a launcher (torchrun, `offloadctl launch`: its environment complete), torch.distributed
    is initialised where it is not yet (init_distributed), as DeepSpeed's initialize does,
    unless dist_init_required=False.
    A model whose every parameter is frozen (requires_grad=False: a reference model or a teacher
    that only runs forward) needs no optimizer: the engine partitions and gathers its parameters
    as any other's, keeps no optimizer state, and the optimizer returned is None.
    """
    if model is None:
        raise ValueError("strata.initialize: model is required")
    if config is None:
        config = config_params
    from_args = None if args is None else (getattr(args, "deepspeed_config", None) or
                                            getattr(args, "deepscale_config", None))
    if config is not None and from_args is not None:
        raise ValueError(f"strata.initialize: a config was passed and args.deepspeed_config "
                         f"({from_args}) names one too; pass one (DeepSpeed refuses both)")
    if config is None:
        config = from_args
    if config is None:
        raise ValueError("strata.initialize: config is required (a dict, JSON text or a path)")
    if mpu is not None:
        raise NotImplementedError("strata.initialize(mpu=...): model parallelism is not supported")
    if training_data is not None:
        _check_dataset(training_data)  # before the engine takes the model's parameters
    cfg = dict(_load(config))
    if lr_scheduler is not None and cfg.get("scheduler"):
        raise ValueError("strata.initialize: the config has a \"scheduler\" section and "
                         "lr_scheduler= was passed; use one")
    torch_scheduler = _torch_scheduler_of(cfg)
    named_scheduler = None
    if torch_scheduler is not None:
        lr_scheduler = torch_scheduler
        named_scheduler = cfg.pop("scheduler")  # the engine's schedule is the client one's
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
            and callable(optimizer):
        # As DeepSpeed: a callable (an optimizer class, a partial) builds the client optimizer
        # from the model's parameters.
        model_parameters = list(model.parameters() if model_parameters is None
                                else model_parameters)
        optimizer = optimizer(model_parameters)
    groups = ParamGroups(model, cfg, optimizer, model_parameters)
    if (cfg.get("zero_optimization") or {}).get("stage", 0) == 3:
        from .zero import _register_peft_lora_reads
        _register_peft_lora_reads(model)  # what PEFT's LoRA layers read, ahead (no notice)
    try:
        engine = _start_engine(model, cfg, groups, dist_init_required, nvme_paths,
                               device_budget_bytes, timeout_ms, overlap_step, lr_scheduler, device)
    except BaseException:
        for p in groups.frozen_here:  # the model as it was given
            p.requires_grad_(True)
        raise
    if groups.frozen_here:
        engine._forward_only = True
        if engine.global_rank == 0:
            logger.warning(
                "strata.initialize: no optimizer and no model_parameters: %s runs forward only, "
                "as under DeepSpeed; its %d trainable parameter(s) are frozen "
                "(requires_grad=False)", type(model).__name__, len(groups.frozen_here))
    engine._named_scheduler = named_scheduler  # scheduler_name() / scheduler_params()
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # as DeepSpeed aligns it with the launcher's
    engine.collate_fn = collate_fn
    # As DeepSpeed's: each rank's share of the data through a DistributedSampler (shuffled with
    # seed 0, the same order every epoch: set_epoch is never called), micro-batches of
    # train_micro_batch_size_per_gpu, dataloader_drop_last from the config.
    loader = None if training_data is None else engine.deepspeed_io(training_data)
    engine.training_dataloader = loader
    # No optimizer (a model with every parameter frozen, which only runs forward): None, as
    # DeepSpeed returns.
    optimizer_out = engine.optimizer if cfg.get("optimizer") else None
    return engine, optimizer_out, loader, engine.lr_scheduler


def _without_paths(config: dict, paths: list) -> dict:
    """`config` without the keys at the dotted `paths` (a copy where there are any)."""
    if not paths:
        return config
    config = copy.deepcopy(config)
    for path in paths:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return config


def _check_dataset(dataset) -> bool:
    """DeepSpeed's test of the data deepspeed_io takes: map-style (indexable with a length) or a
    torch IterableDataset (returned: whether it is iterable)."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if not iterable and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError("Training data must be a torch Dataset")
    return iterable


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _launched() -> bool:
    """A launcher's environment for torch.distributed is complete (torchrun, `offloadctl launch`,
    DeepSpeed's launcher)."""
    return all(k in os.environ for k in _LAUNCH_VARIABLES)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=None,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """As deepspeed.init_distributed: initialises torch.distributed for the script's own use
    (its barriers, metrics, get_rank) where it is not yet. Under a launcher (torchrun,
    `offloadctl launch`, deepspeed's: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    set) from that environment, or from `init_method`; `dist_backend` defaults to nccl where CUDA
    is available (the process's GPU set to LOCAL_RANK first) and gloo otherwise. One process
    without a launcher gets a group of one (RANK 0, WORLD_SIZE 1, LOCAL_RANK 0 set in the
    environment), where DeepSpeed would look for MPI. strata's engine keeps its own communicator
    either way. auto_mpi_discovery, distributed_port, verbose and config are accepted and not
    used."""
    if torch.distributed.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("strata.init_distributed(dist_init_required=False): torch.distributed "
                           "is not initialised")
    start_distributed("strata.init_distributed", dist_backend, timeout, init_method, rank,
                      world_size, set_env=True)


def start_distributed(caller: str, backend: Optional[str] = None, timeout=None,
                      init_method: Optional[str] = None, rank: int = -1, world_size: int = -1,
                      set_env: bool = False) -> None:
    """torch.distributed where it is not yet (init_distributed's rule, one place): from a
    launcher's environment or `init_method`, else a group of one (a HashStore, no port), with
    RANK / WORLD_SIZE / LOCAL_RANK set to a single process's where `set_env` (init_distributed,
    as DeepSpeed's MPI discovery sets them) or the environment left as it is (transformers'
    ZeRO-3 hook: accelerate, built afterwards, would read a LOCAL_RANK set here as a
    multi-process launch). A WORLD_SIZE above 1 without the rest of a launcher's environment is
    a RuntimeError naming `caller` and the missing variables."""
    dist = torch.distributed
    if dist.is_initialized():
        return
    from .accelerator import get_accelerator
    env = os.environ
    backend = backend or get_accelerator().communication_backend_name()
    # As DeepSpeed's init_distributed: DEEPSPEED_TIMEOUT (10 minutes) where none is given; the
    # engine waits as long (_engine_timeout_ms).
    kwargs = {"timeout": timeout if timeout is not None else _deepspeed_default_timeout()}
    if backend == "nccl":
        torch.cuda.set_device(_local_rank())
    if _launched() or init_method is not None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, **kwargs)
        return
    if int(env.get("WORLD_SIZE", "1")) != 1:
        missing = [k for k in _LAUNCH_VARIABLES if k not in env]
        raise RuntimeError(f"{caller}: WORLD_SIZE is {env['WORLD_SIZE']} but "
                           f"{' / '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                           "set: start the ranks with torchrun or `offloadctl launch`")
    if set_env:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            env.setdefault(key, value)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


_STORE_PORT: Optional[int] = None  # the port _engine_store_port picked for this process


def _engine_store_port(world_size: int) -> int:
    """The port the engine's rendezvous store listens on (0: MASTER_PORT). Where torch.distributed
    holds MASTER_PORT (a group the script or initialize started from the launcher's environment),
    rank 0 picks a free port and sends it to the others over that group: MASTER_PORT + 1, fixed,
    could be taken by then (the ranks' own connections draw local ports from that range). Under
    torchrun without a group, its agent's store holds MASTER_PORT: the port after it. Collective
    the first time a group is up (every rank creates its engines in the same order)."""
    global _STORE_PORT
    env = os.environ
    if world_size <= 1 or "MASTER_PORT" not in env:
        return 0
    dist = torch.distributed
    if _STORE_PORT is not None:
        return _STORE_PORT  # the process's store, which its engines share, already listens there
    if dist.is_initialized():
        import socket
        box = [None]
        if dist.get_rank() == 0:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("", 0))  # free on every interface, MASTER_ADDR's included
                box[0] = s.getsockname()[1]
        dist.broadcast_object_list(box, src=0)
        _STORE_PORT = int(box[0])
        return _STORE_PORT
    if "TORCHELASTIC_RUN_ID" in env:
        return int(env["MASTER_PORT"]) + 1
    return 0


def _share_rendezvous_secret() -> None:
    """Under torchrun, the engine's own rendezvous (rank 0 serves a TCP store on the port
    _engine_store_port gives) needs a secret every rank holds (cpu/rendezvous/rendezvous.h). `offloadctl
    launch` sets STRATA_RDZV_SECRET; torchrun does not, so rank 0 draws one and sends it over
    torch.distributed (initialised here with gloo from torchrun's environment when the script has
    not done it)."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= 1 or any(
            env.get(k) for k in ("STRATA_RDZV_SECRET", "STRATA_RDZV_INSECURE", "STRATA_RDZV_DIR")):
        return
    dist = torch.distributed
    if not dist.is_initialized():
        if "TORCHELASTIC_RUN_ID" not in env:
            return  # not torchrun: the engine's rendezvous says what is missing
        dist.init_process_group("gloo")
    import secrets
    box = [secrets.token_hex(32) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    env["STRATA_RDZV_SECRET"] = box[0]


def _load(config: ConfigLike) -> dict:
    if isinstance(config, dict):
        return config
    # JSON text, a path (its errors name the file; the comments DeepSpeed's reader allows are
    # taken), or base64: config.py's one rule.
    return load_config(config)
