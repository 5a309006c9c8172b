"""deepspeed.runtime.zero: partition_parameters (strata.zero's stage-3 names), stage3 and
stage_1_and_2 (DeepSpeed's memory estimators, answered by strata's planner)."""
from . import partition_parameters, stage3, stage_1_and_2  # noqa: F401
