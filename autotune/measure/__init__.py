"""Measurement: latency (`latency`) in a steady allocator (`allocator`), weight size (`size`), the per-module
signals (`sensitivity`, `module_latency`) and the `Measurer` interface the tuner reads them through (`measurer`)."""
from autotune.measure.allocator import steady_allocation
from autotune.measure.latency import LatencyStats, fixed_threads, measure_latency
from autotune.measure.measurer import DeviceMeasurer, Measurer
from autotune.measure.size import weight_bytes

__all__ = ["DeviceMeasurer", "LatencyStats", "Measurer", "fixed_threads", "measure_latency", "steady_allocation",
           "weight_bytes"]
