"""Exercises of chapter 10: fp8 training, from the scale to the three GEMMs of a linear layer.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=10`` (or
``python -m exercises.grade 10``) to see your score per task:

1. ``operand_amax`` and ``amax_to_scale``: a tensor's absolute maximum, per tensor or per slice along the
   contraction dimension, and the scale ``fmax / amax`` that puts it on the format's largest value;
2. ``quantize`` and ``dequantize``: the saturating, round-to-nearest-even cast into e4m3fn / e5m2, and
   back;
3. ``scaled_mm``: the product of two scaled fp8 operands, accumulated in fp32, the scales undone
   (``torch._scaled_mm``'s contract);
4. ``float8_linear``: ``y = x W^T + b`` whose three GEMMs (the output, the input gradient, the weight
   gradient) each run on fp8 operands cast with their own scales, in the formats of the roles they play
   (Micikevicius et al. 2022; torchao's ``Float8Linear``).

The grader compares every cast with PyTorch's own decoding of all 256 codes of each format (the nearest
number, ties to the even code, computed here by search, not by a cast), every scale with the fp32
rounding of the float64 quotient, and every GEMM with a float64 emulation of the same fp8 numbers,
within a stated factor of the fp32 arithmetic's spread measured in the same run (and with
``torch._scaled_mm`` itself). A CPU runs ``torch._scaled_mm`` in any layout and size; the grader also
holds ``scaled_mm`` and the layer's three GEMMs to what an H100 (sm90) accepts.

Notation: an fp8 tensor travels with its scale as ``Float8Tensor(data, scale)``: ``data ~= x * scale``
(``data`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, ``scale`` fp32, 0-d for one scale per
tensor, or ``[M, 1]`` / ``[1, N]``: one per row / column). ``fmt`` is a ``Float8Format`` (``E4M3``:
``max`` 448; ``E5M2``: ``max`` 57344; ``fmt.dtype`` the torch dtype) or that dtype; ``format_of(fmt)``
gives the ``Float8Format`` of either.

You may use ``torch`` (``torch._scaled_mm`` too), ``Float8Format``, ``E4M3``, ``E5M2``, ``format_of``,
``EPS`` and the records ``Float8Tensor`` (its ``data`` and ``scale``) and ``Float8Config`` below; do not
call ``refimpl.precision.fp8``'s functions (that is the answer). Chapter 10 explains each piece.
"""

from __future__ import annotations

import torch

from refimpl.precision.fp8 import E4M3, E5M2, EPS, Float8Config, Float8Format, Float8Tensor, format_of  # noqa: F401

# ---- 1: scales ---------------------------------------------------------------------------------------------


def operand_amax(x: torch.Tensor, *, scaling: str, contraction_dim: int) -> torch.Tensor:
    """``max |x|`` as a tensor without gradient, of ``x``'s dtype.

    * ``scaling="tensorwise"``: a 0-d tensor (0 for an empty ``x``);
    * ``scaling="rowwise"``: ``x`` is a matrix (else ``ValueError``); one amax per slice along
      ``contraction_dim``, that dim kept as 1: ``[M, 1]`` for a left operand ``[M, K]`` with
      ``contraction_dim=1``, ``[1, N]`` for a right operand ``[K, N]`` with ``contraction_dim=0``
      (zeros when the contraction dim is empty).

    Any other ``scaling``: ``ValueError``. Why along the contraction dim: ``C_ij = sum_k A_ik B_kj`` lets
    a scale per row ``i`` of ``A`` and per column ``j`` of ``B`` come out of the sum; a scale that varied
    with ``k`` would not.
    """
    raise NotImplementedError("operand_amax: max |x|, whole or per slice along the contraction dim")


def amax_to_scale(amax: torch.Tensor, fmt: Float8Format | torch.dtype, *, power_of_2: bool = False
                  ) -> torch.Tensor:
    """``fmax / max(amax, EPS)`` in fp32, one scale per element of ``amax`` (any shape, any float dtype).

    ``fmax`` is ``format_of(fmt).max``; ``EPS = 1e-12`` keeps the scale of an all-zero tensor finite. The
    scale is the fp32 number nearest to the quotient (fp32 division of two fp32 numbers rounds once).
    With ``power_of_2=True`` it is then rounded **down** to a power of two (``2^floor(log2 scale)``), so
    that scaling and unscaling are exact.

    Traps: the scale multiplies (``x * scale`` lands on ``fmax``); in torch ``python_float / tensor`` is
    computed as ``tensor.reciprocal() * python_float``, two roundings (``448 / 3`` comes out one ulp
    high).
    """
    raise NotImplementedError("amax_to_scale: fmax / max(amax, eps), in fp32")


# ---- 2: the cast -------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Float8Format | torch.dtype) -> torch.Tensor:
    """``x * scale`` in fp8: a tensor of dtype ``format_of(fmt).dtype`` and ``x``'s shape.

    ``x`` (any float dtype) is taken to fp32 and multiplied by ``scale`` in fp32 (a number, a 0-d
    tensor, or a tensor broadcastable to ``x``: one per row or column); the product is rounded to the
    nearest number of the format, ties to the even code. A magnitude beyond the format's largest finite
    value ``max`` (``+-inf`` included) becomes ``+-max``: the cast **saturates**, never giving inf. NaN
    stays NaN.

    Trap: PyTorch's own ``.to(torch.float8_e5m2)`` does not saturate (``1e6`` becomes inf).
    """
    raise NotImplementedError("quantize: fp32(x) * scale, saturated to +-max, cast to the fp8 dtype")


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, *, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The values ``q`` stands for: ``fp32(q) * (1 / scale)``, returned in ``dtype``.

    ``scale`` as given to ``quantize`` (a number, a 0-d tensor, or broadcastable). The reciprocal is
    taken in fp32 and multiplies (it is the inverse scale ``torch._scaled_mm`` takes); the product is
    fp32, then rounded to ``dtype``.
    """
    raise NotImplementedError("dequantize: fp32(q) times the fp32 inverse scale")


# ---- 3: the scaled GEMM ------------------------------------------------------------------------------------


def scaled_mm(a: Float8Tensor, b: Float8Tensor, *, out_dtype: torch.dtype, use_fast_accum: bool = False
              ) -> torch.Tensor:
    """``(a.data / a.scale) @ (b.data / b.scale)``: ``[M, N]`` in ``out_dtype`` (fp32 or bf16).

    ``a.data [M, K]``, ``b.data [K, N]`` (fp8, either format, possibly non-contiguous views such as a
    transpose); ``a.scale`` 0-d or ``[M, 1]``, ``b.scale`` 0-d or ``[1, N]`` (fp32). The products are
    accumulated in fp32; a bf16 result is the fp32 one rounded. ``use_fast_accum`` is a hint for GPUs
    (the CPU ignores it). The inputs are not modified.

    Trap: ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` computes ``(a * scale_a) @
    (b * scale_b)``: it takes the **inverse** scales.
    """
    raise NotImplementedError("scaled_mm: the fp8 product with the inverse scales applied")


# ---- 4: the linear layer's three GEMMs ---------------------------------------------------------------------


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: Float8Config) -> torch.Tensor:
    """``x @ weight^T + bias`` (``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or None) -> ``[..., N]`` in
    ``x``'s dtype (fp32 here), differentiable with respect to ``x``, ``weight`` and ``bias``.

    With ``M`` tokens (``x`` flattened to ``[M, K]``) and ``g = dL/dy [M, N]``, each of the three GEMMs
    casts both its operands to fp8 with the **dynamic** scale of their current amax
    (``operand_amax``, ``amax_to_scale`` with ``power_of_2=config.power_of_2_scales``, then
    ``quantize``), then multiplies them with ``scaled_mm`` (fp32 output):

    =============  ==========================  ==========================================================
    GEMM           operands                    formats
    =============  ==========================  ==========================================================
    output         ``y  = x @ W^T``            ``x``: ``config.input_format``, ``W``: ``weight_format``
    input grad     ``dx = g @ W``              ``g``: ``config.grad_format``, ``W``: ``weight_format``
    weight grad    ``dW = g^T @ x``            ``g``: ``config.grad_format``, ``x``: ``input_format``
    =============  ==========================  ==========================================================

    ``config.scaling``: ``"tensorwise"`` (one scale per operand) or ``"rowwise"`` (one per slice along
    **that GEMM's** contraction dimension: ``K`` for the output, ``N`` for the input gradient, ``M`` for
    the weight gradient; so ``x``, ``W`` and ``g`` are each cast once per GEMM that reads them, along
    different dims). The bias is added in high precision after the GEMM, and its gradient is ``g``
    summed over the tokens (no fp8). Use ``torch.autograd.Function`` for the backward.

    **Each GEMM as an H100 runs it.** A CPU's ``torch._scaled_mm`` takes any size and layout; sm90's does
    not (``refimpl.distributed.kernel_rules``), so the grader checks every fp8 GEMM the layer makes (the
    three, each through ``scaled_mm`` or ``torch._scaled_mm``) against sm90's rules:

    * the contraction dim and the output's columns are multiples of 16. ``K`` and ``N`` are the layer's
      features (multiples of 16, as ``Float8Linear`` requires), but the weight gradient contracts over the
      ``M`` tokens, which need not be: pad ``g`` and ``x`` (their fp8 data) with zero rows up to a
      multiple of 16, which is exact (a zero row adds nothing to ``g^T x``; zero is the all-zero byte);
    * not both operands e5m2 (there is no e5m2 x e5m2 kernel);
    * where you call ``torch._scaled_mm`` yourself: ``a`` row-major, ``b`` column-major (a transposed
      row-major tensor), fp32 inverse scales, 0-d or ``[M, 1]`` and ``[1, N]`` contiguous.

    Traps: gradients span more decades than activations, which is why the recipes give them e5m2 (the
    range) where the forward tensors get e4m3 (the precision): read the formats from ``config``; a
    rowwise cast reused from the forward has its scales along the wrong dim for both backward GEMMs; the
    backward's operands come in the layouts the kernel refuses (``W [N, K]`` row-major as the ``b`` of
    ``g W``, ``g^T`` a column-major view as the ``a`` of ``g^T x``), and the token count of a batch is
    rarely a multiple of 16: the CPU runs all of it, an H100 none.
    """
    raise NotImplementedError("float8_linear: three scaled fp8 GEMMs, forward and backward")
