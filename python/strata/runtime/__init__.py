"""deepspeed.runtime's names that scripts reach, under strata's: strata.runtime.zero.
partition_parameters (ZeroParamStatus, Init, GatheredParameters, the external-parameter calls),
runtime.utils.see_memory_usage and runtime.activation_checkpointing.checkpointing, imported or
read as attributes (`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`)."""
from . import activation_checkpointing, utils, zero  # noqa: F401
