"""`trainaccel bench`: benchmarks that measure each gain, side by side in one invocation."""
