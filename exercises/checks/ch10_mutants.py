"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 10's checks.

``exercises/checks/ch10.py`` re-exports both; tests/course/cli/test_exercises.py grades every mutant (its
task, and only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole
module that takes refimpl's answers (``exercises/reference/ch10.py``) for the other tasks and replaces its
task's names. The right implementations are written here independently of refimpl (a learner's way: the
quotient in float64 rounded once to fp32, ``frexp`` for the power of two, a dequantize-and-matmul GEMM in fp32
and one on ``torch._scaled_mm`` in the layouts a GPU takes, the layer's backward casting each operand through
a helper), and every mutant is that same code with one line
changed (``_mutate`` insists that the line is there).
"""

from __future__ import annotations

_HEADER = "from exercises.reference.ch10 import *  # noqa: F403\nimport torch\n"
_SCALES = _HEADER + """
def operand_amax(x, *, scaling, contraction_dim):
    if scaling not in ("tensorwise", "rowwise"):
        raise ValueError(f"unknown scaling {scaling!r}")
    x = x.detach()
    if scaling == "tensorwise":
        return x.abs().max() if x.numel() else x.new_zeros(())
    if x.dim() != 2:
        raise ValueError("rowwise scaling needs a matrix")
    reduce = contraction_dim
    if x.shape[reduce] == 0:
        shape = list(x.shape)
        shape[reduce] = 1
        return x.new_zeros(shape)
    return x.abs().amax(dim=reduce, keepdim=True)


def amax_to_scale(amax, fmt, *, power_of_2=False):
    fmax = format_of(fmt).max
    a = amax.to(torch.float32).clamp(min=EPS).double()
    # one rounding: the float64 quotient is exact enough
    scale = (torch.full_like(a, fmax) / a).to(torch.float32)
    if power_of_2:
        _, exponent = torch.frexp(scale)                         # scale = m 2^e, 0.5 <= m < 1
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale
"""
_CAST = _HEADER + """
def quantize(x, scale, fmt):
    f = format_of(fmt)
    v = x.to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    v = v.clamp(min=-f.max, max=f.max)  # saturate (NaN stays NaN)
    return v.to(f.dtype)


def dequantize(q, scale, *, dtype=torch.float32):
    inverse = 1.0 / torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.to(torch.float32) * inverse).to(dtype)
"""
_MM = _HEADER + """
def scaled_mm(a, b, *, out_dtype, use_fast_accum=False):
    sa, sb = a.scale.reciprocal(), b.scale.reciprocal()
    a32 = a.data.to(torch.float32) * sa
    b32 = b.data.to(torch.float32) * sb
    return (a32 @ b32).to(out_dtype)
"""
_LINEAR = _HEADER + """
def _cast(t, fmt, dim, config):
    pow2 = config.power_of_2_scales
    amax = operand_amax(t, scaling=config.scaling, contraction_dim=dim)
    scale = amax_to_scale(amax, fmt, power_of_2=pow2)
    return Float8Tensor(quantize(t.detach(), scale, fmt), scale)


def _pad_tokens(t):
    # zero rows up to a multiple of 16 (an H100's _scaled_mm needs K % 16 == 0); the scale is not along them
    missing = -t.data.shape[0] % 16
    zeros = t.data.new_zeros((missing, t.data.shape[1]))
    return Float8Tensor(torch.cat([t.data, zeros]), t.scale)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, config):
        ctx.save_for_backward(x, weight)
        ctx.config = config
        x8 = _cast(x, config.input_format, 1, config)                      # [M, K], along K
        w8 = _cast(weight, config.weight_format, 1, config)                # [N, K], along K
        return scaled_mm(x8, w8.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        c = ctx.config
        gf = c.grad_format
        dx = scaled_mm(_cast(g, gf, 1, c), _cast(weight, c.weight_format, 0, c), out_dtype=torch.float32)
        g_cols, x_cols = _cast(g, gf, 0, c), _cast(x, c.input_format, 0, c)       # along M, the tokens
        dw = scaled_mm(_pad_tokens(g_cols).t(), _pad_tokens(x_cols), out_dtype=torch.float32)
        return dx, dw, None


def float8_linear(x, weight, bias=None, *, config):
    y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, config)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
"""


# The GEMM on torch._scaled_mm, as a GPU takes it: a row-major, b column-major, fp32 inverse scales
_MM_SCALED = _HEADER + """
def scaled_mm(a, b, *, out_dtype, use_fast_accum=False):
    a_data = a.data.contiguous()
    b_data = b.data.t().contiguous().t()
    sa = a.scale.reciprocal().to(torch.float32).contiguous()
    sb = b.scale.reciprocal().to(torch.float32).contiguous()
    return torch._scaled_mm(a_data, b_data, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
"""

# The layer calling torch._scaled_mm itself, as a GPU takes it: a row-major, b column-major
_GEMM = """

def _gemm(a, b, *, out_dtype):
    a_data = a.data.contiguous()
    b_data = b.data.t().contiguous().t()
    sa = a.scale.reciprocal().contiguous()
    sb = b.scale.reciprocal().contiguous()
    return torch._scaled_mm(a_data, b_data, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
"""
_LINEAR_KERNEL = _LINEAR.replace(" scaled_mm(", " _gemm(") + _GEMM
assert _LINEAR_KERNEL.count("_gemm(") == 4


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


SCALES = "scales: fmax / amax, per tensor and row"
CAST = "quantize / dequantize: saturate, RNE"
MM = "scaled_mm: the scales undone"
LINEAR = "float8_linear: three fp8 GEMMs"
CORRECT = {SCALES: _SCALES, CAST: _CAST, MM: [_MM, _MM_SCALED], LINEAR: [_LINEAR, _LINEAR_KERNEL]}
MUTANTS = {
    SCALES: [
        _mutate(_SCALES, "scale = (torch.full_like(a, fmax) / a).to(torch.float32)",
                "scale = (a / fmax).to(torch.float32)"),  # amax / fmax: the scale inverted
        _mutate(_SCALES, "scale = (torch.full_like(a, fmax) / a).to(torch.float32)",
                "scale = fmax / a.to(torch.float32)"),  # python float / tensor: a reciprocal, then a multiply
        # a scale that varies along K:
        _mutate(_SCALES, "reduce = contraction_dim", "reduce = 1 - contraction_dim"),
    ],
    CAST: [
        _mutate(_CAST, "    v = v.clamp(min=-f.max, max=f.max)  # saturate (NaN stays NaN)\n",
                ""),  # trusts .to(): e5m2 overflows to inf
        _mutate(_CAST, "x.to(torch.float32) * torch.as_tensor(", "x.to(torch.float32) / torch.as_tensor("),
        # ^ divides by the scale
        _mutate(_CAST, "inverse = 1.0 / torch.as_tensor(", "inverse = torch.as_tensor("),  # multiplies back
    ],
    MM: [
        _mutate(_MM, "sa, sb = a.scale.reciprocal(), b.scale.reciprocal()", "sa, sb = a.scale, b.scale"),
        # ^ the scales, not the inverse scales
        _mutate(_MM, "return (a32 @ b32).to(out_dtype)",
                "return (a32.bfloat16() @ b32.bfloat16()).to(out_dtype)"),  # dequantized to bf16
        # the operands as they come: right on a CPU, refused by an H100's torch._scaled_mm
        _mutate(_MM_SCALED, "    b_data = b.data.t().contiguous().t()\n", "    b_data = b.data\n"),
    ],
    LINEAR: [
        _mutate(_LINEAR, "gf = c.grad_format", "gf = c.input_format"),  # e4m3 for the gradients
        _mutate(_LINEAR, "pow2 = config.power_of_2_scales", "pow2 = False"),  # ignores the power-of-2 scales
        # right on a CPU, refused by an H100: the weight gradient's contraction over 40 tokens, not padded
        _mutate(_LINEAR, "scaled_mm(_pad_tokens(g_cols).t(), _pad_tokens(x_cols),",
                "scaled_mm(g_cols.t(), x_cols,"),
        # right on a CPU, refused by an H100: the operands as they come, the backward's W and g^T row-major
        # where the kernel needs b column-major and a row-major
        _mutate(_LINEAR_KERNEL, "    a_data = a.data.contiguous()\n"
                                "    b_data = b.data.t().contiguous().t()\n",
                "    a_data, b_data = a.data, b.data\n"),
    ],
}
