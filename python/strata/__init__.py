"""strata: a ZeRO-Offload/Infinity engine with DeepSpeed's config format and training API.

Without torch: check_config, load_config, plan, and the native Engine (strata.Engine).
With torch: initialize (as deepspeed.initialize), strata.zero, strata.optim (client optimizers).
"""
from ._strata import Engine, StrataError
from .config import ConfigError, check_config, load_config, plan

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("zero", "optim"):  # imported lazily: the rest works without torch
        import importlib
        return importlib.import_module(".zero", __name__)
    raise AttributeError(name)


def initialize(*args, **kwargs):
    """As deepspeed.initialize (see strata.engine.initialize); imports torch."""
    from .engine import initialize as _initialize
    return _initialize(*args, **kwargs)


__all__ = ["Engine", "StrataError", "ConfigError", "check_config", "load_config", "plan",
           "initialize"]
