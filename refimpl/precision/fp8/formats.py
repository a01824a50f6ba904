"""The two 8-bit floating-point formats of fp8 training, and the cast into them (chapter 10).

Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv:2209.05433), define two encodings of a
sign bit ``s``, ``E`` exponent bits ``e`` (bias ``b``) and ``M`` mantissa bits ``m``:

    value = (-1)^s * 2^(e - b) * (1 + m / 2^M)        for 0 < e (normal numbers)
    value = (-1)^s * 2^(1 - b) * (m / 2^M)            for e = 0 (subnormals, down to 2^(1 - b - M))

==========  ====  ====  ====  =====================  ================  ==================  =========
format      E     M     b     largest finite         smallest normal   smallest subnormal  inf
==========  ====  ====  ====  =====================  ================  ==================  =========
e4m3fn      4     3     7     1.75 * 2^8  = 448      2^-6              2^-9                none
e5m2        5     2     15    1.75 * 2^15 = 57344    2^-14             2^-16               yes
==========  ====  ====  ====  =====================  ================  ==================  =========

e5m2 is IEEE-like (the top exponent holds inf and NaN); e4m3**fn** ("finite") gives its top exponent to
numbers and keeps only ``S.1111.111`` for NaN, which buys 448 instead of 240. e4m3 has the precision
(relative spacing ``2^-3``), e5m2 the range (``2^-2``, but 2^31.8 from the smallest subnormal to the
largest value instead of 2^17.8): forward tensors (activations, weights) are cast to e4m3, gradients to
e5m2 (the paper's recipe, NVIDIA Transformer Engine's ``HYBRID`` format and torchao's default).

**The cast** (``quantize``) multiplies by a scale first (``refimpl.precision.fp8.scaling`` picks it
so that the largest magnitude lands on the format's maximum), in fp32, then **saturates**: a magnitude
beyond the largest finite value becomes that value (and ``+-inf`` too), never inf or NaN. Rounding is
round-to-nearest-even. torch 2.13's eager ``.to(float8_e4m3fn)`` already saturates, ``.to(float8_e5m2)``
does not (``1e6`` becomes ``inf``), so the clamp is explicit, as torchao's ``to_fp8_saturated`` is. NaN stays
NaN. ``dequantize`` multiplies by the fp32 **inverse** scale, which is what ``torch._scaled_mm`` does
with the ``scale_a`` / ``scale_b`` it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E5M2", "FORMATS", "Float8Format", "dequantize", "format_of", "quantize"]


@dataclass(frozen=True, kw_only=True)
class Float8Format:
    """One fp8 encoding: its bit layout and the limits that follow from it (the module docstring's table)."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    has_inf: bool

    @property
    def max_exponent(self) -> int:
        """The exponent of the largest finite value (8 for e4m3fn, 15 for e5m2)."""
        return int(torch.tensor(self.max).log2().floor())

    @property
    def min_exponent(self) -> int:
        """The exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** self.min_exponent

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """The spacing of the numbers in ``[1, 2)``, ``2^-M``; round to nearest halves it."""
        return 2.0 ** -self.mantissa_bits

    @property
    def dynamic_range_bits(self) -> float:
        """``log2(max / smallest subnormal)``: how many octaves one scale can cover (17.8 and 31.8)."""
        return float(torch.tensor(self.max / self.smallest_subnormal, dtype=torch.float64).log2())


E4M3 = Float8Format(name="e4m3fn", dtype=torch.float8_e4m3fn, exponent_bits=4, mantissa_bits=3, bias=7,
                    max=448.0, has_inf=False)
E5M2 = Float8Format(name="e5m2", dtype=torch.float8_e5m2, exponent_bits=5, mantissa_bits=2, bias=15,
                    max=57344.0, has_inf=True)
FORMATS: dict[torch.dtype, Float8Format] = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def format_of(fmt: Float8Format | torch.dtype) -> Float8Format:
    """The ``Float8Format`` of a dtype (a format passes through)."""
    if isinstance(fmt, Float8Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"not an fp8 training format: {fmt}; expected one of {list(FORMATS)}")
    return FORMATS[fmt]


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Float8Format | torch.dtype) -> torch.Tensor:
    """``saturate(fp32(x) * scale)`` rounded to nearest even in ``fmt``: an fp8 tensor of ``x``'s shape.

    ``scale`` (fp32, a scalar or broadcastable to ``x``: one per row or column) multiplies; the result is
    clamped to ``[-max, max]`` before the cast, so overflow saturates instead of becoming inf."""
    f = format_of(fmt)
    scaled = x.to(torch.float32) * scale
    return scaled.clamp(min=-f.max, max=f.max).to(f.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, *, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """``fp32(q) * (1 / scale)`` in ``dtype``: the value ``q`` stands for (``scale`` as given to
    ``quantize``; the reciprocal taken in fp32, as ``torch._scaled_mm``'s inverse scales are)."""
    inverse = torch.as_tensor(scale, dtype=torch.float32, device=q.device).reciprocal()
    return (q.to(torch.float32) * inverse).to(dtype)
