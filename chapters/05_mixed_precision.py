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
# # 05 · Mixed precision from scratch, and activation checkpointing
#
# Two ways to fit more model into the same memory and run it faster, both trading something for it.
#
# **Mixed precision** computes in 16-bit numbers: half the bytes for activations and gradients on the
# wire, and the tensor cores of a GPU multiply 16-bit matrices many times faster than fp32 ones. The
# price is range and precision. fp16 (IEEE half) keeps 10 bits of mantissa but only 5 of exponent: small
# gradients underflow to zero. bf16 keeps fp32's 8 exponent bits and only 7 of mantissa. Micikevicius et
# al. 2018 ("Mixed Precision Training") made fp16 training work with three ideas, all built here:
# fp32 **master weights**, **loss scaling**, and fp32 accumulation.
#
# **Activation checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")
# keeps only the input of a transformer block for backward and recomputes the rest: memory for compute.
#
# This chapter proves, with assertions:
#
# 1. why fp16 needs scaling and bf16 does not, on the real gradients of our model;
# 2. our `DynamicLossScaler` (`refimpl.precision`) makes **exactly** the decisions of
#    `torch.amp.GradScaler`, scale and skipped steps, on the same gradients with injected overflows;
# 3. fp16 and bf16 training track the fp32 loss curve within a stated tolerance, and our fp16 step is
#    bit-identical to `torch.amp` + `GradScaler`;
# 4. a NaN on one of two ranks makes **both** skip the step and stay identical (and without the agreement
#    they part ways);
# 5. checkpointing cuts the bytes saved for backward to the block inputs, the measurement equals the
#    planner's formula byte for byte, and the recomputation costs one more forward of each checkpointed
#    block (counted in FLOPs; the time ratio is reported).

# %%
import math
import time

import matplotlib.pyplot as plt
import torch

from refimpl.config import ModelConfig, OptimConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.measure import format_bytes, measure_saved_activations
from refimpl.models import GPT, lm_loss
from refimpl.optim import build_optimizer, lr_at, set_lr
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.planner import activation_bytes_per_layer, korthikanti_bytes_per_layer
from refimpl.precision import MixedPrecision
from refimpl.precision.loss_scaler import DynamicLossScaler

torch.set_num_threads(1)  # small matrices: one thread is as fast, and leaves the second core to the ranks
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu on purpose: no GPU here
print("torch", torch.__version__, "| device:", device)

# %% [markdown]
# ## 1. Three formats: range against precision
#
# A float is $\pm 1.m \times 2^{e}$. The exponent bits set the **range** (the largest number and the
# smallest normal one), the mantissa bits the **precision** (`eps`, the gap between 1 and the next
# number). Below the smallest normal number fp16 has *subnormals* down to $2^{-24} \approx 6 \cdot
# 10^{-8}$, with fewer and fewer significant bits; below that, zero.

# %%
print(f"{'':9s} {'bits e/m':>8s} {'max':>10s} {'smallest normal':>16s} {'smallest subnormal':>19s} {'eps':>9s}")
for name, dtype, bits in (("float32", torch.float32, "8/23"), ("bfloat16", torch.bfloat16, "8/7"),
                          ("float16", torch.float16, "5/10")):
    fi = torch.finfo(dtype)
    subnormal = fi.smallest_normal * fi.eps
    print(f"{name:9s} {bits:>8s} {fi.max:10.3g} {fi.smallest_normal:16.3g} {subnormal:19.3g} {fi.eps:9.3g}")


def as_(dtype, x):
    """x rounded to ``dtype`` and read back as a Python float."""
    return torch.tensor(x, dtype=torch.float32).to(dtype).item()


# range: fp16 loses small and large numbers that bf16 keeps
assert as_(torch.float16, 1e-8) == 0.0 and as_(torch.bfloat16, 1e-8) != 0.0
assert math.isinf(as_(torch.float16, 70_000.0)) and as_(torch.bfloat16, 70_000.0) == 70_144.0
# precision: bf16 cannot tell 1 + 1/512 from 1; fp16 can
assert as_(torch.bfloat16, 1 + 2**-9) == 1.0 and as_(torch.float16, 1 + 2**-9) == 1 + 2**-9
print("1e-8 ->", as_(torch.float16, 1e-8), "in fp16,", as_(torch.bfloat16, 1e-8), "in bf16")
print("70000 ->", as_(torch.float16, 70_000.0), "in fp16,", as_(torch.bfloat16, 70_000.0), "in bf16")
print("1 + 2^-9 ->", as_(torch.float16, 1 + 2**-9), "in fp16,", as_(torch.bfloat16, 1 + 2**-9), "in bf16")

# %% [markdown]
# ## 2. Why fp16 needs a loss scale, and bf16 does not
#
# Under `torch.autocast` the weights stay fp32 but every matrix multiply runs in 16 bits, in backward too:
# the gradient of a weight is a 16-bit product before it is cast back to fp32. We take one batch of our
# model, compute the gradients in fp32 (the reference), and again under fp16 and bf16 autocast, with the
# loss multiplied by a scale $S$ and the gradients divided by $S$ afterwards in fp32. The formats round
# the same way on every device; we run this on the CPU, whose kernels are deterministic, so that
# bit-for-bit comparisons are not blurred by a GPU's atomic additions.

# %%
corpus = prepare_corpus(None)
config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=64)
BATCH, SEQ = 4, 64
batches = ShardedBatches(corpus.tokens, seq_len=SEQ, global_batch_size=BATCH, seed=0)
probe = GPT(config)
x0, y0 = batches.batch(0)


def gradients(dtype, scale):
    """All parameter gradients as one fp32 vector: loss * scale, backward (under autocast), / scale."""
    probe.zero_grad(set_to_none=True)
    autocast_on = dtype is not None
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=autocast_on):  # cpu on purpose: bitwise
        loss = lm_loss(probe(x0), y0)
    (loss * scale).backward()
    return torch.cat([p.grad.flatten() for p in probe.parameters()]) / scale


g32 = gradients(None, 1.0)
tiny = torch.finfo(torch.float16).smallest_normal  # 2^-14
small = (g32.abs() < tiny) & (g32 != 0)
print(f"{small.float().mean():.1%} of the gradient entries are below fp16's smallest normal number "
      f"(2^-14), {(g32.abs() < 2**-24).float().mean():.2%} below its smallest subnormal (2^-24)")
rows = {}
for dtype in (torch.float16, torch.bfloat16):
    for scale in (1.0, 2.0**16):
        g = gradients(dtype, scale)
        rel = (g - g32).abs() / g32.abs()
        rows[(dtype, scale)] = g
        print(f"{str(dtype):15s} S = 2^{int(math.log2(scale)):<3d}: flushed to zero {((g == 0) & (g32 != 0)).sum().item():4d}"
              f" | median relative error of the small entries {rel[small].median():.2e}, of the others "
              f"{rel[~small & (g32 != 0)].median():.2e}")

fp16_err = {s: ((rows[(torch.float16, s)] - g32).abs() / g32.abs())[small].median() for s in (1.0, 2.0**16)}
assert small.float().mean() > 0.05, "a good share of real gradients live in fp16's subnormal range"
assert fp16_err[2.0**16] < fp16_err[1.0] / 5, "scaling moves them into the normal range: far more precise"
assert torch.equal(rows[(torch.bfloat16, 1.0)], rows[(torch.bfloat16, 2.0**16)]), \
    "bf16 has fp32's range: a power-of-two scale changes nothing, bit for bit"

# %% [markdown]
# Gradients spread over many orders of magnitude, and a good share of them sits below fp16's smallest
# normal number, where a subnormal keeps only a few significant bits (and below $2^{-24}$, none). Scaling
# the loss by $2^{16}$ shifts the whole distribution up by 16 binades, into the normal range: the small
# entries become about ten times more precise. bf16 has the same exponent range as fp32, so a power-of-two
# scale changes **nothing**, bit for bit: bf16's error (its unit roundoff is $2^{-8}$, its precision) is
# the same with or without it. That is why bf16 trains without a scaler, and fp16 does not.

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.4))
log2g = g32[g32 != 0].abs().log2()
ax.hist(log2g, bins=80, alpha=0.6, label="|gradient|, S = 1")
ax.hist(log2g + 16, bins=80, alpha=0.6, label="|gradient| x 2^16 (S = 2^16)")
ax.axvspan(-40, -24, color="red", alpha=0.15, label="fp16: zero (< 2^-24)")
ax.axvspan(-24, -14, color="orange", alpha=0.15, label="fp16: subnormal, few bits")
ax.axvline(math.log2(65504), color="black", ls="--", lw=1, label="fp16 max 65504")
ax.set_xlim(-30, 20)
ax.set_xlabel("log2 |gradient entry|")
ax.set_ylabel("entries")
ax.set_title("our model's gradients against fp16's range")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# ## 3. A dynamic loss scaler, from scratch, equal to `GradScaler`
#
# Too small a scale wastes fp16's range; too large overflows it (inf or NaN in the gradients). The dynamic
# scaler of Micikevicius et al. searches for the largest scale that works: **unscale** the gradients in
# fp32, **check** them for inf/NaN; on an overflow **skip** the optimizer step and shrink the scale
# (`backoff_factor`); after `growth_interval` clean steps in a row, grow it (`growth_factor`). Megatron-LM
# adds **hysteresis** (tolerate a few overflows before shrinking) and a **minimum scale**. Writing that rule
# is this chapter's exercise (`update_scale`, graded against `GradScaler`); here we use ours.
#
# `DynamicLossScaler` wraps it with `scale(loss)`, `unscale_`, `step` and `update`, the interface of
# `torch.amp.GradScaler`. The proof: feed both the same 60 steps of gradients, over nine orders of
# magnitude, with an inf or a NaN injected at steps 3-5, 17, 30-31 and 44, using growth and backoff
# factors that are not powers of two (3 and 0.25, so float32 rounding of the scale would show). We record
# the scale after each step, which steps were skipped (a step hook on the optimizer counts real steps),
# the unscaled gradients and the final weights. With `hysteresis=1` and no minimum our rule *is*
# GradScaler's; the same run with `hysteresis=2` shows what hysteresis changes.

# %%
OVERFLOWS = {3: "inf", 4: "nan", 5: "-inf", 17: "nan", 30: "inf", 31: "inf", 44: "nan"}
gen = torch.Generator().manual_seed(0)
sequence = []
for t in range(60):
    g = torch.randn(10, generator=gen) * 10.0 ** torch.randint(-6, 3, (1,), generator=gen).item()
    if t in OVERFLOWS:
        g[t % 10] = float(OVERFLOWS[t])
    sequence.append(g.to(device))


def drive(scaler):
    """Run ``scaler`` over ``sequence``: scale, backward, unscale, step (or skip), update."""
    p = torch.nn.Parameter(torch.zeros(10, device=device))
    opt = torch.optim.SGD([p], lr=0.1)
    real_steps = []
    opt.register_step_post_hook(lambda *_: real_steps.append(1))
    scales, skipped, unscaled = [], [], []
    for g in sequence:
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()  # p.grad = S * g
        scaler.unscale_(opt)
        unscaled.append(p.grad.clone())
        before = len(real_steps)
        scaler.step(opt)
        scaler.update()
        skipped.append(len(real_steps) == before)
        scales.append(scaler.get_scale())
    return scales, skipped, unscaled, p.detach().clone()


knobs = dict(init_scale=2.0**12, growth_factor=3.0, backoff_factor=0.25, growth_interval=4)
theirs = drive(torch.amp.GradScaler(device.type, **knobs))
ours = drive(DynamicLossScaler(**knobs, hysteresis=1, min_scale=0.0, max_consecutive_skips=None))
hyst = drive(DynamicLossScaler(**knobs, hysteresis=2, min_scale=0.0, max_consecutive_skips=None))

assert ours[0] == theirs[0], "the same scale after every step"
assert ours[1] == theirs[1], "the same skipped steps"
assert [t for t, s in enumerate(ours[1]) if s] == sorted(OVERFLOWS)
assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(ours[2], theirs[2], strict=True))
assert torch.equal(ours[3], theirs[3]), "the same final weights, bit for bit"
assert hyst[1] == ours[1] and hyst[0] != ours[0], "hysteresis changes the scale, not which steps skip"
print("skipped steps:", [t for t, s in enumerate(ours[1]) if s])
print("scales (ours == GradScaler's):", ours[0][:12], "...")

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.4))
steps = range(len(sequence))
ax.step(steps, [math.log2(s) for s in theirs[0]], where="post", lw=3, alpha=0.4, label="torch.amp.GradScaler")
ax.step(steps, [math.log2(s) for s in ours[0]], where="post", ls="--", color="black",
        label="DynamicLossScaler (hysteresis 1)")
ax.step(steps, [math.log2(s) for s in hyst[0]], where="post", color="tab:green", alpha=0.8,
        label="DynamicLossScaler (hysteresis 2)")
skips = [t for t, s in enumerate(ours[1]) if s]
ax.scatter(skips, [math.log2(ours[0][t]) for t in skips], marker="x", color="red", zorder=5,
           label="skipped step (inf/NaN)")
ax.set_xlabel("step")
ax.set_ylabel("log2(loss scale) after the step")
ax.set_title("dynamic loss scale: ours and PyTorch's make the same decisions")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# Read the staircase: each overflow divides the scale by 4, each run of 4 clean steps multiplies it by 3.
# With hysteresis 2 the first of two overflows in a row (steps 30, 31) costs nothing, and the scale
# stays higher. A run whose gradients stay inf/NaN at every scale (a diverged loss, a NaN in the data)
# would skip forever; `DynamicLossScaler` raises `LossScaleError` after `max_consecutive_skips` skipped
# steps in a row (30 by default) with a message that says so, and the trainer stops.

# %% [markdown]
# ## 4. Training in fp16 and bf16 tracks fp32, and the scaler at work
#
# `MixedPrecision` puts a policy to work in a loop: `autocast()` around the forward pass,
# `backward(loss)` (scaled in fp16), and `step(optimizer, grad_clip=...)` which unscales, checks,
# clips the true gradients, steps or skips, and updates the scale. The same 24 steps of the same model and
# data in fp32, bf16 and fp16.
#
# **The scaler must act.** With GradScaler's default start ($2^{16}$) this model never overflows, and a
# scaler that never skips proves nothing. So the fp16 run starts at $S = 2^{20}$ and grows the scale after
# every 4 clean steps: the first backward passes overflow fp16 (a gradient above 65504), the scaler skips
# and halves until the gradients fit, then grows again until it overflows again. The same run with
# `torch.amp` + `GradScaler` (same knobs) must skip the same steps, keep the same scale after every step
# and, on a CPU, give the same losses bit for bit.
#
# **Tolerance, measured.** A skipped step is a step fp32 never skips, so the fp16 run is compared with an
# fp32 run that skips the **same** steps. How close is close enough? Each 16-bit format sets its own noise
# floor, and we measure it in this run: the same format trained twice, once with the batch in one piece and
# once cut into 2 micro-batches whose gradients are accumulated (the same mathematics, another order of
# roundings). The tolerance is **10 x** that spread: the split only moves the roundings of the gradient
# sums, while 16 against 32 bits moves the rounding of every matmul input, forward and backward (the ratios
# printed below, 16-bit vs fp32 over the floor, show how far apart the two are). The negative control: the
# fp16 run against the plain fp32 run, which did *not* skip those steps, must fail the same tolerance.

# %%
STEPS = 24
optim_cfg = OptimConfig(lr=3e-3, warmup_steps=5)
OVERFLOWING = dict(init_scale=2.0**20, growth_interval=4)  # too large a start; grow every 4 clean steps


def train(precision, *, use_gradscaler=False, micro_batches=1, skip=(), **scaler_knobs):
    """Losses, skipped steps and scale after each step of ``STEPS`` steps; ``skip``: steps never stepped."""
    model = GPT(config).to(device)
    mp = MixedPrecision.from_name(precision, model, device=device, **scaler_knobs)
    opt = build_optimizer(model, optim_cfg)
    params = [p for group in opt.param_groups for p in group["params"]]
    scaler = torch.amp.GradScaler(device.type, **scaler_knobs) if use_gradscaler else None
    real_steps = []
    opt.register_step_post_hook(lambda *_: real_steps.append(1))
    losses, skipped, scales = [], [], []
    start = time.perf_counter()
    for step in range(STEPS):
        set_lr(opt, lr_at(step, optim_cfg, STEPS))
        x, y = (t.to(device) for t in batches.batch(step))
        loss_sum = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            with mp.autocast():
                loss = lm_loss(model(xm), ym) / micro_batches  # equal halves: the mean of the whole batch
            (mp.backward(loss) if scaler is None else scaler.scale(loss).backward())
            loss_sum += loss.item()
        before = len(real_steps)
        if scaler is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, optim_cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
        elif step not in skip:
            mp.step(opt, grad_clip=optim_cfg.grad_clip)
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        skipped.append(len(real_steps) == before)  # the optimizer's own step hook says whether it ran
        scales.append(scaler.get_scale() if scaler is not None else mp.scale)
    return losses, skipped, scales, time.perf_counter() - start


def drift(a, b):
    """The largest per-step loss difference of two runs, and the step where it is."""
    diffs = [abs(p - q) for p, q in zip(a[0], b[0], strict=True)]
    return max(diffs), diffs.index(max(diffs))


runs = {"fp32": train("fp32"), "bf16": train("bf16"), "bf16, 2 micro-batches": train("bf16", micro_batches=2),
        "fp16 (S = 2^16)": train("fp16"), "fp16 (S = 2^16), 2 micro-batches": train("fp16", micro_batches=2),
        "fp16 overflowing": train("fp16", **OVERFLOWING),
        "fp16 overflowing, torch.amp + GradScaler": train("fp16", use_gradscaler=True, **OVERFLOWING)}
ours, theirs = runs["fp16 overflowing"], runs["fp16 overflowing, torch.amp + GradScaler"]
skipped_steps = [t for t, s in enumerate(ours[1]) if s]
runs["fp32, skipping the same steps"] = train("fp32", skip=set(skipped_steps))
for name, (losses, skipped, _, seconds) in runs.items():
    print(f"{name:42s} loss {losses[0]:.3f} -> {losses[-1]:.3f} | skipped {sum(skipped):2d} | "
          f"{seconds:.1f} s")
print("fp16 overflowing: skipped steps", skipped_steps, "| log2(scale) after each step",
      [int(math.log2(s)) for s in ours[2]])

# the scaler acted: it skipped, backed off, and grew again; GradScaler made the same decisions
assert ours[1] == theirs[1] and ours[2] == theirs[2], "the same skipped steps and scales as GradScaler"
assert skipped_steps[:2] == [0, 1], "the first steps overflow at S = 2^20 and are skipped"
backoffs = [t for t in range(1, STEPS) if ours[2][t] < ours[2][t - 1]]
growths = [t for t in range(1, STEPS) if ours[2][t] > ours[2][t - 1]]
assert backoffs and growths and growths[0] > backoffs[0], "backed off, then grew again"
assert any(t > growths[0] for t in skipped_steps), "a grown scale overflowed again: the search goes on"
if device.type == "cpu":
    assert ours[0] == theirs[0], "our fp16 step is torch.amp + GradScaler's, bit for bit"

checks = {  # 16-bit run, its fp32 reference, the noise floor of its format (same format, 2 micro-batches)
    "bf16": ("bf16", "fp32", ("bf16", "bf16, 2 micro-batches")),
    "fp16": ("fp16 overflowing", "fp32, skipping the same steps",
             ("fp16 (S = 2^16)", "fp16 (S = 2^16), 2 micro-batches")),
}
tolerance = {}
for fmt, (run, reference, (whole, split)) in checks.items():
    assert not any(runs[whole][1]) and not any(runs[split][1]), "the noise floor runs never skip"
    floor, _ = drift(runs[whole], runs[split])
    tolerance[fmt] = 10 * floor
    d, at = drift(runs[run], runs[reference])
    print(f"{fmt}: noise floor {floor:.2e} -> tolerance {tolerance[fmt]:.2e} | {run} vs {reference}: "
          f"{d:.2e} "
          f"(x{d / floor:.1f} the floor, largest at step {at})")
    assert d <= tolerance[fmt], f"{run} drifted {d:.3g} nats from {reference}"
control, _ = drift(ours, runs["fp32"])
print(f"negative control: fp16 overflowing vs plain fp32 (which took the skipped steps): {control:.3f}")
assert control > tolerance["fp16"], "a reference that did not skip the same steps must fail the tolerance"
assert runs["fp32"][0][-1] < runs["fp32"][0][0] - 1.5, "training works"

# %%
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
for name in ("fp32", "bf16", "fp16 overflowing", "fp32, skipping the same steps"):
    ax.plot(runs[name][0], label=name)
ax.scatter(skipped_steps, [ours[0][t] for t in skipped_steps], marker="x", color="red", zorder=5,
           label="fp16: skipped step")
for name, reference in (("bf16", "fp32"), ("fp16 overflowing", "fp32, skipping the same steps")):
    bx.plot([abs(a - b) for a, b in zip(runs[name][0], runs[reference][0], strict=True)],
            label=f"|{name} - {reference}|")
for fmt, ls in (("bf16", "--"), ("fp16", ":")):
    bx.axhline(tolerance[fmt], color="grey", ls=ls, lw=1, label=f"{fmt} tolerance (10 x its noise floor)")
bx.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.set_title("losses: an fp16 run that skips steps lags behind")
ax.legend(fontsize=7)
bx.set_xlabel("step")
bx.set_ylabel("|loss difference|")
bx.set_title("difference from the fp32 reference")
bx.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# On a CPU the 16-bit runs are *slower* than fp32 (the times above): without 16-bit matrix units the
# CPU converts and multiplies in software. On a GPU the same code runs the matmuls on tensor cores. The
# point here is the arithmetic, which is the same on both.
#
# Our fp16 run and `torch.amp` + `GradScaler` give the same losses **bit for bit**: the same autocast, the
# same scale, the same unscaled gradients (section 3), so the same AdamW steps. (Clip the parameters in
# the same order in both: the gradient norm is a sum, and float addition is not associative.) On a GPU
# only the decisions (skipped steps, scales) are compared: some backward kernels (the embedding's, with
# atomic additions) are not bitwise reproducible from one run to the next.
#
# **Master weights.** Autocast keeps fp32 weights and makes a 16-bit copy of each for its matmuls. The
# other way, Micikevicius et al.'s and Megatron's, holds the model itself in 16 bits and an fp32 **master**
# copy for the optimizer (`MasterWeights`, `MixedPrecisionPolicy.from_name("fp16", master_weights=True)`).
# The master copy matters because an update is often much smaller than the weight: $10^{-4}$ added to a
# weight of 1 is lost in fp16, whose spacing at 1 is $2^{-10}$.

# %%
w16 = torch.ones(1, dtype=torch.float16)
w32 = torch.ones(1)
for _ in range(10):
    w16 -= 1e-4
    w32 -= 1e-4
print(f"10 updates of 1e-4: fp16 weight {w16.item()}, fp32 master {w32.item():.6f} -> fp16 copy "
      f"{w32.half().item():.6f}")
assert w16.item() == 1.0 and w32.half().item() < 1.0

# %% [markdown]
# ## 5. Two ranks: a NaN on one rank, and every rank skips
#
# Under data parallelism each rank runs its own scaler. The overflow check must give the **same answer on
# every rank**, or the ranks part ways: one steps, the other skips, and their scales differ from then on.
# With plain DDP the averaged gradient carries a NaN to everybody, but not always: under ZeRO (chapter
# 04) each rank unscales and checks only the shard of gradients it owns, and a fault can hit one rank
# after the all-reduce. So `DynamicLossScaler.unscale_` all-reduces its overflow flag (MAX, one number)
# over the data-parallel group.
#
# The experiment on 2 ranks: fp16, gradients averaged across ranks, and, as under ZeRO, rank $r$ owns,
# checks and updates parameters $r, r+2, \dots$ and then broadcasts them. At step 2 a NaN appears in one
# gradient on rank 1 only. Once with the agreement, once without (`agree_across_ranks=False`, the
# negative control).

# %%
from refimpl.launch import start_ranks

ranks = start_ranks(2, timeout_s=60)
ranks

# %%
# %%px
# (the engines are separate processes: they import for themselves)
from refimpl.config import ModelConfig  # noqa: F811
from refimpl.models import GPT, lm_loss  # noqa: F811
from refimpl.parallel.data_parallel import reduce_gradients_
from refimpl.precision import MixedPrecision, MixedPrecisionPolicy  # noqa: F811


def train_with_a_nan(agree, steps=4, nan_step=2):
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, max_seq_len=16)
    model = GPT(config).to(device)
    mp = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), model, device=device, agree_across_ranks=agree)
    params = list(model.parameters())
    owner = [i % world_size for i in range(len(params))]
    owned = [p for p, o in zip(params, owner, strict=True) if o == rank]
    opt = torch.optim.AdamW(owned, lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    log = []
    for step in range(steps):
        x = torch.randint(0, 256, (4, 16), generator=gen).to(device)  # each rank its own data
        with mp.autocast():
            loss = lm_loss(model(x), x)
        mp.backward(loss)
        reduce_gradients_(params, mp.policy)  # data-parallel average
        if rank == 1 and step == nan_step:
            owned[0].grad.view(-1)[0] = float("nan")  # a fault on rank 1 only
        before = torch.cat([p.detach().flatten() for p in params])
        stepped = mp.step(opt, params=owned)  # checks only the owned gradients
        opt.zero_grad(set_to_none=True)
        for p, o in zip(params, owner, strict=True):
            dist.broadcast(p.data, src=o)  # each owner sends its parameters
        after = torch.cat([p.detach().flatten() for p in params])
        log.append({"stepped": stepped, "scale": mp.scale, "unchanged": torch.equal(before, after)})
    return log, after.cpu()  # cpu on purpose: shipped back to the notebook's kernel


agreed = train_with_a_nan(agree=True)
unagreed = train_with_a_nan(agree=False)

# %%
results = ranks.run(lambda: (agreed, unagreed))
for label, k in (("agreed", 0), ("not agreed", 1)):
    for r, res in enumerate(results):
        log = res[k][0]
        print(f"{label:10s} rank {r}: stepped {[e['stepped'] for e in log]}  scale {[e['scale'] for e in log]}")
(a0, w0), (a1, w1) = results[0][0], results[1][0]
assert [e["stepped"] for e in a0] == [e["stepped"] for e in a1] == [True, True, False, True]
assert [e["scale"] for e in a0] == [e["scale"] for e in a1], "both ranks keep the same scale"
assert a0[2]["unchanged"] and a1[2]["unchanged"], "the skipped step changed no weight"
assert torch.equal(w0, w1), "the ranks end identical"
(u0, _), (u1, _) = results[0][1], results[1][1]
assert u0[2]["stepped"] and not u1[2]["stepped"], "without agreement only rank 1 skips ..."
assert u0[-1]["scale"] != u1[-1]["scale"], "... and the ranks' loss scales part ways"

# %% [markdown]
# Without the agreement rank 0 steps its half of the model while rank 1 skips its half, and the scales
# differ from then on: rank 0 multiplies its loss by $2^{16}$, rank 1 by $2^{15}$, the all-reduce
# averages gradients of two different scales, and each rank divides by its own. Nothing crashes; the
# gradients are silently wrong. One all-reduce of one number per step prevents it.
#
# **Gradients on the wire in 16 bits, summed in fp32.** The policy's third dtype, `reduce_dtype`, sets how
# gradients travel. A plain bf16 all-reduce rounds after every addition of the ring, $n-1$ times.
# `low_precision_all_reduce_` sends bf16 but adds in fp32: an all-to-all gives each rank everybody's
# bf16 copy of its chunk, it sums them in fp32 and rounds once, and an all-gather returns the chunks.
# The tracer records which collectives ran and the bytes of the tensors handed to them (measured from the
# tensors): one fp32 all-reduce of the whole gradient, against one all-to-all and one all-gather of
# bf16 tensors. What each rank then puts on the wire depends on the backend's algorithm; under the ring
# **model** (all-reduce $2\frac{n-1}{n}S$, all-to-all and all-gather $\frac{n-1}{n}S$ each) that is half of
# fp32's bytes, a formula we print, not a measurement. The error is at most one bf16 rounding of the
# inputs and one of the sum: a bound from the rounding arithmetic (unit roundoff $u = 2^{-8}$), which
# holds whatever order the fp32 additions run in. It is also a DDP comm hook
# (`ddp_comm_hook(torch.bfloat16)`), the hook of chapter 03.

# %%
# %%px
from refimpl.comm import CommTracer, ops
from refimpl.parallel.data_parallel import low_precision_all_reduce_

g = (torch.randn(10_000, generator=torch.Generator().manual_seed(rank)) * 1e-3).to(device)
with CommTracer() as fp32_trace:
    exact = g.clone()
    ops.all_reduce(exact)
    exact /= world_size
with CommTracer() as bf16_trace:
    low = g.clone()
    low_precision_all_reduce_(low, comm_dtype=torch.bfloat16)
magnitude = g.abs()
ops.all_reduce(magnitude)
magnitude /= world_size  # sum over ranks of |g_r|, / n: what the rounding errors scale with
ran = {name: [(e.op, e.nbytes) for e in trace.select()] for name, trace in
       (("fp32", fp32_trace), ("bf16", bf16_trace))}
padded = -(-g.numel() // world_size) * world_size  # the all-to-all sends equal chunks
assert ran["fp32"] == [("all_reduce", 4 * g.numel())], ran["fp32"]
assert ran["bf16"] == [("all_to_all", 2 * padded), ("all_gather", 2 * padded)], ran["bf16"]
assert ((low - exact).abs() <= 2**-7 * (1 + 2**-7) * magnitude).all()  # two bf16 roundings (u = 2^-8)

# %%
ran, err = ranks.run(lambda: (ran, (low - exact).abs().max().item()))[0]
n = len(ranks.devices)
ring = {"all_reduce": 2 * (n - 1) / n, "all_to_all": (n - 1) / n, "all_gather": (n - 1) / n}  # the model
for name, events in ran.items():
    print(f"{name}: ran {events} (op, payload bytes) -> ring model: "
          f"{sum(ring[op] * nbytes for op, nbytes in events):,.0f} B sent per rank")
print(f"largest error {err:.2e} on values of size ~1e-3")
ranks.stop()

# %% [markdown]
# ## 6. Activation checkpointing
#
# Chapter 01 measured the bytes autograd keeps for backward. Here we count them **per block and per
# dtype** (`refimpl.measure.SavedTensorMeter`, a `saved_tensors_hooks` pair plus forward hooks on the
# blocks that say whose forward is running; views of one storage count once; weights, and autocast's
# 16-bit copies of them, count apart because they do not grow with the batch) and compare them with a
# formula.
#
# **The formula.** Korthikanti et al. 2022 give, for one Megatron GPT layer in 16 bits,
# $sbh\,(34 + 5as/h)$ bytes: 34 $sbh$ for the inputs of the matmuls, LayerNorms, GELU and dropout masks,
# and $5as^2b$ for the attention scores, their softmax and dropout. Our block differs, and
# `refimpl.planner.activation_bytes_per_layer` counts each term:
#
# | term | Korthikanti (16-bit) | ours, autocast (compute $p$ = 2 B, residual $r$ = 4 B) |
# |---|---|---|
# | 2 LayerNorm inputs | $4sbh$ | $2r\,sbh = 8sbh$ (LayerNorm runs in fp32 under autocast) |
# | LayerNorm mean and rstd | - | $2 \cdot 2 r\,sb = 16sb$ |
# | QKV input, Q K V, projection input | $2 + 6 + 2 = 10\,sbh$ | $10\,sbh$ |
# | attention scores, softmax, dropout | $5as^2b + sbh$ | fused attention: log-sum-exp $4asb$ |
# | MLP input, GELU input and output ($f = 4h$) | $2 + 8 + 8 = 18\,sbh$ | $18\,sbh$ |
# | MLP dropout mask | $sbh$ | - (no dropout) |
# | **total** | $34\,sbh + 5as^2b$ | $36\,sbh + 16sb + 4asb$ |
#
# A checkpointed block keeps only its input: $r\,sbh$. We measure a 4-layer model under bf16 autocast
# (16-bit compute, like the formula) plain, with every block checkpointed, and with blocks 1 and 3 only.
# The measurement runs on the CPU, whose fused attention kernel saves exactly the output and the
# log-sum-exp (GPU kernels add a few small tensors: random-number state, a padded log-sum-exp).

# %%
act_cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, max_seq_len=128)
AB, AS = 4, 128
xa = torch.randint(0, 256, (AB, AS), generator=torch.Generator().manual_seed(0))


def saved(blocks, dtype=torch.bfloat16):
    model = GPT(act_cfg)
    apply_activation_checkpointing(model, blocks)

    def forward():
        with torch.autocast("cpu", dtype=dtype):  # cpu on purpose: the kernel the planner's formula counts
            return lm_loss(model(xa), xa)

    return measure_saved_activations(model, forward)


plain, every, some = saved("none"), saved("all"), saved([1, 3])
per_layer = activation_bytes_per_layer(act_cfg, micro_batch=AB, seq_len=AS, compute_dtype=torch.bfloat16)
ckpt = activation_bytes_per_layer(act_cfg, micro_batch=AB, seq_len=AS, compute_dtype=torch.bfloat16,
                                  checkpointed=True)
paper = korthikanti_bytes_per_layer(seq_len=AS, micro_batch=AB, hidden_size=64, num_heads=4)
for name, value in per_layer.terms.items():
    print(f"  {name:40s} {value:>9,d} B")
print(f"per block: measured {plain.per_block()}, planner {per_layer.total:,d}; checkpointed: measured "
      f"{every.per_block()}, planner {ckpt.total:,d} (= the block input, {AB}x{AS}x64 fp32)")
fp32_layer = activation_bytes_per_layer(act_cfg, micro_batch=AB, seq_len=AS).total
print(f"Korthikanti's formula for the same shape: {paper:,d} B per layer, x{paper / per_layer.total:.2f} ours "
      f"(its 5as^2b term alone: {5 * 4 * AS * AS * AB:,d} B); fp32 would save {fp32_layer:,d} B: bf16 autocast "
      f"keeps {per_layer.total / fp32_layer:.0%} of it")
assert plain.per_block() == [per_layer.total] * 4, "measured == planner, byte for byte"
assert every.per_block() == [ckpt.total] * 4 == [4 * AB * AS * 64] * 4, "only the block inputs remain"
assert some.per_block() == [per_layer.total, ckpt.total, per_layer.total, ckpt.total], "per-block selection"
print(f"whole model, outside the blocks included: {format_bytes(plain.total)} plain, "
      f"{format_bytes(every.total)} with every block checkpointed ({every.total / plain.total:.0%})")

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.4))
labels = [f"block {i}" for i in range(4)]
width = 0.2
for k, (name, values) in enumerate({
    "measured, plain": plain.per_block(),
    "planner, plain": [per_layer.total] * 4,
    "measured, blocks 1 and 3 checkpointed": some.per_block(),
    "planner, checkpointed": [ckpt.total] * 4,
}.items()):
    ax.bar([i + (k - 1.5) * width for i in range(4)], [v / 1024 for v in values], width=width, label=name)
ax.axhline(paper / 1024, color="grey", ls="--", lw=1, label="Korthikanti sbh(34 + 5as/h)")
ax.set_xticks(range(4), labels)
ax.set_ylabel("KiB saved for backward")
ax.set_title(f"saved activations per block, bf16 autocast, b={AB}, s={AS}, h=64")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# Korthikanti's formula overestimates our block about twice at this shape, almost all of it the
# $5as^2b$ attention term that fused attention never materialises. Note also what autocast does *not*
# halve: the residual stream and the LayerNorm inputs stay fp32, so bf16 autocast keeps about 57% of
# fp32's activation bytes ($36\,sbh$ against $64\,sbh$), not 50%.
#
# **Same gradients, one more forward.** Checkpointing changes no arithmetic, so gradients are equal bit for
# bit. The recomputation costs, in FLOPs, exactly one more forward of each checkpointed block, *minus its
# last matmul*: the non-reentrant checkpoint stops recomputing as soon as the last tensor backward needs
# is rebuilt (the input of the last linear layer), so that layer's output is never recomputed. We count
# with `FlopCounterMode`, which counts matmuls. The CPU's fused attention kernel has no FLOP formula in it,
# so a count with it would miss the attention that is recomputed too: we count under PyTorch's *math*
# attention kernel, which computes attention with two batched matmuls the counter sees. Then we time one
# training step each way, with the default kernels (timings are printed, not asserted: this machine is
# shared).

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

ref_model = GPT(act_cfg)
ck_model = GPT(act_cfg)
apply_activation_checkpointing(ck_model, "all")


def step_flops(model):
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(xa), xa).backward()
    return counter.get_total_flops(), [p.grad.clone() for p in model.parameters()]


with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    ref_model(xa)
fwd = counter.get_flop_counts()
attention_fwd = sum(fwd[f"GPT.layers.{i}"].get(torch.ops.aten.bmm, 0) for i in range(4))
blocks_fwd = sum(sum(fwd[f"GPT.layers.{i}"].values()) for i in range(4))
last_linear = sum(sum(fwd[f"GPT.layers.{i}.mlp.dense_4h_to_h"].values()) for i in range(4))
plain_flops, plain_grads = step_flops(ref_model)
ck_flops, ck_grads = step_flops(ck_model)
with set_checkpoint_early_stop(False):
    full_flops, _ = step_flops(ck_model)
assert all(torch.equal(a, b) for a, b in zip(plain_grads, ck_grads, strict=True)), "identical gradients"
assert full_flops - plain_flops == blocks_fwd, "recompute without early stop: exactly one forward of the blocks"
assert ck_flops - plain_flops == blocks_fwd - last_linear, "with early stop: minus each block's last matmul"
assert attention_fwd == 4 * 4 * AB * AS * AS * 64, "the counter sees attention: 4bs^2h per block"
print(f"FLOPs per step: plain {plain_flops / 1e6:.0f} M, checkpointed {ck_flops / 1e6:.0f} M "
      f"(x{ck_flops / plain_flops:.3f}; the blocks' forward is {blocks_fwd / 1e6:.0f} M, of it attention "
      f"{attention_fwd / 1e6:.0f} M)")


def seconds(model, fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(model)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def fwd_bwd(model):
    model.zero_grad(set_to_none=True)
    lm_loss(model(xa), xa).backward()


def fwd_only(model):
    lm_loss(model(xa), xa)  # with autograd recording, as the recomputation runs


t_plain, t_ckpt, t_fwd = seconds(ref_model, fwd_bwd), seconds(ck_model, fwd_bwd), seconds(ref_model, fwd_only)
print(f"step time: plain {t_plain * 1e3:.1f} ms, all blocks checkpointed {t_ckpt * 1e3:.1f} ms "
      f"(x{t_ckpt / t_plain:.2f}); the extra time is {(t_ckpt - t_plain) / t_fwd:.2f} forward passes "
      f"({t_fwd * 1e3:.1f} ms each)")

# %% [markdown]
# **What the FLOPs predict, and what the clock says.** Backward costs about twice the forward in FLOPs, so
# one more forward of every block adds at most a third of the FLOPs of a step; the count above, attention
# included, is x1.235 (+23.5%): less than a third, because the embedding, the output layer and each block's
# last matmul are not recomputed. The *time* printed above is another matter: on this CPU the
# checkpointed step took x1.37, x1.57 and x1.85 the plain one in three of our runs (it varies with the load
# of the machine), the extra time 0.9 to 1.9 forward passes. The FLOP argument does not predict time at
# this size: a small model on a CPU spends much of its step outside matmuls (LayerNorm, GELU, the fused
# attention kernel, autograd's bookkeeping, and the checkpoint's own), and recomputation repeats all of it.
# Measure the ratio on your hardware, at your model's size (`bench/bench_precision.py`). In exchange the
# activations of a checkpointed layer shrink from $36\,sbh + \dots$ to $4\,sbh$ bytes.
# Checkpointing every other block (`apply_activation_checkpointing(model, lambda i: i % 2 == 0)`)
# is the middle ground; Korthikanti et al.'s *selective* recomputation goes further and recomputes only
# the attention scores, which is what fused attention kernels now do by design.
#
# ## What to take away
#
# * fp16 has precision but no range: real gradients fall below its normal numbers, and a loss scale
#   shifts them back. bf16 has fp32's range and needs no scale (a power-of-two scale changes nothing).
# * A dynamic loss scaler is twenty lines of rule; ours makes GradScaler's decisions exactly, and adds
#   hysteresis, a minimum scale, and an abort after too many skipped steps.
# * Under data parallelism or ZeRO the overflow flag must be all-reduced: otherwise ranks skip different
#   steps and their scales diverge.
# * Activation checkpointing keeps only the block input; the bytes saved for backward match a per-term
#   formula exactly, and the recomputation is one forward of the block (minus its last matmul).
#
# In the trainer: `python -m refimpl.train --precision bf16 --activation-checkpointing`.
#
# ## Exercise
#
# Open `exercises/05_mixed_precision.py` and implement `update_scale` (the loss-scale rule, with
# hysteresis and a minimum), `overflow_on_any_rank` (the agreement of section 5: one rank sees an inf,
# every rank skips) and `checkpoint_block`. Grade your work with
#
# ```
# make grade CH=05
# ```
#
# which compares your rule with `torch.amp.GradScaler` step by step, runs your agreement on 2 ranks, and
# checks your checkpointed block's gradients, saved bytes and recomputation.
#
# ## Questions
#
# 1. The scaler tests the *scaled* gradients for inf/NaN, then divides. Could it divide first and test
#    the unscaled fp32 gradients instead? When would the two tests disagree?
# 2. In section 4 the fp16 run skipped its first steps. Why is the run with skipped steps compared with an
#    fp32 run that skips the same steps, and what would a tolerance wide enough to pass against the plain
#    fp32 run hide?
# 3. Under ZeRO each rank checks only its shard. Why is a MAX all-reduce of one flag enough, and why must a
#    rank with no gradients in its shard still call it?
# 4. `low_precision_all_reduce_` sends bf16 but sums in fp32. Why is a plain bf16 all-reduce worse on 64
#    ranks than on 2, and why does bf16 on the wire need no loss scale?
# 5. Checkpointing adds x1.235 the FLOPs here but more than that in time on a CPU. On a GPU with a large
#    model, which way would you expect the time ratio to move, and why does the count stay below x4/3?
