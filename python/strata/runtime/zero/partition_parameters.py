"""deepspeed.runtime.zero.partition_parameters' names that scripts and libraries use: strata.zero's,
and the constructor wrapper transformers swaps while it builds a model under zero.Init."""
import torch

from ...accelerator import get_accelerator  # noqa: F401
from ...zero import (GatheredParameters, Init, ZeroParamStatus,  # noqa: F401
                     register_external_parameter, unregister_external_parameter)

# DeepSpeed's zero.Init routes tensor constructors (torch.arange among them) through this to
# give them the config's dtype and device; transformers' prevent_arange_dtype_change replaces it
# for the duration of a load. strata's zero.Init changes no constructor (a parameter keeps the
# dtype it is built in until strata.initialize), so nothing calls it: it returns `fn` as is.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
