"""deepspeed.runtime.zero.partition_parameters' names that scripts use: strata.zero's."""
from ...zero import (GatheredParameters, Init, ZeroParamStatus,  # noqa: F401
                     register_external_parameter, unregister_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
