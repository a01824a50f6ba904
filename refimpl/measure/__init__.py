"""What is measured, never predicted: state bytes, peak bytes, saved activations, throughput and MFU, the
device peaks, and the times of messages (chapters 01, 02, 04, 05 and 10).

* ``refimpl.measure.state``: ``StateMemory`` (the one record of model-state bytes, which the
  planner returns too) and ``state_bytes``, counted from the tensors (chapter 04);
* ``refimpl.measure.peak``: ``PeakStateBytes`` through a step, the device's or process's peak
  memory, ``format_bytes``;
* ``refimpl.measure.activations``: ``SavedTensorMeter``, the bytes autograd saves for backward, per
  block and dtype (chapter 05);
* ``refimpl.measure.throughput``: tokens/s and MFU (PaLM appendix B), ``peak_dtype``, the progress
  bar; ``refimpl.measure.peaks``: the table of dense device peaks, the one place it lives;
* ``refimpl.measure.collective_timing``: collectives and ping-pongs timed per message size (chapter 02);
* ``refimpl.measure.order_spread``: ``order_tolerance``, the numerics rule's yardstick (the spread
  of two one-device summation orders times a factor).

The formulas these measurements are checked against are in ``refimpl.planner``. Imports run
config/comm/distributed -> measure -> precision/parallel -> planner: nothing here imports the planner.
"""

from refimpl.measure.activations import (
    OUTSIDE,
    SavedTensorMeter,
    SavedTensorReport,
    measure_saved_activations,
    transformer_blocks,
)
from refimpl.measure.collective_timing import DEFAULT_SIZES, Timings, measure_collective, measure_p2p
from refimpl.measure.order_spread import order_tolerance
from refimpl.measure.peak import PeakStateBytes, format_bytes, peak_memory_bytes
from refimpl.measure.peaks import PEAK_DTYPES, PEAK_FLOPS, peak_flops
from refimpl.measure.state import StateMemory, local_tensor, state_bytes, storage_bytes, tensors_in
from refimpl.measure.throughput import (
    Throughput,
    device_peak_flops,
    format_mfu,
    model_flops_utilization,
    peak_dtype,
    progress,
)

__all__ = [
    "DEFAULT_SIZES",
    "OUTSIDE",
    "PEAK_DTYPES",
    "PEAK_FLOPS",
    "PeakStateBytes",
    "SavedTensorMeter",
    "SavedTensorReport",
    "StateMemory",
    "Throughput",
    "Timings",
    "device_peak_flops",
    "format_bytes",
    "order_tolerance",
    "format_mfu",
    "local_tensor",
    "measure_collective",
    "measure_p2p",
    "measure_saved_activations",
    "model_flops_utilization",
    "peak_dtype",
    "peak_flops",
    "peak_memory_bytes",
    "progress",
    "state_bytes",
    "storage_bytes",
    "tensors_in",
    "transformer_blocks",
]
