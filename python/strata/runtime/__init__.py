"""deepspeed.runtime's names that scripts reach, under strata's: strata.runtime.zero.
partition_parameters (ZeroParamStatus, Init, GatheredParameters, the external-parameter calls),
imported or read as attributes (`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`)."""
from . import zero  # noqa: F401
