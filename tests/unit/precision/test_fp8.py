"""fp8 training (chapter 10), one process: the formats and their cast, scales, Float8Linear's three GEMMs
against a float64 emulation and against torchao 0.18.0, the conversion of a model, and measured numerics.

**What torchao 0.18.0 does on CPU** (torch 2.13, found by wrapping ``torch._scaled_mm`` during its forward
and backward): ``convert_to_float8_training`` with ``Float8LinearConfig()`` (tensorwise) calls
``torch._scaled_mm`` itself on CPU, three times (e4m3 x e4m3 with fp32 output; e5m2 x e4m3 twice), with a
row-major left and a column-major right operand and 0-d inverse scales, so ``emulate=True`` is not needed
(it would replace the GEMM by ``mm(a / scale, b / scale)``, a different rounding). Under
``torch.autocast("cpu", dtype=torch.bfloat16)`` its module's own cast (``torch.is_autocast_enabled()``,
CUDA's flag) does nothing; CPU autocast turns its ``mm`` into bf16 output instead, while the casts still
read the fp32 tensors. The ``rowwise`` recipe (``Float8LinearConfig.from_recipe_name("rowwise")``: e4m3
everywhere, power-of-two scales) runs on CPU too; it asks for **bf16** output even for an fp32 layer
(pytorch/pytorch#156771's workaround for CUDA's bf16-only rowwise kernel) and applies the gradient
GEMMs' scales after a unit-scale ``_scaled_mm``. Ours makes the same casts in the same order and the same
GEMM calls: tensorwise (fp32 and autocast) and rowwise under autocast are bitwise torchao's; rowwise in
fp32 is bitwise torchao's once our fp32 GEMM output is rounded to bf16 as theirs is.

**Tolerances** (docs: a measured spread times a stated factor). Errors of a GEMM ``C = A B`` are measured
per element against ``(|A| |B|)_ij`` (the scale of its rounding errors, so a large row cannot hide a small
one). The spread is measured in the same run on the same fp8 operands: the fp32 product in two
summation orders, plus the effect of dequantizing each operand to fp32 first (what the CPU kernel does);
the bf16 output's spread is the float64 result rounded to bf16.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from refimpl.precision.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    Float8Config,
    Float8Linear,
    Float8Tensor,
    amax_to_scale,
    cast_to_float8,
    convert_to_float8,
    dequantize,
    float8_linear,
    quantize,
)

FACTOR = 4  # the stated factor over the measured spread
M, K, N = 40, 96, 48  # 40 tokens: the weight gradient pads them to 48 (a multiple of 16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- formats and the cast


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_formats_limits_match_torch_and_the_bit_layout(fmt):
    finfo = torch.finfo(fmt.dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    finite = codes[codes.isfinite()]
    assert fmt.max == finfo.max == finite.max().item()
    assert fmt.smallest_normal == finfo.smallest_normal
    assert fmt.smallest_subnormal == finite[finite > 0].min().item()
    assert fmt.epsilon == finfo.eps
    # 1.75 * 2^emax: e5m2's top mantissa 11 (its top exponent is inf/NaN), e4m3fn's 110 (111 is NaN)
    top = 2 - fmt.epsilon if fmt.has_inf else 2 - 2 * fmt.epsilon
    assert fmt.max == top * 2.0**fmt.max_exponent == 1.75 * 2.0**fmt.max_exponent
    assert (fmt.max_exponent, fmt.min_exponent) == {"e4m3fn": (8, -6), "e5m2": (15, -14)}[fmt.name]
    assert codes.isinf().any().item() == fmt.has_inf
    assert 1 + fmt.exponent_bits + fmt.mantissa_bits == finfo.bits == 8
    assert round(fmt.dynamic_range_bits, 1) == {"e4m3fn": 17.8, "e5m2": 31.8}[fmt.name]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_cast_round_trips_saturates_and_rounds_to_nearest_even(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt.dtype).float()
    ok = values.isfinite()
    # every finite fp8 number casts to itself (its byte) and dequantizes to itself
    assert torch.equal(quantize(values[ok], 1.0, fmt).view(torch.uint8), codes[ok])
    assert torch.equal(dequantize(quantize(values[ok], 1.0, fmt), 1.0), values[ok])
    # each midpoint between neighbours goes to the neighbour with the even code; just above it, up
    pos = values[ok & (values > 0)].sort().values
    pos = torch.cat([torch.zeros(1), pos])
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2  # exact in fp32: an fp8 neighbour pair needs at most 5 significant bits
    lo_code = quantize(lo, 1.0, fmt).view(torch.uint8)
    even = torch.where(lo_code % 2 == 0, lo, hi)
    assert torch.equal(quantize(mid, 1.0, fmt).float(), even)
    assert torch.equal(quantize(torch.nextafter(mid, hi), 1.0, fmt).float(), hi)
    assert torch.equal(quantize(-mid, 1.0, fmt).float(), -even)
    # saturation: beyond the largest finite value (and inf) clamps to +-fmax, never inf; NaN stays NaN
    big = torch.tensor([fmt.max * 1.01, 1e30, float("inf"), -1e30, float("-inf")])
    assert quantize(big, 1.0, fmt).float().tolist() == [fmt.max, fmt.max, fmt.max, -fmt.max, -fmt.max]
    assert quantize(torch.tensor([float("nan")]), 1.0, fmt).float().isnan().all()
    if fmt is E5M2:  # why the clamp is explicit: torch's own e5m2 cast overflows to inf
        assert torch.tensor([1e6]).to(fmt.dtype).float().isinf().all()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_scale_from_amax_puts_the_largest_value_on_fmax_and_equals_torchaos(fmt):
    from torchao.float8.float8_utils import amax_to_scale as ao_amax_to_scale

    decades = 10.0 ** torch.randint(-9, 9, (200,), generator=_gen(1))
    edges = torch.tensor([0.0, 1e-13, 1e-12, 3.0, 448.0, 3e38])  # 448 / 3: where a reciprocal-multiply errs
    amax = torch.cat([torch.rand(200, generator=_gen(0)) * decades, edges])
    # with power_of_2 too: torchao's exp2(floor(log2)) rounds up only for a scale within an ulp of a power of
    # two above it (the next test), which none of these random amaxes has
    for pow2 in (False, True):
        assert torch.equal(amax_to_scale(amax, fmt, power_of_2=pow2),
                           ao_amax_to_scale(amax, fmt.dtype, round_scales_to_power_of_2=pow2))
    x = torch.randn(64, 32, generator=_gen(2)) * 1e-3
    t = cast_to_float8(x, fmt)
    assert t.scale.dim() == 0 and t.data.float().abs().max().item() == fmt.max
    rows = cast_to_float8(x, fmt, scaling="rowwise", contraction_dim=1)
    cols = cast_to_float8(x, fmt, scaling="rowwise", contraction_dim=0)
    assert rows.scale.shape == (64, 1) and cols.scale.shape == (1, 32)
    assert (rows.data.float().abs().amax(1) == fmt.max).all()
    assert (cols.data.float().abs().amax(0) == fmt.max).all()
    zero = cast_to_float8(torch.zeros(4, 4), fmt)  # the eps floor: a finite scale, zeros stay zeros
    assert zero.scale.isfinite() and (zero.data.float() == 0).all()


def _power_of_2_down(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two not above each scale, from Python's exact ``frexp`` (a source independent
    of the package's)."""
    return torch.tensor([math.ldexp(1.0, math.frexp(v)[1] - 1) for v in scale.flatten().tolist()],
                        dtype=torch.float32).view(scale.shape)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_power_of_2_scale_rounds_down_so_the_amax_never_saturates(fmt):
    """Amaxes whose exact scale ``fmax / amax`` is one fp32 ulp below ``2^k``: the power-of-two scale must
    be ``2^(k-1)``. Rounded to nearest (or through ``exp2(floor(log2(scale)))``, whose fp32 ``log2``
    rounds to ``k``) it is ``2^k``, ``amax * scale`` exceeds ``fmax`` and the amax saturates."""
    k = torch.arange(-30, 31, dtype=torch.float32)
    power = torch.exp2(k)
    below = torch.nextafter(power, torch.zeros(()))                     # one ulp below 2^k
    amax = (fmt.max / below.double()).float()
    exact = amax_to_scale(amax, fmt)
    assert (exact < power).all(), "the planted amaxes: their exact scale lies below 2^k"
    scale = amax_to_scale(amax, fmt, power_of_2=True)
    assert torch.equal(scale, _power_of_2_down(exact)) and torch.equal(scale, power / 2)
    assert (amax * scale <= fmt.max).all()                              # exact: scale is a power of two
    # the cast the rowwise recipe makes: each row's amax (the first entry) is scaled to fmax / 2, not onto
    # fmax, so no entry of the row saturates or lands on fmax
    x = torch.stack([amax, -amax / 3, amax / 7], dim=1)
    t = cast_to_float8(x, fmt, scaling="rowwise", contraction_dim=1, power_of_2=True)
    assert torch.equal(t.scale.flatten(), scale)
    assert (x * t.scale).abs().le(fmt.max).all() and (t.data.float().abs() < fmt.max).all()
    # negative controls: round to nearest gives 2^k and saturates every one of them; so does the fp32 log2
    # of exp2(floor(log2(scale))) wherever it rounds to k (measured on torch 2.13's CPU kernels: for every
    # k >= 3 and k <= -2, where fp32's spacing near k is coarser than the distance)
    nearest = torch.exp2(torch.round(torch.log2(exact)))
    assert torch.equal(nearest, power) and (amax * nearest > fmt.max).all()
    via_log2 = torch.exp2(torch.floor(torch.log2(exact)))
    assert (amax * via_log2 > fmt.max).any()


def test_delayed_scaling_saturates_on_the_step_the_amax_jumps():
    """Transformer Engine's amax history: the jump step is cast with the stale scale (numbers for the
    chapter: the saturated fraction and the error of that step, against dynamic scaling's)."""
    delayed = DelayedScaling(E4M3, history_len=4)
    base = torch.randn(4096, generator=_gen(3))
    steps = [base * s for s in (1.0, 0.9, 1.0, 0.95, 1e5, 1.0, 1.0, 1.0, 1.0, 1.0)]
    casts = [delayed.cast(x) for x in steps]
    err = [float((c.tensor.dequantize() - x).norm() / x.norm()) for c, x in zip(casts, steps, strict=True)]
    dyn = [float((cast_to_float8(x, E4M3).dequantize() - x).norm() / x.norm()) for x in steps]
    saturated = [c.saturated for c in casts]
    print(f"\ndelayed scaling: saturated {saturated}\n  error {err}\n  dynamic error {dyn}")
    assert saturated[4] > 0.9 and all(s == 0 for i, s in enumerate(saturated) if i != 4)
    assert err[4] > 10 * max(dyn)
    # for history_len steps after the spike the scale is 1e5 x too small: the values fall under e4m3's
    # subnormals (flushed to zero); then the spike leaves the history
    assert all(e > 10 * d for e, d in zip(err[5:9], dyn[5:9], strict=True)) and err[9] < 1.1 * dyn[9]


def test_delayed_scaling_margin_halves_the_scale_per_step_and_absorbs_a_growth_of_2_to_the_margin():
    """Transformer Engine's ``margin``: the scale is ``fmax / amax_history / 2^margin``. A tensor that grows
    by 1.5x on the next step saturates under margin 0 and fits under margin 1 (its amax is within
    ``2^1`` of the history's); each margin halves the scale exactly (a power of two: no other rounding).
    Negative control: margin 0 saturates the grown step."""
    base = torch.randn(4096, generator=_gen(5))
    grown = base * 1.5
    casts = {}
    for margin in (0, 1, 3):
        delayed = DelayedScaling(E4M3, history_len=4, margin=margin)
        first = delayed.cast(base)
        casts[margin] = (first, delayed.cast(grown))
        plain = amax_to_scale(base.abs().amax(), E4M3)
        assert torch.equal(first.tensor.scale, plain / 2**margin), margin  # the first cast: its own amax
        assert torch.equal(casts[margin][1].tensor.scale, plain / 2**margin)  # the next: the history's
    assert casts[0][1].saturated > 0 and casts[1][1].saturated == 0 and casts[3][1].saturated == 0
    # the price of the margin: the range given up at the top is lost at the bottom (more small values in
    # e4m3's subnormals), so the error of the step that did not grow does not shrink as the margin grows
    err = {m: float((c[0].tensor.dequantize() - base).norm() / base.norm()) for m, c in casts.items()}
    assert err[0] <= err[1] <= err[3], err
    with pytest.raises(ValueError, match="margin must be >= 0"):
        DelayedScaling(E4M3, margin=-1)


def test_a_config_whose_gemm_pairs_two_e5m2_operands_is_refused():
    """CUDA's _scaled_mm has no e5m2 x e5m2 kernel (refimpl.distributed.kernel_rules): a config that gives
    one of the three GEMMs two e5m2 operands is refused at construction, naming the GEMM; torchao's two
    recipes and an e5m2 weight with e4m3 gradients are accepted."""
    for kwargs, gemm in ((dict(weight_format=E5M2), "the input gradient g W"),
                         (dict(input_format=E5M2), "the weight gradient g^T x"),
                         (dict(input_format=E5M2, weight_format=E5M2, grad_format=E4M3), "the output x W")):
        with pytest.raises(ValueError, match=gemm.replace("^", r"\^")):
            Float8Config(**kwargs)
    Float8Config(weight_format=E5M2, grad_format=E4M3)
    Float8Config.recipe("tensorwise")
    Float8Config.recipe("rowwise")


# ---------------------------------------------------------------- the three GEMMs against float64


def _ref_cast(t: torch.Tensor, fmt, *, rowwise: bool, dim: int, pow2: bool) -> Float8Tensor:
    """The recipe's cast restated from the formulas: amax in float64, scale = fmax / amax rounded to fp32."""
    t = t.detach().float()
    amax = t.double().abs().amax(dim=dim, keepdim=True) if rowwise else t.double().abs().amax()
    amax = amax.clamp(min=1e-12)
    scale = (torch.full_like(amax, fmt.max) / amax).float()  # one correctly rounded division, then to fp32
    if pow2:
        scale = _power_of_2_down(scale)
    return Float8Tensor((t * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype), scale)


def _emulate(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """quantize -> matmul -> dequantize in float64: the fp8 values (exact in float64; their products have
    at most 8 significant bits, so the sums are exact or within 2^-53) times the fp32 inverse scales."""
    return (a.data.double() @ b.data.double()) * a.inverse_scale.double() * b.inverse_scale.double()


def _spread(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``(|A| |B|, measured spread)``: the same fp8 operands dequantized to fp32 and multiplied in fp32
    in two summation orders, plus the dequantization's own rounding (fp32 operands multiplied in float64);
    for bf16 output, the float64 result rounded to bf16."""
    a32, b32 = a.dequantize(), b.dequantize()
    scale = a32.double().abs() @ b32.double().abs()
    exact = _emulate(a, b)
    forward = a32 @ b32
    backward = sum(a32[:, k:k + 8] @ b32[k:k + 8] for k in reversed(range(0, a32.shape[1], 8)))
    order = ((forward - backward).abs() / scale).max()
    spread = order + ((a32.double() @ b32.double() - exact).abs() / scale).max()
    if out_dtype == torch.bfloat16:
        spread = spread + ((exact.to(torch.bfloat16).double() - exact).abs() / scale).max()
    return scale, float(spread)


def _gemm_error(got: torch.Tensor, a: Float8Tensor, b: Float8Tensor, scale: torch.Tensor) -> float:
    return float(((got.double() - _emulate(a, b)).abs() / scale).max())


def _run_layer(config: Float8Config, *, autocast: bool, x=None, g=None, seed: int = 0):
    """A Float8Linear [N, K] on x [M, K] with incoming gradient g [M, N]: (x, W, g, y, dx, dW)."""
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=_gen(seed)) * 0.05)
    layer = Float8Linear.from_linear(lin, config=config)
    x = (torch.randn(M, K, generator=_gen(seed + 1)) * 2.0 if x is None else x).requires_grad_()
    g = torch.randn(M, N, generator=_gen(seed + 2)) * 1e-3 if g is None else g
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(g.to(y.dtype))
    return x.detach(), layer.weight.detach(), g, y.detach(), x.grad, layer.weight.grad


def _three_gemms(config: Float8Config, x, w, g):
    """The operands of the three GEMMs as the recipe casts them (output, input grad, weight grad)."""
    c, rw, p2 = config, config.scaling == "rowwise", config.power_of_2_scales
    return {
        "y = x W^T": (_ref_cast(x, c.input_format, rowwise=rw, dim=1, pow2=p2),
                      _ref_cast(w, c.weight_format, rowwise=rw, dim=1, pow2=p2).t()),
        "dx = g W": (_ref_cast(g, c.grad_format, rowwise=rw, dim=1, pow2=p2),
                     _ref_cast(w, c.weight_format, rowwise=rw, dim=0, pow2=p2)),
        "dW = g^T x": (_ref_cast(g, c.grad_format, rowwise=rw, dim=0, pow2=p2).t(),
                       _ref_cast(x, c.input_format, rowwise=rw, dim=0, pow2=p2)),
    }


@pytest.mark.numerics
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_gemm_equals_its_float64_emulation(recipe, autocast):
    config = Float8Config.recipe(recipe)
    x, w, g, y, dx, dw = _run_layer(config, autocast=autocast)
    out = torch.bfloat16 if autocast else torch.float32
    assert y.dtype == out and dx.dtype == dw.dtype == torch.float32
    report = {}
    for (name, (a, b)), got in zip(_three_gemms(config, x, w, g.to(out).float()).items(), (y, dx, dw),
                                   strict=True):
        scale, spread = _spread(a, b, out)
        err = _gemm_error(got, a, b, scale)
        report[name] = (err, spread)
        assert err <= FACTOR * spread, f"{name}: error {err:.3g} > {FACTOR} x spread {spread:.3g}"
        # negative control: one scale applied twice is far outside the same tolerance
        twice = Float8Tensor(a.data, a.scale * a.scale)
        assert _gemm_error(got, twice, b, scale) > 10 * FACTOR * spread, name
    print(f"\n{recipe} {out}: (error, spread) per GEMM, relative to |A||B|: {report}")


@pytest.mark.numerics
def test_e4m3_gradients_lose_what_e5m2_keeps():
    """Negative control for the gradient format: rows of the output gradient over 2^0 .. 2^-28 (more than
    e4m3's 2^17.8 octaves, less than e5m2's 2^31.8). With one tensorwise scale e4m3 flushes the small rows
    to zero; e5m2 keeps them. Error of dx = g W per row, against float64."""
    g = torch.randn(M, N, generator=_gen(7)) * torch.exp2(-torch.linspace(0, 28, M)).unsqueeze(1)
    errors = {}
    for fmt in (E5M2, E4M3):
        x, w, _, _, dx, _ = _run_layer(Float8Config(grad_format=fmt), autocast=False, g=g)
        exact = g.double() @ w.double()
        errors[fmt.name] = ((dx.double() - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()
    print(f"\nmean per-row relative error of dx: {errors}")
    assert errors["e4m3fn"] > 3 * errors["e5m2"]


# ---------------------------------------------------------------- against torchao 0.18.0


def _torchao_and_ours(recipe: str, *, autocast: bool, bias: bool):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias)
    theirs = nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(theirs[0]).__name__ == "Float8Linear"
    ours = Float8Linear.from_linear(copy.deepcopy(lin), scaling=recipe)
    x = torch.randn(4, 16, K, generator=_gen(11)) * 3
    g = torch.randn(4, 16, N, generator=_gen(12))
    out = []
    for layer in (theirs[0], ours):
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xx)
        y.backward(g.to(y.dtype))
        out.append({"y": y, "dx": xx.grad, "dW": layer.weight.grad})
        if bias:
            out[-1]["db"] = layer.bias.grad
    return out, ours, x


@pytest.mark.numerics
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_tensorwise_is_bitwise_torchaos(autocast):
    (theirs, ours), _, _ = _torchao_and_ours("tensorwise", autocast=autocast, bias=True)
    for name in theirs:
        assert theirs[name].dtype == ours[name].dtype, name
        assert torch.equal(theirs[name], ours[name]), name


@pytest.mark.numerics
def test_rowwise_is_torchaos_up_to_its_bf16_output():
    """torchao's rowwise asks for bf16 output from an fp32 layer; ours keeps fp32. Under autocast both
    are bf16 and bitwise equal; in fp32, ours rounded to bf16 is bitwise theirs."""
    (theirs, ours), _, _ = _torchao_and_ours("rowwise", autocast=True, bias=True)
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    (theirs, ours), layer, x = _torchao_and_ours("rowwise", autocast=False, bias=False)
    for name in ("y", "dx", "dW"):
        assert not torch.equal(theirs[name], ours[name]), name  # the bf16 rounding is really there
        assert torch.equal(theirs[name], ours[name].to(torch.bfloat16).float()), name


# ---------------------------------------------------------------- the layer in a model


def test_from_linear_keeps_the_parameters_and_refuses_shapes_scaled_mm_cannot_take():
    lin = nn.Linear(64, 32)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    layer = Float8Linear.from_linear(lin, scaling="rowwise")
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert layer.state_dict().keys() == before.keys()
    layer(torch.randn(16, 64)).square().sum().backward()
    opt.step()  # the optimizer built before the swap steps the layer's parameters
    assert not torch.equal(layer.weight, before["weight"]) and layer.weight is lin.weight
    # ugly cases: an empty batch (amax 0: the eps floor), a frozen weight (no dW GEMM)
    empty = torch.zeros(0, 64, requires_grad=True)
    layer(empty).sum().backward()
    assert empty.grad.shape == (0, 64) and not layer.weight.grad.isnan().any()
    layer.weight.requires_grad_(False)
    layer.weight.grad = None
    layer(torch.randn(16, 64)).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None
    with pytest.raises(ValueError, match=r"\[out_features=40, in_features=64\]"):
        Float8Linear.from_linear(nn.Linear(64, 40))


def test_convert_to_float8_swaps_the_middle_layers_of_the_gpt_in_place():
    from refimpl.config import ModelConfig
    from refimpl.models import GPT, lm_loss

    model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=32,
                            tie_word_embeddings=False))
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters())
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    report = convert_to_float8(model, scaling="tensorwise")
    assert report.skipped == {"layers.0.self_attention.query_key_value": "first or last linear layer: kept "
                              "in high precision", "output_layer": "first or last linear layer: kept in high "
                              "precision"}
    assert report.converted == linears[1:-1] and len(report.converted) == 7
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in report.converted)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    tokens = torch.randint(0, 256, (2, 32), generator=_gen(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    opt.step()


def test_convert_to_float8_states_why_it_skips_a_layer():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 40), nn.Linear(40, 48), nn.Linear(48, 32),
                          nn.Linear(32, 32), nn.Linear(32, 16), nn.MultiheadAttention(32, 4))
    report = convert_to_float8(model, module_filter_fn=lambda m, name: name != "4")
    assert report.converted == ["3"]
    assert report.skipped["0"].startswith("first or last") and report.skipped["6.out_proj"].startswith("read")
    assert "[40, 64] is not a multiple of 16" in report.skipped["1"] and "[48, 40]" in report.skipped["2"]
    assert report.skipped["4"] == "refused by module_filter_fn"
    assert report.skipped["5"].startswith("first or last")  # out_proj is not counted: it is never called
    with pytest.raises(ValueError, match="from_linear"):
        convert_to_float8(nn.Linear(32, 32))


def test_fp8_training_takes_any_model_and_a_filter_the_user_sees():
    """``--precision fp8``'s conversion on a model that is not ours: every ``nn.Linear`` but the first and
    last (torch's own ``nn.Linear``, not only refimpl's seam layers), and ``module_filter_fn`` decides
    what the model's declaration (the GPT's ``float8_filter``: an MoE router stays bf16) would."""
    from refimpl.precision.fp8 import apply_float8_training, first_and_last_linear, float8_layers

    def user_model() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32),
                             nn.Linear(32, 16))

    model = user_model()
    report = apply_float8_training(model, keep=first_and_last_linear(model))
    assert report.converted == ["2", "3"] == float8_layers(model)
    assert set(report.skipped) == {"0", "4"}
    model = user_model()
    report = apply_float8_training(model, module_filter_fn=lambda module, name: name != "3")
    assert report.converted == ["0", "2", "4"]
    assert report.skipped["3"].startswith("refused by module_filter_fn")


# ---------------------------------------------------------------- measured numerics (for the chapter)


@pytest.mark.numerics
def test_measured_errors_fp32_bf16_fp8_rowwise_outliers_and_small_gradients():
    a = torch.randn(64, 256, generator=_gen(20))
    b = torch.randn(256, 64, generator=_gen(21))
    exact = a.double() @ b.double()

    def rel(c: torch.Tensor) -> float:
        return float((c.double() - exact).norm() / exact.norm())

    errors = {"fp32": rel(a @ b), "bf16": rel(a.bfloat16() @ b.bfloat16()),
              "e4m3": rel(float8_linear(a, b.t().contiguous(), config=Float8Config()))}
    assert errors["fp32"] < errors["bf16"] < errors["e4m3"]
    # an outlier token (row x 1e5): one tensorwise scale flushes the other rows, rowwise keeps them
    x = a.clone()
    x[0] *= 1e5
    exact_x = x.double() @ b.double()
    other = {}
    for recipe in ("tensorwise", "rowwise"):
        y = float8_linear(x, b.t().contiguous(), config=Float8Config.recipe(recipe))
        other[recipe] = float((y[1:].double() - exact_x[1:]).norm() / exact_x[1:].norm())
    assert other["rowwise"] * 5 < other["tensorwise"] and other["rowwise"] < 1.5 * errors["e4m3"]
    # gradients of size ~1e-3 cast without a scale: e4m3's subnormals end at 2^-9, e5m2's at 2^-16
    grad = torch.randn(100_000, generator=_gen(22)) * 1e-3
    flushed = {}
    for fmt in (E4M3, E5M2):
        flushed[f"{fmt.name} unscaled"] = float((quantize(grad, 1.0, fmt).float() == 0).float().mean())
        flushed[f"{fmt.name} scaled"] = float((cast_to_float8(grad, fmt).data.float() == 0).float().mean())
    print(f"\nrelative error vs float64: {errors}\noutlier row: other rows' error {other}\n"
          f"fraction of ~1e-3 gradients flushed to zero: {flushed}")
    assert flushed["e4m3fn unscaled"] > 0.5 and flushed["e5m2 unscaled"] < 0.02
    assert flushed["e4m3fn scaled"] < 1e-3 and flushed["e5m2 scaled"] < 1e-3
