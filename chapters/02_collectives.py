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
# all-reduce that NCCL uses on large tensors, the **ring**, from nothing but `isend`/`irecv`, and proves it
# equal to `torch.distributed.all_reduce`; (3) **measures** with a tracer the bytes our ring hands to
# `isend` and compares them with the ring's formula, $2\frac{n-1}{n}S$ per rank, and says what the tracer
# can only *model* (what a `torch.distributed` collective puts on the wire); and (4) measures latency and
# bandwidth on this machine, fits the **alpha-beta** cost model that later chapters use to reason about
# time, and reports with $R^2$ how much of the measured times the model explains.
#
# Everything here lives in `refimpl.comm`: `ops` (the traced calls), `tracer`, `ring`, `pictures`; the timing
# in `refimpl.measure.collective_timing`, the alpha-beta model in `refimpl.planner.time_model`.

# %%
import torch

from refimpl.comm.pictures import plot_timeline, plot_who_holds_what
from refimpl.launch import start_ranks
from refimpl.planner import fit_alpha_beta
from refimpl.viz import plot_alpha_beta

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
from refimpl.comm import CommTracer, ops
from refimpl.comm.ring import (
    chunk_sizes,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
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
# * **Reduce-scatter, $n-1$ steps.** At every step each rank sends one chunk to its right neighbour and
#   receives one from its left, adds its own values of that chunk to it, and passes the result on at the
#   next step. A partial sum thus travels once round the ring, collecting one contribution per hop; after
#   $n-1$ hops it holds all $n$ and stays on the rank that added last. Which chunk a rank must send first
#   so that rank $r$ ends with chunk $r$ (the layout of `reduce_scatter_tensor`) is for you to work out
#   in exercise 02.1.
# * **All-gather, $n-1$ steps.** The finished chunks travel round the ring once more, copied, not added.
#
# Per rank and per step one chunk of $S/n$ bytes goes out: $2(n-1)$ steps, so
# $$\text{bytes sent per rank} = 2\,\frac{n-1}{n}\,S,$$
# less than $2S$ however many ranks there are. Lengths that $n$ does not divide are cut by
# `torch.tensor_split` into chunks of $\lceil S/n\rceil$ and $\lfloor S/n\rfloor$ elements (some empty when
# $S < n$); a rank then sends every chunk but one per phase, which differs from $\frac{n-1}{n}S$ by less
# than one element, while the sum over the ranks stays exactly $(n-1)S$ per phase.
#
# The code is `refimpl.comm.ring` (the exercise asks you to write it yourself first, so it is not shown
# here). The two phases on the same inputs as above: after the reduce-scatter rank $r$ holds one fully summed
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
        ops.reduce_scatter_tensor(theirs, ints)   # torch's own (ops: the same call, under its current name)
        assert torch.equal(shard, theirs)
        gathered = torch.empty(S, device=device)
        ops.all_gather_into_tensor(gathered, shard)
        assert torch.equal(ring_all_gather(shard, S), gathered)

# %% [markdown]
# ## 3. What the tracer measures, and what it only models
#
# `refimpl.comm.CommTracer` is a context manager that records every call made through `refimpl.comm.ops`:
# the op, its payload, the bytes this rank sends, the group size, the peer, start and end times (an async
# op's end is stamped when its handle is waited) and the step. `tracer.step()` closes a step, and
# `tracer.per_step()` gives the totals per step. Two kinds of numbers, and the difference matters:
#
# * **measured**: the payload of every call (`nbytes`, the size of the tensors handed to it), and the bytes
#   of every point-to-point call (a `send`/`isend` puts exactly its tensor on the wire, a receive nothing);
#   `tracer.measured_bytes_sent()` sums what this rank handed to `send`/`isend`;
# * **modelled**: what a `torch.distributed` collective sends. The backend does not say, so the tracer
#   books the ring's formula for it (`event.measured` is `False`, `tracer.modelled_bytes_sent()`).
#
# Our ring is made of `isend`/`irecv`, so its traffic is **measured**, chunk by chunk, from the tensors it
# sends, and can be held against the formula: $2\frac{n-1}{n}S$ per rank for the all-reduce,
# $\frac{n-1}{n}S$ for the reduce-scatter and for the all-gather. We try a length that 4 divides
# (4096 float32 = 16 KiB) and three it does not: 1001, 6 and 3 elements ($3 < n$: one rank owns an empty
# chunk). For those the formula is not an integer number of elements; each rank sends every chunk but one
# per phase, so it is off by less than one element per phase, and the ranks together send exactly
# $n$ times the formula. Each (op, length) is one traced step.

# %%
# %%px
LENGTHS = (4096, 1001, 6, 3)
PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # formula: PHASES[op] (n-1)/n S
runs = []                                                          # (op, numel) per traced step
with CommTracer() as tracer:
    for numel in LENGTHS:
        x = torch.ones(numel, device=device)
        ring_all_reduce(x)
        runs.append(("all_reduce", numel))
        tracer.step()
        shard = ring_reduce_scatter(x)
        runs.append(("reduce_scatter", numel))
        tracer.step()
        ring_all_gather(shard, numel)
        runs.append(("all_gather", numel))
        tracer.step()
ring_events = tracer.select(step=0)  # the all-reduce of 16 KiB, for the timeline below

measured = []
for step, (op, _) in enumerate(runs):
    totals = tracer.summary(step=step)
    assert set(totals) == {"isend", "irecv"}, totals              # only point-to-point: nothing modelled
    assert totals["isend"].count == PHASES[op] * (n - 1)          # one send per step of each phase
    measured.append(tracer.measured_bytes_sent(step=step))      # bytes of the tensors handed to isend
assert all(e.end is not None and e.end >= e.start for e in tracer.events)

with CommTracer() as naive:
    naive_all_reduce(torch.ones(4096, device=device))
naive_sent = naive.measured_bytes_sent()

# %% [markdown]
# The notebook collects every rank's measurement and holds it against the formula $f\,\frac{n-1}{n}S$
# ($f$ = 2 phases for the all-reduce, 1 for the others, $S$ in bytes): equal on every rank when 4 divides
# the length, within one element per phase otherwise, and the sum over the ranks equal to $n$ times the
# formula, exactly, in every case.

# %%
per_rank = ranks.run(lambda: (runs, measured, naive_sent))
runs = per_rank[0][0]
n, PHASES = WORLD_SIZE, {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
print(f"{'op':14s} {'S (bytes)':>9s} | {'f(n-1)/n S':>10s} | measured per rank (bytes) | sum over ranks")
for i, (op, numel) in enumerate(runs):
    f, S = PHASES[op], numel * 4
    sent = [m[i] for _, m, _ in per_rank]
    print(f"{op:14s} {S:9d} | {f * (n - 1) / n * S:10.1f} | {str(sent):25s} | {sum(sent)} = {n} x formula")
    # in integers, times n: exact comparisons
    assert sum(sent) == f * (n - 1) * S, (op, numel, sent)                           # all ranks together
    assert all(abs(n * b - f * (n - 1) * S) < n * f * 4 for b in sent), (op, numel, sent)  # < 1 element/phase
    if numel % n == 0:
        assert all(n * b == f * (n - 1) * S for b in sent), (op, numel, sent)        # every rank, exactly

naive_sent, S = [s for _, _, s in per_rank], 4096 * 4
print(f"\nnaive all-reduce through rank 0, S = {S} B: measured per rank {naive_sent}, sum {sum(naive_sent)}")
assert naive_sent[0] == (n - 1) * S                                  # rank 0 sends (n-1) S, the others S
assert sum(naive_sent) == 2 * (n - 1) * S                            # the same total as the ring ...
assert not all(n * b == 2 * (n - 1) * S for b in naive_sent)         # ... but the per-rank check fails

# %% [markdown]
# The ring spreads the work: every rank sends $1.5\,S$ here, where the naive version makes rank 0 send
# $3S$ (and $(n-1)S$ on $n$ ranks, e.g. $7S$ on 8) and the others $S$. Both send $2(n-1)S$ in total; what
# the ring buys is the balance, and the per-rank check is the one that tells them apart (it fails for the
# naive all-reduce, so it can fail).
#
# **What the tracer can not measure.** For `dist.all_reduce` the tracer sees one call and its payload;
# what gloo (or NCCL) then sends happens inside the backend. It books the ring model for it, and says so:

# %%
# %%px
with CommTracer() as dist_trace:
    ops.all_reduce(torch.ones(4096, device=device))
(event,) = dist_trace.events
assert event.op == "all_reduce" and event.nbytes == 4096 * 4     # measured: which collective, which payload
assert not event.measured and dist_trace.measured_bytes_sent() == 0  # no byte on the wire was seen
modelled = dist_trace.modelled_bytes_sent()
if rank == 0:
    print(f"dist.all_reduce of {event.nbytes} B: the tracer books {modelled:.0f} B sent per rank, "
          f"the ring model 2(n-1)/n S, not a measurement")

# %% [markdown]
# That number is what NCCL's ring would send on a large tensor, a model: NCCL switches to trees for small
# messages, and gloo, the backend running here, picks its own algorithms (its reduce-scatter is built from
# an all-reduce). When chapters 03-05 compare traced bytes of `torch.distributed` collectives with their
# formulas, what is really checked is *which* collectives ran with *which* payloads; the wire bytes are
# the model's. Only our own point-to-point rings give measured wire bytes, as above.
#
# The timeline of the traced sends of the 16 KiB ring all-reduce shows its $2(n-1) = 6$ steps on each
# rank, the first 3 of the reduce-scatter, then 3 of the all-gather, each waiting on the neighbour's
# previous step.

# %%
events = ranks.run(lambda: ring_events)
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
# large messages count alike), and ask how much the fit explains: $R^2$, computed on $\log T$ (what the
# log-log plot shows),
# $$R^2 = 1 - \frac{\sum_S (\log T_S - \log \hat T_S)^2}{\sum_S (\log T_S - \overline{\log T})^2},$$
# the share of the spread of the measured times over the sizes that the line $\hat T = \alpha + S/\beta$
# accounts for: 1 when every point lies on it, 0 when it does no better than one constant time for all
# sizes, negative when it does worse. **These numbers describe this machine only**; on a GPU box the same
# cell measures NVLink or the network.

# %%
# %%px
from refimpl.measure import collective_timing

p2p = collective_timing.measure_p2p(repeats=9, warmup=2, device=device)
torch_ar = collective_timing.measure_collective(ops.all_reduce, name="dist.all_reduce", repeats=5, warmup=2,
                                                device=device)
ring_ar = collective_timing.measure_collective(ring_all_reduce, name="ring_all_reduce", repeats=5, warmup=2,
                                               device=device)

# %%
p2p, torch_ar, ring_ar = ranks.run(lambda: (p2p, torch_ar, ring_ar))[0]
fits = [fit_alpha_beta(t.sizes_bytes, t.seconds) for t in (p2p, torch_ar, ring_ar)]


def verdict(r2: float) -> str:
    """What an R^2 says about alpha + S/beta (the thresholds are a reading convention, not a test)."""
    if r2 >= 0.9:
        return "explains these times well: alpha and beta mean what they say"
    if r2 >= 0.5:
        return "explains part of the spread: read alpha and beta as rough"
    return "says little about these times: something else sets them, alpha and beta describe nothing"


for t, f in zip((p2p, torch_ar, ring_ar), fits, strict=True):
    print(f"{t.op:16s} alpha = {f.alpha_s * 1e6:9.1f} us   beta = {f.beta_bytes_per_s / 1e9:6.2f} GB/s   "
          f"alpha*beta = {f.half_bandwidth_bytes / 1024:7.0f} KiB   R^2 (log T) = {f.r2:6.3f}")
    print(f"{'':16s} measured {', '.join(f'{s * 1e6:.0f}' for s in t.seconds)} us; the model {verdict(f.r2)}")
link = fits[0]
fig = plot_alpha_beta(
    [p2p, torch_ar, ring_ar], fits=fits,
    models={f"ring predicted from p2p fit: 2(n-1)α + 2(n-1)/n S/β, n={WORLD_SIZE}":
            lambda s: link.ring_all_reduce(s, WORLD_SIZE)})

# %% [markdown]
# **What $R^2$ says here.** Where the model holds, the plot reads from left to right: flat at small sizes
# (latency-bound; our Python ring pays its $2(n-1)$ steps of latency), then a slope of 1 (bandwidth-bound),
# the turn at $S = \alpha\beta$: below it, sending fewer and larger messages is what pays. Whether it holds
# is what the $R^2$ printed above says, run by run. Two ranks exchanging messages while the others wait
# come closest to a machine of their own, and point-to-point is where the line can fit. The 4-rank
# collectives on a CPU with fewer cores than ranks (plus the notebook, plus whatever else runs) spend their
# time waiting for the operating system to schedule a neighbour; their times then follow the scheduler,
# not the message size, and a low $R^2$ says exactly that: the fitted $\alpha$ and $\beta$ of such a fit
# describe nothing, and the model is not refuted by it, only not tested. A plain least-squares fit would
# report some $\alpha$ and $\beta$ all the same; $R^2$ is what keeps us from reading them. (The prediction
# of the ring from the point-to-point fit, dashed, is only as good as that fit's $R^2$.)
#
# Do not expect the ring to win on time here. Its advantage is that every rank's link carries an equal,
# bounded share at the same time; on one CPU box all the "links" are the same few cores copying through
# the same memory, so there is nothing to spread the load over, and each of the ring's $2(n-1)$ Python-level
# steps waits for the operating system to schedule a neighbour. (`bench/bench_collectives.py` measures the
# ring, the naive all-reduce and `dist.all_reduce` side by side.) Where links are independent (NVLink,
# InfiniBand), the bytes per rank are what the time follows, and those we measured above.

# %%
ranks.stop()

# %% [markdown]
# ## What to take away
#
# * Seven collectives cover all of distributed training. All-reduce = reduce-scatter + all-gather.
# * The ring all-reduce sends $2\frac{n-1}{n}S$ bytes per rank, whatever $n$, in $2(n-1)$ steps; the naive
#   all-reduce through one rank makes it send $(n-1)S$. We proved the ring equal to `dist.all_reduce`
#   (bit for bit on integers, within the rounding bound $\gamma_{n-1}\sum|x_i|$ on floats), and measured
#   the bytes it hands to `isend`: equal to the formula on every rank when $n$ divides the length, within
#   one element per phase otherwise, and $n$ times the formula summed over the ranks.
# * The tracer measures payloads and point-to-point bytes; for a `torch.distributed` collective it can
#   only book the ring model. Checks built on it test which collectives ran with which payload.
# * $T(S) = \alpha + S/\beta$, fitted to measured times, is worth what its $R^2$ says: it can explain
#   point-to-point times, and says little about collectives on an oversubscribed CPU, whose times follow
#   the scheduler. Later chapters use it to reason about time on real links.
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

# %% [markdown]
# ## Questions
#
# 1. In section 3 the ring all-reduce of 1001 float32 on 4 ranks made ranks 1 and 2 send one element
#    more than ranks 0 and 3. Which chunk does each rank *not* send in each phase, and why does that give
#    this pattern? Why is the sum over the ranks exact even though $\frac{n-1}{n}S$ is not a whole number
#    of elements?
# 2. The naive all-reduce through rank 0 sends the same total number of bytes as the ring, $2(n-1)S$.
#    On $n$ GPUs with a link each, why is it still slower, and how does the time of each grow with $n$
#    under the alpha-beta model?
# 3. For `dist.all_reduce` the tracer books $2\frac{n-1}{n}S$ bytes per rank. Give two reasons why the bytes
#    NCCL or gloo really put on the wire can differ, and one way to measure them instead of modelling them.
# 4. Under the alpha-beta model, at which message size $S$ do the ring all-reduce's latency and bandwidth
#    terms cost the same? How does that size move with $n$, and what does it say about all-reducing each
#    of a model's hundreds of parameter tensors on its own (chapter 03's buckets)?
# 5. What does a negative $R^2$ of the alpha-beta fit mean? What would you change in the experiment before
#    trusting a fit of the collectives on a CPU, and why is $R^2$ computed on $\log T$ rather than on $T$?
