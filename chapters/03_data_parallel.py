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
# 2. the gradients, and after $k$ AdamW steps the parameters, equal a **single-device** run on the same
#    global batch (within a tolerance measured in the same run), and equal **torch DDP** bit for bit;
# 3. buckets cut the number of all-reduces to $\lceil \text{gradient bytes} / \text{cap} \rceil$ per step,
#    and their communication **overlaps** backward (a timeline from the tracer);
# 4. gradient accumulation has two traps, shown wrong and then right;
# 5. an all-reduce in bf16 halves the bytes, at a small cost in the loss.
#
# The code lives in `refimpl/parallel/data_parallel/`; the communication goes through
# `refimpl.comm.ops`, so chapter 02's tracer sees every byte.

# %%
import torch

from refimpl.config import DataConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.launch import start_ranks
from refimpl.models import lm_loss

torch.manual_seed(0)
WORLD_SIZE = 2  # try 4: every assertion holds, the bitwise comparisons become tolerances (section 2)

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
# **What most write-ups show instead**: PyTorch's `DistributedSampler` inside a `DataLoader`. It shards
# the same way (rank $r$ takes every $W$-th index of a permutation), but the permutation is seeded with
# `seed + epoch`, and the epoch is whatever the loop last passed to `sampler.set_epoch(epoch)`: forget
# the call and every epoch replays epoch 0's order. And when the dataset does not divide by $W$, it
# **pads** by repeating the first indices so that every rank gets the same count: in an evaluation those
# samples are counted twice. (`drop_last=True` drops the tail instead.) `ShardedBatches` has neither
# trap: the epoch is part of its seed, and a step only ever takes whole global batches. Both, asserted:

# %%
from torch.utils.data import DataLoader, DistributedSampler

windows = torch.arange(10)  # a 10-window dataset on 4 ranks


def epoch_order(world, *, call_set_epoch, epoch, drop_last=False):
    """The windows each rank's DataLoader yields in `epoch`, concatenated rank by rank."""
    order = []
    for r in range(world):
        sampler = DistributedSampler(windows, num_replicas=world, rank=r, shuffle=True, seed=0,
                                     drop_last=drop_last)
        if call_set_epoch:
            sampler.set_epoch(epoch)
        order += [int(w) for b in DataLoader(windows, batch_size=2, sampler=sampler) for w in b]
    return order


forgot = [epoch_order(4, call_set_epoch=False, epoch=e) for e in range(3)]
assert forgot[0] == forgot[1] == forgot[2]  # without set_epoch: the same order every epoch
called = [epoch_order(4, call_set_epoch=True, epoch=e) for e in range(3)]
assert called[0] != called[1] != called[2]
padded = epoch_order(4, call_set_epoch=True, epoch=0)
duplicates = sorted({w for w in padded if padded.count(w) > 1})
assert len(padded) == 12 and len(set(padded)) == 10 and len(duplicates) == 2  # 2 windows seen twice
dropped = epoch_order(4, call_set_epoch=True, epoch=0, drop_last=True)
assert len(dropped) == len(set(dropped)) == 8  # drop_last: no duplicate, 2 windows never seen
print("no set_epoch, epochs 0-2 :", forgot[0], "(identical)")
print("with set_epoch, epoch 1  :", called[1])
print(f"10 windows on 4 ranks    : {len(padded)} samples, windows {duplicates} twice; drop_last: {len(dropped)}")

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
# We start one engine per rank (`refimpl.launch`). Each `%%px` cell runs on every rank; each engine has
# `rank`, `world_size`, `device`, `dist` and `torch`, and an initialised process group (gloo on CPU).

# %%
ranks = start_ranks(WORLD_SIZE, timeout_s=120)
ranks

# %% [markdown]
# On every rank: a small GPT (2 layers, width 64, tied embeddings), the batches above, and a training
# loop that works with any wrapper. The single-device reference is simply the same loop with the plain
# model on the **whole** global batch; every rank computes it itself, so each can compare on its own.
#
# **How close is "equal"?** One device sums the batch inside its matmuls; the ranks sum their shards and
# then add across ranks: the same numbers in another order, so a gradient differs by a few ulps, and
# AdamW carries that through the steps. How large such a reordering is depends on the CPU's kernels
# (torch picks them by CPU: `ATEN_CPU_CAPABILITY`), so no fixed number is safe. We **measure** it in this
# run: one device trains the global batch in 1 micro-batch and again in $W$ micro-batches (each loss
# divided by $W$, gradients summed in `.grad`), a pure change of summation order. Their distance,
# relative to how far the parameters moved, $\|\theta_W - \theta_1\| / \|\theta_1 - \theta_0\|$, is the
# `spread`, and every non-bitwise comparison below allows `TOL = FACTOR x spread` with `FACTOR = 4`
# (data parallelism is such a reordering; at 4 ranks it lands at about 1.0 to 1.3 spreads). The
# gradients of the first step get the same treatment (`grad_spread`, relative to the gradient's norm):
# AdamW is nearly scale-invariant, so only the gradients show a gradient of the wrong scale.
#
# Where is the difference largest? Printed below: in the fused query/key/value **bias**, at an element
# whose first-step gradient is tiny next to the largest of its tensor. That is the *key* bias: softmax
# ignores a constant added to every key, so its true gradient is zero and what backward computes is
# rounding noise; AdamW divides by $\sqrt{v}$, the size of that same noise, and turns it into a full step
# of about `lr` whose sign depends on the summation order.
#
# At $W = 2$ we can say more: each rank's gradient divided by 2 (exact: a power of two) and one addition
# is *exactly* what one device computes with 2 micro-batches of loss / 2, so data parallelism equals the
# 2-micro-batch run **bit for bit**, and its distance to the 1-micro-batch run *is* the spread.

# %%
# %%px
import contextlib
import math

from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.comm.tracer import CommTracer
from refimpl.config import ModelConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.models import GPT, lm_loss
from refimpl.parallel.data_parallel import DataParallelBucket, DataParallelNaive, low_precision_hook

cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=32)
batches = ShardedBatches(prepare_corpus().tokens, seq_len=32, global_batch_size=8, seed=0)
STEPS, LR, FACTOR, MB = 5, 1e-3, 4, 2**20


def gpt():
    return GPT(cfg).to(device)  # every rank builds the same weights (seeded), on its own device


def train(model, wrapper, *, steps=STEPS, world=world_size, me=rank, accumulation=1, tracer=None, trap=None):
    """`steps` AdamW steps of `wrapper` (the model itself, or a data-parallel wrapper of it) on shard `me`."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=False)
    losses = []
    for step in range(steps):
        x_all, y_all = (t.to(device) for t in batches.batch(step, me, world))  # [B/W, s] each
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
            x_global, y_global = (t.to(device) for t in batches.batch(step, 0, 1))
            losses.append(lm_loss(model(x_global), y_global).item())
    return [p.detach().clone() for p in model.parameters()], losses


def moved(a, b, init):
    """||a - b|| / ||b - init||: the difference relative to how far the reference moved."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a, b, strict=True)).sqrt()
    return (num / sum(((y - z).double() ** 2).sum() for y, z in zip(b, init, strict=True)).sqrt()).item()


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def grad_error(grads, ref_grads):
    """||g - g_ref|| / ||g_ref|| over all gradients."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(grads, ref_grads, strict=True)).sqrt()
    return (num / sum((y.double() ** 2).sum() for y in ref_grads).sqrt()).item()


def single_grads(micro_batches):
    """One device's first-step gradient on the whole global batch, in `micro_batches` slices."""
    model = gpt()
    x_all, y_all = (t.to(device) for t in batches.batch(0, 0, 1))
    for x, y in zip(x_all.chunk(micro_batches), y_all.chunk(micro_batches), strict=True):
        (lm_loss(model(x), y) / micro_batches).backward()
    return [p.grad.clone() for p in model.parameters()]


names = [n for n, _ in GPT(cfg).named_parameters()]
init = [p.detach().clone() for p in gpt().parameters()]
single = gpt()
ref, ref_losses = train(single, single, world=1, me=0)  # one device, the whole global batch
single = gpt()
split, _ = train(single, single, world=1, me=0, accumulation=world_size)  # ... in W micro-batches
spread = moved(split, ref, init)
TOL = FACTOR * spread
ref_grads, split_grads = single_grads(1), single_grads(world_size)
grad_spread = grad_error(split_grads, ref_grads)
GRAD_TOL = FACTOR * grad_spread
assert spread > 0 and grad_spread > 0  # a zero yardstick would make every tolerance vacuous
largest = max(range(len(names)), key=lambda i: (split[i] - ref[i]).abs().max().item())
element = (split[largest] - ref[largest]).abs().argmax()
g_there = (ref_grads[largest].flatten()[element].abs() / ref_grads[largest].abs().max()).item()
if rank == 0:
    print(f"{sum(p.numel() for p in init):,d} parameters in {len(init)} tensors; single-device losses:",
          " ".join(f"{v:.3f}" for v in ref_losses))
    print(f"1 vs {world_size} micro-batches on one device: spread {spread:.2e} of the distance moved "
          f"-> TOL {TOL:.1e}; first-step gradients {grad_spread:.2e} -> GRAD_TOL {GRAD_TOL:.1e}")
    print(f"largest difference: {names[largest]} "
          f"({(split[largest] - ref[largest]).abs().max().item():.1e} in element {element.item()}, whose "
          f"first-step gradient is {g_there:.1e} of the tensor's largest)")

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
model = gpt()
with CommTracer() as tracer:
    naive, naive_losses = train(model, DataParallelNaive(model), tracer=tracer)
d = moved(naive, ref, init)
counts = [s["all_reduce"].count for s in tracer.per_step()]
assert counts == [len(init)] * STEPS, counts  # one all-reduce per parameter tensor per step
assert d <= TOL, (d, TOL)
if world_size == 2:
    assert same(naive, split)  # bit for bit one device with 2 micro-batches
if rank == 0:
    print(f"naive: {counts[0]} all-reduces per step; differs from one device by {d:.2e} of the distance "
          f"moved ({d / spread:.2f} spreads); bitwise = {world_size} micro-batches: {same(naive, split)}")

# the gradients of the first step, before any optimizer step
model = gpt()
dp_naive = DataParallelNaive(model)
x_all, y_all = (t.to(device) for t in batches.batch(0, rank, world_size))
lm_loss(dp_naive(x_all), y_all).backward()
dp_naive.finish_gradient_synchronization()
naive_grads = [p.grad.clone() for p in model.parameters()]
g_err = grad_error(naive_grads, ref_grads)
assert g_err <= GRAD_TOL, (g_err, GRAD_TOL)

# negative controls: a wrapper that never synchronises, and a sum without the division by W
model = gpt()
alone, _ = train(model, model)  # every rank on its own shard, no communication
d_alone = moved(alone, ref, init)
assert d_alone > 1000 * TOL, d_alone
g_sum = grad_error([world_size * g for g in naive_grads], ref_grads)  # what forgetting "/ W" hands AdamW
assert g_sum > 1000 * GRAD_TOL, g_sum
if rank == 0:
    print(f"first-step gradients: {g_err:.2e} from one device; summed without / W: {g_sum:.2f}")
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
model = gpt()
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
assert moved(bucketed, ref, init) <= TOL
if world_size == 2:  # a + b = b + a: the layout of the sum cannot change a bit
    assert same(bucketed, naive) and same(bucketed, split)
if rank == 0:
    print(f"per step: {per_step[0][0]} all-reduces, {per_step[0][1]:,d} bytes = all gradient bytes once")

# %% [markdown]
# **Against PyTorch.** `torch.nn.parallel.DistributedDataParallel` on the same model, shards and cap. At 2
# ranks each gradient is $(g_0 + g_1)/2$ in both, and adding two numbers is commutative, so the result is
# **bit for bit** the same although DDP lays out its buckets differently. At 4 ranks the ring adds
# four numbers in an order that depends on an element's position in its bucket, and the layouts differ:
# then the comparison is the measured tolerance of section 2 (set `WORLD_SIZE = 4` at the top).

# %%
# %%px
model = gpt()
device_ids = [device.index] if device.type == "cuda" else None
theirs, ddp_losses = train(model, DDP(model, device_ids=device_ids, bucket_cap_mb=CAP / MB))
same_bits = same(bucketed, theirs)
d_ddp = moved(bucketed, theirs, init)
if world_size == 2:
    assert same_bits
assert d_ddp <= TOL
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
model = gpt()
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
# **The overlap, timed.** A timeline says when each piece ran, not how much time the overlap saved. On two
# CPU cores over plain loopback it saves nothing measurable: the bytes are nearly free and gloo's copies
# compete with backward for the same cores. Behind a link shaped to 1 Gbit/s
# (`run_ranks(..., link="1gbit")`, `refimpl/launch/shaped_link.py`: the ranks in a private network
# namespace whose loopback is rate-limited) the link sets the pace, as between machines. The measurement
# is `refimpl.parallel.overlap.data_parallel_overlap`: 2 ranks, 4 layers of 1024 x 1024, one 4 MiB bucket
# each, the wrapper as built against the **serialized control**, the same wrapper with a comm hook that
# waits for each all-reduce inside the gradient hook; the two kinds of step alternate, median of 5. The
# control changes when the bytes move, not what they add up to: the gradients must be bitwise equal.
#
# Beside it, the planner's prediction (`refimpl.planner.step_time`, chapter 04 says more): the step as
# two streams, the backward's layers on one and each bucket's all-reduce on the link as soon as its layer
# is done, from the step's compute alone (timed in the same rounds) and the buckets' bytes; within 15% of
# both measurements, or the measurement is taken again. It also says which all-reduces it assumes hidden:
# never the first layer's, launched after the last backward.

# %%
from refimpl.parallel.overlap import data_parallel_overlap, time_overlap  # noqa: E402
from refimpl.planner.step_time import layer_stack_step, prediction_error  # noqa: E402
from refimpl.viz import plot_timed_overlap  # noqa: E402


def predicted(timed):
    return layer_stack_step("dp", layers=4, width=1024, compute_s=timed["compute"], rate_bits_per_s=1e9)


def within_15_percent(timed):
    error = prediction_error(predicted(timed), timed)
    return None if all(abs(e) <= 0.15 for e in error.values()) else f"the planner missed by {error}"


timed = time_overlap(data_parallel_overlap, accept=within_15_percent)  # bitwise equal, <= 0.9, predicted
if isinstance(timed, str):
    print(f"no shaped link on this machine ({timed}): the timing is skipped")
else:
    print(f"1 Gbit/s link: overlapped {timed['overlapped']:.2f} s, serialized {timed['serialized']:.2f} s "
          f"per step: {timed['ratio']:.2f} of it; gradients bitwise equal")
    plan = predicted(timed)
    print(f"planner: overlapped {plan['overlapped'].seconds:.2f} s, serialized {plan['serialized'].seconds:.2f} s "
          f"({', '.join(f'{k} {e:+.1%}' for k, e in prediction_error(plan, timed).items())}); assumed hidden: "
          f"{', '.join(plan['overlapped'].hidden) or 'none'}")
    assert "all-reduce 0" not in plan["overlapped"].hidden
    fig = plot_timed_overlap(timed, xlabel="seconds per step (median of 5, slowest rank)",
                             title="bucketed all-reduce vs its serialized control, 1 Gbit/s")

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
    model = gpt()
    dp = DataParallelBucket(model, bucket_cap_mb=CAP / MB)
    tracer = CommTracer()
    with tracer:
        x_all, y_all = (t.to(device) for t in batches.batch(0, rank, world_size))
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


acc_tol = FACTOR * grad_error(single_grads(2 * world_size), ref_grads)  # the reordering of 2W slices
wrong, _, _ = gradients_after_accumulation("no division")
right, n_right, n_buckets = gradients_after_accumulation(None)
late, n_late, _ = gradients_after_accumulation("no_sync around backward only")
assert grad_error(wrong, [2 * g for g in ref_grads]) <= acc_tol  # exactly twice the true gradient
assert grad_error(wrong, ref_grads) > 1000 * acc_tol
assert grad_error(right, ref_grads) <= acc_tol and grad_error(late, ref_grads) <= acc_tol
assert n_right == n_buckets and n_late == 2 * n_buckets
if rank == 0:
    print(f"no division:                  gradient = 2 x the true one (off by {grad_error(wrong, ref_grads):.2f})")
    print(f"no_sync around backward only: right gradient, but {n_late} all-reduces instead of {n_buckets}")
    print(f"right:                        off by {grad_error(right, ref_grads):.1e}, {n_right} all-reduces")

# %% [markdown]
# And the slip that breaks training: `no_sync()` around every forward, including the last. Nothing is
# ever synchronised, each rank follows its own shard, and after a few steps the replicas are different
# models. The right loop matches the single-device run on the same global batch.

# %%
# %%px
model = gpt()
drifted, _ = train(model, DataParallelBucket(model, bucket_cap_mb=CAP / MB), accumulation=2,
                   trap="no_sync around every forward")
model = gpt()
with CommTracer() as tracer:
    accumulated, _ = train(model, DataParallelBucket(model, bucket_cap_mb=CAP / MB), accumulation=2,
                           tracer=tracer)
single = gpt()
split_acc, _ = train(single, single, world=1, me=0, accumulation=2 * world_size)  # its own yardstick
acc_param_tol = FACTOR * moved(split_acc, ref, init)
assert moved(drifted, ref, init) > 1000 * acc_param_tol
assert moved(accumulated, ref, init) <= acc_param_tol
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
# bf16, which keeps 8 significant bits: a relative error of at most $2^{-8} \approx 0.4\%$ per rounding.
# The tracer shows the bytes halved; the printed losses show what the rounding costs here.

# %%
# %%px
model = gpt()
dp16 = DataParallelBucket(model, bucket_cap_mb=CAP / MB, comm_hook=low_precision_hook(torch.bfloat16))
with CommTracer() as tracer:
    low, low_losses = train(model, dp16, tracer=tracer)
bytes16 = [s["all_reduce"].nbytes for s in tracer.per_step()]
assert bytes16 == [dp16.grad_bytes // 2] * STEPS  # half the fp32 bytes, exactly
assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
rel_loss = max(abs(a - b) / b for a, b in zip(low_losses, bucketed_losses, strict=True))
assert not same(low, bucketed)  # the rounding is real ...
assert rel_loss > 0
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
# 3. `sync_bucket(tensors)`: average a list of tensors with one all-reduce;
# 4. `DataParallelBucket`: bucket all-reduces launched by gradient hooks while backward runs,
#    asynchronously, waited for in `finish_gradient_synchronization()` (a version that waits inside the
#    hook gets the right numbers and fails);
# 5. its `no_sync()`: accumulation without communication, decided by the forward.
#
# Going further: make `DataParallelBucket` keep `.grad` as *views* into the bucket buffers (DDP's
# `gradient_as_bucket_view=True`) and measure the memory it saves.

# %%
ranks.stop()

# %% [markdown]
# ## Questions
#
# 1. At 2 ranks data parallelism equals one device with 2 micro-batches bit for bit, at 4 ranks it does
#    not equal one device with 4 micro-batches. Which additions happen in a different order, and could a
#    different all-reduce algorithm make 4 ranks bitwise too?
# 2. A bug sums the gradients without dividing by $W$. Why does the loss curve of an AdamW run with
#    gradient clipping barely change, and which check in this chapter catches it at once?
# 3. Section 6 sends bf16 but keeps the gradients in fp32. Why is a *reduce-scatter* in bf16 (each rank
#    receiving the bf16 sum of its shard) not enough to get fp32 accuracy, and what would you have to
#    change in the collective itself?
# 4. `DistributedSampler` pads 10 windows on 4 ranks to 12. What does that do to a validation loss
#    averaged over the ranks, and how would you compute an exact one without dropping samples?
# 5. Our wrapper, like DDP, decides in `forward` whether the coming backward synchronises. What would
#    a wrapper that decides in its gradient hooks get wrong, given that `backward()` is often called
#    outside the `with` block, and what must be ready before the first hook fires?
