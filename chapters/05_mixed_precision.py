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
import inspect
import math
import time

import matplotlib.pyplot as plt
import torch

from refimpl.activation_planner import activation_bytes_per_layer, korthikanti_bytes_per_layer
from refimpl.activations import apply_activation_checkpointing, measure_saved_activations
from refimpl.config import ModelConfig, OptimConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.loss_scaler import DynamicLossScaler, update_scale
from refimpl.metrics import format_bytes
from refimpl.model import GPT, lm_loss
from refimpl.optim import build_optimizer, lr_at, set_lr
from refimpl.precision import MixedPrecision

torch.set_num_threads(1)  # small matrices: one thread is as fast, and leaves the second core to the ranks
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
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
# adds **hysteresis** (tolerate a few overflows before shrinking) and a **minimum scale**. The whole rule:

# %%
print(inspect.getsource(update_scale))

# %% [markdown]
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
# ## 4. Training in fp16 and bf16 tracks fp32
#
# `MixedPrecision` puts a policy to work in a loop: `autocast()` around the forward pass,
# `backward(loss)` (scaled in fp16), and `step(optimizer, grad_clip=...)` which unscales, checks,
# clips the true gradients, steps or skips, and updates the scale. The same 24 steps of the same
# model and data in fp32, bf16 and fp16, and once more in fp16 with `torch.amp.GradScaler` doing the
# scaling, clipping the same parameters in the same order.
#
# **Tolerance.** bf16 and fp16 round every matmul input (unit roundoff $2^{-8} \approx 0.004$ for bf16,
# $2^{-11}$ for fp16), but the loss is a mean over 256 tokens, whose rounding errors mostly cancel, and
# over a short run the weights drift apart slowly. We require every step's loss to be within
# **0.02 nats** of fp32's: 0.5% of a loss of 4, over ten times the drift we observe (about 0.001), and
# far below the 2.5 nats the loss falls. A real precision bug (an fp16 gradient flushed, a skipped
# step that was not skipped) moves the curve by more.

# %%
STEPS = 24
optim_cfg = OptimConfig(lr=3e-3, warmup_steps=5)


def train(precision, use_gradscaler=False):
    model = GPT(config).to(device)
    mp = MixedPrecision.from_name(precision, model, device=device)
    opt = build_optimizer(model, optim_cfg)
    params = [p for group in opt.param_groups for p in group["params"]]
    scaler = torch.amp.GradScaler(device.type) if use_gradscaler else None
    losses, skipped = [], 0
    start = time.perf_counter()
    for step in range(STEPS):
        set_lr(opt, lr_at(step, optim_cfg, STEPS))
        x, y = (t.to(device) for t in batches.batch(step))
        with mp.autocast():
            loss = lm_loss(model(x), y)
        if scaler is None:
            mp.backward(loss)
            skipped += not mp.step(opt, grad_clip=optim_cfg.grad_clip)
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, optim_cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, skipped, time.perf_counter() - start


runs = {name: train(name) for name in ("fp32", "bf16", "fp16")}
runs["fp16, torch.amp + GradScaler"] = train("fp16", use_gradscaler=True)
for name, (losses, skipped, seconds) in runs.items():
    drift = max(abs(a - b) for a, b in zip(losses, runs["fp32"][0], strict=True))
    print(f"{name:30s} loss {losses[0]:.3f} -> {losses[-1]:.3f} | max |loss - fp32 loss| {drift:.5f} | "
          f"skipped {skipped} | {seconds:.1f} s")
    assert drift <= 0.02, f"{name} drifted {drift:.4f} nats from fp32"
assert runs["fp32"][0][-1] < runs["fp32"][0][0] - 1.5, "training works"
if device.type == "cpu":
    assert runs["fp16"][0] == runs["fp16, torch.amp + GradScaler"][0], "our fp16 step is torch.amp's, bit for bit"

# %%
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, (losses, _, _) in runs.items():
    if "GradScaler" in name:
        continue
    ax.plot(losses, label=name)
    bx.plot([a - b for a, b in zip(losses, runs["fp32"][0], strict=True)], label=f"{name} - fp32")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.set_title("the three precisions: one curve")
ax.legend()
bx.axhspan(-0.02, 0.02, color="grey", alpha=0.15, label="tolerance ±0.02")
bx.set_xlabel("step")
bx.set_ylabel("loss difference")
bx.set_title("difference from fp32")
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
# the comparison holds within the tolerance only: some backward kernels (the embedding's, with atomic
# additions) are not bitwise reproducible from one run to the next.
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
from refimpl.notebook import start_ranks

ranks = start_ranks(2, timeout_s=60)
ranks

# %%
# %%px
# (the engines are separate processes: they import for themselves)
from refimpl.config import ModelConfig  # noqa: F811
from refimpl.model import GPT, lm_loss  # noqa: F811
from refimpl.precision import MixedPrecision, MixedPrecisionPolicy, reduce_gradients_  # noqa: F811


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
    return log, after.cpu()


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
# Half the bytes of fp32 (the tracer counts them), and at most one bf16 rounding of the inputs and one of
# the sum. It is also a DDP comm hook (`ddp_comm_hook(torch.bfloat16)`), the hook of chapter 03.

# %%
# %%px
from refimpl.comm import CommTracer, ops
from refimpl.precision import low_precision_all_reduce_

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
wire = (fp32_trace.bytes_sent(), bf16_trace.bytes_sent())
assert wire[1] == wire[0] / 2
assert ((low - exact).abs() <= 2**-7 * (1 + 2**-7) * magnitude).all()  # two bf16 roundings (u = 2^-8)

# %%
wire, err = ranks.run(lambda: (wire, (low - exact).abs().max().item()))[0]
print(f"bytes sent per rank: fp32 all-reduce {wire[0]:.0f}, bf16 on the wire with fp32 sums {wire[1]:.0f}; "
      f"largest error {err:.2e} on values of size ~1e-3")
ranks.stop()

# %% [markdown]
# ## 6. Activation checkpointing
#
# Chapter 01 measured the bytes autograd keeps for backward. Here we count them **per block and per
# dtype** (`refimpl.activations.SavedTensorMeter`, a `saved_tensors_hooks` pair plus forward hooks on the
# blocks that say whose forward is running; views of one storage count once; weights, and autocast's
# 16-bit copies of them, count apart because they do not grow with the batch) and compare them with a
# formula.
#
# **The formula.** Korthikanti et al. 2022 give, for one Megatron GPT layer in 16 bits,
# $sbh\,(34 + 5as/h)$ bytes: 34 $sbh$ for the inputs of the matmuls, LayerNorms, GELU and dropout masks,
# and $5as^2b$ for the attention scores, their softmax and dropout. Our block differs, and
# `refimpl.activation_planner.activation_bytes_per_layer` counts each term:
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
        with torch.autocast("cpu", dtype=dtype):
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
# with `FlopCounterMode` (which counts matmuls; the CPU's fused attention kernel has no FLOP formula in
# it), and time one training step each way (timings are printed, not asserted: this machine is shared).

# %%
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

ref_model = GPT(act_cfg)
ck_model = GPT(act_cfg)
apply_activation_checkpointing(ck_model, "all")


def step_flops(model):
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(xa), xa).backward()
    return counter.get_total_flops(), [p.grad.clone() for p in model.parameters()]


with FlopCounterMode(display=False) as counter:
    ref_model(xa)
fwd = counter.get_flop_counts()
blocks_fwd = sum(sum(fwd[f"GPT.layers.{i}"].values()) for i in range(4))
last_linear = sum(sum(fwd[f"GPT.layers.{i}.mlp.dense_4h_to_h"].values()) for i in range(4))
plain_flops, plain_grads = step_flops(ref_model)
ck_flops, ck_grads = step_flops(ck_model)
with set_checkpoint_early_stop(False):
    full_flops, _ = step_flops(ck_model)
assert all(torch.equal(a, b) for a, b in zip(plain_grads, ck_grads, strict=True)), "identical gradients"
assert full_flops - plain_flops == blocks_fwd, "recompute without early stop: exactly one forward of the blocks"
assert ck_flops - plain_flops == blocks_fwd - last_linear, "with early stop: minus each block's last matmul"
print(f"FLOPs per step: plain {plain_flops / 1e6:.0f} M, checkpointed {ck_flops / 1e6:.0f} M "
      f"(+{(ck_flops - plain_flops) / plain_flops:.1%}; the blocks' forward is {blocks_fwd / 1e6:.0f} M)")


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
# Backward costs about twice the forward, so one more forward of every block adds at most a third to a
# step; here the FLOPs grow by about 20%, because the embedding, the output layer and each block's last
# matmul are not recomputed. The timing printed above should land near that, give or take the noise of a
# shared CPU (`bench/bench_precision.py` measured x1.24 on the default model). In exchange the
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
# hysteresis and a minimum) and `checkpoint_block`. Grade your work with
#
# ```
# make grade CH=05
# ```
#
# which compares your rule with `torch.amp.GradScaler` step by step and checks your checkpointed block's
# gradients, saved bytes and recomputation.
