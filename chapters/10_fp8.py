# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · fp8 training from scratch
#
# Chapter 05 trained in 16 bits. The large runs of today multiply in **8 bits**: an fp8 tensor core on
# an H100 does twice the FLOPs of its bf16 one, and an fp8 tensor is half the bytes of a bf16 one, in
# memory and on the wire. What others report (their measurements, not ours): a torchtitan commit
# (pytorch/torchtitan 7a04053) measured Llama-3 8B at 5,760 tokens/s in bf16 and 7,186 tokens/s with
# torchao's tensorwise fp8 and an fp8 weight all-gather, **+25%**; torchao reports up to 1.5x on
# Llama-3.1 70B and 405B at 512 GPUs, and 1.34-1.43x with its rowwise recipe at 2,000 GPUs; DeepSeek-V3
# (2024) was trained in fp8 from the start, 671B parameters. And this course's seed wrote that "FP16
# gradients cut communication by 50%"; section 6 says what that is: arithmetic on the element size.
#
# Eight bits leave three bits of mantissa, or two. What makes that trainable (Micikevicius et al. 2022,
# *FP8 Formats for Deep Learning*) is a **scale per tensor** (or per row) chosen from its largest
# magnitude, and fp32 accumulation inside the matrix multiply. `refimpl/precision/fp8/` builds it, and
# this chapter proves, with assertions:
#
# 1. the two formats' limits are what their bits say, the cast saturates and rounds to nearest even;
# 2. a scale per tensor moves values into the format's window; one outlier ruins a tensorwise scale and
#    not a rowwise one; an amax **history** (delayed scaling) saturates on the step the amax jumps;
# 3. our `Float8Linear` runs its three GEMMs (forward, input gradient, weight gradient) in fp8, each equal
#    to a float64 emulation within a spread measured in the same cell, and bit for bit equal to
#    **torchao**'s `Float8Linear`;
# 4. the course's GPT trains in fp8 (tensorwise and rowwise) along the fp32 and bf16 curves, and its first
#    step's gradients land in a band measured over seeds, which three planted bugs leave;
# 5. on 2 ranks, ZeRO-3's weight all-gather in fp8 gives every rank bitwise the one-device cast, in
#    exactly half the bytes of a bf16 gather; an fp8 gradient all-reduce is far less accurate;
# 6. the seed's 50%: true of the bytes because an fp16 number is 2 bytes and an fp32 one 4 (arithmetic,
#    not a measurement), and what fp16 gradients cost without a loss scale (measured).
#
# Everything here runs on a CPU, whose `torch._scaled_mm` multiplies fp8 operands in software: it shows
# the **arithmetic** of fp8, not its speed, and this chapter makes no speed claim.

# %%
import contextlib
import copy
import importlib
import math
import statistics

import matplotlib.pyplot as plt
import torch
from torch import nn

from refimpl.config import ModelConfig, OptimConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.models import GPT, lm_loss
from refimpl.nn.linear import DeferredProduct
from refimpl.optim import build_optimizer, lr_at, set_lr
from refimpl.precision.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    Float8Config,
    Float8Linear,
    Float8Tensor,
    cast_to_float8,
    convert_to_float8,
    float8_linear,
    quantize,
)

torch.set_num_threads(1)  # small matrices: one thread is as fast, and leaves the second core to the ranks
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the training of section 4
print("torch", torch.__version__, "| device:", device)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# %% [markdown]
# ## 1. Two formats of 8 bits
#
# A float is $\pm 2^{e - b}\,(1 + m / 2^M)$ with $E$ exponent bits (bias $b$) and $M$ mantissa bits;
# exponent 0 holds the **subnormals** $2^{1-b}\,m / 2^M$, down to $2^{1-b-M}$. Micikevicius et al. define
# two 8-bit ones, now in PyTorch as `torch.float8_e4m3fn` and `torch.float8_e5m2`:
#
# * **e4m3fn**: 4 exponent bits, 3 of mantissa. "fn" for *finite*: it has no inf, and gives its top
#   exponent to numbers (only `S.1111.111` is NaN), which buys a maximum of 448 instead of 240. Used for
#   the forward tensors, activations and weights: precision matters there.
# * **e5m2**: 5 and 2, IEEE-like (inf and NaN in the top exponent). Used for the gradients: they span more
#   decades, and range matters more than the third mantissa bit.
#
# `refimpl.precision.fp8.formats` states each format's limits from its bits; below they are checked
# against PyTorch's own encoding, by decoding all 256 bytes.

# %%
print(f"{'':8s} {'e/m':>4s} {'bias':>4s} {'max':>8s} {'smallest normal':>16s} {'smallest subnormal':>19s} "
      f"{'spacing at 1':>12s} {'octaves':>8s}")
for f in (E4M3, E5M2):
    print(f"{f.name:8s} {f.exponent_bits}/{f.mantissa_bits:<2d} {f.bias:4d} {f.max:8g} "
          f"{f.smallest_normal:16.3g} {f.smallest_subnormal:19.3g} {f.epsilon:12g} {f.dynamic_range_bits:8.1f}")
bf = torch.finfo(torch.bfloat16)
print(f"{'bfloat16':8s} {'8/7':>4s} {127:4d} {bf.max:8.2g} {bf.smallest_normal:16.3g} "
      f"{bf.smallest_normal * bf.eps:19.3g} {bf.eps:12g} {math.log2(bf.max / (bf.smallest_normal * bf.eps)):8.1f}")

print(f"spacing at 1 relative to bf16's: e4m3 x{E4M3.epsilon / bf.eps:g}, e5m2 x{E5M2.epsilon / bf.eps:g}")

codes = torch.arange(256, dtype=torch.uint8)
for f in (E4M3, E5M2):
    values = codes.view(f.dtype).float()  # every byte, decoded by PyTorch
    finite = values.isfinite()
    assert f.max == values[finite].max().item() == torch.finfo(f.dtype).max
    assert f.smallest_subnormal == values[finite & (values > 0)].min().item()
    assert f.smallest_normal == torch.finfo(f.dtype).smallest_normal and f.epsilon == torch.finfo(f.dtype).eps
    assert values.isinf().any().item() == f.has_inf  # e5m2 has inf, e4m3fn none
    assert values.isnan().sum().item() == (6 if f.has_inf else 2)  # e5m2: 3 NaN codes per sign
    # the cast: every finite fp8 number casts back to its own byte
    assert torch.equal(quantize(values[finite], 1.0, f).view(torch.uint8), codes[finite])

# %% [markdown]
# **How coarse is coarse?** The figure decodes every positive number of each format and plots the gap to
# the next one, relative to the number. In the normal range the relative gap stays between $2^{-M-1}$ and
# $2^{-M}$ (a binade's first gap is relatively the largest); in the subnormals it grows until the last
# number before zero. In the normal range e4m3 is 16 times coarser than bf16 and e5m2 32 times (the ratios
# of their spacing at 1, printed above), and their **window**, from the smallest subnormal to the
# maximum, is a few dozen octaves against bf16's hundreds (the table's last column).

# %%


def positive_values(dtype):
    """Every positive finite number of ``dtype`` (fp8 or bf16), sorted."""
    if dtype == torch.bfloat16:
        v = torch.arange(2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    else:
        v = codes.view(dtype).float()
    return v[v.isfinite() & (v > 0)].sort().values


fig, ax = plt.subplots(figsize=(7.5, 3.4))
for name, dtype in (("bfloat16", torch.bfloat16), ("e4m3fn", E4M3.dtype), ("e5m2", E5M2.dtype)):
    v = positive_values(dtype)
    gap = (v[1:] - v[:-1]) / v[:-1]
    ax.step(v[:-1].log2(), gap, where="post", label=f"{name}: max {v[-1].item():g}")
for f, ls in ((E4M3, "--"), (E5M2, ":")):
    ax.axvline(math.log2(f.max), color="black", ls=ls, lw=1)
    ax.axvline(math.log2(f.smallest_normal), color="grey", ls=ls, lw=1)
ax.set_yscale("log", base=2)
ax.set_xlim(-20, 17)
ax.set_xlabel("log2 x (vertical lines: smallest normal (grey), max (black) of e4m3 --, e5m2 :)")
ax.set_ylabel("gap to the next number / x")
ax.set_title("relative spacing of the representable numbers")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# **The cast.** `quantize(x, scale, fmt)` multiplies by the scale in fp32, **saturates** (a magnitude
# beyond the maximum, inf included, becomes the maximum: never inf, never NaN), then rounds to nearest,
# ties to the even code. PyTorch's own `.to(torch.float8_e5m2)` does not saturate (1e6 becomes inf), which
# is why the clamp is explicit, as torchao's `to_fp8_saturated` is.

# %%


def q(values, f):
    return quantize(torch.tensor(values), 1.0, f).float().tolist()


inf = float("inf")
print("e4m3:", [448.0, 500.0, 1e6, inf, -inf], "->", q([448.0, 500.0, 1e6, inf, -inf], E4M3))
print("e5m2:", [57344.0, 1e6, inf], "->", q([57344.0, 1e6, inf], E5M2), "| torch's own .to(e5m2) of 1e6:",
      torch.tensor([1e6]).to(E5M2.dtype).float().item())
assert q([448.0, 500.0, 1e6, inf, -inf], E4M3) == [448.0, 448.0, 448.0, 448.0, -448.0]
assert q([57344.0, 1e6, inf], E5M2) == [57344.0] * 3
assert torch.tensor([1e6]).to(E5M2.dtype).float().isinf().all()
# round to nearest even: in [1, 2) e4m3's numbers are 1 + k/8, e5m2's 1 + k/4; a tie goes to the even k
ties = {E4M3: ([1.0625, 1.1875, 1.3125], [1.0, 1.25, 1.25]), E5M2: ([1.125, 1.375, 1.625], [1.0, 1.5, 1.5])}
for f, (tie, want) in ties.items():
    above = torch.nextafter(torch.tensor(tie[0]), torch.tensor(2.0)).item()  # the next fp32 number
    print(f"{f.name}: ties {tie} -> {q(tie, f)}; the fp32 number just above the first tie -> {q([above], f)}")
    assert q(tie, f) == want and q([above], f) == [1.0 + f.epsilon]
# below the smallest subnormal s: s/2 is a tie between 0 and s, and 0 is even
s = E4M3.smallest_subnormal
assert q([s / 2, 3 * s / 2, 0.51 * s], E4M3) == [0.0, 2 * s, s]
print(f"e4m3: s/2, 3s/2, 0.51s (s = 2^-9) -> {q([s / 2, 3 * s / 2, 0.51 * s], E4M3)}")

# %% [markdown]
# ## 2. Scales: move the tensor into the window
#
# 17.8 octaves is not much: activations of order 1 and gradients of order $10^{-3}$ cannot share one
# unscaled window. So every tensor is cast with its own scale, chosen from its absolute maximum so that
# the largest magnitude lands on the format's maximum (`amax_to_scale`):
#
# $$s = \frac{f_{max}}{\mathrm{amax}(x)}, \qquad q = \mathrm{fp8}(\mathrm{sat}(x \cdot s)), \qquad
# x \approx q / s .$$
#
# A matrix multiply of two scaled operands takes the inverse scales and applies them to its fp32
# accumulator: $AB \approx (q_A\, q_B) / (s_A s_B)$; that is `torch._scaled_mm`. **Tensorwise**: one scale
# per tensor. **Rowwise**: one per row of the left operand and one per column of the right one (one per
# slice along the contraction dimension, so the scales factor out of the sum); DeepSeek-V3 goes finer,
# one per $1 \times 128$ tile of activations and $128 \times 128$ block of weights.
#
# First the price of 8 bits: the relative error of a $64 \times 256 \times 64$ product against float64,
# in fp32, in bf16 and with both operands in e4m3.

# %%
a = torch.randn(64, 256, generator=gen(20))
b = torch.randn(256, 64, generator=gen(21))
exact = a.double() @ b.double()


def rel(c, ref):
    return float((c.double() - ref).norm() / ref.norm())


errors = {"fp32": rel(a @ b, exact), "bf16": rel(a.bfloat16() @ b.bfloat16(), exact),
          "e4m3 tensorwise": rel(float8_linear(a, b.t().contiguous(), config=Float8Config()), exact),
          "e4m3 rowwise": rel(float8_linear(a, b.t().contiguous(), config=Float8Config.recipe("rowwise")),
                              exact)}
for name, e in errors.items():
    print(f"{name:16s} relative error vs float64: {e:.2e}")
assert errors["fp32"] * 100 < errors["bf16"] and errors["bf16"] * 4 < errors["e4m3 tensorwise"]
t = cast_to_float8(a, E4M3)
assert t.data.float().abs().max().item() == E4M3.max, "the largest magnitude lands on 448"

# %% [markdown]
# **One outlier.** Real activations have a few huge channels and tokens. Multiply one row of `a` (one
# token) by $10^5$: a tensorwise scale must fit that row, so the scale of every other row is $10^5$ times
# too small, and their values fall below e4m3's smallest subnormal. A rowwise scale gives each row its own.

# %%
x = a.clone()
x[0] *= 1e5
exact_x = x.double() @ b.double()
other_rows, flushed_rows = {}, {}
for recipe in ("tensorwise", "rowwise"):
    y = float8_linear(x, b.t().contiguous(), config=Float8Config.recipe(recipe))
    other_rows[recipe] = rel(y[1:], exact_x[1:])
    cast = cast_to_float8(x, E4M3, scaling=recipe, contraction_dim=1,
                          power_of_2=Float8Config.recipe(recipe).power_of_2_scales)
    flushed_rows[recipe] = (cast.data[1:].float() == 0).float().mean().item()
    print(f"{recipe:10s}: error of the other 63 rows {other_rows[recipe]:.2e}, their entries cast to zero "
          f"{flushed_rows[recipe]:.1%}")
assert other_rows["rowwise"] * 5 < other_rows["tensorwise"], "one outlier ruins the tensorwise scale"
assert other_rows["rowwise"] < 1.5 * errors["e4m3 rowwise"], "rowwise: as if there were no outlier"

# %% [markdown]
# **Why gradients need e5m2, or a scale.** Gradients of size $10^{-3}$ cast *without* a scale: e4m3's
# smallest subnormal is $2^{-9} \approx 2 \cdot 10^{-3}$, so everything under half of it rounds to zero;
# e5m2's is $2^{-16}$. The fraction that flushes is a formula, the fraction of $|g| \le s/2$ (a tie at
# $s/2$ goes to the even code, 0), and the cast must flush exactly that many. With a scale neither format
# flushes anything of note.

# %%
grad = torch.randn(100_000, generator=gen(22)) * 1e-3
flushed = {}
for f in (E4M3, E5M2):
    unscaled = (quantize(grad, 1.0, f).float() == 0).sum().item()  # counts of entries
    formula = (grad.double().abs() <= f.smallest_subnormal / 2).sum().item()
    scaled = (cast_to_float8(grad, f).data.float() == 0).sum().item()
    flushed[f.name] = (unscaled / grad.numel(), scaled / grad.numel())
    print(f"{f.name:7s}: ~1e-3 gradients flushed to zero unscaled {unscaled:,d} of {grad.numel():,d} "
          f"(formula {formula:,d}), scaled {scaled:,d}")
    assert unscaled == formula, "the cast flushes exactly the entries under half the smallest subnormal"
assert flushed["e4m3fn"][0] > 10 * flushed["e5m2"][0], "unscaled: e4m3 loses far more than e5m2"
assert max(flushed["e4m3fn"][1], flushed["e5m2"][1]) < flushed["e5m2"][0], "a scale beats e5m2's range"

# %% [markdown]
# **Delayed scaling.** The scale above needs the tensor's amax before the cast: one reduction over the
# tensor on the critical path. Transformer Engine's first recipe (and torchao's, until 2025) used the
# maximum of the last $n$ steps' amaxes instead (`DelayedScaling`, an amax history), known before the
# tensor is. It is right while amax drifts slowly. Below, a tensor whose amax jumps $10^5$-fold for one
# step, with a history of 4: on the jump the stale scale is far too large and the values **saturate**;
# for the next 4 steps the spike's amax is in the history, the scale is $10^5$ too small and the values
# fall into e4m3's subnormals or to zero; then the spike leaves the history.

# %%
delayed = DelayedScaling(E4M3, history_len=4)
base = torch.randn(4096, generator=gen(3))
jumps = (1.0, 0.9, 1.0, 0.95, 1e5, 1.0, 1.0, 1.0, 1.0, 1.0)
steps = [base * j for j in jumps]
casts = [delayed.cast(s) for s in steps]
err_delayed = [rel(c.tensor.dequantize(), s.double()) for c, s in zip(casts, steps, strict=True)]
err_dynamic = [rel(cast_to_float8(s, E4M3).dequantize(), s.double()) for s in steps]
saturated = [c.saturated for c in casts]
for i, (j, sat, ed, ey) in enumerate(zip(jumps, saturated, err_delayed, err_dynamic, strict=True)):
    print(f"step {i}: amax x{j:<6g} saturated {sat:6.1%} | error delayed {ed:.2e}, dynamic {ey:.2e}")
assert saturated[4] > 0.9 and all(s == 0 for i, s in enumerate(saturated) if i != 4)
assert err_delayed[4] > 10 * max(err_dynamic), "the jump step: saturated"
assert all(e > 10 * d for e, d in zip(err_delayed[5:9], err_dynamic[5:9], strict=True)), "then flushed"
assert err_delayed[9] < 1.1 * err_dynamic[9], "once the spike leaves the history, as good as dynamic"

fig, ax = plt.subplots(figsize=(7.5, 3.2))
ax.semilogy(err_delayed, "o-", label="delayed scaling (history 4)")
ax.semilogy(err_dynamic, "s--", label="dynamic scaling (this step's amax)")
ax.axvspan(3.5, 4.5, color="red", alpha=0.15, label="amax x 1e5: saturated")
ax.axvspan(4.5, 8.5, color="orange", alpha=0.15, label="spike in the history: flushed")
ax.set_xlabel("step")
ax.set_ylabel("relative error of the e4m3 cast")
ax.set_title("an amax history is one step late, and remembers a spike for 4")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# torchao deprecated delayed scaling in v0.9 and deleted it in v0.10 (pytorch/ao#1680, #1753): "dynamic
# scaling is required for higher accuracy", and nobody used the delayed one; torchtitan had measured it
# no faster than dynamic scaling on Llama-3 8B (pytorch/torchtitan#698, 6,750 against 6,810 words/s),
# once the amax reduction is fused into the cast by `torch.compile`. Our `Float8Linear` scales dynamically.
#
# ## 3. `Float8Linear`: three scaled GEMMs
#
# A linear layer $y = x W^T$ ($x$: $M$ tokens $\times K$, $W$: $N \times K$) has three matrix products,
# and each casts its own operands, with their own scales, in the format of the role they play:
#
# | GEMM | shapes | formats (tensorwise recipe) |
# |---|---|---|
# | output $y = x\,W^T$ | $[M, K] \cdot [K, N]$ | e4m3 $\times$ e4m3 |
# | input gradient $dx = g\,W$ | $[M, N] \cdot [N, K]$ | e5m2 $\times$ e4m3 |
# | weight gradient $dW = g^T x$ | $[N, M] \cdot [M, K]$ | e5m2 $\times$ e4m3 |
#
# `torch._scaled_mm(a, b, scale_a, scale_b)` multiplies two fp8 operands, accumulates in fp32 and applies
# the inverse scales; on a CPU it dequantizes each operand to fp32 and multiplies in fp32. The proof for
# each GEMM: its result equals a **float64 emulation**, the same fp8 numbers multiplied exactly, with
# scales recomputed here from the formula (amax in float64). How close? The fp8 operands are the same, so
# what is left is the fp32 arithmetic, and we measure it on the same operands: the fp32 product in two
# summation orders, plus the rounding of the dequantized operands. The tolerance is 4 x that spread. The
# negative control: the same product with one scale applied twice must be far outside it. The
# recipe's rowwise variant (per-row scales rounded down to powers of two, e4m3 for gradients too) is
# checked the same way.

# %%
M, K, N = 40, 96, 48  # 40 tokens: the weight gradient pads them to 48 (a multiple of 16, CUDA's rule)
FACTOR = 4  # the stated factor over the measured spread


def reference_cast(t, f, *, rowwise, dim, pow2):
    """The recipe's cast from the formula: amax in float64, scale = fmax / amax rounded to fp32 (and down to
    a power of two, 2^(e-1) for frexp's exponent e, if pow2)."""
    t = t.detach().float()
    amax = t.double().abs().amax(dim=dim, keepdim=True) if rowwise else t.double().abs().amax()
    amax = amax.clamp(min=1e-12)
    scale = (torch.full_like(amax, f.max) / amax).float()
    if pow2:
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
    return Float8Tensor((t * scale).clamp(-f.max, f.max).to(f.dtype), scale)


def emulate(a8, b8):
    """The fp8 numbers multiplied and summed in float64 (products of at most 8 significant bits: the sums
    are exact or within 2^-53), then the inverse scales applied."""
    return (a8.data.double() @ b8.data.double()) * a8.inverse_scale.double() * b8.inverse_scale.double()


def spread(a8, b8):
    """(|A||B|, the measured spread): fp32 in two summation orders, plus the dequantization's rounding."""
    a32, b32 = a8.dequantize(), b8.dequantize()
    size = a32.double().abs() @ b32.double().abs()
    reverse = sum(a32[:, k:k + 8] @ b32[k:k + 8] for k in reversed(range(0, a32.shape[1], 8)))
    order = ((a32 @ b32 - reverse).abs() / size).max()
    dequant = ((a32.double() @ b32.double() - emulate(a8, b8)).abs() / size).max()
    return size, float(order + dequant)


def gemm_error(got, a8, b8, size):
    return float(((got.double() - emulate(a8, b8)).abs() / size).max())


lin = nn.Linear(K, N, bias=False)
with torch.no_grad():
    lin.weight.copy_(torch.randn(N, K, generator=gen(0)) * 0.05)
x_in = torch.randn(M, K, generator=gen(1)) * 2.0
g_out = torch.randn(M, N, generator=gen(2)) * 1e-3  # a gradient of the size real ones have
gemm_report = {}
for recipe in ("tensorwise", "rowwise"):
    c = Float8Config.recipe(recipe)
    layer = Float8Linear.from_linear(copy.deepcopy(lin), config=c)
    xx = x_in.clone().requires_grad_()
    y = layer(xx)
    y.backward(g_out)
    w, rw, p2 = layer.weight.detach(), recipe == "rowwise", c.power_of_2_scales
    operands = {  # each GEMM's operands, cast as the recipe says (dim: the contraction dimension)
        "y = x W^T": (reference_cast(x_in, c.input_format, rowwise=rw, dim=1, pow2=p2),
                      reference_cast(w, c.weight_format, rowwise=rw, dim=1, pow2=p2).t()),
        "dx = g W": (reference_cast(g_out, c.grad_format, rowwise=rw, dim=1, pow2=p2),
                     reference_cast(w, c.weight_format, rowwise=rw, dim=0, pow2=p2)),
        "dW = g^T x": (reference_cast(g_out, c.grad_format, rowwise=rw, dim=0, pow2=p2).t(),
                       reference_cast(x_in, c.input_format, rowwise=rw, dim=0, pow2=p2)),
    }
    for (name, (a8, b8)), got in zip(operands.items(), (y.detach(), xx.grad, layer.weight.grad), strict=True):
        size, sp = spread(a8, b8)
        err = gemm_error(got, a8, b8, size)
        twice = gemm_error(got, Float8Tensor(a8.data, a8.scale * a8.scale), b8, size)  # negative control
        gemm_report[recipe, name] = (err, sp, twice)
        print(f"{recipe:10s} {name:11s} ({a8.fmt.name} x {b8.fmt.name}): error {err:.1e} | spread {sp:.1e} "
              f"| scale applied twice {twice:.1e}  (per element, relative to |A||B|)")
        assert err <= FACTOR * sp, f"{recipe} {name}: {err:.3g} > {FACTOR} x {sp:.3g}"
        assert twice > 10 * FACTOR * sp, f"{recipe} {name}: the negative control passed"

# %% [markdown]
# **Against torchao.** PyTorch's reference implementation is torchao's `Float8Linear`
# (`torchao.float8.convert_to_float8_training`), which runs on a CPU too, with the same
# `torch._scaled_mm` calls. The same layer, the same input and incoming gradient: the tensorwise recipe's
# output and three gradients are **bit for bit** torchao's. The rowwise recipe differs in one documented
# place: torchao asks the kernel for bf16 output even for an fp32 layer (the only output CUDA's rowwise
# kernel has); ours keeps fp32, and ours rounded to bf16 is bit for bit theirs.

# %%
import logging


@contextlib.contextmanager
def quiet_loggers(*names):
    """The named loggers raised to ERROR inside the block (their warnings dropped), restored after."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# importing torchao logs three warnings, none about this chapter: two of its compiled CUDA extensions do not
# load here (logger "torchao"), and torch deprecates a pytree registration torchao makes (its logger
# "torch.utils._pytree"). Dropped for the import only; anything either logger says later still prints.
with quiet_loggers("torchao", "torch.utils._pytree"):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

x3 = torch.randn(4, 16, K, generator=gen(11)) * 3
g3 = torch.randn(4, 16, N, generator=gen(12))
for recipe in ("tensorwise", "rowwise"):
    torch.manual_seed(0)
    lin_b = nn.Linear(K, N, bias=recipe == "tensorwise")  # rowwise: torchao adds the bias to its bf16 output
    theirs = nn.Sequential(copy.deepcopy(lin_b))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    ours = Float8Linear.from_linear(copy.deepcopy(lin_b), scaling=recipe)
    out = []
    for module in (theirs[0], ours):
        xx = x3.clone().requires_grad_()
        y = module(xx)
        y.backward(g3.to(y.dtype))
        out.append({"y": y.detach(), "dx": xx.grad, "dW": module.weight.grad})
        if module.bias is not None:
            out[-1]["db"] = module.bias.grad
    assert type(theirs[0]).__name__ == "Float8Linear"
    if recipe == "tensorwise":
        same = {k: torch.equal(out[0][k], out[1][k]) for k in out[0]}
        assert all(same.values()), same
    else:
        same = {k: torch.equal(out[0][k], out[1][k].to(torch.bfloat16).float()) for k in ("y", "dx", "dW")}
        raw = {k: torch.equal(out[0][k], out[1][k]) for k in ("y", "dx", "dW")}
        assert all(same.values()) and not any(raw.values()), (same, raw)
    print(f"{recipe:10s}: ours == torchao's, bit for bit{' (ours rounded to bf16)' if recipe == 'rowwise' else ''}:"
          f" {same}")

# %% [markdown]
# ## 4. Training the GPT in fp8
#
# `convert_to_float8(model)` swaps a model's `nn.Linear` layers for `Float8Linear` in place, keeping the
# same Parameter objects (an optimizer built before still steps them). It keeps the **first and last**
# linear layers in high precision, as Micikevicius et al. and torchtitan do (the last one produces the
# logits, whose softmax magnifies small errors), and refuses layers whose sizes are not multiples of 16
# (CUDA's `_scaled_mm` rule). fp8 training in practice runs *inside* bf16 mixed precision: the GEMMs in
# fp8, everything else (LayerNorm, attention, the kept layers) under bf16 autocast, the weights and
# optimizer in fp32.
#
# Runs of the same 2-layer GPT, the same data, 60 AdamW steps: fp32, bf16 autocast, fp8 tensorwise
# and fp8 rowwise (both under bf16 autocast), and fp32 again from four other initialisation seeds. Two
# kinds of evidence come out of them, of very different strength:
#
# * **the final loss**, against fp32's spread over the five initialisations: it tells a run that
#   diverges, stalls or learns visibly slower, and nothing finer. AdamW divides every gradient by its
#   own running size, so a gradient off by a constant factor per tensor trains much as the right one
#   does (pytorch/pytorch#160285: expert-parallel gradients ep times too large, identical loss curves);
# * **the first step's gradients**, before the optimizer touches anything, against fp32's: this is where
#   a bug in an fp8 GEMM shows, and the next cells give it a band, above and below, measured over seeds.

# %%
corpus = prepare_corpus(None)
config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=64)
BATCH, SEQ, STEPS = 8, 64, 60
batches = ShardedBatches(corpus.tokens, seq_len=SEQ, global_batch_size=BATCH, seed=0)
optim_cfg = OptimConfig(lr=3e-3, warmup_steps=5)
report = convert_to_float8(GPT(config))
print("converted:", report.converted)
print("kept:", report.skipped)


def make(precision, seed):
    """The GPT initialised from ``seed``, its linears converted for the fp8 precisions."""
    model = GPT(config, seed=seed).to(device)
    if precision.startswith("fp8"):
        convert_to_float8(model, scaling=precision.split()[1])
    return model


def backward(model, precision, step):
    """Forward and backward on the stream's batch number ``step`` (bf16 autocast unless fp32): the loss."""
    x, y = (t.to(device) for t in batches.batch(step))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "fp32"):
        loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item()


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()


def train(precision, *, seed=0):
    """Losses of STEPS steps, and the first step's gradients (fp32, one vector)."""
    model = make(precision, seed)
    opt = build_optimizer(model, optim_cfg)
    losses, first_grads = [], None
    for step in range(STEPS):
        set_lr(opt, lr_at(step, optim_cfg, STEPS))
        losses.append(backward(model, precision, step))
        if step == 0:
            first_grads = flat_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first_grads


LOSS_SEEDS = (1, 2, 3, 4)  # with seed 0: five initialisations of fp32
runs = {name: train(name) for name in ("fp32", "bf16", "fp8 tensorwise", "fp8 rowwise")}
for seed in LOSS_SEEDS:
    runs[f"fp32, init seed {seed}"] = train("fp32", seed=seed)

# %%
TAIL = 20  # the final loss: the mean of the last 20 steps (one batch is noisy)


def final(name):
    return sum(runs[name][0][-TAIL:]) / TAIL


finals = [final("fp32")] + [final(f"fp32, init seed {s}") for s in LOSS_SEEDS]
# the yardstick: the standard deviation of fp32's final loss over the five initialisations, taken with each
# seed left out in turn, and the smallest of those five: no single seed, an outlier included, can widen it
leave_one_out = [statistics.stdev(finals[:i] + finals[i + 1:]) for i in range(len(finals))]
yardstick = min(leave_one_out)
for name, (losses, _) in runs.items():
    print(f"{name:18s} loss {losses[0]:.3f} -> {losses[-1]:.3f} | final (last {TAIL}) {final(name):.4f}, "
          f"minus fp32's {final(name) - final('fp32'):+.4f}")
print(f"fp32's final loss over init seeds 0-4: {', '.join(f'{f:.4f}' for f in finals)}; standard deviation "
      f"{statistics.stdev(finals):.4f}, leaving one seed out {min(leave_one_out):.4f} to "
      f"{max(leave_one_out):.4f}: the yardstick is {yardstick:.4f}")
assert all(r[0][-1] < r[0][0] - 1.0 for r in runs.values()), "every run trains"
for name in ("bf16", "fp8 tensorwise", "fp8 rowwise"):
    gap = abs(final(name) - final("fp32"))
    assert gap < yardstick, f"{name}: {gap:.4f} from fp32's final loss, beyond the seeds' {yardstick:.4f}"

fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, (losses, _) in runs.items():
    ax.plot(losses, label=name, ls=":" if "seed" in name else "-")
    if name != "fp32":
        bx.plot([abs(p - r) for p, r in zip(losses, runs["fp32"][0], strict=True)], label=f"|{name} - fp32|",
                ls=":" if "seed" in name else "-")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.set_title("the same GPT, the same data: fp32, bf16, fp8")
ax.legend(fontsize=6)
bx.set_yscale("log")
bx.set_xlabel("step")
bx.set_ylabel("|loss difference|")
bx.set_title("distance from the fp32 curve")
bx.legend(fontsize=6)
fig.tight_layout()

# %% [markdown]
# At this size and length every final loss lands within fp32's own spread over initialisations (the gaps
# and the spread are printed above the figure). That is a coarse check, as said: it would pass a run
# whose gradients are wrong by a factor per tensor. The finer one is the first step's gradients.
#
# **How far from fp32 should fp8's gradients be?** That depends on the model, the batch and the
# initialisation, so it is measured: the first step's gradients of fp32, bf16 and both fp8 recipes for
# six other seeds (seed $s$: initialised from $s$, on the stream's batch number $s$), each against fp32's
# of the same seed (the relative error of all the gradients as one vector). Their range is how far a
# correct fp8 lands; a new seed may fall a little outside it (a seventh draw falls beyond the range of six
# with probability 2/7), so the **band** is that range widened by its own width on each side, in log
# scale: $[\,lo^2/hi,\ hi^2/lo\,]$. The check is two-sided. Above: a broken cast or GEMM. Below: an fp8
# that is not there (the linears left in bf16) would land with bf16, which the last assertion keeps far
# under fp8. Seed 0, the training runs above, is not one of the six: its first step must land inside.

# %%
BAND_SEEDS = range(1, 7)


def first_step_grads(precision, seed):
    """The first step's gradients (fp32, one vector) of seed ``seed``: initialised from it, on the stream's
    batch number ``seed`` (for seed 0, exactly the first step of ``train``)."""
    model = make(precision, seed)
    backward(model, precision, seed)
    return flat_grads(model)


PRECISIONS = ("bf16", "fp8 tensorwise", "fp8 rowwise")
spread = {name: [] for name in PRECISIONS}
for seed in BAND_SEEDS:
    reference = first_step_grads("fp32", seed).double()
    for name in PRECISIONS:
        spread[name].append(rel(first_step_grads(name, seed), reference))
band = {name: (min(e) ** 2 / max(e), max(e) ** 2 / min(e)) for name, e in spread.items()}
g32 = runs["fp32"][1].double()
grad_err = {name: rel(runs[name][1], g32) for name in PRECISIONS}  # seed 0: the training runs' first step
for name in PRECISIONS:
    lo, hi = band[name]
    print(f"{name:14s} first-step gradients vs fp32: seeds 1-6 {min(spread[name]):.2e} to "
          f"{max(spread[name]):.2e}, band [{lo:.2e}, {hi:.2e}] | seed 0: {grad_err[name]:.2e}")
    assert lo < grad_err[name] < hi, f"{name}: seed 0's first-step gradient error is outside the band"
coarser = min(min(spread["fp8 tensorwise"]), min(spread["fp8 rowwise"])) / max(spread["bf16"])
print(f"fp8's smallest error over the seeds is {coarser:.1f} x bf16's largest")
assert coarser > 4, "fp8 (3 or 2 mantissa bits in the converted GEMMs) is far coarser than bf16 (7)"

# %% [markdown]
# **Three planted bugs** (negative controls), each on seed 0's first step, each a realistic mistake in
# `refimpl/precision/fp8/float8_linear.py`, planted by swapping one of its functions inside a `with`
# block and restoring it after:
#
# * **(a) a scale applied twice**: the weight-gradient GEMM $dW = g^T x$ takes $1/s_x$, and $dW$ is then
#   divided by $s_x$ once more. Every converted layer's $dW$ comes out about $s_x$ times too small (a
#   factor per tensor: the kind AdamW hides from the loss curve);
# * **(b) gradients cast to e4m3 instead of e5m2**: the scale is the recipe's, computed for e5m2's
#   maximum 57344, the bytes are e4m3, whose maximum is 448: every gradient entry above $448/57344 =
#   1/128$ of its tensor's amax saturates. (A recipe with e4m3 gradients *and their own scale* is not a
#   bug: the rowwise recipe is one.)
# * **(c) a rowwise amax over the wrong dimension**: $dW = g^T x$ sums over the tokens, so $g$ must be
#   scaled per column, by its amax along the tokens. The bug reuses the bytes of $g$ scaled per row (the
#   amax over the other dimension, what $dx = g\,W$ needs) and hands the GEMM the per-column scale its
#   shape asks for. The tensorwise recipe may reuse those bytes (one scale has no direction);
#   `_scaled_mm` checks only the scales' shapes, so nothing complains.

# %%
# the module whose functions the bugs replace (the package's float8_linear is the function, imported above)
float8_linear_module = importlib.import_module("refimpl.precision.fp8.float8_linear")


@contextlib.contextmanager
def planted(name, bug):
    """Inside the block, the module's function ``name`` is ``bug(original)``; restored after."""
    original = getattr(float8_linear_module, name)
    setattr(float8_linear_module, name, bug(original))
    try:
        yield
    finally:
        setattr(float8_linear_module, name, original)


def dw_scale_applied_twice(weight_grad):
    def bug(c, sharded, g, x, g_rows=None):
        dw = weight_grad(c, sharded, g, x, g_rows)  # the right GEMM, which applies 1 / s_x ...
        x_scale = float8_linear_module._cast(c, sharded, x, "x", c.input_format, 0).scale
        return DeferredProduct(lambda: dw() / x_scale)  # ... and once more
    return bug


def grads_cast_to_e4m3(cast):
    def bug(c, sharded, t, operand, fmt, dim):
        t8 = cast(c, sharded, t, operand, fmt, dim)
        if operand != "grad":
            return t8
        return Float8Tensor(quantize(t.detach(), t8.scale, E4M3), t8.scale)  # e5m2's scale, e4m3's bytes
    return bug


def dw_grad_amax_over_wrong_dim(cast):
    def bug(c, sharded, t, operand, fmt, dim):
        t8 = cast(c, sharded, t, operand, fmt, dim)
        if operand != "grad" or dim != 0:  # dim 0: g for dW, scaled along the tokens
            return t8
        rows = cast(c, sharded, t, operand, fmt, 1)  # g's bytes scaled per row, dx's cast
        return Float8Tensor(rows.data, t8.scale)  # with the per-column scale the GEMM's shape wants
    return bug


CONTROLS = {"(a) dW: a scale applied twice": ("fp8 tensorwise", "_weight_grad", dw_scale_applied_twice),
            "(b) gradients cast to e4m3": ("fp8 tensorwise", "_cast", grads_cast_to_e4m3),
            "(c) dW: g's amax over the wrong dim": ("fp8 rowwise", "_cast", dw_grad_amax_over_wrong_dim)}
originals = {name: getattr(float8_linear_module, name) for _, name, _ in CONTROLS.values()}
control_err = {}
for label, (recipe, name, bug) in CONTROLS.items():
    with planted(name, bug):
        control_err[label] = rel(first_step_grads(recipe, 0), g32)
    lo, hi = band[recipe]
    print(f"{label:36s} ({recipe:14s}): first-step gradient error {control_err[label]:.2e}, "
          f"{control_err[label] / hi:.1f} x the top of the band [{lo:.2e}, {hi:.2e}]")
    assert control_err[label] > hi, f"{label}: the planted bug lands inside the band"
assert all(getattr(float8_linear_module, n) is f for n, f in originals.items()), "every bug is removed"

# %% [markdown]
# Each planted bug lands far above its recipe's band (the printout gives each one's error as a multiple of
# the band's top), while seed 0's correct runs land inside. So the first step's gradients tell a correct
# fp8 from a broken one; the final loss could not be trusted to: (a) is a factor per tensor, the kind
# AdamW absorbs. What the band cannot see is a bug that costs less at the first step than a correct fp8
# varies between seeds, or one that shows only later in training (a scale that goes stale, an outlier that
# grows): the loss curves are the coarse net for those. And all of this is one small model over 60
# steps; the evidence that fp8 holds over long runs of large models is the runs cited at the top.
#
# ## 5. fp8 on the wire: ZeRO-3's all-gather in fp8
#
# ZeRO-3 (chapter 04) gathers every weight before using it, forward and backward. A tensorwise fp8
# GEMM casts the *whole* weight with one scale, so the cast can move **before** the gather: every rank
# casts its own rows with the same scale, and the gather moves one byte per element instead of bf16's two
# (torchao's `enable_fsdp_float8_all_gather`, part of the run behind the +25% quoted at the top).
# `all_gather_float8` does it in three steps:
#
# 1. `amax = all_reduce_MAX(max |W_r|)`: one fp32 number, the whole tensor's amax, the same on every rank;
# 2. `W8_r = fp8(sat(W_r * fmax / amax))`: each rank casts its rows;
# 3. `W8 = all_gather(W8_r)`, as `uint8` (gloo refuses float8 dtypes in collectives).
#
# The proof, on every rank: the gathered bytes and scale are **bitwise** those of casting the whole weight
# on one device. The weight's amax sits in rank 1's rows, so the negative control, a rank that casts with
# its own amax, must differ on rank 0. Then: the gathered fp8 weight feeds `Float8Linear` with bitwise
# the output and gradients of the layer that casts its full weight itself; the tracer measures the fp8
# gather's bytes against ZeRO-3's own bf16 gather of the same weight (`refimpl.parallel.zero`,
# `param_dtype=bf16`), for an even shape and an uneven one (37 rows: 19 and 18, padded to the chunk).

# %%
from refimpl.launch import start_ranks

ranks = start_ranks(2, timeout_s=60)
ranks

# %%
# %%px
# (the engines are separate processes: they import for themselves)
from torch import nn  # noqa: F811

from refimpl.comm import ops
from refimpl.comm.tracer import CommTracer
from refimpl.distributed.placement import chunk_range
from refimpl.parallel.zero.fsdp_communications import finish_all_gather, shard_into_units
from refimpl.precision.fp8 import (  # noqa: F811
    E4M3,
    E5M2,
    Float8Config,
    Float8Linear,
    all_gather_float8,
    amax_to_scale,
    float8_all_gather_bytes,
    float8_tensor,
    gradient_all_reduce_errors,
    quantize,
)


def weight(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02
    w[-1, -1] = 3.0  # the amax, in the last rank's rows
    return w.to(device)


def zero3_bf16_gather(full):
    """ZeRO-3's own all-gather of the weight in bf16: its traced payload, and whether it is right."""
    layer = nn.Linear(full.shape[1], full.shape[0], bias=False).to(device)
    with torch.no_grad():
        layer.weight.copy_(full)
    (unit,) = shard_into_units(layer, (), rank=rank, world_size=world_size, param_dtype=torch.bfloat16)
    with CommTracer() as tracer:
        finish_all_gather(unit, None)
    assert torch.equal(unit.params[0].unsharded.detach(), full.to(torch.bfloat16))
    return tracer.summary()["all_gather"].nbytes


gather = {}
for shape in ((48, 64), (37, 24)):
    full = weight(shape)
    start, end = chunk_range(shape[0], rank, world_size)
    with CommTracer() as tracer:
        w8, scale = all_gather_float8(full[start:end], None, rows=shape[0])
    one_scale = amax_to_scale(full.abs().amax(), E4M3)
    one_device = quantize(full, one_scale, E4M3)
    assert w8.dtype == E4M3.dtype and torch.equal(w8.view(torch.uint8), one_device.view(torch.uint8))
    assert torch.equal(scale, one_scale), "the agreed scale is the whole tensor's"
    own = quantize(full[start:end], amax_to_scale(full[start:end].abs().amax(), E4M3), E4M3)
    own_is_right = torch.equal(own.view(torch.uint8), one_device[start:end].view(torch.uint8))
    assert own_is_right == (rank == 1), "negative control: without the agreed amax rank 0 casts differently"
    ran = {op: (t.count, t.nbytes) for op, t in tracer.summary().items()}
    bf16_bytes = zero3_bf16_gather(full)
    formula = float8_all_gather_bytes(shape, world_size)
    assert ran == {"all_reduce": (1, 4), "all_gather": (1, formula.payload)}, ran
    assert 2 * ran["all_gather"][1] == bf16_bytes, "exactly half of ZeRO-3's bf16 all-gather"
    gather[shape] = (ran, bf16_bytes)

# the gathered weight feeds the fp8 GEMMs: bitwise the layer that casts its full weight itself
full = weight((48, 64))
start, end = chunk_range(48, rank, world_size)
gathered = float8_tensor(all_gather_float8(full[start:end], None))
x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(device)
g = torch.randn(32, 48, generator=torch.Generator().manual_seed(3)).to(device)
results = []
for weight_fp8 in (None, gathered):
    layer = Float8Linear(64, 48, bias=False, config=Float8Config()).to(device)
    with torch.no_grad():
        layer.weight.copy_(full)
    layer.weight_fp8 = weight_fp8
    xx = x.clone().requires_grad_()
    y = layer(xx)
    y.backward(g)
    results.append((y.detach(), xx.grad, layer.weight.grad))
assert all(torch.equal(p, r) for p, r in zip(*results, strict=True)), "y, dx, dW from the gathered bytes"

# %%
for shape, (ran, bf16_bytes) in ranks.run(lambda: gather)[0].items():
    print(f"W {shape}: fp8 gather ran {ran} (op: count, payload bytes; {ran['all_gather'][1] // shape[1]} rows "
          f"of {shape[1]} bytes) | ZeRO-3's bf16 gather {bf16_bytes:,d} B = 2 x {ran['all_gather'][1]:,d} B")

# %% [markdown]
# Half the bytes, plus one 4-byte all-reduce per weight for the amax (torchtitan's
# `precompute_float8_dynamic_scale_for_fsdp` batches those into one all-reduce for the whole model). The
# uneven shape gathers 38 rows' worth (2 x 19): the padding of the chunk travels too, in both dtypes.
#
# **Why gradients stay in bf16 or fp32.** A weight is cast once, gathered and used; a gradient reduction
# *adds* $N$ contributions, and each one cast to fp8 carries e5m2's relative error ($2^{-3}$) against
# bf16's $2^{-8}$; worse, one scale shared by the group flushes a gradient's small entries (gradients
# span many decades). `gradient_all_reduce_errors` sums every rank's gradient in fp32, in bf16 and from
# fp8 contributions, against a float64 sum; the gradients here span six decades, different on each rank.

# %%
# %%px
gen_r = torch.Generator().manual_seed(10 + rank)
grad = torch.randn(8192, generator=gen_r) * 10.0 ** (-6 * torch.rand(8192, generator=gen_r))
reduce_errors = {f.name: gradient_all_reduce_errors(grad.to(device), None, fmt=f) for f in (E5M2, E4M3)}

# %%
reduce_errors = ranks.run(lambda: reduce_errors)
for name, e in reduce_errors[0].items():
    print(f"fp8 = {name:7s}: relative error of the sum: fp32 {e.fp32:.1e}, bf16 {e.bf16:.1e}, fp8 {e.fp8:.1e}"
          f" (x{e.fp8 / e.bf16:.0f} bf16's) | entries flushed to zero by the fp8 cast {e.fp8_flushed:.1%}")
for e in reduce_errors[0].values():
    assert e.fp32 < e.bf16 < e.fp8 and e.fp8 > 5 * e.bf16, e
assert reduce_errors[0]["e4m3fn"].fp8_flushed > 0.05 and reduce_errors[0]["e5m2"].fp8_flushed == 0, \
    "six decades fit e5m2's 31.8 octaves, not e4m3's 17.8"

# %% [markdown]
# ## 6. The seed: "FP16 gradients cut communication by 50%"
#
# In bytes the claim holds by definition: an fp16 number is 2 bytes and an fp32 one 4, so the same
# gradient all-reduced in fp16 hands the collective half the bytes. That is **arithmetic on the element
# size**, not a finding, and nothing below measures it. What the 2 ranks do, on the real gradients of the
# chapter's GPT (each rank its own batch): the tracer counts the bytes of the tensor each `all_reduce` is
# actually handed (its number of elements times their size), which checks that the cast to fp16 happens
# *before* the collective, not after it; the bytes "sent per rank" it prints are its ring model, the
# formula $2\frac{N-1}{N}$ times those, not a count of the wire. One number here is a measurement: how
# many of those gradients fp16 flushes to zero **without** a loss scale (chapter 05: fp16 needs one;
# bf16 halves the bytes the same way and needs none).

# %%
# %%px
from refimpl.config import ModelConfig  # noqa: F811
from refimpl.models import GPT, lm_loss  # noqa: F811

model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=64)).to(device)
ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(rank)).to(device)
lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
flat = torch.cat([p.grad.flatten() for p in model.parameters()])
traffic = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    with CommTracer() as tracer:
        ops.all_reduce(flat.to(dtype, copy=True))  # a copy: flat itself stays this rank's gradient
    (event,) = tracer.select()
    traffic[str(dtype)] = (event.op, event.nbytes, tracer.bytes_sent())
fp16_zero = ((flat.half() == 0) & (flat != 0)).float().mean().item()
assert traffic["torch.float16"][1] * 2 == traffic["torch.float32"][1] == 4 * flat.numel()
assert traffic["torch.bfloat16"][1] == traffic["torch.float16"][1]

# %%
traffic, fp16_zero, numel = ranks.run(lambda: (traffic, fp16_zero, flat.numel()))[0]
for name, (op, nbytes, sent) in traffic.items():
    print(f"{name:15s}: {op} handed {nbytes:,d} B = {numel:,d} elements x {nbytes // numel} B; "
          f"the ring model's formula books {sent:,.0f} B sent per rank")
print(f"fp16 without a loss scale flushes {fp16_zero:.2%} of this gradient's nonzero entries to zero")
assert traffic["torch.float16"][2] * 2 == traffic["torch.float32"][2]

# %% [markdown]
# So the claim is right about the **bytes** of a gradient all-reduce, by the element sizes (and bf16 gets
# the same halving without a loss scale); it says nothing about time, which on a real network also pays a
# latency per message and overlaps with backward, and nothing on this CPU would measure it. What fp8 adds
# is the **weight** traffic of ZeRO-3 / FSDP, and here is the arithmetic (a formula, not a measurement),
# with the ring model on $N$ ranks: a step gathers every weight twice (forward, and again in backward) and
# reduce-scatters every gradient once, each moving $\frac{N-1}{N}\,\Psi$ elements per rank.

# %%
PSI, RANKS = 8.0e9, 64  # Llama-3 8B's parameters, 64 ranks of FSDP
ring = (RANKS - 1) / RANKS
recipes = {"fp32 weights, fp32 gradients": (4, 4), "bf16 weights, bf16 gradients": (2, 2),
           "fp8 weight gathers, bf16 gradients": (1, 2)}
per_step = {}
for name, (w_bytes, g_bytes) in recipes.items():
    per_step[name] = (2 * w_bytes + g_bytes) * ring * PSI  # two all-gathers + one reduce-scatter
    print(f"{name:36s}: (2 x {w_bytes} + {g_bytes}) x (N-1)/N x Psi = {per_step[name] / 1e9:6.1f} GB "
          f"sent per rank per step")
bf16, fp8 = per_step["bf16 weights, bf16 gradients"], per_step["fp8 weight gathers, bf16 gradients"]
print(f"fp8 gathers: the weight traffic halves again, the step's traffic falls to {fp8 / bf16:.0%} of bf16's")

# %% [markdown]
# The gathers halve again; the step does not, because the gradients stay in bf16 (section 5 showed why).
# Under plain data parallelism there is no weight gather at all, and fp8 saves no traffic.
#
# ## What to take away
#
# * e4m3 (forward) and e5m2 (gradients) have 3 and 2 mantissa bits and windows of 17.8 and 31.8 octaves;
#   the cast saturates and rounds to nearest even.
# * A scale per tensor, from its amax, moves the tensor into the window. One outlier ruins a tensorwise
#   scale; rowwise (or DeepSeek-V3's tiles) contains it. An amax history is one step late on a jump.
# * `Float8Linear` is three scaled GEMMs; each equals its float64 emulation within the fp32 arithmetic's
#   own spread, and the whole layer is torchao's, bit for bit.
# * The GPT trains in fp8 along the fp32 curve; the first and last layers stay in high precision. The
#   loss is a coarse check; the first step's gradients, in a band measured over seeds, are the fine one
#   (three planted bugs land far outside it).
# * On the wire: fp8 weight gathers halve ZeRO-3's gather bytes with bitwise the one-device cast;
#   gradient reductions stay in bf16 or fp32.
#
# In the package: `refimpl.precision.fp8` (`convert_to_float8(model, scaling="rowwise")`,
# `all_gather_float8`). In the trainer: `python -m refimpl.train --precision fp8 [--fp8-scaling rowwise]`
# (bf16 autocast with fp8 linears, composing with dp, ZeRO 0-3, tp and pp; under ZeRO-3 the weights of
# the fp8 layers are all-gathered in fp8 as section 5 built it, tensorwise (each pipeline stage's
# wrapper too, and each tensor-parallel block with its whole layer's scale); with sequence parallelism
# and the zbh1 schedule the linear seam runs the two backward GEMMs through the same fp8 product; what
# does not compose is refused with the reason, `--list-layouts` prints it; tests/trainer/ranks/cli/test_train_fp8.py and
# tests/ranks/test_fp8_zero3.py compare the layouts with one device).

# %%
ranks.stop()

# %% [markdown]
# ## Exercise
#
# Open `exercises/10_fp8.py` and implement fp8 from the scale up: `operand_amax` and `amax_to_scale`
# ($s = f_{max}/\mathrm{amax}$ in fp32, per tensor or per slice along the contraction dimension,
# optionally a power of two), `quantize` and `dequantize` (the saturating, round-to-nearest-even cast and
# back), `scaled_mm` (two scaled fp8 operands multiplied with fp32 accumulation, the scales undone), then
# `float8_linear`: a linear layer whose three GEMMs (output, input gradient, weight gradient) each cast
# their operands with their own scales, in the formats the config gives their roles. Grade your work with
#
# ```
# make grade CH=10
# ```
#
# which compares every cast with the nearest number of the format found in PyTorch's decoding of all 256
# codes (midpoints, overflow, inf and NaN included), every scale bit for bit with the correctly rounded
# quotient, and every GEMM with a float64 emulation of the same fp8 numbers (and with `torch._scaled_mm`)
# within a factor of the fp32 spread measured in the same run, under four recipes, and holds every fp8
# GEMM of your layer to what an H100 accepts (sm90's `_scaled_mm` rules: operand layouts, dims that are
# multiples of 16, no e5m2 x e5m2; a CPU runs all of it). A scale of $\mathrm{amax}/f_{max}$ fails, a
# cast that lets e5m2 overflow to inf fails, and so do a layer that casts its gradients to e4m3 when the
# recipe says e5m2, one whose weight gradient contracts over a token count that is not a multiple of 16,
# and one that hands the backward's operands to the kernel in the layouts it refuses.
#
# ## Questions
#
# 1. e4m3fn has no inf. What does a saturating cast do to an activation that overflowed to inf in the
#    layer before, and why do fp8 recipes saturate instead of producing inf, when chapter 05's loss
#    scaler relies on seeing an inf?
# 2. The rowwise recipe puts one scale per row of $x$ and one per *column* of $W^T$. Why may a scale not
#    vary along the contraction dimension $K$, and how does DeepSeek-V3's $1 \times 128$ tiling along
#    $K$ still work (what must the GEMM do every 128 elements)?
# 3. In section 3 the weight gradient pads 40 tokens to 48 with zero rows. Why is that exact for
#    $dW = g^T x$, and why could the same trick not pad $K$ of a layer with 40 input features?
# 4. The fp8 all-gather needs one all-reduce of the amax before the gather. Why can rowwise weight scales
#    (one per row of $W$, the rows ZeRO shards) do without it, and why would a per-column scale need the
#    whole tensor?
# 5. Section 6's arithmetic gives fp8 gathers 67% of bf16's traffic per step. Which would save more on
#    a large FSDP run: fp8 gradients in the reduce-scatter, or keeping the weights gathered between
#    forward and backward (no second gather)? What does each cost?
