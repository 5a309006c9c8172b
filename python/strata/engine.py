"""The PyTorch adapter: `strata.initialize`, a drop-in for `deepspeed.initialize`.

How parameters move (this version: whole-model gathering, correct for every ZeRO stage):
  - groups: each module that owns parameters directly (recurse=False) is one engine group, in
    module registration order; a parameter shared by several modules (tied embeddings) belongs to
    the first and is gathered, and its gradient reduced, once.
  - forward: every group is gathered and each parameter's .data becomes a zero-copy view of the
    engine's gathered buffer (torch.from_dlpack; the engine's working dtype: bf16 / fp16 / fp32).
  - backward(loss): autograd runs on (loss x loss scale) with the gathered views; then each
    group's .grad tensors are copied into the engine's gradient buffer and reduced (the engine
    averages over ranks and over gradient_accumulation_steps), and the groups are released.
  - outside forward/backward the parameters are empty tensors, as in DeepSpeed ZeRO-3; use
    engine.gathered_parameters() (or strata.zero.GatheredParameters) to see them whole.
The gathered working set is the whole model (stage 3 still keeps only a shard between steps);
per-module gathering with forward hooks is future work.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterable, Optional

import torch

from . import _strata
from .config import ConfigLike, check_config, ConfigError

_UNSUPPORTED_TOP_LEVEL = {
    "amp": "apex AMP (use bf16 or fp16 sections)",
    "compression_training": "compression training",
    "sparse_attention": "sparse attention",
    "pipeline": "pipeline parallelism",
    "flops_profiler": None,  # accepted, ignored (a note)
}


def _env_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _Group:
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: list):
        self.name = name
        self.params = params  # [(qualified name, nn.Parameter)]


def _make_groups(model: torch.nn.Module) -> list[_Group]:
    seen: set[int] = set()
    groups = []
    for mname, module in model.named_modules():
        own = []
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # tied: owned by the first module that registered it
            seen.add(id(p))
            if not p.requires_grad:
                raise NotImplementedError(
                    f"parameter {mname}.{pname} has requires_grad=False: frozen parameters are "
                    "not supported by strata yet")
            own.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            groups.append(_Group(mname or "<root>", own))
    if not groups:
        raise ValueError("the model has no parameters")
    return groups


class StrataEngine(torch.nn.Module):
    """The training engine deepspeed.initialize returns (DeepSpeedEngine's names)."""

    def __init__(self, model: torch.nn.Module, config: dict, rank: int, world_size: int,
                 nvme_paths: Optional[list] = None, device_budget_bytes: int = 8 << 30,
                 timeout_ms: int = 300000):
        super().__init__()
        self.module = model
        self._config = config
        self._groups = _make_groups(model)
        check = check_config(config, world_size=world_size)
        if not check["ok"]:
            raise ConfigError("invalid DeepSpeed config:\n" +
                              "\n".join(e["text"] for e in check["errors"]))
        eff = json.loads(check["effective_json"])
        self._effective = eff
        self._gas = int(eff.get("gradient_accumulation_steps") or 1)
        self._micro_batch = eff.get("train_micro_batch_size_per_gpu")
        master_port = 0
        if world_size > 1 and "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_PORT" in os.environ:
            master_port = int(os.environ["MASTER_PORT"]) + 1  # torchrun's store holds MASTER_PORT
        spec = [(g.name, [(n, list(p.shape)) for n, p in g.params]) for g in self._groups]
        self._engine = _strata.Engine(spec, json.dumps(config), rank, world_size,
                                      nvme_paths or [], device_budget_bytes, timeout_ms, "auto",
                                      master_port)
        self._dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}[self._engine.dtype]
        init = [[p.detach().to(torch.float32).contiguous().cpu().numpy() for _, p in g.params]
                for g in self._groups]
        self._engine.init_from_tensors(init)
        self._shapes = [{n: list(p.shape) for n, p in g.params} for g in self._groups]
        for g in self._groups:
            for _, p in g.params:
                p._strata_engine = self  # strata.zero.GatheredParameters finds the engine
        self._release_all()  # parameters are empty until gathered
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._last_report: Optional[dict] = None
        self._pending_grads = False

    # -- parameters --------------------------------------------------------------------------
    def _gather_all(self) -> None:
        for gi, g in enumerate(self._groups):
            if self._engine.is_gathered(gi):
                continue
            views = self._engine.gather(gi)
            for (_, p), v in zip(g.params, views):
                p.data = torch.from_dlpack(v)

    def _release_all(self) -> None:
        empty = torch.empty(0, dtype=self._dtype)
        for gi, g in enumerate(self._groups):
            for _, p in g.params:
                p.data = empty
            self._engine.release(gi)

    @contextlib.contextmanager
    def gathered_parameters(self):
        """The full parameters (working dtype, read-only) inside the block."""
        was = [self._engine.is_gathered(i) for i in range(len(self._groups))]
        self._gather_all()
        try:
            yield
        finally:
            if not any(was):
                self._release_all()

    def read_master(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master weights by qualified name (collective)."""
        out = {}
        for gi, g in enumerate(self._groups):
            flat = torch.from_numpy(self._engine.read_master(gi))
            off = 0
            for name, _ in g.params:
                shape = self._shapes[gi][name]
                n = int(torch.Size(shape).numel())
                out[name] = flat[off:off + n].view(shape).clone()
                off += n
        return out

    # -- the training loop (DeepSpeedEngine's API) --------------------------------------------
    def forward(self, *args, **kwargs):
        self._gather_all()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """loss.backward() with the loss scale; the engine averages over ranks and micro-steps
        (gradient_accumulation_steps), as DeepSpeed's scale_wrt_gas does."""
        scale = self._engine.loss_scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        for gi in reversed(range(len(self._groups))):
            views = self._engine.grad_buffer(gi)
            for (name, p), v in zip(self._groups[gi].params, views):
                if p.grad is not None:
                    torch.from_dlpack(v).copy_(p.grad)
                    p.grad = None
            self._engine.reduce_gradients(gi)
        self._release_all()
        self._pending_grads = True
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._gas == 0

    def step(self, lr_kwargs=None) -> None:
        """The optimizer step at the accumulation boundary; a no-op between."""
        if lr_kwargs is not None:
            raise NotImplementedError("step(lr_kwargs=...) is not supported by strata")
        if self.is_gradient_accumulation_boundary():
            self._release_all()
            self._last_report = self._engine.step()
            self.global_steps = self._last_report["global_step"]
            self._pending_grads = False
        self.micro_steps += 1
        if self._micro_batch:
            self.global_samples += int(self._micro_batch) * self._engine.world_size

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self._groups:
            for _, p in g.params:
                p.grad = None

    def get_lr(self) -> list[float]:
        return [self._engine.lr]

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self._last_report is None else self._last_report["grad_norm"]

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self._micro_batch

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    @property
    def global_rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def last_step_report(self) -> Optional[dict]:
        return self._last_report

    def stats(self) -> dict:
        """Per-tier bytes (moved, used, peak, budget), comm bytes, wait and optimizer times."""
        s = self._engine.stats()
        s["layout"] = self._engine.layout()
        return s

    def layout(self) -> dict:
        return self._engine.layout()

    def close(self) -> None:
        self._engine.close()

    # -- DeepSpeed features strata does not have: a clear error naming each ------------------
    def save_checkpoint(self, *a, **k):
        raise NotImplementedError("save_checkpoint: strata has no checkpoint support yet")

    def load_checkpoint(self, *a, **k):
        raise NotImplementedError("load_checkpoint: strata has no checkpoint support yet")

    def save_16bit_model(self, *a, **k):
        raise NotImplementedError("save_16bit_model: not supported by strata yet "
                                  "(engine.read_master() returns the fp32 weights)")


class _EngineOptimizer:
    """What deepspeed.initialize returns as the optimizer: the engine's Adam, driven by
    engine.step(); param_groups report the current learning rate."""

    def __init__(self, engine: StrataEngine):
        self._engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return [{"lr": self._engine.get_lr()[0],
                 "params": [p for g in self._engine._groups for _, p in g.params]}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def step(self, *a, **k):
        raise RuntimeError("call engine.step(), not optimizer.step(): the engine runs the optimizer")

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale


class _EngineScheduler:
    """The config's scheduler, stepped by engine.step() (skipped steps do not advance it)."""

    def __init__(self, engine: StrataEngine):
        self._engine = engine

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def step(self, *a, **k) -> None:
        pass  # engine.step() advances the schedule


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None,
               model_parameters: Optional[Iterable] = None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config: Optional[ConfigLike] = None, config_params=None,
               *, nvme_paths: Optional[list] = None, device_budget_bytes: int = 8 << 30,
               timeout_ms: int = 300000):
    """As deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The optimizer and the LR schedule come from the config's "optimizer" and "scheduler"
    sections (Adam / AdamW; WarmupLR, WarmupDecayLR, WarmupCosineLR) and run inside the engine.
    """
    if model is None:
        raise ValueError("strata.initialize: model is required")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("strata.initialize: config is required (a dict, JSON text or a path)")
    if optimizer is not None:
        raise NotImplementedError(
            "strata.initialize(optimizer=...): a client optimizer is not supported; strata runs "
            "its own Adam/AdamW from the config's \"optimizer\" section")
    if lr_scheduler is not None:
        raise NotImplementedError(
            "strata.initialize(lr_scheduler=...): a client scheduler is not supported; use the "
            "config's \"scheduler\" section (WarmupLR, WarmupDecayLR, WarmupCosineLR)")
    if mpu is not None:
        raise NotImplementedError("strata.initialize(mpu=...): model parallelism is not supported")
    if model_parameters is not None:
        given = {id(p) for p in model_parameters}
        if given != {id(p) for p in model.parameters()}:
            raise NotImplementedError(
                "strata.initialize(model_parameters=...): only all of model.parameters() is "
                "supported (no parameter groups or frozen subsets)")
    rank, world = _env_rank_world()
    cfg = _load(config)
    for key, what in _UNSUPPORTED_TOP_LEVEL.items():
        if what is not None and cfg.get(key, {}).get("enabled", False):
            raise NotImplementedError(f"config \"{key}\": {what} is not supported by strata")
    engine = StrataEngine(model, cfg, rank, world, nvme_paths=nvme_paths,
                          device_budget_bytes=device_budget_bytes, timeout_ms=timeout_ms)
    loader = None
    if training_data is not None:
        sampler = None
        if world > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(
                training_data, num_replicas=world, rank=rank)
        loader = torch.utils.data.DataLoader(
            training_data, batch_size=engine.train_micro_batch_size_per_gpu() or 1,
            sampler=sampler, collate_fn=collate_fn, shuffle=False)
    scheduler = _EngineScheduler(engine) if cfg.get("scheduler") else None
    return engine, _EngineOptimizer(engine), loader, scheduler


def _load(config: ConfigLike) -> dict:
    if isinstance(config, dict):
        return config
    s = os.fspath(config)
    if s.lstrip().startswith("{"):
        text = s
    else:
        with open(s) as f:
            text = f.read()
    res = check_config(text)
    if not res["ok"]:
        raise ConfigError("invalid DeepSpeed config:\n" +
                          "\n".join(e["text"] for e in res["errors"]))
    return json.loads(res["normalized_json"])
