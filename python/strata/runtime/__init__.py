"""deepspeed.runtime's names that scripts reach, under strata's: strata.runtime.zero.
partition_parameters (ZeroParamStatus, Init, GatheredParameters, the external-parameter calls),
zero.stage3 / zero.stage_1_and_2 (the memory estimators, from strata's planner),
runtime.utils.see_memory_usage, runtime.activation_checkpointing.checkpointing,
runtime.lr_schedules (DeepSpeed's scheduler classes) and runtime.engine.DeepSpeedEngine, imported
or read as attributes (`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`)."""
from . import activation_checkpointing, engine, lr_schedules, utils, zero  # noqa: F401
