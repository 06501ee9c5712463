"""Mixed precision: `PrecisionPolicy` decides per epoch or step whether to autocast; zero-code AMP for DDP."""

from trainaccel.amp.ddp import AmpState, autocast_dtype, scaled
from trainaccel.amp.policy import MixedPrecision_TrainingPolicy, PrecisionPolicy, parse_policy

__all__ = ["AmpState", "MixedPrecision_TrainingPolicy", "PrecisionPolicy", "autocast_dtype", "parse_policy", "scaled"]
