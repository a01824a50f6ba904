"""fp8 training from scratch: formats, scales, a linear layer on ``torch._scaled_mm``, fp8 on the wire
(chapter 10).

Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; PyTorch's reference is torchao's ``float8``
(``convert_to_float8_training``, ``Float8LinearConfig``), which the tests compare against. One concept per
file:

* ``.formats``: e4m3fn and e5m2 (``Float8Format``: bits, largest value, smallest normal and
  subnormal), the saturating round-to-nearest-even cast ``quantize`` and ``dequantize``;
* ``.scaling``: ``scale = fmax / amax`` (``amax_to_scale``), tensorwise and rowwise casts
  (``cast_to_float8`` -> ``Float8Tensor``), and ``DelayedScaling`` (an amax history);
* ``.float8_linear``: ``Float8Linear`` (three separately scaled fp8 GEMMs, forward and backward),
  ``Float8Matmul`` (the same GEMMs as the linear seam's matmul), ``Float8Config`` (torchao's
  ``tensorwise`` and ``rowwise`` recipes), ``scaled_mm``;
* ``.sharded_scales``: ``ShardedScales``, a tensor-parallel shard cast with its whole layer's
  scales;
* ``.convert``: ``convert_to_float8``, the in-place swap of a model's ``nn.Linear`` layers;
* ``.training``: ``apply_float8_training``, what ``--precision fp8`` does to the trainer's model
  (the seam's layers, tensor-parallel shards included, with one device's scales);
* ``.float8_communication``: ZeRO-3's weight all-gather in fp8 (``all_gather_float8``) and the
  error of an fp8 gradient all-reduce (``gradient_all_reduce_errors``).
"""

from __future__ import annotations

from refimpl.precision.fp8.convert import Float8Conversion, convert_to_float8, first_and_last_linear
from refimpl.precision.fp8.float8_communication import (
    GatherBytes,
    GradientReductionErrors,
    agreed_amax,
    all_gather_float8,
    float8_all_gather_bytes,
    float8_tensor,
    gradient_all_reduce_errors,
)
from refimpl.precision.fp8.float8_linear import (
    Float8Config,
    Float8Linear,
    Float8Matmul,
    check_float8_shape,
    float8_linear,
    scaled_mm,
)
from refimpl.precision.fp8.formats import E4M3, E5M2, FORMATS, Float8Format, dequantize, format_of, quantize
from refimpl.precision.fp8.scaling import (
    EPS,
    SCALINGS,
    DelayedCast,
    DelayedScaling,
    Float8Tensor,
    amax_to_scale,
    cast_to_float8,
    operand_amax,
)
from refimpl.precision.fp8.sharded_scales import ShardedScales
from refimpl.precision.fp8.training import apply_float8_training, float8_layers

__all__ = [
    "E4M3",
    "E5M2",
    "EPS",
    "FORMATS",
    "SCALINGS",
    "DelayedCast",
    "DelayedScaling",
    "Float8Config",
    "Float8Conversion",
    "Float8Format",
    "Float8Linear",
    "Float8Matmul",
    "Float8Tensor",
    "GatherBytes",
    "GradientReductionErrors",
    "ShardedScales",
    "agreed_amax",
    "all_gather_float8",
    "amax_to_scale",
    "apply_float8_training",
    "cast_to_float8",
    "check_float8_shape",
    "convert_to_float8",
    "dequantize",
    "first_and_last_linear",
    "float8_layers",
    "float8_all_gather_bytes",
    "float8_linear",
    "float8_tensor",
    "format_of",
    "gradient_all_reduce_errors",
    "operand_amax",
    "quantize",
    "scaled_mm",
]
