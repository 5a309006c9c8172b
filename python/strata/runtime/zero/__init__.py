"""deepspeed.runtime.zero: partition_parameters (strata.zero's stage-3 names, also exported
here as DeepSpeed's package does), stage3 and stage_1_and_2 (DeepSpeed's memory estimators,
answered by strata's planner)."""
from . import partition_parameters, stage3, stage_1_and_2  # noqa: F401
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus,  # noqa: F401
                                   register_external_parameter)
