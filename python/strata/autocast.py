"""The config's "torch_autocast" section, as DeepSpeed's engine applies it around the forward.

    "torch_autocast": {"enabled": true, "dtype": "bfloat16",
                       "lower_precision_safe_modules": ["torch.nn.Linear", ...]}

With it enabled, engine(...) runs the module under torch.autocast(device, dtype): the parameters
stay in their dtype (fp32 without a bf16 / fp16 section) and autocast computes the ops it lists in
the lower precision. Without it, an autocast the script opened around engine(...) is switched
off inside the forward, as DeepSpeed switches it off (the bf16 / fp16 sections or torch_autocast
set the precision), with one warning.

Differences from DeepSpeed: the gradients of lower_precision_safe_modules' parameters are
reduced in their own dtype (fp32), where DeepSpeed reduces them in the autocast dtype (the
module names are checked as DeepSpeed checks them); float16 autocast, which DeepSpeed pairs with
torch's GradScaler, is refused (bfloat16 needs no loss scaling).
"""
import contextlib
import importlib
import warnings
from typing import Optional

import torch

from .config import ConfigError

# DeepSpeed's DtypeEnum spellings.
_BF16 = ("bf16", "bfloat16", "bfloat", "torch.bfloat16")
_FP16 = ("fp16", "float16", "half", "torch.float16")
_FP32 = ("fp32", "float32", "float", "torch.float32")
_OUTER_WARNED = [False]


class TorchAutocast:
    """The section's settings for one engine (dtype None: the section is off)."""

    def __init__(self, config: dict, device_type: str):
        self.device_type = device_type
        self.dtype: Optional[torch.dtype] = None
        self.lower_precision_safe_modules: Optional[list] = None
        section = config.get("torch_autocast")
        if section is None:
            return
        if not isinstance(section, dict):
            raise ConfigError('config "torch_autocast": expected an object with "enabled", '
                              '"dtype" and "lower_precision_safe_modules"')
        enabled = section.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f'config "torch_autocast.enabled": {enabled!r} is not true or false')
        self.lower_precision_safe_modules = _module_names(section)
        if enabled:
            self.dtype = _dtype(section.get("dtype"), device_type)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def context(self):
        """What surrounds the module's forward (DeepSpeed's autocast_if_enabled)."""
        if self.enabled:
            return torch.autocast(device_type=self.device_type, dtype=self.dtype)
        if torch.is_autocast_enabled(self.device_type):
            if not _OUTER_WARNED[0]:
                _OUTER_WARNED[0] = True
                warnings.warn(
                    "strata: torch.autocast is enabled around the engine's forward but the "
                    "config has no torch_autocast section: it is disabled inside, as DeepSpeed "
                    "does (the bf16 / fp16 sections set the precision; torch_autocast enables "
                    "autocast inside the engine)", stacklevel=3)
            return torch.autocast(device_type=self.device_type, enabled=False)
        return contextlib.nullcontext()


def _dtype(value, device_type: str) -> torch.dtype:
    if value is None:  # torch's default for the device: bf16 on the CPU, fp16 on a GPU
        dtype = torch.get_autocast_dtype(device_type)
    elif isinstance(value, str) and value.lower() in _BF16:
        dtype = torch.bfloat16
    elif isinstance(value, str) and value.lower() in _FP16:
        dtype = torch.float16
    elif isinstance(value, str) and value.lower() in _FP32:
        raise ConfigError('config "torch_autocast.dtype": float32 autocasts nothing; use '
                          '"bfloat16", or turn the section off')
    else:
        raise ConfigError(f'config "torch_autocast.dtype": invalid dtype for torch autocast: '
                          f'{value!r} (bfloat16)')
    if dtype == torch.float16:
        raise NotImplementedError(
            'config "torch_autocast.dtype": float16 autocast needs torch\'s GradScaler, which '
            'strata does not run; use "bfloat16" (or the fp16 section, with its loss scaling)'
            + ("" if value is not None else
               f" (no dtype given: torch's default on {device_type} is float16)"))
    return dtype


def _module_names(section: dict) -> Optional[list]:
    names = section.get("lower_precision_safe_modules")
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError('config "torch_autocast.lower_precision_safe_modules": '
                          f'invalid module names for torch autocast: {names!r}. Expected list '
                          'of strings.')
    for name in names:
        package, _, cls = name.rpartition(".")
        try:
            getattr(importlib.import_module(package), cls)
        except Exception as e:  # as DeepSpeed: any failure to import names the module
            raise ConfigError('config "torch_autocast.lower_precision_safe_modules": failed to '
                              f'import lower precision safe module {name}: {e}') from e
    return names
