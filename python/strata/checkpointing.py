"""As deepspeed.checkpointing: DeepSpeed's activation checkpointing API, for scripts written for
DeepSpeed (`deepspeed.checkpointing.configure(None, deepspeed_config=...)` and
`deepspeed.checkpointing.checkpoint(block, x)` around each transformer block).

checkpoint(function, *args, **kwargs) runs `function` without keeping its activations and runs it
again in the backward, as DeepSpeed's CheckpointFunction: torch.utils.checkpoint's reentrant form,
which restores the CPU and CUDA random states (dropout draws the same mask twice) and the
autocast state for the recompute. Only the block's inputs are kept; with `cpu_checkpointing`
they are kept in host memory (page-locked where a GPU is present) until the backward, so a
stack of N blocks holds N inputs on the host instead of the device. As with DeepSpeed's (and
torch's reentrant form), a block none of whose inputs requires a gradient gives its parameters
none: non_reentrant_checkpoint is the form without that limit (the same options apply). Under a strata engine at ZeRO
stage 3 the recompute gathers the block's parameters again through the engine's hooks.

configure(mpu_, deepspeed_config=None, ...) reads the config's `activation_checkpointing`
section as DeepSpeed does, the keyword arguments overriding it:
  - cpu_checkpointing / checkpoint_in_cpu: as above;
  - synchronize_checkpoint_boundary / synchronize: the device synchronized before and after each
    checkpointed forward and each recompute;
  - profile: each forward's and recompute's time logged (logger "strata.checkpointing", INFO);
  - partition_activations: DeepSpeed splits the kept inputs across the model-parallel group;
    strata runs no model parallelism (a non-None mpu_ is refused), so the group is one rank and
    there is nothing to split;
  - contiguous_memory_optimization / number_checkpoints: DeepSpeed's buffer for partitioned
    inputs, checked as DeepSpeed checks them (it needs partition_activations, and a count), no
    further effect.
An unknown key in the section (which DeepSpeed ignores, so that a misspelt key silently turns
nothing on) or a value of the wrong type, there or in an argument, is a ValueError naming it;
booleans are also taken as 0 / 1 and "true" / "false".
checkpoint() works unconfigured, with every option off, as DeepSpeed's does.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.utils.checkpoint

logger = logging.getLogger(__name__)

_SECTION = "activation_checkpointing"
# DeepSpeed's keys (DeepSpeedActivationCheckpointingConfig) and their defaults.
_DEFAULTS = {"partition_activations": False, "contiguous_memory_optimization": False,
             "cpu_checkpointing": False, "number_checkpoints": None,
             "synchronize_checkpoint_boundary": False, "profile": False}

_options = dict(_DEFAULTS)
_configured = False


def _value(key: str, value, where: str):
    """One option's value, taken as DeepSpeed's config model takes it (booleans also as 0 / 1 or
    "true" / "false"; number_checkpoints a positive integer or None); else a ValueError naming
    `where`."""
    if key == "number_checkpoints":
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"{where}: expected a positive integer or null, got {value!r}")
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{where}: expected true or false, got {value!r}")


def _read_section(deepspeed_config) -> dict:
    from .engine import _load
    section = _load(deepspeed_config).get(_SECTION) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{_SECTION}: expected an object, got {section!r}")
    out = {}
    for key, value in section.items():
        if key not in _DEFAULTS:  # DeepSpeed ignores it: a misspelt cpu_checkpointing is off
            raise ValueError(f"{_SECTION}.{key}: unknown key; DeepSpeed's are "
                             f"{', '.join(_DEFAULTS)}")
        out[key] = _value(key, value, f"{_SECTION}.{key}")
    return out


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None) -> None:
    """As deepspeed.checkpointing.configure (see the module docstring): the config's section
    (a dict, a path or JSON text), then the arguments that are not None."""
    global _configured, _options
    if mpu_ is not None:
        raise NotImplementedError("strata.checkpointing.configure(mpu_=...): model parallelism is "
                                  "not supported; pass None")
    options = dict(_DEFAULTS)
    if deepspeed_config is not None:
        options.update(_read_section(deepspeed_config))
    for key, arg, value in (
            ("partition_activations", "partition_activations", partition_activations),
            ("contiguous_memory_optimization", "contiguous_checkpointing",
             contiguous_checkpointing),
            ("number_checkpoints", "num_checkpoints", num_checkpoints),
            ("cpu_checkpointing", "checkpoint_in_cpu", checkpoint_in_cpu),
            ("synchronize_checkpoint_boundary", "synchronize", synchronize),
            ("profile", "profile", profile)):
        if value is not None:
            options[key] = _value(key, value, f"configure({arg}=...)")
    if options["contiguous_memory_optimization"]:  # DeepSpeed's two assertions
        assert options["partition_activations"], (
            "Contiguous Checkpointing is only available with partitioned activations. Set "
            "partitioned activations to true in deepspeed config")
        assert options["number_checkpoints"] is not None, (
            "Must specify the number of layers with contiguous memory checkpointing")
    _options = options  # one assignment: a checkpoint() running meanwhile sees old or new
    _configured = True
    logger.info("activation checkpointing: %s", ", ".join(f"{k}={v}" for k, v in options.items()))


def is_configured() -> bool:
    """True once configure() has been called, as DeepSpeed's."""
    return _configured


def options() -> dict:
    """The options in effect (DeepSpeed's key names)."""
    return dict(_options)


def set_num_layers(nlayers) -> None:
    _options["number_checkpoints"] = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    _options["partition_activations"] = bool(partition_activation)


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here (after forwards without a backward); strata
    keeps none, so there is nothing to free."""


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _bound(function):
    """`function` with the configured synchronization and timing around each call: the
    checkpoint's forward (run without grad) and its recompute in the backward."""
    sync, profile = _options["synchronize_checkpoint_boundary"], _options["profile"]
    if not (sync or profile):
        return function
    calls = [0]

    def call(*args):
        what = "forward" if calls[0] == 0 else "recompute"
        calls[0] += 1
        if sync:
            _synchronize()
        t0 = time.perf_counter()
        try:
            return function(*args)
        finally:  # also when the non-reentrant form stops a recompute early (an exception)
            if sync:
                _synchronize()
            if profile:
                logger.info("checkpoint %s: %.3f ms", what, (time.perf_counter() - t0) * 1e3)
    return call


def _keeping_inputs():
    """Where the checkpoint's kept inputs live until the backward: the host with
    cpu_checkpointing (only when a backward will come), else where they are."""
    if _options["cpu_checkpointing"] and torch.is_grad_enabled():
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return contextlib.nullcontext()


def _with_kwargs(function, args, kwargs):
    """DeepSpeed's handling of keyword arguments: tensors passed by keyword take part in autograd
    as positional ones do."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def call(*all_args):
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))
    return call, args + tuple(kwargs.values())


def checkpoint(function, *args, **kwargs):
    """As deepspeed.checkpointing.checkpoint (the module docstring)."""
    function, args = _with_kwargs(function, args, kwargs)
    with _keeping_inputs():
        return torch.utils.checkpoint.checkpoint(_bound(function), *args, use_reentrant=True)


def non_reentrant_checkpoint(function, *args, **kwargs):
    """As deepspeed.checkpointing.non_reentrant_checkpoint: torch.utils.checkpoint's
    non-reentrant form (parameters get gradients even where no input requires one), with the
    same options as checkpoint()."""
    function, args = _with_kwargs(function, args, kwargs)
    with _keeping_inputs():
        return torch.utils.checkpoint.checkpoint(_bound(function), *args, use_reentrant=False)
