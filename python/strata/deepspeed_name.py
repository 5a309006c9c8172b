"""strata under the import name `deepspeed`, for code that imports DeepSpeed itself.

A script changes its own import (`import strata as deepspeed`), but libraries import `deepspeed`
in their own code wherever they meet a ZeRO-3 model: transformers' from_pretrained (zero.Init,
GatheredParameters), resize_token_embeddings and weight initialisation, PEFT's
`modules_to_save` and LoRA initialisation. Where strata partitions the
parameters those imports must give strata's zero.Init / GatheredParameters, or the library fails
(no deepspeed installed) or gathers strata's parameters with DeepSpeed's code (where it is).

register_as_deepspeed() makes `import deepspeed` and `import deepspeed.X.Y` give `strata` and
`strata.X.Y` (the same module objects, so no state is duplicated) for the rest of the process.
A `deepspeed.X` strata lacks is missing as any module is (ModuleNotFoundError;
importlib.util.find_spec gives None). Package metadata is not touched: `importlib.metadata.version("deepspeed")` still says whether DeepSpeed is installed, so
transformers' and accelerate's is_deepspeed_available() keep their answer.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_NAME = "deepspeed"


class _StrataUnderDeepSpeed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """deepspeed.X.Y -> strata.X.Y while sys.modules["deepspeed"] is strata."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_NAME + ".") or not is_registered():
            return None
        real = "strata" + fullname[len(_NAME):]
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError as e:  # a parent strata lacks; another missing module is
            if e.name is None or not (real + ".").startswith(e.name + "."):  # its own error
                raise
            found = None
        # None where strata lacks it: the import fails as for any missing module, and probes
        # (importlib.util.find_spec) get None.
        return None if found is None else importlib.machinery.ModuleSpec(fullname, self,
                                                                        origin=found.origin)

    def create_module(self, spec):
        return importlib.import_module("strata" + spec.name[len(_NAME):])

    def exec_module(self, module):
        pass  # strata's own module, already executed under its own name


_finder = _StrataUnderDeepSpeed()


def is_registered() -> bool:
    """Whether `import deepspeed` gives strata in this process."""
    return sys.modules.get(_NAME) is sys.modules["strata"]


def installed_elsewhere() -> bool:
    """Whether `deepspeed` is DeepSpeed itself here: imported, or installed and not yet taken by
    strata."""
    if is_registered():
        return False
    return sys.modules.get(_NAME) is not None or importlib.util.find_spec(_NAME) is not None


def register_as_deepspeed(required: bool = True) -> bool:
    """Makes `import deepspeed` (and its submodules) give strata from now on; returns whether it
    does. Where DeepSpeed itself was already imported in this process, libraries would gather
    strata's ZeRO-3 parameters with DeepSpeed's code: a RuntimeError says so.
    required=False is strata's own implicit call (zero.Init, a stage-3 initialize): it does
    nothing, returning False, where DeepSpeed is installed or imported, so that a process may
    still run DeepSpeed itself (a side-by-side benchmark); the explicit calls
    (this with required=True, HfDeepSpeedConfig) take the name even from an installed DeepSpeed
    that nothing imported yet."""
    if is_registered():
        return True
    other = sys.modules.get(_NAME)
    if other is not None:
        if required:
            raise RuntimeError(
                f"strata.register_as_deepspeed: DeepSpeed is already imported in this process "
                f"({getattr(other, '__file__', other)}); libraries would gather strata's ZeRO-3 "
                "parameters with DeepSpeed's code. Let strata stand in for deepspeed before "
                "anything imports it, or do not import DeepSpeed in a strata run")
        return False
    if not required and installed_elsewhere():
        return False  # DeepSpeed installed: it keeps its name unless the script asks
    sys.modules[_NAME] = sys.modules["strata"]
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True
