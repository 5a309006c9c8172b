"""deepspeed.ops.adam's optimizers as client optimizers for strata.initialize (strata.optim):
DeepSpeedCPUAdam and FusedAdam take DeepSpeed's signatures; the engine runs the step (its SIMD CPU
Adam for offloaded state, the device's kernels for state in HBM), whichever class a script picks."""
from ..optim import CPUAdam as DeepSpeedCPUAdam
from ..optim import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
