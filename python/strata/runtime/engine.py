"""deepspeed.runtime.engine.DeepSpeedEngine: strata's engine under that name, for the
`isinstance(model, DeepSpeedEngine)` tests libraries and scripts make."""
from ..engine import StrataEngine as DeepSpeedEngine  # noqa: F401

__all__ = ["DeepSpeedEngine"]
