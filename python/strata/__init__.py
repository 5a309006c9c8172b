"""strata: a ZeRO-Offload/Infinity engine with DeepSpeed's config format and training API.

Without torch: check_config, load_config, plan, and the native Engine (strata.Engine).
With torch: initialize (as deepspeed.initialize), init_distributed, strata.zero, strata.optim
(client optimizers), strata.accelerator (get_accelerator, as deepspeed.accelerator's),
strata.comm (as deepspeed.comm), strata.checkpointing (deepspeed.checkpointing, activation
checkpointing), strata.ops.adam (deepspeed.ops.adam's DeepSpeedCPUAdam and
FusedAdam), strata.runtime.zero.partition_parameters (ZeroParamStatus, ...), get_accelerator at
the top level too: a script's `deepspeed` imports become strata's by changing that word.
add_config_arguments (as deepspeed's) needs no torch. With these, the calls DeepSpeed's example
scripts make at the top level work on `import strata as deepspeed`.
"""


def _load_pip_cuda_libraries():
    """The native module of a CUDA build needs libcudart.so.13 and libnccl.so.2. torch's CUDA
    wheels carry their own (pip packages under nvidia/), newer than a system toolkit's may be:
    loaded first, they are the ones the module binds to, so strata and torch share one NCCL and
    one CUDA runtime whichever is imported first (a system NCCL loaded first would lack symbols
    torch needs). Nothing happens where those packages are not installed."""
    import ctypes
    import glob
    import importlib.util
    import os
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for name in ("libcudart.so.1[0-9]", "libnccl.so.2"):
            for path in sorted(glob.glob(os.path.join(root, "*", "lib", name)))[:1]:
                try:
                    ctypes.CDLL(path)
                except OSError:
                    pass  # the module's own dependency then applies


_load_pip_cuda_libraries()
from ._strata import Engine, StrataError  # noqa: E402
from .config import (ConfigError, add_config_arguments, check_config, load_config,  # noqa: E402
                     plan)

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("zero", "optim", "utils", "accelerator", "comm", "ops", "runtime",
                "checkpointing", "compression"):  # need torch
        import importlib
        return importlib.import_module("." + name, __name__)
    if name == "DeepSpeedEngine":  # `from deepspeed import DeepSpeedEngine` (isinstance checks)
        from .engine import StrataEngine
        return StrataEngine
    if name == "get_accelerator":  # `from deepspeed import get_accelerator`
        from .accelerator import get_accelerator
        return get_accelerator
    raise AttributeError(name)


def initialize(*args, **kwargs):
    """As deepspeed.initialize (see strata.engine.initialize); imports torch."""
    from .engine import initialize as _initialize
    return _initialize(*args, **kwargs)


def register_as_deepspeed(required: bool = True) -> bool:
    """`import deepspeed` gives strata from now on, for libraries that import it themselves to
    gather ZeRO-3 parameters (see strata.deepspeed_name); no torch needed."""
    from .deepspeed_name import register_as_deepspeed as _register
    return _register(required)


def init_distributed(*args, **kwargs):
    """As deepspeed.init_distributed (see strata.engine.init_distributed); imports torch."""
    from .engine import init_distributed as _init_distributed
    return _init_distributed(*args, **kwargs)


__all__ = ["Engine", "StrataError", "ConfigError", "add_config_arguments", "check_config",
           "load_config", "plan", "initialize", "init_distributed", "register_as_deepspeed"]
