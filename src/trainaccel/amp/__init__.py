"""Mixed precision: `PrecisionPolicy` decides per epoch or step whether to autocast."""

from trainaccel.amp.policy import MixedPrecision_TrainingPolicy, PrecisionPolicy

__all__ = ["MixedPrecision_TrainingPolicy", "PrecisionPolicy"]
