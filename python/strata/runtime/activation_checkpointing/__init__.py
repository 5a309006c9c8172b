"""deepspeed.runtime.activation_checkpointing: its checkpointing module is strata.checkpointing."""
from . import checkpointing  # noqa: F401
