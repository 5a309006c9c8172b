"""Optimizers for strata.initialize: parameter groups and the optimizer objects scripts build.

The engine runs Adam / AdamW itself (the SIMD CPU Adam for offloaded state, the device's kernels
for state in HBM); what a script passes only says which parameters form which group and with
which hyperparameters:
  - `strata.initialize(optimizer=torch.optim.AdamW(groups, ...))`: torch.optim.Adam, AdamW, or
    CPUAdam / FusedAdam here (DeepSpeed's DeepSpeedCPUAdam and FusedAdam signatures). Each of
    its param_groups keeps its lr, betas, eps and weight_decay; torch's Adam with weight_decay is
    L2 (DeepSpeed's "Adam" with adam_w_mode false), AdamW decoupled. The config then must not
    have an "optimizer" section: strata writes one from the client's first group.
  - `model_parameters=[{"params": [...], "weight_decay": 0.0}, ...]`: torch's param-group dicts;
    keys not given take the config's optimizer.params values.
Unsupported options (amsgrad, maximize, a per-group bias_correction) are refused naming them.

The engine's groups follow modules (a module's own parameters are gathered together); a module
whose parameters sit in two parameter groups becomes two engine groups, so every optimizer
sub-group has one set of hyperparameters.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

SUPPORTED = ("torch.optim.Adam, torch.optim.AdamW, strata.optim.CPUAdam "
             "(DeepSpeedCPUAdam) and strata.optim.FusedAdam")

_HYPER = ("lr", "betas", "eps", "weight_decay")


class CPUAdam(torch.optim.Optimizer):
    """DeepSpeed's DeepSpeedCPUAdam signature, run by the strata engine (its step() refuses: the
    engine steps it at engine.step())."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
                 fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("strata.optim.CPUAdam: amsgrad is not supported")
        if not fp32_optimizer_states:
            raise ValueError("strata.optim.CPUAdam: the optimizer states are always fp32 "
                             "(fp32_optimizer_states=False is not supported)")
        super().__init__(model_params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                            weight_decay=weight_decay,
                                            bias_correction=bias_correction))
        self.adamw_mode = bool(adamw_mode)

    def step(self, closure=None):
        raise RuntimeError(f"{type(self).__name__} runs inside the strata engine: pass it to "
                           "strata.initialize(optimizer=...) and call engine.step()")


DeepSpeedCPUAdam = CPUAdam


class FusedAdam(CPUAdam):
    """DeepSpeed's FusedAdam signature (adam_w_mode), run by the strata engine."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


def _client_type(optimizer) -> tuple[str, bool]:
    """(DeepSpeed optimizer type, bias_correction) of a client optimizer, or TypeError."""
    if isinstance(optimizer, CPUAdam):
        corrections = {bool(g.get("bias_correction", True)) for g in optimizer.param_groups}
        if len(corrections) > 1:
            raise ValueError(f"{type(optimizer).__name__}: bias_correction differs between "
                             "param_groups; strata applies one setting to every group")
        return ("AdamW" if optimizer.adamw_mode else "Adam"), corrections.pop()
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        own_step = inspect.unwrap(type(optimizer).step)
        if own_step not in (inspect.unwrap(torch.optim.Adam.step),
                            inspect.unwrap(torch.optim.AdamW.step)):
            raise TypeError(
                f"strata.initialize(optimizer=...): {type(optimizer).__qualname__} overrides "
                "step(); strata runs its own Adam on the engine's fp32 master weights and "
                "would never call it, so what it changes in the update would be lost. Do that "
                "work in the training loop (clipping: the config's gradient_clipping), or pass "
                "torch.optim.Adam / AdamW")
        for i, g in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ValueError(f"strata.initialize(optimizer=...): param_groups[{i}] has "
                                     f"{key}=True, which strata's Adam does not support")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay") for g in optimizer.param_groups)
        return ("AdamW" if decoupled else "Adam"), True
    raise TypeError(f"strata.initialize(optimizer=...): {type(optimizer).__module__}."
                    f"{type(optimizer).__qualname__} is not supported; strata runs {SUPPORTED} "
                    "(or the config's \"optimizer\" section)")


# Param-group keys the engine does not read: torch's optimizer flags, and what torch's LR
# schedulers record in the groups they drive (OneCycleLR: max_lr, min_lr, max_momentum,
# base_momentum; SWALR: swa_lr; every scheduler: initial_lr).
_NOT_HYPER = frozenset({"params", "name", "initial_lr", "amsgrad", "maximize", "foreach",
                        "capturable", "differentiable", "fused", "decoupled_weight_decay",
                        "bias_correction", "max_lr", "min_lr", "max_momentum", "base_momentum",
                        "swa_lr"})


def _hyper(group: dict, where: str) -> dict:
    """The engine's hyperparameters of one param-group dict (only the keys it has)."""
    out = {}
    for key in _HYPER:
        if key not in group:
            continue
        value = group[key]
        if key == "betas":
            b1, b2 = (float(b) for b in value)
            out["beta1"], out["beta2"] = b1, b2
        else:
            out[key] = float(value)
    unknown = set(group) - set(_HYPER) - _NOT_HYPER
    if unknown:
        raise ValueError(f"{where}: unknown param-group key(s) {sorted(unknown)}; strata's Adam "
                         f"takes {', '.join(_HYPER)}")
    return out


def _as_group_dicts(model_parameters) -> Optional[list]:
    """model_parameters as a list of param-group dicts when it is one, else None."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and all(isinstance(x, dict) for x in items):
        return items
    if any(isinstance(x, dict) for x in items):
        raise TypeError("strata.initialize(model_parameters=...): mix of parameters and "
                        "param-group dicts")
    return [{"params": items}]


class ParamGroups:
    """Which parameters form which optimizer group, each group's hyperparameters for the engine
    (OptimizerGroupOptions), the list the returned optimizer exposes as param_groups (the
    client's own list when it passed an optimizer), and the "optimizer" section a config
    without one gets from the client."""

    def __init__(self, model: torch.nn.Module, config: dict, optimizer=None,
                 model_parameters=None):
        self.client = optimizer
        self.optimizer_section = None
        # The parameters this froze (a model without an optimizer runs forward only): initialize
        # gives them requires_grad back where it fails.
        self.frozen_here: list = []
        if optimizer is not None:
            kind, bias_correction = _client_type(optimizer)
            if config.get("optimizer"):
                raise ValueError(
                    "strata.initialize: the config has an \"optimizer\" section and optimizer= "
                    "was passed; use one (drop the section to run the client's optimizer)")
            dicts = optimizer.param_groups
            self.optimizer_section = {"type": kind, "params": _section_params(
                dicts[0], kind, bias_correction)}
        else:
            dicts = _as_group_dicts(model_parameters) or [{"params": list(model.parameters())}]
            trains = any(p.requires_grad for p in model.parameters())
            if not config.get("optimizer") and trains and model_parameters is not None:
                raise ValueError(
                    "strata.initialize: the config has no \"optimizer\" section and no optimizer= "
                    f"was passed, but model_parameters= names parameters to train; add one, or "
                    f"pass a client optimizer ({SUPPORTED})")
            if not config.get("optimizer") and trains:
                # Neither an optimizer nor parameters to train: a model that only runs forward
                # (a reference or reward model, a teacher, an EMA copy), as DeepSpeed runs one
                # without an optimizer whatever requires_grad says. Nothing would update its
                # parameters: they are frozen (the engine keeps no gradient or optimizer state).
                self.frozen_here = [p for p in model.parameters() if p.requires_grad]
                model.requires_grad_(False)
        self.params = [list(d["params"]) for d in dicts]
        self.hyper = [_hyper(d, f"param_groups[{i}]") for i, d in enumerate(dicts)]
        self.index = _index_params(model, self.params)
        self.dicts = dicts if optimizer is not None else [
            dict(d, params=list(d["params"])) for d in dicts]


def _section_params(group: dict, kind: str, bias_correction: bool) -> dict:
    params = {"lr": float(group["lr"]), "betas": [float(b) for b in group["betas"]],
              "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
              "bias_correction": bias_correction}
    if kind == "Adam":
        params["adam_w_mode"] = False  # torch.optim.Adam's weight_decay is L2
    return params


def _index_params(model: torch.nn.Module, groups: list) -> dict:
    """id(param) -> its group index; every trainable parameter of the model in exactly one group
    (a frozen one, requires_grad=False, may be in one or none: it has no optimizer state)."""
    names = {id(p): n for n, p in model.named_parameters()}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    index = {}
    for gi, params in enumerate(groups):
        for p in params:
            if id(p) not in names:
                raise ValueError(f"param_groups[{gi}] holds a tensor that is not a parameter of "
                                 "the model")
            if id(p) in index:
                raise ValueError(f"parameter {names[id(p)]} is in param_groups[{index[id(p)]}] "
                                 f"and param_groups[{gi}]")
            index[id(p)] = gi
    missing = [n for i, n in names.items() if i not in index and i not in frozen]
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) with requires_grad=True are in no optimizer group "
            f"(first: {missing[0]}): give every trainable parameter to the optimizer, or freeze "
            "it (requires_grad=False) before strata.initialize")
    return index
