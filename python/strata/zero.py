"""deepspeed.zero's context managers: Init (partition at construction) and GatheredParameters.

zero.Init: every nn.Module built inside the block keeps, when its outermost __init__ returns, only
this rank's stage-3 range of its own parameters (a group: the module's parameters with
recurse=False, in registration order, as strata.initialize groups them; the range is the one the
engine stores, strata._strata.owned_range), as an fp32 tensor; the parameter itself becomes empty
(ds_shape keeps its shape). strata.initialize then initialises the engine from those ranges, so no
rank ever holds more than its share of a module built later. As in DeepSpeed, a change made to a
partitioned parameter outside GatheredParameters(..., modifier_rank=...) is lost (it is empty).

Stage-3 parameters (zero.Init's, and every parameter of a stage-3 engine) carry DeepSpeed's
`ds_id` (unique in the process), `ds_status` (ZeroParamStatus: AVAILABLE while whole, else
NOT_AVAILABLE) and `ds_tensor` (a meta tensor of this rank's part's size), beside `ds_shape` and
`ds_numel`: scripts written for DeepSpeed pick the parameters to gather with them
(`hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE`) and count parameters
(`p.ds_numel if hasattr(p, "ds_tensor") else p.numel()`).

GatheredParameters: the parameters whole (the engine's working dtype) inside the block; with
modifier_rank, that rank's values at the end of the block are written back to every rank's
shard (torch.distributed broadcasts them when more than one process runs). Before an engine's
first step the write sets the weights, fp32 masters included (custom initialisation); after it,
as in DeepSpeed once its optimizer exists, the working parameters only (Engine::WriteParams): the
next step recomputes them from the masters, so a change made to be saved (a LoRA adapter fused
into its base weights) stands until then. The engine warns once when it writes that way.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import json
from typing import Iterable, Optional, Union

import warnings

import torch

from . import _strata
from .config import ConfigLike


class ZeroParamStatus(enum.Enum):
    """deepspeed.runtime.zero.partition_parameters.ZeroParamStatus: a stage-3 parameter's
    `ds_status`. strata gathers synchronously, so INFLIGHT is never set."""
    AVAILABLE = 1  # whole: p.data holds ds_shape's values
    NOT_AVAILABLE = 2  # partitioned: p.data is empty
    INFLIGHT = 3


_ds_ids = itertools.count()


def _mark_partitioned(p: torch.nn.Parameter, part_numel: int) -> None:
    """DeepSpeed's stage-3 attributes on p (ds_id once, in creation order) with p empty.
    ds_tensor is a meta tensor of this rank's part's size (part_numel elements): scripts test for
    it (`hasattr(p, "ds_tensor")`) and count with it; its values stay in the engine, so reading
    them fails (a meta tensor has none)."""
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_ds_ids)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.ds_tensor = torch.empty(part_numel, dtype=p.dtype, device="meta")


def _owned_parts(numels: list, world: int, rank: int) -> list:
    """[(begin, end)] per parameter of a group whose parameters have `numels` elements: the rank's
    stage-3 range of the group (strata._strata.owned_range) cut at parameter bounds, in
    parameter-local indices; (0, 0) for a parameter the rank holds none of."""
    lo, hi = _strata.owned_range(sum(numels), world, rank)
    parts, off = [], 0
    for n in numels:
        b, e = max(lo, off) - off, min(hi, off + n) - off
        parts.append((b, e) if b < e else (0, 0))
        off += n
    return parts


class _Part:
    """This rank's range [begin, end) of one parameter (parameter-local element indices)."""
    __slots__ = ("group_ids", "begin", "end", "shard")

    def __init__(self, group_ids, begin, end, shard):
        self.group_ids = group_ids
        self.begin = begin
        self.end = end
        self.shard = shard  # fp32, end - begin values


def _rank_world():
    from .engine import _env_rank_world
    return _env_rank_world()


def _partition_module(module: torch.nn.Module, rank: int, world: int, dtype=None) -> None:
    """Keeps this rank's range of each of `module`'s own parameters (cast to `dtype` first where
    given), emptying the parameter (the module docstring)."""
    every = list(module.parameters(recurse=False))
    own = [p for p in every if getattr(p, "_strata_part", None) is None
           and getattr(p, "_strata_engine", None) is None]
    if not own:
        return  # no parameters, or only ones another module owns (tied): no group of its own
    if len(own) != len(every):
        raise NotImplementedError(
            f"strata.zero.Init: {type(module).__name__} mixes new parameters with ones another "
            "module owns; tie parameters after construction instead")
    ids = tuple(id(p) for p in own)
    for p, (b, e) in zip(own, _owned_parts([p.numel() for p in own], world, rank)):
        # The shard waits on the host; the empty placeholder keeps the parameter's device, which
        # tells strata.initialize where the engine runs.
        if dtype is not None:
            p.data = p.data.to(dtype)
        # Rank 0's values (DeepSpeed's zero.Init broadcasts each parameter from rank 0 before
        # partitioning it): ranks seeded apart, or not seeded at all, get one model, as
        # strata.initialize takes rank 0's weights for a model built whole. In place: the
        # parameter is emptied below.
        full = _broadcast(p.detach(), 0, world, "strata.zero.Init")
        shard = full.reshape(-1)[b:e].to(device="cpu", dtype=torch.float32).clone()
        p.ds_shape = p.shape
        p.ds_numel = p.numel()
        p._strata_part = _Part(ids, b, e, shard)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        _mark_partitioned(p, e - b)


def _partition_tree(model: torch.nn.Module, rank: int, world: int, dtype=None) -> None:
    """Partitions every module of an existing model, each after its children (the order in
    which their construction would end under zero.Init, which decides who owns a tied one)."""
    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            visit(child)
        _partition_module(m, rank, world, dtype)
    visit(model)


# zero.Init blocks entered and not yet left: only the outermost partitions (DeepSpeed's rule).
_init_depth = 0


class Init:
    """with strata.zero.Init(config=ds_config): model = Model()

    Partitions every module's parameters as its construction ends (see the module docstring),
    those of classes defined or first imported inside the block too (as DeepSpeed's).
    Needs zero_optimization.stage 3 in the config where one is given (none: stage 3, as
    DeepSpeed's `with deepspeed.zero.Init():`); the world size is torch.distributed's, else
    WORLD_SIZE (torchrun, offloadctl launch). From then on `import deepspeed` in a library gives
    strata (strata.register_as_deepspeed), unless DeepSpeed is installed or imported. Nested
    blocks partition once, as the outermost one says (transformers' from_pretrained opens one
    inside strata's). Like DeepSpeed's, it patches the module classes of the whole process while
    the outermost block is open: build models under it from one thread at a time. Each
    parameter is rank 0's (broadcast before it is partitioned, as DeepSpeed's), so with more
    than one process it starts torch.distributed from the launcher's environment where the
    script has not. `module=model` partitions a model built before, at once, as if it had been
    built in the block. Arguments strata has no use for (remote_device,
    pin_memory, mem_efficient_linear) are accepted; data_parallel_group, mpu and sequence data
    parallelism are refused with NotImplementedError.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        for name, v in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                        ("zero_param_parallel_group", zero_param_parallel_group),
                        ("sequence_data_parallel_group", sequence_data_parallel_group),
                        ("param_swapper", param_swapper)):
            if v is not None:
                raise NotImplementedError(f"strata.zero.Init({name}=...) is not supported: strata "
                                          "partitions over every rank of the job")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("strata.zero.Init: quantized weights are not supported")
        self.enabled = enabled
        cfg = config if config is not None else config_dict_or_path
        if enabled:
            from .config import zero_stage
            from .engine import _load
            # No config: stage 3, as DeepSpeed's Init assumes (`with deepspeed.zero.Init():`);
            # an engine of a lower stage then refuses the partitioned parameters at initialize.
            stage = 3 if cfg is None else zero_stage(_load(cfg))
            if stage != 3:
                raise ValueError(f"strata.zero.Init needs zero_optimization.stage 3 (the config "
                                 f"says {stage}): below it every rank holds the whole model")
            # Libraries that meet these parameters and `import deepspeed` to gather them get
            # strata (strata.register_as_deepspeed).
            from .deepspeed_name import register_as_deepspeed
            register_as_deepspeed(required=False)
        self.rank, self.world = _rank_world()
        self.dtype = dtype
        self._patched = []
        self._active = False  # between the outermost __enter__ and its __exit__
        if enabled and self.world > 1:  # DeepSpeed's Init starts it too: rank 0's values
            from .engine import start_distributed
            start_distributed("strata.zero.Init")
        if module is not None and enabled:  # an existing model: partitioned now, as if built here
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"strata.zero.Init(module=...): expected an nn.Module, got "
                                f"{type(module).__name__}")
            _partition_tree(module, self.rank, self.world, dtype)

    def __enter__(self):
        global _init_depth
        if not self.enabled:
            return self
        _init_depth += 1
        if _init_depth > 1:
            return self  # nested (transformers inside strata's from_pretrained): the outer one's
        classes, todo = set(), [torch.nn.Module]
        while todo:
            c = todo.pop()
            for sub in c.__subclasses__():
                if sub not in classes:
                    classes.add(sub)
                    todo.append(sub)
        classes.add(torch.nn.Module)
        self._active = True
        for c in classes:
            self._patch(c)
        # Classes created inside the block (defined there, or imported there for the first
        # time: transformers' lazy modules) are patched as they are created, as DeepSpeed's
        # zero.Init does through __init_subclass__.
        init = self

        def __init_subclass__(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            init._patch(cls)
        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def _patch(self, c: type) -> None:
        if "__init__" in c.__dict__:
            orig = c.__dict__["__init__"]
            c.__init__ = self._wrap(orig)
            self._patched.append((c, orig))

    def _wrap(self, orig):
        init = self

        def __init__(module, *args, **kwargs):
            if not init._active:  # left in place by a decorator that wrapped it (__exit__)
                return orig(module, *args, **kwargs)
            depth = module.__dict__.get("_strata_init_depth", 0)
            object.__setattr__(module, "_strata_init_depth", depth + 1)
            try:
                orig(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_strata_init_depth", depth)
            if depth == 0:  # the outermost __init__ of this object: construction is over
                _partition_module(module, init.rank, init.world, init.dtype)
        __init__.__wrapped__ = orig
        return __init__

    def __exit__(self, *exc):
        global _init_depth
        if not self.enabled:
            return False
        _init_depth -= 1
        if _init_depth == 0:  # the outermost block ends (the same object may be entered twice)
            del torch.nn.Module.__init_subclass__  # object's again
            self._active = False
            for c, orig in reversed(self._patched):
                # A class created in the block may have had its __init__ wrapped again after
                # ours (a class decorator runs after __init_subclass__: transformers'
                # use_kernelized_func): restoring `orig` would drop that wrapper, so ours stays
                # inside it, inert now.
                if getattr(c.__dict__.get("__init__"), "__wrapped__", None) is orig:
                    c.__init__ = orig
            self._patched = []
        return False


def _broadcast(t: torch.Tensor, src: int, world: int, what: str) -> torch.Tensor:
    """t with rank src's values (torch.distributed): in place where t is on the backend's device
    (the GPU for NCCL), else in a copy there. `what` names the caller in the error raised when
    torch.distributed is not initialised."""
    if world == 1:
        return t
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} with more than one process needs torch.distributed "
                           "initialised (strata.zero.Init starts it from torchrun's or offloadctl "
                           "launch's environment; else call torch.distributed.init_process_group)")
    t = _on_backend_device(t)
    if not t.is_contiguous():
        t = t.contiguous()
    dist.broadcast(t, src)
    return t


def _on_backend_device(t: torch.Tensor) -> torch.Tensor:
    """t where torch.distributed's default group can reduce it: a copy on this process's GPU
    under NCCL (GPU tensors only), else t."""
    if torch.distributed.get_backend() == "nccl" and t.device.type != "cuda":
        return t.to(f"cuda:{torch.cuda.current_device()}")
    return t


def _gather_parts(params: list, rank: int, world: int):
    """Whole tensors from zero.Init partitions (not yet in an engine): all-gather of the ranges."""
    out = []
    for p in params:
        part = p._strata_part
        full = torch.zeros(p.ds_numel, dtype=torch.float32)
        full[part.begin:part.end] = part.shard
        if world > 1:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise RuntimeError("strata.zero.GatheredParameters on zero.Init parameters with "
                                   "more than one process needs torch.distributed initialised")
            full = _on_backend_device(full)
            torch.distributed.all_reduce(full)  # ranges are disjoint: the sum is the whole
            full = full.cpu()
        out.append(full)
    return out


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """As DeepSpeed's: `module`'s forward uses `parameter`, which another module owns (a tied
    head written as `x @ self.emb.weight.t()`). At stage 3 each call of `module` gathers the
    parameter's group with its own (and backward gathers it again); stages 0-2 keep every
    parameter whole, so there it changes nothing. Before or after strata.initialize. Without it,
    strata gathers a parameter read during the engine's forward and registers it the same way,
    with a notice (one per module)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    module.__dict__.setdefault("_strata_external", {})[id(parameter)] = parameter
    engine = getattr(parameter, "_strata_engine", None)
    if engine is not None:
        engine._hook_module(module)


def _register_peft_lora_reads(model: torch.nn.Module) -> None:
    """PEFT's LoRA layer reads its adapters' weights (lora_A[...].weight.dtype, the embedding
    adapters' lora_embedding_A / _B) in its own forward, which does not own them, DoRA's
    magnitude module the base weight and the adapters, IA3's layer its ia3_l vectors: registered
    ahead as external parameters of the reading module, so stage 3 gathers them with its call
    without a notice. strata.initialize does it at stage 3
    for every model (nothing without peft or LoRA layers)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return
    try:
        from peft.tuners.ia3 import IA3Layer
    except ImportError:
        IA3Layer = None
    for m in model.modules():
        if isinstance(m, LoraLayer):
            adapters = [p for name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
                        for p in getattr(m, name, torch.nn.ModuleDict()).parameters()]
            for p in adapters:
                register_external_parameter(m, p)
            # DoRA: each magnitude module's forward reads the base weight and the adapters.
            for magnitude in getattr(m, "lora_magnitude_vector", torch.nn.ModuleDict()).values():
                if not isinstance(magnitude, torch.nn.Module):
                    continue  # PEFT before 0.12: a Parameter, read by the layer itself
                for p in (*m.get_base_layer().parameters(), *adapters):
                    register_external_parameter(magnitude, p)
        elif IA3Layer is not None and isinstance(m, IA3Layer):  # reads its ia3_l vectors
            for p in getattr(m, "ia3_l", torch.nn.ParameterDict()).parameters():
                register_external_parameter(m, p)


def unregister_external_parameter(module: torch.nn.Module,
                                  parameter: torch.nn.Parameter) -> None:
    """Undoes register_external_parameter (as DeepSpeed's). Once a module has none left, a
    parameter read there again gets the notice again."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    external = module.__dict__.get("_strata_external", {})
    external.pop(id(parameter), None)
    if not external:
        module.__dict__.pop("_strata_noticed", None)
        engine = getattr(parameter, "_strata_engine", None)
        if engine is not None:
            engine._noticed_classes.discard(type(module))


class GatheredParameters:
    """The parameters whole inside the block; see the module docstring for modifier_rank. As
    DeepSpeed's class: `params` (those ZeRO-3 partitions: strata's engine or zero.Init hold
    them), `src_rank` (modifier_rank) and `enabled` (False where none is partitioned), which
    wrappers read; modifier_rank's values are kept when the block raises, as DeepSpeed's exit
    broadcasts them whatever the block did."""

    def __init__(self, params: Union[Iterable, torch.nn.Parameter],
                 modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        given = [p for p in params if p is not None] if enabled else []
        self.params = [p for p in given if hasattr(p, "ds_id") or
                       getattr(p, "_strata_engine", None) is not None or
                       getattr(p, "_strata_part", None) is not None]
        self.src_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._given, self._fwd_module, self._open = given, fwd_module, None

    def __enter__(self):
        if not self._given:
            return None
        self._open = _gathered(self._given, self.src_rank, self._fwd_module)
        return self._open.__enter__()

    def __exit__(self, *exc):
        opened, self._open = self._open, None
        return False if opened is None else opened.__exit__(*exc)


@contextlib.contextmanager
def _gathered(params: list, modifier_rank: Optional[int], fwd_module):
    if fwd_module is not None:  # as DeepSpeed: fwd_module's forward uses them from now on
        for p in params:
            register_external_parameter(fwd_module, p)
            # Inside the engine's forward (PEFT's AdaLoRA regulariser, in fwd_module's own
            # forward): the call in progress began before the registration, so it holds them,
            # and its backward gathers them for what the block computes.
            engine = getattr(p, "_strata_engine", None)
            if engine is not None:
                engine._hold_in_running_call(p)
    rank, world = _rank_world()
    engines, parted = {}, []
    for p in params:
        e = getattr(p, "_strata_engine", None)
        if e is not None:
            engines.setdefault(id(e), (e, set()))[1].add(e._group_of[id(p)])
        elif getattr(p, "_strata_part", None) is not None:
            parted.append(p)
    # zero.Init parameters before strata.initialize: whole (fp32 -> their dtype) in the block.
    if parted:
        for p, full in zip(parted, _gather_parts(parted, rank, world)):
            p.data = full.to(p.dtype if p.dtype.is_floating_point else torch.float32).view(
                p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE
    writes = []
    try:
        yield from _gathered_block(engines, parted, modifier_rank, world, writes)
    finally:
        for e, values in writes:  # after the release: the engine rewrites masters and params,
            # or once it has stepped (DeepSpeed's optimizer exists then) the working params only
            if e._engine.global_step > 0:
                e._write_params(values)
            else:
                e._write_master(values)


def _warn_unkept_writes(versions: dict) -> None:
    """A parameter written in place inside a GatheredParameters block without modifier_rank
    (its version counter moved): DeepSpeed discards the write (its sanity checks raise "Use
    modifier_rank"); here it may stand in the working copy until the next step, or be dropped
    with the gathered copy (several ranks, offloaded parameters). Warned, naming it; a write
    through .data moves no counter and goes unseen."""
    moved = [p for p, version in versions.values() if p._version != version]
    if moved:
        engine = moved[0]._strata_engine
        warnings.warn(
            f"strata: parameter {engine._param_name(moved[0])} was written inside "
            "GatheredParameters without modifier_rank: as under DeepSpeed the write is not "
            "kept (the next step, or the release of the gathered copy, drops it); pass "
            "modifier_rank=0 to keep it", stacklevel=4)


def _gathered_block(engines: dict, parted: list, modifier_rank, world: int, writes: list):
    """GatheredParameters' block: the engines' groups gathered, the zero.Init parts whole;
    at its end modifier_rank's values broadcast into `writes` (engine parameters) and the parts
    (zero.Init ones)."""
    with contextlib.ExitStack() as stack:
        for e, groups in engines.values():
            stack.enter_context(e.gathered_parameters(sorted(groups)))
        versions = {} if modifier_rank is not None else {  # stage 3 (else whole: no gather)
            id(p): (p, p._version) for e, groups in engines.values() if not e._whole
            for gi in groups for _, p in e._groups[gi].params}
        try:
            yield
        finally:
            _warn_unkept_writes(versions)
            if modifier_rank is not None:
                for e, groups in engines.values():
                    members = [p for gi in sorted(groups) for _, p in e._groups[gi].params]
                    writes.append((e, {id(p): _broadcast(
                        p.data.detach().to(torch.float32).clone(), modifier_rank, world,
                        "strata.zero.GatheredParameters(modifier_rank=...)") for p in members}))
                for p in parted:
                    full = _broadcast(p.data.detach().to(torch.float32).reshape(-1).clone(),
                                      modifier_rank, world,
                                      "strata.zero.GatheredParameters(modifier_rank=...)")
                    part = p._strata_part
                    part.shard = full[part.begin:part.end].clone()
            for p in parted:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE


# -- ZeRO-3 leaf modules (deepspeed.utils.z3_leaf_module) ------------------------------------------
# A leaf module's whole subtree is one unit at stage 3: strata.initialize makes its parameters one
# group (gathered, reduced and placed together: the planner and the engine count it as one) and
# hooks the leaf alone. For mixture-of-experts blocks, whose experts run in an order (and a set)
# that changes with every batch: the block is gathered once per call, whichever experts run. Set
# before strata.initialize. DeepSpeed 0.19 makes these classes leaves unless the config's
# zero_optimization.leaf_module says otherwise:
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether `module` is a ZeRO-3 leaf (set_z3_leaf_modules)."""
    return bool(getattr(module, "_z3_leaf", False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if z3_leaf_module(m)]


def _qualified(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _set_leaf_classes(model, classes, flag: bool, raise_if_not_found: bool) -> list:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be classes or class names, got {classes}")
    found = []
    for m in model.modules():
        if any((isinstance(c, type) and isinstance(m, c)) or
               (isinstance(c, str) and c in (type(m).__name__, _qualified(m))) for c in classes):
            m._z3_leaf = flag
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {list(classes)} found in model "
                         f"{type(model).__name__}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes,
                        raise_if_not_found: bool = True) -> list:
    """As deepspeed.utils.set_z3_leaf_modules: every module of `model` of one of the classes
    (classes, or their names, plain or qualified) becomes a ZeRO-3 leaf; the modules flagged.
    ValueError when none matches (unless raise_if_not_found=False)."""
    return _set_leaf_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes,
                          raise_if_not_found: bool = True) -> list:
    """Undoes set_z3_leaf_modules for those classes (before strata.initialize)."""
    return _set_leaf_classes(model, leaf_module_classes, False, raise_if_not_found)


def _set_leaf_where(model, match, flag: bool = True) -> list:
    found = []
    for name, m in model.named_modules():
        if name and match(name):
            m._z3_leaf = flag
            found.append(m)
    return found


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):
    """As DeepSpeed's: the modules with these qualified names; (modules, names not found)."""
    names = [module_names] if isinstance(module_names, str) else list(module_names)
    found = _set_leaf_where(model, lambda n: n in names, flag)
    present = {n for n, _ in model.named_modules()}
    missing = [n for n in names if n not in present]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """As DeepSpeed's: the modules whose qualified name ends with one of the suffixes."""
    suffixes = [module_name_suffixes] if isinstance(module_name_suffixes, str) \
        else list(module_name_suffixes)
    found = _set_leaf_where(model, lambda n: any(n.endswith(s) for s in suffixes), flag)
    names = [n for n, _ in model.named_modules() if n]
    missing = [s for s in suffixes if not any(n.endswith(s) for n in names)]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model "
                         f"{type(model).__name__}")
    return found, missing


def apply_leaf_module_config(model: torch.nn.Module, leaf_cfg: Optional[dict]) -> list:
    """zero_optimization.leaf_module as DeepSpeed applies it (its shape checked by the config
    checker): `classes` (default DEFAULT_LEAF_MODULE_CLASSES), `names` and `name_suffixes`, each
    a string or a list; what none of them matches is left alone. The modules made leaves."""
    cfg = dict(leaf_cfg or {})

    def listed(key, default):
        v = cfg.get(key, default)
        return [v] if isinstance(v, str) else list(v)
    found = set_z3_leaf_modules(model, listed("classes", DEFAULT_LEAF_MODULE_CLASSES),
                                raise_if_not_found=False)
    found += set_z3_leaf_modules_by_name(model, listed("names", []), raise_if_not_found=False)[0]
    found += set_z3_leaf_modules_by_suffix(model, listed("name_suffixes", []),
                                           raise_if_not_found=False)[0]
    return list({id(m): m for m in found}.values())
