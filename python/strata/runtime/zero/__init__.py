"""deepspeed.runtime.zero: partition_parameters (strata.zero's stage-3 names)."""
from . import partition_parameters  # noqa: F401
