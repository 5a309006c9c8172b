"""deepspeed.runtime.dataloader's RepeatingLoader, which scripts import from there (strata.utils).
DeepSpeedDataLoader is what engine.deepspeed_io builds: a torch DataLoader over a
DistributedSampler, with DeepSpeed's data_sampler attribute."""
from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
