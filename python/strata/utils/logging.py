"""deepspeed.utils.logging's names that scripts import: DeepSpeed's logger, log_dist and the
level helpers (strata.utils)."""
from . import (get_log_level_from_string, log_dist, log_dist_once, logger, print_dist,
               set_log_level_from_string)

__all__ = ["logger", "log_dist", "log_dist_once", "print_dist", "get_log_level_from_string",
           "set_log_level_from_string"]
