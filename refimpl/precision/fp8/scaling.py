"""Scales for fp8: from the absolute maximum, per tensor or per row, now or from history (chapter 10).

An fp8 format covers about 2^18 (e4m3) or 2^32 (e5m2) from its smallest subnormal to its largest value,
with three or two mantissa bits everywhere in between. A tensor is moved into that window by a **scale**
chosen from its absolute maximum ``amax`` (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
section 4.3; torchao's ``amax_to_scale``)::

    scale = fmax / max(amax, eps)        (fp32; eps = 1e-12 keeps an all-zero tensor finite)
    q     = saturate(x * scale)          in fp8     (refimpl.precision.fp8.formats.quantize)
    x    ~= q * (1 / scale)              the inverse scale is what torch._scaled_mm takes

so the largest magnitude lands on ``fmax`` and nothing saturates. ``scale`` is computed in fp32; torchao
divides in fp64 and rounds to fp32, which is the same number (a correctly rounded fp64 quotient of two
fp32 numbers rounds to the correctly rounded fp32 quotient: 53 >= 2 * 24 + 2 bits). One trap: torch
computes ``python_float / tensor`` as ``tensor.reciprocal() * python_float``, two roundings (448 / 3 comes
out one ulp high), so the division here is tensor by tensor. With
``power_of_2=True`` the scale is rounded down to a power of two (torchao's rowwise recipe), so scaling
and unscaling are exact and only the fp8 rounding is left. **Down**, exactly: a power of two above the
scale puts ``amax * scale`` above ``fmax``, and amax saturates. ``exp2(floor(log2(scale)))`` (torchao's
``_round_scale_down_to_power_of_2``, 0.18) is not exact: for a scale one ulp below ``2^k`` the fp32
``log2`` rounds to the integer ``k`` (measured for k in -30..30: at every ``k >= 3`` and ``k <= -2``, where
fp32's spacing near ``k`` is coarser than the distance), and the scale rounds **up**. The exponent ``frexp``
gives is exact (tests/unit/precision/test_fp8.py plants such amaxes).

**Granularity** (``cast_to_float8``): *tensorwise* is one scale for the whole tensor (torchao's
default); one outlier then pushes every other value toward the subnormals. *Rowwise* is one scale per
row of the left operand of ``C = A @ B`` and one per column of the right operand, i.e. one per slice along
the contraction dimension ``k``: ``C_ij = sum_k A_ik B_kj`` becomes ``(1/sa_i)(1/sb_j) sum_k qA_ik qB_kj``,
so the scales factor out of the sum and the GEMM applies them to its output (``scale_a [M, 1]``,
``scale_b [1, N]`` in ``torch._scaled_mm``). A scale along any other dimension would not factor out.
DeepSeek-V3 (2024) goes finer (1 x 128 tiles and 128 x 128 blocks) for the same reason.

**Delayed scaling** (``DelayedScaling``): Transformer Engine's original recipe (and torchao's, before
it removed it) uses the maximum of the last ``history_len`` steps' amaxes, so the scale is known before
the tensor is (no reduction over the tensor on the critical path). It is right while amax drifts slowly;
on the step where amax jumps the stale scale is too large and the new values **saturate**. The class
measures that (``DelayedCast.saturated``): the chapter's cost of not looking.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from refimpl.config import FP8_SCALINGS
from refimpl.precision.fp8.formats import Float8Format, dequantize, format_of, quantize

__all__ = ["EPS", "SCALINGS", "DelayedCast", "DelayedScaling", "Float8Tensor", "Scaling", "amax_to_scale",
           "cast_to_float8", "operand_amax"]

EPS = 1e-12
Scaling = Literal["tensorwise", "rowwise"]
SCALINGS: tuple[str, ...] = FP8_SCALINGS  # ("tensorwise", "rowwise"), named in refimpl.config


def amax_to_scale(amax: torch.Tensor, fmt: Float8Format | torch.dtype, *, power_of_2: bool = False
                  ) -> torch.Tensor:
    """``fmax / max(amax, eps)`` in fp32 (any shape: one scale per amax), optionally rounded down to a
    power of two, ``2^floor(log2(scale))`` exactly (not via an fp32 ``log2``: module docstring)."""
    f = format_of(fmt)
    amax = amax.to(torch.float32).clamp(min=EPS)
    scale = torch.full_like(amax, f.max) / amax  # not f.max / amax (a reciprocal, then a multiply)
    if power_of_2:
        # scale = m 2^e with 0.5 <= m < 1 (frexp, exact), so 2^(e-1) = scale / (2m): a quotient whose exact
        # value is a float, which IEEE division returns exactly. 0, inf and NaN stay as they are.
        mantissa, _ = torch.frexp(scale)
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale / (2 * mantissa), scale)
    return scale


def operand_amax(x: torch.Tensor, *, scaling: Scaling, contraction_dim: int) -> torch.Tensor:
    """``max |x|``: a 0-d tensor (tensorwise), or one per slice along ``contraction_dim`` with that dim
    kept as 1 (rowwise: ``[M, 1]`` for a left operand ``[M, K]`` and ``contraction_dim=1``, ``[1, N]`` for a
    right operand ``[K, N]`` and ``contraction_dim=0``)."""
    if scaling == "tensorwise":
        return x.detach().abs().amax() if x.numel() else x.new_zeros(())  # an empty tensor: amax 0
    if scaling == "rowwise":
        if x.dim() != 2:
            raise ValueError(f"rowwise scaling needs a matrix, got shape {tuple(x.shape)}")
        if x.shape[contraction_dim] == 0:
            return x.new_zeros([1 if d == contraction_dim % 2 else n for d, n in enumerate(x.shape)])
        return x.detach().abs().amax(dim=contraction_dim, keepdim=True)
    raise ValueError(f"unknown scaling {scaling!r}; expected one of {SCALINGS}")


@dataclass(frozen=True)
class Float8Tensor:
    """An fp8 tensor and the scale it was cast with: ``data ~= x * scale`` (a plain record, not a tensor
    subclass as torchao's ``Float8TrainingTensor`` is). ``scale``: fp32, 0-d or broadcastable to ``data``."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def inverse_scale(self) -> torch.Tensor:
        """``1 / scale`` in fp32: the ``scale_a`` / ``scale_b`` ``torch._scaled_mm`` multiplies by."""
        return self.scale.reciprocal()

    @property
    def fmt(self) -> Float8Format:
        return format_of(self.data.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.scale, dtype=dtype)

    def t(self) -> Float8Tensor:
        """The transpose, its scale transposed with it (a rowwise ``[M, 1]`` becomes ``[1, M]``)."""
        return Float8Tensor(self.data.t(), self.scale.t() if self.scale.dim() == 2 else self.scale)


def cast_to_float8(x: torch.Tensor, fmt: Float8Format | torch.dtype, *, scaling: Scaling = "tensorwise",
                   contraction_dim: int = -1, power_of_2: bool = False,
                   amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Float8Tensor:
    """``x`` cast to ``fmt`` with the dynamic scale of its current amax (module docstring): one scale
    (tensorwise) or one per slice along ``contraction_dim`` (rowwise). ``amax_reduce`` (e.g. a MAX
    all-reduce over the ranks that hold the other parts of the tensor) turns the local amax into the whole
    tensor's before the scale is taken."""
    amax = operand_amax(x, scaling=scaling, contraction_dim=contraction_dim)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    scale = amax_to_scale(amax, fmt, power_of_2=power_of_2)
    return Float8Tensor(quantize(x.detach(), scale, fmt), scale)


@dataclass(frozen=True)
class DelayedCast:
    """What one delayed-scaling cast did: the fp8 tensor, the amax it recorded, and the fraction of its
    elements that saturated (``|x * scale| > fmax``, clamped to ``fmax``)."""

    tensor: Float8Tensor
    amax: float
    saturated: float


class DelayedScaling:
    """Tensorwise scales from an amax history (Transformer Engine's ``DelayedScaling``; module docstring).

    Each ``cast`` uses ``amax_to_scale(max(history))`` (``margin`` halvings below it, TE's margin),
    then appends the tensor's own amax, so the scale of step ``t`` reflects steps
    ``t - history_len .. t - 1``. The first cast has no history and uses its own amax (TE starts from
    scale 1 instead)."""

    def __init__(self, fmt: Float8Format | torch.dtype, *, history_len: int = 16, margin: int = 0) -> None:
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.fmt = format_of(fmt)
        self.margin = margin
        self.history: deque[float] = deque(maxlen=history_len)

    def scale(self) -> torch.Tensor | None:
        """The scale the next cast will use (None before the first cast)."""
        if not self.history:
            return None
        return amax_to_scale(torch.tensor(max(self.history)), self.fmt) / 2.0**self.margin

    @torch.no_grad()
    def cast(self, x: torch.Tensor) -> DelayedCast:
        amax = x.abs().amax().to(torch.float32)
        scale = self.scale()
        if scale is None:
            scale = amax_to_scale(amax, self.fmt) / 2.0**self.margin
        scale = scale.to(x.device)
        saturated = ((x.to(torch.float32) * scale).abs() > self.fmt.max).float().mean().item()
        self.history.append(float(amax))
        return DelayedCast(tensor=Float8Tensor(quantize(x, scale, self.fmt), scale), amax=float(amax),
                           saturated=saturated)
