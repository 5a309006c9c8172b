"""deepspeed.runtime.activation_checkpointing.checkpointing, where some scripts import DeepSpeed's
activation checkpointing from: strata.checkpointing's functions (one set of options)."""
from ...checkpointing import (checkpoint, configure, is_configured,  # noqa: F401
                              non_reentrant_checkpoint, partition_activations_in_checkpoint,
                              reset, set_num_layers)
