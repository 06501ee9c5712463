"""Operations: step metrics (throughput, data wait vs compute, peak memory)."""

from trainaccel.monitor.metrics import StepMeter, StepRecord, peak_memory_bytes

__all__ = ["StepMeter", "StepRecord", "peak_memory_bytes"]
