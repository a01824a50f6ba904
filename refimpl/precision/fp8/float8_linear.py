"""``Float8Linear``: a linear layer whose three GEMMs run in fp8 on ``torch._scaled_mm`` (chapter 10).

``y = x W^T (+ b)`` has three matrix products, and fp8 training (Micikevicius et al. 2022, "FP8 Formats
for Deep Learning"; torchao's ``Float8Linear``, the reference here) casts the operands of each to fp8 with
their own dynamic scales (``refimpl.precision.fp8.scaling``) and lets the GEMM undo the scales on its
fp32 accumulator::

    output       y  = x  W^T    [M, K] @ [K, N]    e4m3 x e4m3     scales: x per row, W^T per column
    input grad   dx = g  W      [M, N] @ [N, K]    e5m2 x e4m3     g per row, W per column
    weight grad  dW = g^T x     [N, M] @ [M, K]    e5m2 x e4m3     g^T per row, x per column

(``M`` tokens, ``K`` in_features, ``N`` out_features; the per-row/column scales are the rowwise recipe,
the tensorwise recipe has one scale per tensor.) ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype)``
computes ``(a * scale_a) @ (b * scale_b)``: the scales it takes are the **inverse** scales ``1 / s``. Its
conventions, as measured on torch 2.13 and as CUDA requires them:

* ``a`` row-major, ``b`` column-major (cuBLASLt's only fp8 layout; the CPU kernel accepts any, we pass the
  CUDA layout everywhere, as torchao's ``preprocess_addmm`` does);
* scales fp32: 0-d for tensorwise, ``scale_a [M, 1]`` and ``scale_b [1, N]`` (contiguous) for rowwise;
* ``out_dtype`` fp32 or bf16. On CPU the kernel dequantizes each operand to fp32 (``a * scale_a``,
  rounded) and multiplies in fp32 (measured: bitwise ``(a.float() * sa) @ (b.float() * sb)``); bf16 output
  is the fp32 result rounded. CUDA's rowwise kernel writes bf16 only, so on CUDA a rowwise GEMM asked for
  fp32 computes bf16 and upcasts (torchao does the same); CUDA refuses a bias with fp32 output, so the
  bias is added after the GEMM on every device (as torchao adds it);
* **sizes**: on CUDA ``a``'s columns and both dimensions of ``b`` must be multiples of 16. For the three
  GEMMs above that is ``K`` and ``N`` (the layer's features) and, in the weight gradient, the token count
  ``M``. We **refuse** a layer whose features are not multiples of 16 (``check_float8_shape``, naming
  the shape; ``refimpl.precision.fp8.convert.convert_to_float8`` skips such layers) and **pad** the
  tokens of the weight gradient with zero rows, which is exact (a zero row adds nothing to ``g^T x``).

Recipes (``Float8Config``): ``tensorwise`` is torchao's default (dynamic per-tensor amax, e4m3 for
inputs and weights, e5m2 for output gradients); ``rowwise`` is torchao's ``rowwise`` recipe (per-row
scales rounded down to powers of two, e4m3 for the gradients too: a per-row scale already covers the
gradients' range, the extra mantissa bit is worth more). The output GEMM may use fast accumulation
(``use_fast_accum``, torchao's default for it; on Hopper it drops the periodic promotion of the tensor
core's accumulator to fp32; the CPU kernel ignores it); the gradient GEMMs do not.

Under ``torch.autocast`` the casts read the tensors as they are (the fp32 master weight is cast to fp8
once, not through bf16 first) and the GEMMs write the autocast dtype; gradients come back in their
inputs' dtypes. The high-precision input and weight are saved for backward, where they are cast again
along the other dimension (rowwise needs that; tensorwise's second cast gives the same bytes). The layer
is a ``refimpl.nn.Linear`` (same ``weight`` / ``bias`` Parameters and state-dict names) whose
forward goes through the linear seam with the fp8 product as its ``matmul`` (``Float8Matmul``, which
hands the seam the two backward GEMMs too): under sequence parallelism (the seam gathers the input) and
with a deferred weight gradient (zero-bubble's ``weight_grad_store``: the casts of ``dW``'s operands run
in ``B``, the fp8 GEMM in ``W``) all three GEMMs stay fp8, cast as here.

**Tensor-parallel shards** cast with the whole layer's scales: ``refimpl.precision.fp8.sharded_scales``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from refimpl.nn.linear import DeferredProduct, Linear, linear_with_grad
from refimpl.precision.fp8.formats import E4M3, E5M2, Float8Format, format_of
from refimpl.precision.fp8.scaling import SCALINGS, Float8Tensor, Scaling, cast_to_float8
from refimpl.precision.fp8.sharded_scales import ShardedScales

__all__ = ["Float8Config", "Float8Linear", "Float8Matmul", "check_float8_shape", "float8_linear",
           "scaled_mm"]

ALIGN = 16  # torch._scaled_mm on CUDA: a's columns and both of b's dims are multiples of 16


@dataclass(frozen=True, kw_only=True)
class Float8Config:
    """Which fp8 format each operand gets, how it is scaled, and whether scales are powers of two."""

    scaling: Scaling = "tensorwise"
    input_format: Float8Format = E4M3
    weight_format: Float8Format = E4M3
    grad_format: Float8Format = E5M2
    power_of_2_scales: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; expected one of {SCALINGS}")
        for field in ("input_format", "weight_format", "grad_format"):
            object.__setattr__(self, field, format_of(getattr(self, field)))
        # the three GEMMs' operand pairs: CUDA's _scaled_mm has no e5m2 x e5m2 kernel (kernel_rules)
        for gemm, a, b in (("the output x W", "input_format", "weight_format"),
                           ("the input gradient g W", "grad_format", "weight_format"),
                           ("the weight gradient g^T x", "grad_format", "input_format")):
            if getattr(self, a).dtype == getattr(self, b).dtype == torch.float8_e5m2:
                raise ValueError(f"Float8Config: {a} and {b} both e5m2 make {gemm} an e5m2 x e5m2 GEMM, "
                                 "which CUDA's _scaled_mm has no kernel for; give one of them e4m3")

    @classmethod
    def recipe(cls, name: Scaling) -> Float8Config:
        """torchao's recipe of that name: ``tensorwise`` (its default) or ``rowwise`` (module docstring)."""
        if name == "tensorwise":
            return cls()
        if name == "rowwise":
            return cls(scaling="rowwise", grad_format=E4M3, power_of_2_scales=True)
        raise ValueError(f"unknown recipe {name!r}; expected one of {SCALINGS}")


def check_float8_shape(in_features: int, out_features: int, *, name: str = "") -> None:
    """Refuse a layer whose GEMM dimensions ``_scaled_mm`` cannot take on CUDA (module docstring)."""
    if in_features % ALIGN or out_features % ALIGN:
        where = f" {name}" if name else ""
        raise ValueError(
            f"Float8Linear{where}: weight shape [out_features={out_features}, in_features={in_features}] is "
            f"not a multiple of {ALIGN} in both dims, which torch._scaled_mm needs on CUDA; keep this layer "
            "in high precision (convert_to_float8 skips it) or pad its features")


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def scaled_mm(a: Float8Tensor, b: Float8Tensor, *, out_dtype: torch.dtype, use_fast_accum: bool = False
              ) -> torch.Tensor:
    """``(a.data / a.scale) @ (b.data / b.scale)`` on ``torch._scaled_mm`` (``a [M, K]``, ``b [K, N]``,
    scales 0-d or ``[M, 1]`` / ``[1, N]``), in the layouts CUDA needs; ``[M, N]`` in ``out_dtype``."""
    rowwise = a.scale.dim() == 2
    kernel_dtype = out_dtype
    if rowwise and a.data.is_cuda and out_dtype != torch.bfloat16:
        kernel_dtype = torch.bfloat16  # CUDA's rowwise kernel writes bf16 only
    out = torch._scaled_mm(a.data.contiguous(), _column_major(b.data),
                           scale_a=a.inverse_scale.contiguous(), scale_b=b.inverse_scale.contiguous(),
                           out_dtype=kernel_dtype, use_fast_accum=use_fast_accum)
    return out.to(out_dtype)


def _pad_rows(t: Float8Tensor, dim: int) -> Float8Tensor:
    """``t`` with zero slices appended along ``dim`` up to a multiple of 16 (the scale is unchanged: it
    is not along ``dim``). Zero is the all-zero byte in both formats."""
    missing = -t.data.shape[dim] % ALIGN
    if not missing:
        return t
    shape = list(t.data.shape)
    shape[dim] = missing
    return Float8Tensor(torch.cat([t.data, t.data.new_zeros(shape)], dim=dim), t.scale)


def _cast(c: Float8Config, sharded: ShardedScales | None, t: torch.Tensor, operand: str, fmt: Float8Format,
          dim: int) -> Float8Tensor:
    """``t`` (the operand named ``operand``) cast along ``dim`` with the recipe ``c``; a tensor-parallel
    shard's amax made the whole tensor's first (``ShardedScales``)."""
    reduce = None if sharded is None else sharded.reducer(operand, dim, c.scaling)
    return cast_to_float8(t, fmt, scaling=c.scaling, contraction_dim=dim, power_of_2=c.power_of_2_scales,
                          amax_reduce=reduce)


def _input_grad(c: Float8Config, sharded: ShardedScales | None, g: torch.Tensor, weight: torch.Tensor,
                weight_fp8: Float8Tensor | None) -> tuple[torch.Tensor, Float8Tensor]:
    """``dx = g W`` (``[M, N] @ [N, K]``, e5m2 x e4m3 under tensorwise) in ``g``'s dtype, and ``g`` cast
    per row (tensorwise: the bytes the weight gradient reuses)."""
    g_rows = _cast(c, sharded, g, "grad", c.grad_format, 1)                            # per row [M, 1]
    w8 = weight_fp8 if weight_fp8 is not None else _cast(c, sharded, weight, "weight", c.weight_format, 0)
    return scaled_mm(g_rows, w8, out_dtype=g.dtype), g_rows                           # w8 per column [1, K]


def _weight_grad(c: Float8Config, sharded: ShardedScales | None, g: torch.Tensor, x: torch.Tensor,
                 g_rows: Float8Tensor | None = None) -> DeferredProduct:
    """``dW = g^T x`` (``[N, M] @ [M, K]``) in ``g``'s dtype, in two steps: the casts now (with their
    scales' all-reduces, if any), the GEMM when the returned function is called (zero-bubble's ``W``: no
    collective runs there, and what waits is the fp8 bytes)."""
    g_cols = (g_rows if c.scaling == "tensorwise" and g_rows is not None               # the same bytes
              else _cast(c, sharded, g, "grad", c.grad_format, 0))                     # per column [1, N]
    x_cols = _cast(c, sharded, x, "x", c.input_format, 0)                              # per column [1, K]
    def gemm() -> torch.Tensor:
        return scaled_mm(_pad_rows(g_cols, 0).t(), _pad_rows(x_cols, 0), out_dtype=g.dtype)
    return DeferredProduct(gemm, held=(g_cols.data, g_cols.scale, x_cols.data, x_cols.scale))


class _Float8LinearFunction(torch.autograd.Function):
    """``x [M, K] @ W[N, K]^T`` with the three fp8 GEMMs of the module docstring."""

    @staticmethod  # autograd.Function.apply passes the inputs positionally
    def forward(ctx, x, weight, config: Float8Config, out_dtype: torch.dtype,  # noqa: PLR0917
                weight_fp8: Float8Tensor | None, sharded: ShardedScales | None):
        c = config
        ctx.config, ctx.weight_fp8, ctx.sharded = config, weight_fp8, sharded
        with torch.autocast(x.device.type, enabled=False):
            x8 = _cast(c, sharded, x, "x", c.input_format, 1)                           # [M, K], scale [M, 1]
            w8 = weight_fp8 if weight_fp8 is not None else _cast(
                c, sharded, weight, "weight", c.weight_format, 1)                       # [N, K], scale [N, 1]
            y = scaled_mm(x8, w8.t(), out_dtype=out_dtype, use_fast_accum=True)       # [M, N]
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors                 # x [M, K], weight [N, K], g [M, N]
        c, sharded = ctx.config, ctx.sharded
        dx = dw = g_rows = None
        if ctx.needs_input_grad[0]:
            dx, g_rows = _input_grad(c, sharded, g, weight, ctx.weight_fp8)
            dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(c, sharded, g, x, g_rows)().to(weight.dtype)
        return dx, dw, None, None, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: Float8Config, weight_fp8: Float8Tensor | None = None,
                  sharded: ShardedScales | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` (``[..., K] -> [..., N]``) with fp8 GEMMs forward and backward; ``sharded``:
    the layer is a tensor-parallel shard whose scales must be the whole layer's (module docstring).

    ``weight_fp8``: the weight already cast (tensorwise), e.g. by an fp8 all-gather
    (``refimpl.precision.fp8.float8_communication.all_gather_float8``); it replaces the cast of
    ``weight`` in both GEMMs that read the weight, and ``weight`` then only receives the gradient."""
    if weight_fp8 is not None and (config.scaling != "tensorwise" or weight_fp8.scale.dim() != 0):
        raise ValueError("a pre-cast fp8 weight must be tensorwise-scaled (as torchao's fp8 all-gather is)")
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    y = _Float8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, config, out_dtype, weight_fp8,
                                    sharded)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


@dataclass(frozen=True, kw_only=True)
class Float8Matmul:
    """The fp8 product as the linear seam's matmul (``refimpl.nn.linear.SplitMatmul``): called, it is
    ``float8_linear``; ``input_grad`` and ``weight_grad`` are the same backward GEMMs, for the seam's
    own backward (a sequence gather, a deferred ``dW``), so such a layer stays fp8 in all three GEMMs, with
    the same casts as ``float8_linear``'s backward (bitwise: tests/unit/nn/test_linear_seam.py)."""

    config: Float8Config
    sharded: ShardedScales | None = None
    weight_fp8: Float8Tensor | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return float8_linear(x, weight, bias, config=self.config, weight_fp8=self.weight_fp8,
                             sharded=self.sharded)

    def input_grad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dx = dy W``: ``[..., N] -> [..., K]`` in ``dy``'s dtype."""
        with torch.autocast(dy.device.type, enabled=False):
            dx, _ = _input_grad(self.config, self.sharded, dy.reshape(-1, dy.shape[-1]), weight,
                                self.weight_fp8)
        return dx.reshape(*dy.shape[:-1], dx.shape[-1])

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor) -> DeferredProduct:
        """``dW = dy^T x`` (``dy [M, N]``, ``x [M, K]``): casts now, the GEMM when called."""
        with torch.autocast(dy.device.type, enabled=False):
            return _weight_grad(self.config, self.sharded, dy, x)


class Float8Linear(Linear):
    """``refimpl.nn.Linear`` with fp8 GEMMs (module docstring). ``weight_fp8``, when a caller sets it
    (an fp8 all-gather), is used instead of casting ``weight``; the caller clears it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: Float8Config | None = None, device=None, dtype=None) -> None:
        check_float8_shape(in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config if config is not None else Float8Config()
        self.weight_fp8: Float8Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, scaling: Scaling = "tensorwise",
                    config: Float8Config | None = None) -> Float8Linear:
        """A Float8Linear holding ``linear``'s own ``weight`` and ``bias`` Parameters (optimizers and
        state dicts see no change); ``config`` defaults to torchao's recipe named ``scaling``."""
        check_float8_shape(linear.in_features, linear.out_features)
        config = config if config is not None else Float8Config.recipe(scaling)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.weight_grad_store = getattr(linear, "weight_grad_store", None)  # zbh1's deferred dW, in fp8
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = Float8Matmul(config=self.config, weight_fp8=self.weight_fp8)
        return linear_with_grad(x, self.weight, self.bias, weight_grad_store=self.weight_grad_store,
                                matmul=matmul)

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, scaling={c.scaling}, formats=(x {c.input_format.name}, "
                f"W {c.weight_format.name}, grad {c.grad_format.name})")
