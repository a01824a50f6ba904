# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Collective communication: who holds what, the ring, and what it costs
#
# Every parallel technique in this course is a way of splitting work plus a handful of **collectives**,
# the operations in which a whole group of ranks exchanges data at once:
#
# | collective | what every rank ends with | used by |
# |---|---|---|
# | send / recv | (one rank gets another's tensor) | pipeline parallelism (activations between stages) |
# | broadcast | the root's tensor | the same initial weights everywhere |
# | reduce | (the root gets the sum) | metrics on rank 0 |
# | **all-reduce** | the sum of all tensors | data parallelism: gradients, every step |
# | **reduce-scatter** | one chunk of the sum | ZeRO / FSDP: gradient shards; sequence parallelism |
# | **all-gather** | the concatenation of all chunks | ZeRO-3 / FSDP: parameters before use; tensor parallelism |
# | all-to-all | chunk *r* of everybody's tensor | mixture of experts, Ulysses sequence parallelism |
#
# This chapter (1) runs each of them on 4 ranks and draws who holds what before and after; (2) builds the
# all-reduce that NCCL uses, the **ring**, from nothing but `isend`/`irecv`, and proves it equal to
# `torch.distributed.all_reduce`; (3) proves with a **tracer** that each rank sends exactly
# $2\frac{n-1}{n}S$ bytes; and (4) measures latency and bandwidth on this machine and fits the
# **alpha-beta** cost model that later chapters use to reason about time.
#
# Everything here lives in `refimpl.comm`: `ops` (the traced calls), `tracer`, `ring`, `cost_model`,
# `pictures`.

# %%
import inspect

import torch

from refimpl.comm import ring
from refimpl.comm.cost_model import fit_alpha_beta, plot_alpha_beta
from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
from refimpl.notebook import start_ranks

WORLD_SIZE = 4
ranks = start_ranks(WORLD_SIZE, timeout_s=60)
ranks

# %% [markdown]
# ## 1. The collectives, one by one
#
# Rank $r$ starts with the values $10(r+1) + j$, so every value says where it came from (10, 11, ... are
# rank 0's, 40, 41, ... rank 3's) and the picture can colour each cell by the rank it came from. A grey
# cell marked Σ holds a value that is no single rank's: a sum. Each rank records `(before, after)` per
# collective in `pictures`; the notebook gathers them and draws. Every call goes through
# `refimpl.comm.ops`, the thin layer over `torch.distributed` that the tracer of section 3 watches.

# %%
# %%px
from refimpl.comm import CommTracer, cost_model, ops
from refimpl.comm.ring import (
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_bytes_sent,
    ring_reduce_scatter,
)

n = world_size


def mine(length=4):
    """Rank r's input: 10(r+1) + j, j = 0..length-1 (float32 on this rank's device)."""
    return torch.arange(length, dtype=torch.float32, device=device) + 10 * (rank + 1)


def keep(name, before, after):
    """Remember what this rank held before and after (None: nothing that matters), on the CPU."""
    pictures[name] = tuple(None if t is None else t.detach().cpu() for t in (before, after))


pictures = {}
total = sum(torch.arange(4.0) + 10 * (r + 1) for r in range(n)).to(device)  # what an all-reduce must give

# %% [markdown]
# **Point to point.** Rank 0 sends its tensor, rank 1 receives it into a buffer of the same shape. Both
# calls block until the transfer is done; `isend`/`irecv` are the non-blocking versions that return a
# handle to `wait()` on.

# %%
# %%px
x = mine() if rank == 0 else torch.zeros(4, device=device)
before = x.clone() if rank == 0 else None
if rank == 0:
    ops.send(x, dst=1)
elif rank == 1:
    ops.recv(x, src=0)
    assert torch.equal(x, torch.arange(4.0, device=device) + 10)
keep("send 0 → recv 1", before, x if rank in (0, 1) else None)

# %% [markdown]
# **Broadcast** (root 0) and **reduce** (root 0, sum): one to all, and all to one. After a reduce only the
# root's tensor is defined (the others may hold partial sums), so the picture shows only the root.

# %%
# %%px
x = mine()
before = x.clone()
ops.broadcast(x, src=0)
assert torch.equal(x, torch.arange(4.0, device=device) + 10)
keep("broadcast from 0", before, x)

x = mine()
before = x.clone()
ops.reduce(x, dst=0)
if rank == 0:
    assert torch.equal(x, total)
keep("reduce to 0 (sum)", before, x if rank == 0 else None)

# %% [markdown]
# **All-reduce** leaves the sum on every rank. **Reduce-scatter** leaves rank $r$ with chunk $r$ of the sum
# (here 8 values, 2 per rank), and **all-gather** is its mirror: every rank contributes a chunk and
# every rank ends with all of them. All-reduce = reduce-scatter followed by all-gather, which is exactly
# how the ring will do it. **All-to-all** sends chunk $j$ of rank $i$ to rank $j$: a transpose across ranks.

# %%
# %%px
x = mine()
before = x.clone()
ops.all_reduce(x)
assert torch.equal(x, total)
keep("all-reduce (sum)", before, x)

x = mine(8)
out = torch.empty(2, device=device)
ops.reduce_scatter_tensor(out, x)
everything = sum(torch.arange(8.0) + 10 * (r + 1) for r in range(n)).to(device)
assert torch.equal(out, everything[2 * rank: 2 * rank + 2])
keep("reduce-scatter (sum)", x, out)

shard = mine(2)
full = torch.empty(2 * n, device=device)
ops.all_gather_into_tensor(full, shard)
assert torch.equal(full, torch.cat([torch.arange(2.0) + 10 * (r + 1) for r in range(n)]).to(device))
keep("all-gather", shard, full)

x = mine()
out = torch.empty(4, device=device)
ops.all_to_all_single(out, x)
assert torch.equal(out, torch.tensor([10.0 * (r + 1) + rank for r in range(n)], device=device))
keep("all-to-all", x, out)

# %% [markdown]
# The notebook gathers every rank's record (`ranks.run` evaluates the lambda on each engine, where
# `pictures` lives) and draws them: each row of cells is one rank.

# %%
per_rank = ranks.run(lambda: pictures)
names = ["send 0 → recv 1", "broadcast from 0", "reduce to 0 (sum)", "all-reduce (sum)", "reduce-scatter (sum)",
         "all-gather", "all-to-all"]
fig = plot_who_holds_what({k: ([p[k][0] for p in per_rank], [p[k][1] for p in per_rank]) for k in names})

# %% [markdown]
# ## 2. The ring all-reduce, from `isend` and `irecv`
#
# The obvious all-reduce sends everything to rank 0, which sums and sends the result back. Rank 0 then
# sends (and receives) $(n-1)S$ bytes for an $S$-byte tensor, and everybody waits on its one link: the
# cost grows with the number of ranks. That is `ring.naive_all_reduce`, kept as the foil.
#
# The **ring** (Patarasuk & Yuan 2009; Baidu's "ring-allreduce", 2017; what NCCL does on large tensors)
# keeps every link busy with an equal share. Put the ranks on a ring, rank $r$ sending to $r+1$ and
# receiving from $r-1$, and cut the tensor into $n$ chunks.
#
# * **Reduce-scatter, $n-1$ steps.** At step $s$ rank $r$ sends its running sum of chunk $(r-s-1) \bmod n$
#   and receives chunk $(r-s-2) \bmod n$, to which it adds its own values. Each chunk travels once round
#   the ring collecting one contribution per hop; after $n-1$ steps rank $r$ holds chunk $r$ of the sum.
# * **All-gather, $n-1$ steps.** The finished chunks travel round the ring once more, copied, not added.
#
# Per rank and per step one chunk of $S/n$ bytes goes out: $2(n-1)$ steps, so
# $$\text{bytes sent per rank} = 2\,\frac{n-1}{n}\,S,$$
# less than $2S$ however many ranks there are. Lengths that $n$ does not divide are cut by
# `torch.tensor_split` into chunks of $\lceil S/n\rceil$ and $\lfloor S/n\rfloor$ elements (some empty when
# $S < n$). Here are the two loops, the whole algorithm:

# %%
print(inspect.getsource(ring._ring_reduce_scatter_))
print(inspect.getsource(ring._ring_all_gather_))

# %% [markdown]
# The two phases on the same inputs as above: after the reduce-scatter rank $r$ holds one fully summed
# chunk (Σ), after the all-gather every rank holds all of them.

# %%
# %%px
x = mine()
shard = ring_reduce_scatter(x)
full = ring_all_gather(shard, x.numel())
assert torch.equal(full, total)
keep("ring reduce-scatter", x, shard)
keep("ring all-gather", shard, full)

# %%
per_rank = ranks.run(lambda: pictures)
fig = plot_who_holds_what({k: ([p[k][0] for p in per_rank], [p[k][1] for p in per_rank])
                           for k in ("ring reduce-scatter", "ring all-gather")})

# %% [markdown]
# ### Proof: equal to `torch.distributed.all_reduce`
#
# On **integer-valued** data (floats that hold integers, far below $2^{24}$) every partial sum is exact, so
# the order of the additions cannot matter: the ring must equal `dist.all_reduce` **bit for bit**.
#
# On **arbitrary floats** it need not: each chunk of the ring is summed in ring order starting at a
# different rank, and gloo or NCCL add in their own orders; floating-point addition is not associative.
# How far apart may they be? Summing $n$ numbers in float32, in any order, has an error of at most
# $\gamma_{n-1} \sum_i |x_i|$ with $\gamma_k = \frac{k u}{1 - k u} \approx k u$ and $u = 2^{-24}$ the unit
# roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 4). So we check both results
# against the exact sum (float64, exact for 4 float32 inputs of similar size) with that bound, per element.
# The tolerance comes from the arithmetic, not from what happened to pass. We try lengths that 4 does not
# divide, including 1 and 3 (some ranks then own empty chunks).

# %%
# %%px
unit_roundoff = torch.finfo(torch.float32).eps / 2
g = torch.Generator().manual_seed(1234 + rank)
for S in (1, 3, 5, 64, 1001, 4096):
    ints = torch.randint(-1000, 1000, (S,), generator=g).float().to(device)
    ours, theirs = ints.clone(), ints.clone()
    ring_all_reduce(ours)
    dist.all_reduce(theirs)
    assert torch.equal(ours, theirs), f"S={S}: integer data must agree bit for bit"

    floats = torch.randn(S, generator=g).to(device)
    ours, theirs = floats.clone(), floats.clone()
    ring_all_reduce(ours)
    dist.all_reduce(theirs)
    exact, magnitude = floats.double(), floats.double().abs()
    dist.all_reduce(exact)
    dist.all_reduce(magnitude)
    gamma = (n - 1) * unit_roundoff / (1 - (n - 1) * unit_roundoff)
    bound = gamma * magnitude
    assert ((ours.double() - exact).abs() <= bound).all(), f"S={S}: ring outside the rounding bound"
    assert ((theirs.double() - exact).abs() <= bound).all(), f"S={S}: dist outside the rounding bound"

    if rank == 0:
        print(f"S={S:5d}: ints bit-equal; floats: {(ours != theirs).sum().item():4d} of {S} elements differ "
              f"in the last bits, max |ring - dist| = {(ours - theirs).abs().max().item():.1e}")

# %% [markdown]
# And the two halves on their own: the ring reduce-scatter gives chunk $r$ of `dist.all_reduce`'s
# result, the ring all-gather reassembles it, and when $n$ divides $S$ they equal PyTorch's
# `reduce_scatter_tensor` and `all_gather_into_tensor`.

# %%
# %%px
for S in (1, 3, 5, 1001, 4096):
    ints = torch.randint(-1000, 1000, (S,), generator=g).float().to(device)
    reference = ints.clone()
    dist.all_reduce(reference)
    shard = ring_reduce_scatter(ints)
    assert shard.numel() == chunk_sizes(S, n)[rank]
    assert torch.equal(shard, torch.tensor_split(reference, n)[rank])
    assert torch.equal(ring_all_gather(shard, S), reference)
    if S % n == 0:
        theirs = torch.empty(S // n, device=device)
        dist.reduce_scatter_tensor(theirs, ints)
        assert torch.equal(shard, theirs)
        gathered = torch.empty(S, device=device)
        dist.all_gather_into_tensor(gathered, shard)
        assert torch.equal(ring_all_gather(shard, S), gathered)

# %% [markdown]
# ## 3. The tracer proves the traffic
#
# `refimpl.comm.CommTracer` is a context manager that records every call made through `refimpl.comm.ops`:
# the op, its bytes, the group size, the peer, start and end times (an async op's end is stamped when its
# handle is waited) and the step. `tracer.step()` closes a step, and `tracer.per_step()` gives the totals
# per step. For point-to-point calls the bytes sent are exact, so the tracer measures what the ring
# actually sends. Step 0: a tensor that 4 divides ($S$ = 4096 float32 = 16 KiB); step 1: one it does not
# (1001 elements), where the exact count is $(S - c_r) + (S - c_{r+1})$ elements with $c_i$ the chunk sizes.
# For comparison the tracer also records `dist.all_reduce` through `ops`, for which it books the ring's
# cost model, and the naive all-reduce through rank 0.

# %%
# %%px
with CommTracer() as tracer:
    x = torch.ones(4096, device=device)
    ring_all_reduce(x)
    tracer.step()
    y = torch.ones(1001, device=device)
    ring_all_reduce(y)
ring_events = list(tracer.events)

S0, S1 = x.numel() * 4, y.numel() * 4
steps = tracer.per_step()
assert len(steps) == 2
assert steps[0]["isend"].count == 2 * (n - 1) and steps[0]["irecv"].count == 2 * (n - 1)
assert tracer.bytes_sent(step=0) == 2 * (n - 1) / n * S0           # the formula, exactly
assert tracer.bytes_sent(step=1) == ring_bytes_sent(1001, n, rank, 4)  # uneven chunks, exactly
assert all(e.end is not None and e.end >= e.start for e in tracer.events)

with CommTracer() as nccl_model:
    ops.all_reduce(torch.ones(4096, device=device))
assert nccl_model.bytes_sent() == tracer.bytes_sent(step=0)          # what NCCL's ring sends

with CommTracer() as naive:
    naive_all_reduce(torch.ones(4096, device=device))
traffic = (tracer.bytes_sent(step=0), tracer.bytes_sent(step=1), naive.bytes_sent())

# %%
traffic = ranks.run(lambda: traffic)
S0, S1, n = 4096 * 4, 1001 * 4, WORLD_SIZE
print(f"formula 2(n-1)/n S = {2 * (n - 1) / n * S0:.0f} bytes for S = {S0} bytes\n")
print("rank | ring, S = 16384 B | ring, S = 4004 B | naive (through rank 0), S = 16384 B")
for r, (a, b, c) in enumerate(traffic):
    print(f"{r:4d} | {a:17.0f} | {b:16.0f} | {c:.0f}")
assert traffic[0][2] == (n - 1) * S0      # rank 0 of the naive all-reduce sends (n-1) S: grows with n
assert all(a == 2 * (n - 1) / n * S0 for a, _, _ in traffic)

# %% [markdown]
# The ring spreads the work: every rank sends $1.5\,S$ here, where the naive version makes rank 0 send
# $3S$ (and $(n-1)S$ on $n$ ranks, e.g. $7S$ on 8). The timeline of the traced sends shows the
# $2(n-1) = 6$ steps of the ring on each rank, the first 3 of the reduce-scatter, then 3 of the
# all-gather, each waiting on the neighbour's previous step.

# %%
events = ranks.run(lambda: [e for e in ring_events if e.step == 0])
fig = plot_timeline(events, ops=["isend", "irecv"], title="ring all-reduce of 16 KiB on 4 ranks: traced p2p")

# %% [markdown]
# ## 4. What it costs: latency, bandwidth and the alpha-beta model
#
# The simplest model that explains communication time prices a message of $S$ bytes at
# $$T(S) = \alpha + \frac{S}{\beta},$$
# a fixed latency $\alpha$ plus the bytes over a bandwidth $\beta$. Small messages pay $\alpha$, large ones
# $S/\beta$; they cost the same at $S = \alpha\beta$. The ring all-reduce takes $2(n-1)$ steps of $S/n$
# bytes, so
# $$T_\text{ring}(S) = 2(n-1)\,\alpha + 2\,\frac{n-1}{n}\,\frac{S}{\beta}:$$
# its bandwidth term is optimal, but its latency term grows with $n$ (which is why libraries switch to
# trees for small messages, and why gradients are sent in large buckets, chapter 03).
#
# We measure a **ping-pong** between ranks 0 and 1 (one-way time = half the round trip) from 4 bytes to
# 4 MiB, then `dist.all_reduce` and our ring on all 4 ranks. Each size is warmed up, repeated, and the
# median kept. Then we fit $\alpha$ and $\beta$ by least squares on the relative error (so that small and
# large messages count alike). **These numbers describe this machine only**: 4 ranks sharing a few
# CPU cores pay the operating system's scheduling in every step, so the 4-rank collectives look far
# slower than the p2p model predicts. On a GPU box the same cell measures NVLink or the network.

# %%
# %%px
p2p = cost_model.measure_p2p(repeats=3, warmup=1, device=device)
torch_ar = cost_model.measure_collective(ops.all_reduce, name="dist.all_reduce", repeats=3, warmup=1,
                                         device=device)
ring_ar = cost_model.measure_collective(ring_all_reduce, name="ring_all_reduce", repeats=3, warmup=1,
                                        device=device)

# %%
p2p, torch_ar, ring_ar = ranks.run(lambda: (p2p, torch_ar, ring_ar))[0]
fits = [fit_alpha_beta(t.sizes_bytes, t.seconds) for t in (p2p, torch_ar, ring_ar)]
for t, f in zip((p2p, torch_ar, ring_ar), fits, strict=True):
    print(f"{t.op:16s} alpha = {f.alpha_s * 1e6:9.1f} us   beta = {f.beta_bytes_per_s / 1e9:6.2f} GB/s   "
          f"R^2 (log T) = {f.r2:.3f}   alpha*beta = {f.half_bandwidth_bytes / 1024:.0f} KiB")
link = fits[0]
assert link.alpha_s > 0 and link.beta_bytes_per_s > 0, "a sane fit has positive latency and bandwidth"
fig = plot_alpha_beta(
    [p2p, torch_ar, ring_ar], fits=fits,
    models={f"ring predicted from p2p fit: 2(n-1)α + 2(n-1)/n S/β, n={WORLD_SIZE}":
            lambda s: link.ring_all_reduce(s, WORLD_SIZE)})

# %% [markdown]
# Read the plot from left to right: at small sizes every curve is flat (latency-bound; our Python ring
# pays its $2(n-1)$ steps of latency), at large sizes it turns into a slope of 1 (bandwidth-bound). The
# fitted $\alpha\beta$ is the size where the turn happens: below it, sending fewer and larger messages is
# what pays.
#
# Do not expect the ring to win on time here. Its advantage is that every rank's link carries an equal,
# bounded share at the same time; on one CPU box all the "links" are the same few cores copying through
# the same memory, so there is nothing to spread the load over, and each of the ring's $2(n-1)$ Python-level
# steps waits for the operating system to schedule a neighbour. (`bench/bench_collectives.py` measures the
# ring, the naive all-reduce and `dist.all_reduce` side by side.) Where links are independent (NVLink,
# InfiniBand), the bytes per rank are what the time follows, and those we proved above.

# %%
ranks.stop()

# %% [markdown]
# ## What to take away
#
# * Seven collectives cover all of distributed training. All-reduce = reduce-scatter + all-gather.
# * The ring all-reduce sends $2\frac{n-1}{n}S$ bytes per rank, whatever $n$, in $2(n-1)$ steps; the naive
#   all-reduce through one rank makes it send $(n-1)S$. We proved the ring equal to `dist.all_reduce`
#   (bit for bit on integers, within the rounding bound $\gamma_{n-1}\sum|x_i|$ on floats) and its traffic equal
#   to the formula, with the tracer, for lengths the world size does not divide.
# * $T(S) = \alpha + S/\beta$ explains most of the measured times; later chapters use it and the tracer
#   to predict and to check their communication.
#
# ## Exercise
#
# Open `exercises/02_collectives.py` and implement `ring_reduce_scatter`, `ring_all_gather` and
# `ring_all_reduce` with nothing but `isend`/`irecv` (the file gives you both). Grade your work with
#
# ```
# make grade CH=02
# ```
#
# which runs your functions on 2 and 3 ranks, on lengths that do not divide by the world size, against
# `torch.distributed`.
