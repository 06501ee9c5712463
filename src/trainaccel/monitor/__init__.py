"""Operations: step metrics, straggler detection and the timeline."""

from trainaccel.monitor.metrics import StepMeter, StepRecord, peak_memory_bytes
from trainaccel.monitor.straggler import Straggler, StragglerDetector, StragglerReport

__all__ = ["StepMeter", "StepRecord", "Straggler", "StragglerDetector", "StragglerReport", "peak_memory_bytes"]
