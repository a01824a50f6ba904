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
# # 03 · Data parallelism: one model per rank, one shard of the batch each
#
# The first way to train on several devices, and still the one every large run uses on its outermost
# axis: **every rank holds the whole model**, each trains on a different slice of the global batch, and
# before the optimizer step the ranks **average their gradients**. Since the replicas start equal and
# apply equal updates, they stay equal, and the run computes exactly what one device would compute on the
# whole global batch, only faster.
#
# This chapter builds it twice, the naive way and the way PyTorch's `DistributedDataParallel` does it
# (Li et al. 2020, *PyTorch Distributed: Experiences on Accelerating Data Parallel Training*), and proves:
#
# 1. the data is sharded without overlap, reshuffled every epoch, and the global batch is
#    micro-batch x accumulation steps x ranks;
# 2. after $k$ AdamW steps the parameters equal a **single-device** run on the same global batch, and equal
#    **torch DDP** bit for bit;
# 3. buckets cut the number of all-reduces to $\lceil \text{gradient bytes} / \text{cap} \rceil$ per step,
#    and their communication **overlaps** backward (a timeline from the tracer);
# 4. gradient accumulation has two traps, shown wrong and then right;
# 5. an all-reduce in bf16 halves the bytes, at a small cost in the loss.
#
# The code lives in `refimpl/parallel/data_parallel.py`; the communication goes through
# `refimpl.comm.ops`, so chapter 02's tracer sees every byte.

# %%
import torch

from refimpl.config import DataConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.model import lm_loss
from refimpl.notebook import start_ranks

torch.manual_seed(0)
WORLD_SIZE = 2  # try 4: every assertion holds, the DDP comparison becomes a tolerance (section 4)

# %% [markdown]
# ## 1. The data: a distinct shard per rank
#
# `refimpl.data.ShardedBatches` makes every batch a pure function of (seed, step, rank, world size). The
# corpus is cut into windows of `seq_len + 1` tokens; each epoch permutes them with a seed that includes
# the epoch (what `DistributedSampler.set_epoch(epoch)` does for a PyTorch `DataLoader`); step $k$ takes
# the next `global_batch_size` windows, and rank $r$ takes rows $[rB/W, (r+1)B/W)$ of them.
#
# Two consequences we check: the ranks never see the same window in a step, and the *global* batch does
# not depend on the world size, so a run on 4 ranks and one on 1 rank see the same tokens.

# %%
corpus = prepare_corpus()
batches = ShardedBatches(corpus.tokens, seq_len=32, global_batch_size=8, seed=0)
for step in (0, 1, batches.steps_per_epoch):
    one = batches.window_ids(step, 0, 1)
    for W in (2, 4, 8):
        shards = [batches.window_ids(step, r, W) for r in range(W)]
        assert len(set(torch.cat(shards).tolist())) == len(one)  # disjoint ...
        assert torch.equal(torch.cat(shards), one)  # ... and together the global batch
print(f"{batches.num_windows:,d} windows, {batches.steps_per_epoch:,d} steps per epoch")
print("step 0, rank 0 of 2:", batches.window_ids(0, 0, 2).tolist(), "| rank 1 of 2:", batches.window_ids(0, 1, 2).tolist())

# a new epoch is a new permutation of all windows
first, second = batches._permutation(0), batches._permutation(1)
assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(batches.num_windows))
assert not torch.equal(first, second)
print("epoch 0 starts", first[:6].tolist(), "| epoch 1 starts", second[:6].tolist())

# %% [markdown]
# **The arithmetic of a step.** A step trains `global_batch_size` sequences: each of the $W$ data-parallel
# ranks runs $A$ micro-batches of $m$ sequences before the optimizer steps, so
# $$B_\text{global} = m \times A \times W.$$
# `DataConfig` derives $A$ and refuses a split that does not divide.

# %%
data_cfg = DataConfig(global_batch_size=64, micro_batch_size=4)
for W in (1, 2, 4, 8):
    A = data_cfg.accumulation_steps(W)
    assert 4 * A * W == 64
    print(f"W = {W}: {data_cfg.per_rank_batch(W):2d} sequences per rank = 4 per micro-batch x {A:2d} accumulation steps")

# %% [markdown]
# **The loss normalisation.** Let rank $r$ hold $n_r$ of the $N$ tokens of the global batch. One device
# minimises the mean over all tokens, $L = \frac1N\sum_t \ell_t$. If every rank computes its *own* mean
# $L_r = \frac1{n_r}\sum_{t\in r}\ell_t$ and the gradients are averaged, the result is
# $\frac1W\sum_r L_r$, which equals $L$ **only when all $n_r$ are equal**. The robust form divides each
# rank's *sum* by the global count $N$ and sums the gradients (`lm_loss(..., num_tokens=N)`,
# `DataParallelBucket(average_gradients=False)`). With equal shards (our `ShardedBatches`) both agree, and
# the trainer keeps the per-rank mean with averaging, like DDP. Here is the difference on uneven shards:

# %%
logits, labels = torch.randn(4, 8, 256), torch.randint(0, 256, (4, 8))
uneven = [(logits[:3], labels[:3]), (logits[3:], labels[3:])]  # 24 and 8 tokens
N = labels.numel()
global_mean = lm_loss(logits, labels)
mean_of_means = sum(lm_loss(x, y) for x, y in uneven) / len(uneven)
sum_over_global_count = sum(lm_loss(x, y, num_tokens=N) for x, y in uneven)
print(f"global mean {global_mean:.5f} | mean of per-rank means {mean_of_means:.5f} (wrong) | "
      f"sum of (rank sum / N) {sum_over_global_count:.5f}")
assert torch.allclose(sum_over_global_count, global_mean, rtol=1e-6)
assert not torch.allclose(mean_of_means, global_mean, rtol=1e-3)

# %% [markdown]
# ## 2. Ranks, a model, and the single-device reference
#
# We start one engine per rank (`refimpl.notebook`). Each `%%px` cell runs on every rank; each engine has
# `rank`, `world_size`, `device`, `dist` and `torch`, and an initialised process group (gloo on CPU).

# %%
ranks = start_ranks(WORLD_SIZE, timeout_s=120)
ranks

# %% [markdown]
# On every rank: a small GPT (2 layers, width 64, tied embeddings), the batches above, and a training
# loop that works with any wrapper. The single-device reference is simply the same loop with the plain
# model on the **whole** global batch; every rank computes it itself, so each can compare on its own.
#
# **How close is "equal"?** One device sums the batch inside its matmuls, the ranks sum half-batches and
# then add across ranks: the same numbers in a different order, so each gradient differs by a few ulps
# (relative ~1e-7). AdamW then divides by $\sqrt{v}$: a gradient that is mathematically zero, such as the
# attention *key* bias (softmax ignores a constant added to every key), is pure rounding noise, and Adam
# turns noise into a step of up to $\text{lr}\cdot|g|/\epsilon$. These few elements dominate the
# difference. So we measure it relative to the distance the parameters moved,
# $\|\theta - \theta_\text{ref}\| / \|\theta_\text{ref} - \theta_0\|$, and allow `RTOL = 1e-3`: about
# 100 x what reduction order gives, 1000 x below what a missing synchronisation gives (section 3).

# %%
# %%px
import contextlib
import math

from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.comm.tracer import CommTracer
from refimpl.config import ModelConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.model import GPT, lm_loss
from refimpl.parallel.data_parallel import DataParallelBucket, DataParallelNaive, low_precision_hook

cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=32)
batches = ShardedBatches(prepare_corpus().tokens, seq_len=32, global_batch_size=8, seed=0)
STEPS, LR, RTOL, MB = 5, 1e-3, 1e-3, 2**20


def train(model, wrapper, *, steps=STEPS, world=world_size, me=rank, accumulation=1, tracer=None, trap=None):
    """`steps` AdamW steps of `wrapper` (the model itself, or a data-parallel wrapper of it) on shard `me`."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=False)
    losses = []
    for step in range(steps):
        x_all, y_all = batches.batch(step, me, world)  # [B/W, s] each
        micro = x_all.shape[0] // accumulation
        for i in range(accumulation):
            x, y = x_all[i * micro : (i + 1) * micro], y_all[i * micro : (i + 1) * micro]
            last = i == accumulation - 1
            quiet = contextlib.nullcontext() if last or not hasattr(wrapper, "no_sync") else wrapper.no_sync()
            divide = 1 if trap == "no division" else accumulation
            if trap == "no_sync around backward only":
                out = wrapper(x)
                with quiet:
                    (lm_loss(out, y) / divide).backward()
            elif trap == "no_sync around every forward":
                with wrapper.no_sync():
                    out = wrapper(x)
                (lm_loss(out, y) / divide).backward()
            else:  # right: no_sync around forward *and* backward of every micro-batch but the last
                with quiet:
                    (lm_loss(wrapper(x), y) / divide).backward()
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()  # wait for the all-reduces before the step
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracer is not None:
            tracer.step()
        with torch.no_grad():  # the loss of this step's whole global batch, after the update
            x_global, y_global = batches.batch(step, 0, 1)
            losses.append(lm_loss(model(x_global), y_global).item())
    return [p.detach().clone() for p in model.parameters()], losses


def moved(a, b, init):
    """||a - b|| / ||b - init||: the difference relative to how far the reference moved."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a, b, strict=True)).sqrt()
    return (num / sum(((y - z).double() ** 2).sum() for y, z in zip(b, init, strict=True)).sqrt()).item()


init = [p.detach().clone() for p in GPT(cfg).parameters()]
single = GPT(cfg)
ref, ref_losses = train(single, single, world=1, me=0)  # one device, the whole global batch
if rank == 0:
    print(f"{sum(p.numel() for p in init):,d} parameters in {len(init)} tensors; single-device losses:",
          " ".join(f"{v:.3f}" for v in ref_losses))

# %% [markdown]
# ## 3. The naive version: one all-reduce per gradient, after backward
#
# `DataParallelNaive` does the two things data parallelism needs and nothing else: at construction it
# **broadcasts rank 0's parameters** (so the replicas start equal even if their initialisation was not),
# and after `backward()` its `finish_gradient_synchronization()` **all-reduces every gradient**, divided
# by $W$ (the mean, as DDP computes it). Two costs are plain to see: one collective per tensor, so its
# latency is paid again and again, and no communication starts before the whole backward is over.

# %%
# %%px
model = GPT(cfg)
with CommTracer() as tracer:
    naive, naive_losses = train(model, DataParallelNaive(model), tracer=tracer)
d = moved(naive, ref, init)
counts = [s["all_reduce"].count for s in tracer.per_step()]
assert counts == [len(init)] * STEPS, counts  # one all-reduce per parameter tensor per step
assert d < RTOL, d
if rank == 0:
    print(f"naive: {counts[0]} all-reduces per step; differs from one device by {d:.1e} of the distance moved")

# negative control: a wrapper that never synchronises must fail the same check
model = GPT(cfg)
alone, _ = train(model, model)  # every rank on its own shard, no communication
d_alone = moved(alone, ref, init)
assert d_alone > 100 * RTOL, d_alone
if rank == 0:
    print(f"without synchronisation: {d_alone:.2f} of the distance moved (the check catches it)")

# %% [markdown]
# ## 4. Buckets, and communication that overlaps backward
#
# Backward produces gradients **in reverse order of the forward**: the last layer's first, the
# embedding's last. The moment a gradient is final, nothing stops us from sending it, while backward
# computes the layers below. Sending each tensor alone would pay a latency per tensor, so DDP groups them
# into **buckets** of about `bucket_cap_mb` and launches an asynchronous all-reduce as soon as a bucket's
# last gradient is ready (Li et al. 2020, section 3.2).
#
# `DataParallelBucket` does exactly this:
#
# * the trainable parameters are laid out in one flat buffer in **reverse registration order** and the
#   buffer is cut every `cap` bytes, so there are exactly $\lceil G / \text{cap} \rceil$ buckets for $G$
#   bytes of gradients (a tensor larger than the cap spans several buckets; DDP instead never splits a
#   tensor, so its count is only about that);
# * a `register_post_accumulate_grad_hook` per parameter fires when its `.grad` is final; the bucket's
#   gradients are copied into its buffer (divided by $W$) and `ops.all_reduce(..., async_op=True)` is
#   launched, buckets strictly in order, so every rank issues the same collectives in the same order;
# * `finish_gradient_synchronization()` waits for all of them and copies the averages back into `.grad`;
#   call it before clipping and `optimizer.step()`.
#
# The ugly cases are handled: tied weights are one tensor whose hook fires once, after autograd has
# summed both uses; frozen parameters get no bucket; the buckets of parameters unused in a step are
# launched at the end of backward with zeros, so the collectives still match on every rank.

# %%
# %%px
CAP = 64 * 1024  # bytes: ~8 buckets for this model
model = GPT(cfg)
dp = DataParallelBucket(model, bucket_cap_mb=CAP / MB)
assert dp.module is model and [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]
assert dp.num_buckets == math.ceil(dp.grad_bytes / CAP)
if rank == 0:
    print(f"{dp.grad_bytes:,d} gradient bytes / cap {CAP:,d} -> ceil = {dp.num_buckets} buckets")
    for b, (names, size) in enumerate(zip(dp.bucket_param_names(), dp.bucket_bytes(), strict=True)):
        shown = ", ".join(n.replace("layers.", "L").replace("self_attention.", "attn.") for n in names)
        print(f"  bucket {b}: {size:6,d} B  {shown[:95]}")

with CommTracer() as tracer:
    bucketed, bucketed_losses = train(model, dp, tracer=tracer)
per_step = [(s["all_reduce"].count, s["all_reduce"].nbytes) for s in tracer.per_step()]
assert per_step == [(dp.num_buckets, dp.grad_bytes)] * STEPS, per_step  # the formula, measured
assert moved(bucketed, ref, init) < RTOL
if world_size == 2:  # a + b = b + a: the layout of the sum cannot change a bit
    assert all(torch.equal(a, b) for a, b in zip(bucketed, naive, strict=True))
if rank == 0:
    print(f"per step: {per_step[0][0]} all-reduces, {per_step[0][1]:,d} bytes = all gradient bytes once")

# %% [markdown]
# **Against PyTorch.** `torch.nn.parallel.DistributedDataParallel` on the same model, shards and cap. At 2
# ranks each gradient is $(g_0 + g_1)/2$ in both, and adding two numbers is commutative, so the result is
# **bit for bit** the same although DDP lays out its buckets differently. At 4 ranks gloo's ring adds
# four numbers in an order that depends on an element's position in its bucket, and the layouts differ:
# then the comparison is the tolerance of section 2 (set `WORLD_SIZE = 4` at the top to see it).

# %%
# %%px
model = GPT(cfg)
theirs, ddp_losses = train(model, DDP(model, bucket_cap_mb=CAP / MB))
same_bits = all(torch.equal(a, b) for a, b in zip(bucketed, theirs, strict=True))
d_ddp = moved(bucketed, theirs, init)
if world_size == 2:
    assert same_bits
assert d_ddp < RTOL
if rank == 0:
    print(f"DataParallelBucket vs torch DDP after {STEPS} AdamW steps: bitwise equal = {same_bits}, "
          f"difference {d_ddp:.1e} of the distance moved")

# %% [markdown]
# **The overlap, seen.** Every synchronised backward leaves a `SyncTimeline`: when each gradient hook
# fired, when each bucket was launched (the tracer's `CommEvent.start`) and completed, and when
# `finish_gradient_synchronization` waited. We take two steps with a smaller cap and draw the second on
# one clock for all ranks. Every bucket is launched by a hook while backward runs, and every bucket that
# holds no embedding is launched before the embeddings' gradients (the last ones backward computes; the
# word embedding is also the tied output layer) are final. Only what lies right of the dotted line, the
# end of backward, is exposed: on CPU the ranks' compute and gloo share the same cores, so expect a part.

# %%
# %%px
model = GPT(cfg)
dp = DataParallelBucket(model, bucket_cap_mb=32 * 1024 / MB)
with CommTracer() as tracer:
    train(model, dp, steps=2, tracer=tracer)  # the second step is warm
timeline, events = dp.last_timeline, tracer.select(op="all_reduce", step=1)
assert len(events) == dp.num_buckets == len(timeline.launch)
assert all(t <= timeline.backward_end for t in timeline.launch)  # launched by hooks, inside backward
last_gradient = max(timeline.grad_ready)
early = [b for b, names in enumerate(dp.bucket_param_names()) if not any("embedding" in n for n in names)]
assert all(timeline.launch[b] < last_gradient for b in early)  # while backward still computes
if rank == 0:
    print(f"{len(early)} of {dp.num_buckets} buckets launched before the last gradient was computed; "
          f"exposed communication: {timeline.exposed_fraction():.0%} of {timeline.comm_seconds() * 1e3:.1f} ms")

# %%
from refimpl.parallel.dp_viz import plot_overlap


def timeline_and_events():
    return timeline, events  # the engine's globals (this function runs on each rank)


pulled = ranks.run(timeline_and_events)
fig = plot_overlap([t for t, _ in pulled], events_per_rank=[e for _, e in pulled],
                   title=f"{WORLD_SIZE} ranks: backward vs bucket all-reduces (cap 32 KiB)")

# %% [markdown]
# ## 5. Gradient accumulation and its two traps
#
# When the global batch does not fit, each rank runs $A$ micro-batches and sums their gradients before the
# step. Only the last micro-batch needs to communicate; the others run inside `no_sync()`. Two mistakes
# are common, and both are silent:
#
# * **Forgetting to divide by $A$.** The gradients add up, so without `loss / A` they are $A$ times the
#   gradient of the mean loss. (AdamW hides much of it since it is nearly scale-invariant; SGD, gradient
#   clipping and the logged loss do not.)
# * **Setting the no-sync flag after the forward.** Like DDP's reducer, our wrapper decides in `forward`
#   whether the coming backward synchronises. `no_sync()` around `backward()` alone is too late: every
#   micro-batch communicates (here the answer stays right, at $A$ times the traffic). And the opposite
#   slip, `no_sync()` around the last forward too, means no micro-batch communicates: the ranks drift apart.
#
# We show each wrong, then right, with $A = 2$ micro-batches per rank.

# %%
# %%px
def gradients_after_accumulation(trap):
    model = GPT(cfg)
    dp = DataParallelBucket(model, bucket_cap_mb=CAP / MB)
    tracer = CommTracer()
    with tracer:
        x_all, y_all = batches.batch(0, rank, world_size)
        m = x_all.shape[0] // 2  # 2 micro-batches of m sequences
        for i in range(2):
            x, y = x_all[m * i : m * (i + 1)], y_all[m * i : m * (i + 1)]
            divide = 1 if trap == "no division" else 2
            if trap == "no_sync around backward only":
                out = dp(x)
                with dp.no_sync() if i == 0 else contextlib.nullcontext():
                    (lm_loss(out, y) / divide).backward()
            else:
                with dp.no_sync() if i == 0 else contextlib.nullcontext():
                    (lm_loss(dp(x), y) / divide).backward()
        dp.finish_gradient_synchronization()
    return [p.grad.clone() for p in model.parameters()], len(tracer.select(op="all_reduce")), dp.num_buckets


reference = GPT(cfg)
lm_loss(reference(batches.batch(0, 0, 1)[0]), batches.batch(0, 0, 1)[1]).backward()
ref_grads = [p.grad for p in reference.parameters()]


def worst(grads, scale=1.0):  # largest error relative to each tensor's largest gradient entry
    return max(((g - scale * r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref_grads, strict=True))


wrong, _, _ = gradients_after_accumulation("no division")
right, n_right, n_buckets = gradients_after_accumulation(None)
late, n_late, _ = gradients_after_accumulation("no_sync around backward only")
assert worst(wrong, scale=2.0) < 1e-5 and worst(wrong) > 0.5  # exactly twice the true gradient
assert worst(right) < 1e-5 and worst(late) < 1e-5
assert n_right == n_buckets and n_late == 2 * n_buckets
if rank == 0:
    print(f"no division:                 gradient = 2.000 x the true one (off by {worst(wrong):.2f})")
    print(f"no_sync around backward only: right gradient, but {n_late} all-reduces instead of {n_buckets}")
    print(f"right:                        off by {worst(right):.1e}, {n_right} all-reduces")

# %% [markdown]
# And the slip that breaks training: `no_sync()` around every forward, including the last. Nothing is
# ever synchronised, each rank follows its own shard, and after a few steps the replicas are different
# models. The right loop matches the single-device run on the same global batch.

# %%
# %%px
model = GPT(cfg)
drifted, _ = train(model, DataParallelBucket(model, bucket_cap_mb=CAP / MB), accumulation=2,
                   trap="no_sync around every forward")
model = GPT(cfg)
with CommTracer() as tracer:
    accumulated, _ = train(model, DataParallelBucket(model, bucket_cap_mb=CAP / MB), accumulation=2,
                           tracer=tracer)
assert moved(drifted, ref, init) > 100 * RTOL
assert moved(accumulated, ref, init) < RTOL
assert [s["all_reduce"].count for s in tracer.per_step()] == [math.ceil(dp.grad_bytes / CAP)] * STEPS
if rank == 0:
    print(f"no_sync around every forward: {moved(drifted, ref, init):.2f} of the distance moved (drifted)")
    print(f"right accumulation:           {moved(accumulated, ref, init):.1e} (equal to one device)")

# %% [markdown]
# ## 6. Fewer bytes: all-reduce in bf16
#
# The bucket all-reduce moves $2\frac{W-1}{W} G$ bytes per rank. A communication hook can send a bf16
# copy instead (DDP's `bf16_compress_hook`): `low_precision_hook(torch.bfloat16)` divides by $W$ in fp32,
# casts, all-reduces, and writes the result back into the fp32 buffer. The gradients stay fp32 on every
# rank (accumulated in fp32, stepped in fp32); only the wire, and the additions inside the collective, are
# bf16, which keeps 8 significant bits: a relative error of at most $2^{-8} \approx 0.4\%$ per rounding. The tracer shows
# the bytes halved; the loss barely moves.

# %%
# %%px
model = GPT(cfg)
dp16 = DataParallelBucket(model, bucket_cap_mb=CAP / MB, comm_hook=low_precision_hook(torch.bfloat16))
with CommTracer() as tracer:
    low, low_losses = train(model, dp16, tracer=tracer)
bytes16 = [s["all_reduce"].nbytes for s in tracer.per_step()]
assert bytes16 == [dp16.grad_bytes // 2] * STEPS  # half the fp32 bytes, exactly
assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
rel_loss = max(abs(a - b) / b for a, b in zip(low_losses, bucketed_losses, strict=True))
assert rel_loss < 5e-3
if rank == 0:
    print(f"bytes per step: fp32 {dp16.grad_bytes:,d} -> bf16 {bytes16[0]:,d}")
    print("loss fp32:", " ".join(f"{v:.4f}" for v in bucketed_losses))
    print("loss bf16:", " ".join(f"{v:.4f}" for v in low_losses), f"  (largest relative gap {rel_loss:.1e})")

# %% [markdown]
# ## 7. In the trainer, and your turn
#
# `python -m refimpl.train --nproc-per-node 2` now wraps the model in `DataParallelBucket` (no more
# `torch.nn.parallel.DistributedDataParallel`): `no_sync()` around forward and backward of all but the
# last micro-batch, `finish_gradient_synchronization()` before clipping and `optimizer.step()`.
# `bench/bench_data_parallel.py` measures its step time against DDP's, side by side, and the fraction of
# communication left exposed after backward (`bench/RESULTS.md`).
#
# **Exercises** (`exercises/03_data_parallel.py`, graded by `make grade CH=03`):
#
# 1. `sync_gradients_naive(module)`: one all-reduce per trainable gradient, zeros for missing ones;
# 2. `assign_buckets(numels, cap_numel)`: the reverse-order flat layout cut into buckets;
# 3. `sync_bucket(tensors)`: average a list of tensors with one all-reduce.
#
# Going further: make `DataParallelBucket` keep `.grad` as *views* into the bucket buffers (DDP's
# `gradient_as_bucket_view=True`) and measure the memory it saves; or reduce in fp32 while sending bf16
# (reduce-scatter in bf16 is not enough: why?).

# %%
ranks.stop()
