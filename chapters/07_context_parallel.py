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
# # 07 · Context parallelism: ring attention and Ulysses
#
# Data, ZeRO and tensor parallelism (chapters 03-06) split the batch, the state and the matmuls. None of
# them splits the **sequence**: every rank still runs all $s$ tokens of its sequences through every layer,
# and the activations it keeps for backward grow linearly with $s$. A model that fits one device can
# still not train on one 128k-token sequence. **Context parallelism** cuts the sequence into `cp` parts,
# one per rank. Everything in a transformer acts on each token alone, except attention, which needs every
# key and value of the sequence. Two ways to give it that:
#
# * **ring attention** (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
#   Context"): the K/V blocks travel round a ring of the `cp` ranks, each rank attends its queries to the
#   block it holds while the next one is on the wire, and the partial results are merged exactly with
#   their log-sum-exp. Under a causal mask a plain split gives the last rank the most work; the zig-zag
#   split (the load-balanced ring of Megatron-LM's context parallelism and Llama 3; not Brandon et al.
#   2023's Striped Attention, which deals the tokens out round-robin) evens it out;
# * **all-to-all sequence parallelism** (Jacobs et al. 2023, "DeepSpeed Ulysses"): one all-to-all turns
#   sequence shards into head shards, each rank runs ordinary attention on $a/\mathrm{cp}$ heads of the
#   whole sequence, and a second all-to-all turns the output back.
#
# Everything here lives in `refimpl.parallel.context_parallel`. This chapter proves, with assertions:
#
# 1. the log-sum-exp merge of blocks is attention (to rounding), on one device first;
# 2. ring attention (causal and not, zig-zag and contiguous) and Ulysses give the output and dQ, dK, dV
#    of full-sequence `scaled_dot_product_attention` on one device, at cp = 2 and 4; a merge that averages
#    the blocks fails the same check. PyTorch's own `context_parallel`
#    (`torch.distributed.tensor.experimental`) does **not** run on a CPU (it has sharding rules for the
#    CUDA attention kernels only; shown below), so one-device full-sequence attention is the reference;
# 3. the zig-zag split gives every rank the same causal work (counted), the plain split does not;
# 4. the bytes each rank sends per layer, measured by the tracer, equal the planner's formula: the ring
#    sends $\frac{cp-1}{cp}$ of the whole sequence's K and V forward (and their gradients back), Ulysses
#    four all-to-alls each way of $\frac{cp-1}{cp}$ of the local tensor;
# 5. the activation bytes per rank fall as $1/\mathrm{cp}$ (measured, and equal to the planner's count);
# 6. the ring posts each K/V transfer before the attention of the block already there and waits after it,
#    so that the two can overlap (a timeline; what it can and cannot show is said there), and behind a
#    link shaped to 1 Gbit/s it takes at most 0.9 of the time of its serialized control (timed);
# 7. the whole GPT trained at cp = 2 has the one-device losses.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from refimpl.config import ModelConfig
from refimpl.launch import start_ranks
from refimpl.measure import format_bytes
from refimpl.parallel.context_parallel import causal_work, merge_partial_attention
from refimpl.parallel.context_parallel.ring_attention import block_attention
from refimpl.planner import activation_bytes, param_count, state_memory

torch.set_num_threads(1)  # small tensors: one thread is as fast, and leaves the other core to the ranks
print("torch", torch.__version__)

# %% [markdown]
# ## 1. Why: activations grow with the sequence
#
# The planner counts what one block of our GPT keeps for backward (chapter 05). Take a configuration of
# 24 layers of width 2048 (its parameter count printed) in bf16 and let the sequence grow: the model
# states (weights, gradients, AdamW moments, 16 bytes per parameter unsharded) stay the same, the
# activations of **one** sequence grow with $s$.

# %%
big = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, max_seq_len=131072)
states = state_memory(big).total
n_params = param_count(big).total
print(f"{big.num_layers} layers, h = {big.hidden_size}: {n_params / 1e9:.2f}B parameters, model states "
      f"{format_bytes(states)} ({states / n_params:.0f} bytes per parameter) for any sequence length")
for s in (4096, 16384, 65536, 131072):
    acts = sum(activation_bytes(big, micro_batch=1, seq_len=s, compute_dtype=torch.bfloat16))
    print(f"s = {s:>6d}: activations of one sequence {acts / 2**30:7.1f} GiB = {acts / states:5.1f} x "
          "the states")

# %% [markdown]
# At a few thousand tokens the states dominate; at 128k tokens one sequence's activations are many times
# the states, and no single device holds them. Activation checkpointing (chapter 05) keeps only each
# block's input, which still grows with $s$; tensor parallelism with sequence parallelism (chapter 06)
# divides it by $t$, but $t$ stays within a node. Context parallelism divides it by `cp`, across nodes too.
#
# ## 2. The log-sum-exp merge, on one device
#
# Attention of a row of queries over keys split into blocks $j$: each block gives its own softmax output
# $o_j = \mathrm{softmax}(S_j) V_j$ (with $S_j = q K_j^\top/\sqrt d$) and its log-sum-exp
# $\ell_j = \log \sum_k e^{(S_j)_k}$. The softmax over the whole row weights block $j$ by
# $e^{\ell_j}/\sum_i e^{\ell_i}$, so two partial results merge exactly as
#
# $$\ell = \log(e^{\ell_1} + e^{\ell_2}), \qquad o = e^{\ell_1 - \ell}\, o_1 + e^{\ell_2 - \ell}\, o_2 ,$$
#
# which is associative: the blocks may arrive in any order (FlashAttention merges its tiles the same way).
# `refimpl`'s `block_attention` returns $(o_j, \ell_j)$ and `merge_partial_attention` applies the rule.
# Under a causal mask the sequence is cut into chunks for the queries too: a key chunk after the query
# chunk contributes nothing and is skipped, the diagonal chunk gets the triangular mask.
#
# The reference is `scaled_dot_product_attention` on the whole sequence. "Equal" means within
# `FACTOR = 4` times the distance of one-device float32 SDPA from float64 SDPA, measured here, per tensor;
# the error of the blocked version is measured against float64 too.

# %%
FACTOR = 4.0
gen = torch.Generator().manual_seed(0)
qf, kf, vf = (torch.randn(2, 4, 24, 8, generator=gen) for _ in range(3))  # [b, a, s, d], one device
scale = 8 ** -0.5


def blocked(q, k, v, *, n_blocks, causal, merge):
    """Attention over n_blocks chunks of the sequence, merged with `merge` (query chunks too, for causal)."""
    qs, ks, vs = (t.chunk(n_blocks, dim=2) for t in (q, k, v))
    rows = []
    for i, qi in enumerate(qs):
        out, lse = None, None
        for j in range(i + 1 if causal else n_blocks):  # causal: key chunks after the query chunk skipped
            o, l_ = block_attention(qi, ks[j], vs[j], scale=scale, diagonal=causal and i == j)
            out, lse = merge(out, lse, o, l_)
        rows.append(out)
    return torch.cat(rows, dim=2)  # [b, a, s, d]


def averaging_merge(out, lse, block_out, block_lse):
    """Wrong on purpose: the plain mean of the partial outputs instead of their log-sum-exp weights."""
    return (block_out, block_lse) if out is None else ((out + block_out) / 2, torch.logaddexp(lse, block_lse))


for causal in (False, True):
    ref64 = F.scaled_dot_product_attention(qf.double(), kf.double(), vf.double(), is_causal=causal)
    tol = FACTOR * (F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).double() - ref64).abs().max()
    for n in (2, 4):
        good = (blocked(qf, kf, vf, n_blocks=n, causal=causal, merge=merge_partial_attention).double()
                - ref64).abs().max()
        bad = (blocked(qf, kf, vf, n_blocks=n, causal=causal, merge=averaging_merge).double()
               - ref64).abs().max()
        assert good <= tol, (causal, n, good, tol)
        assert bad > tol, "the averaging merge must fail the same check"
        print(f"causal={causal!s:5s} {n} blocks: lse merge off by {good:.1e}, averaging merge off by "
              f"{bad:.1e} (tolerance {tol:.1e})")

# %% [markdown]
# The log-sum-exp merge is attention within rounding; averaging the blocks is not (it weights a block of
# tiny scores as much as the block that holds the row's largest ones).
#
# ## 3. Ring attention on 2 and 4 ranks
#
# Now the blocks live on different ranks. Rank $r$ holds the queries, keys and values of its part of the
# sequence, `[b, a, s/cp, d]`. At step $k$ it attends its queries to the K/V block of rank $r - k$ while
# it sends that block on to rank $r + 1$ and receives the next one from $r - 1$ (plain `isend`/`irecv`
# through `refimpl.comm.ops`). After `cp` steps it has merged every block. Backward is a ring too: with
# the saved row log-sum-exp each block's softmax is rebuilt, dQ accumulates where it is, and each block's
# dK/dV travels behind it round the ring, collecting one rank's share per hop, back to its owner.
#
# One cluster of 4 ranks serves both sizes: the whole world is one ring of 4, and ranks {0, 1} and
# {2, 3} are two rings of 2 that run the same experiment side by side. Every rank builds the same
# whole-sequence tensors (seeded), keeps its part (`split_sequence`, zig-zag or contiguous) and compares
# its output and gradients with its part of one-device SDPA's.
#
# PyTorch has its own ring attention, `torch.distributed.tensor.experimental.context_parallel`, but it
# does not run on a CPU: it knows sharding rules for the CUDA flash and memory-efficient attention
# kernels only, not for the CPU one. The first cell on the ranks tries it; on a CPU it raises. So here the
# reference is full-sequence SDPA on one device.

# %%
ranks = start_ranks(4, timeout_s=120)
ranks

# %%
# %%px
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

buffers = [torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(9)).to(device) for _ in range(3)]
try:
    with context_parallel(init_device_mesh(device.type, (world_size,)), buffers=buffers,
                          buffer_seq_dims=[2, 2, 2]):
        torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=True)
    pytorch_cp = "ran"
except NotImplementedError as e:
    pytorch_cp = f"NotImplementedError: {str(e).splitlines()[0]}"
assert device.type != "cpu" or pytorch_cp.startswith("NotImplementedError"), pytorch_cp
if rank == 0:
    print(f"PyTorch's context_parallel on {device.type}: {pytorch_cp}")

# %%
# %%px
import datetime
import functools

import torch.nn.functional as F

import refimpl.parallel.context_parallel.ring_attention as ra  # the module (its functions swapped below)
from refimpl.comm import CommTracer
from refimpl.config import ModelConfig
from refimpl.measure.activations import SavedTensorMeter
from refimpl.models import GPT, lm_loss
from refimpl.parallel.context_parallel import (
    RingTimeline,
    apply_context_parallel,
    heads_to_sequence,
    sequence_to_heads,
    split_for_context_parallel,
    split_sequence,
    ulysses_attention,
)
from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.planner import activation_bytes_per_layer

timeout = datetime.timedelta(seconds=120)
pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]  # every rank
cp_groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
FACTOR = 4.0
B, A, S, D = 2, 4, 24, 8  # S cuts into 2 cp chunks at cp 2 and 4; A heads divide by both (Ulysses)
gen = torch.Generator().manual_seed(0)
whole = {n: torch.randn(B, A, S, D, generator=gen).to(device) for n in ("q", "k", "v", "do")}  # [b, a, s, d]
NAMES = ("out", "dq", "dk", "dv")


def sdpa(causal, dtype):
    """One device, the whole sequence: SDPA's output and dQ, dK, dV."""
    q, k, v = (whole[n].to(dtype, copy=True).requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(whole["do"].to(dtype))
    return dict(zip(NAMES, (out.detach(), q.grad, k.grad, v.grad), strict=True))


reference = {causal: (sdpa(causal, torch.float32), sdpa(causal, torch.float64)) for causal in (False, True)}
spread = {causal: {n: (r32[n].double() - r64[n]).abs().max().item() for n in NAMES}
          for causal, (r32, r64) in reference.items()}


def averaging_merge(out, lse, block_out, block_lse):
    """Wrong on purpose (the negative control): the plain mean of the partial outputs."""
    return (block_out, block_lse) if out is None else ((out + block_out) / 2, torch.logaddexp(lse, block_lse))


def run_parallel(attention, group, layout):
    """`attention` forward (tracer step 0) and backward (step 1) on this rank's part; blocks counted."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    part = {n: split_sequence(t, dim=2, cp_rank=me, cp_size=cp, layout=layout) for n, t in whole.items()}
    q, k, v = (part[n].clone().requires_grad_() for n in "qkv")
    calls, block = [], ra.block_attention
    ra.block_attention = lambda *a, **kw: calls.append(1) or block(*a, **kw)
    try:
        with CommTracer() as tracer:
            out = attention(q, k, v)
            tracer.step()
            out.backward(part["do"])
    finally:
        ra.block_attention = block
    return {"got": dict(zip(NAMES, (out.detach(), q.grad, k.grad, v.grad), strict=True)), "work": len(calls),
            "tracer": tracer, "me": me, "cp": cp}


def ratios(run, causal, layout):
    """Per tensor: max |ours - float64 SDPA| on this rank's part / (FACTOR x float32 SDPA's own spread)."""
    r64 = reference[causal][1]
    return {n: (run["got"][n].double() - split_sequence(r64[n], dim=2, cp_rank=run["me"], cp_size=run["cp"],
                                                        layout=layout)).abs().max().item()
            / (FACTOR * spread[causal][n]) for n in NAMES}


ring_results, ring_runs = {}, {}
for cp, group in cp_groups.items():
    for causal in (False, True):
        for layout in ra.LAYOUTS:
            attention = functools.partial(ring_attention, cp_group=group, causal=causal, layout=layout)
            run = run_parallel(attention, group, layout)
            ring_runs[(cp, causal, layout)] = run
            ring_results[(cp, causal, layout)] = ratios(run, causal, layout)
    merge = ra.merge_partial_attention
    ra.merge_partial_attention = averaging_merge  # the negative control: ring attention with a wrong merge
    try:
        run = run_parallel(functools.partial(ring_attention, cp_group=group, causal=True, layout="zigzag"),
                           group, "zigzag")
    finally:
        ra.merge_partial_attention = merge
    ring_results[(cp, True, "zigzag, averaging merge")] = ratios(run, True, "zigzag")

for key, r in ring_results.items():
    if "averaging" in key[2]:
        assert r["out"] > 1, f"the negative control passed at {key}: the check cannot see a wrong merge"
    else:
        assert max(r.values()) <= 1, f"{key}: {r}"

# %%
for (cp, causal, layout), r in ranks.run(lambda: ring_results)[0].items():
    worst = max(r, key=r.get)
    print(f"cp={cp} causal={causal!s:5s} {layout:24s}: largest |error| / tolerance {r[worst]:7.2f} "
          f"({worst}) | " + " ".join(f"{n} {v:.2f}" for n, v in r.items()))

# %% [markdown]
# Ring attention equals one-device attention in the output and in all three gradients, at both sizes,
# in both layouts, causal or not (ratios printed for rank 0; every rank asserted its own). The averaging
# merge misses the output by orders of magnitude. The rounding differs from SDPA's for two reasons: each
# row's softmax is assembled from `cp` partial results in the order the ring delivers them, and each
# dK/dV block is a sum of `cp` ranks' partial gradients, added hop by hop, where SDPA does one matmul.
#
# ## 4. Causal balance: zig-zag
#
# Under a causal mask the query chunk $i$ needs the key chunks $0..i$. With the plain (contiguous) split,
# rank 0 attends to one block and the last rank to `cp` blocks: the ring is as slow as its last rank. The
# zig-zag split cuts the sequence into $2\,\mathrm{cp}$ chunks and gives rank $i$ chunks $i$ and
# $2\,\mathrm{cp} - 1 - i$, an early and a late one, so every rank gets $2\,\mathrm{cp} + 1$ (query chunk,
# key chunk) pairs of half-size chunks. `causal_work` counts the pairs from the layout; the ranks above
# counted the block attentions their forward actually computed.

# %%
work = ranks.run(lambda: {k: run["work"] for k, run in ring_runs.items() if k[1]})
counted = {(cp, layout): [work[r][(cp, True, layout)] for r in range(cp)] for cp in (2, 4)
           for layout in ("contiguous", "zigzag")}
for (cp, layout), measured in counted.items():
    formula = causal_work(cp_size=cp, layout=layout)
    assert measured == formula, (cp, layout, measured, formula)
    # a zig-zag chunk is half a contiguous one: a pair costs a quarter of a contiguous pair's score matrix
    area = [w / 4 if layout == "zigzag" else w for w in measured]
    print(f"cp={cp} {layout:10s}: block attentions per rank {measured} (= causal_work), in contiguous-block "
          f"units {area}, slowest / mean {max(area) / (sum(area) / cp):.2f}")
    if layout == "zigzag":
        assert len(set(measured)) == 1, "zig-zag: the same work on every rank"

fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
for ax, layout in zip(axes, ("contiguous", "zigzag"), strict=True):
    area = [w / 4 if layout == "zigzag" else w for w in counted[(4, layout)]]
    ax.bar(range(4), area, color="tab:orange" if layout == "contiguous" else "tab:green")
    ax.set_xticks(range(4), [f"rank {r}" for r in range(4)])
    ax.set_title(f"{layout} split, cp = 4, causal")
axes[0].set_ylabel("attention work per rank\n(contiguous blocks of s/cp x s/cp)")
fig.tight_layout()

# %% [markdown]
# With the contiguous split the last rank computes 4 times what the first one does, and every step of
# the ring waits for it; with zig-zag every rank computes the same $(2\,\mathrm{cp}+1)/4$ contiguous
# blocks' worth, the whole causal triangle divided evenly (the diagonal pairs are half empty, which the
# count of pairs ignores: they are equal in number on every rank too).
#
# ## 5. Ulysses: all-to-all from sequence shards to head shards
#
# Attention's heads are independent. `sequence_to_heads` is one all-to-all: rank $r$ sends head block $j$
# of its tokens to rank $j$ and receives rank $j$'s tokens of its own head block, `[b, a, s/cp, d]` ->
# `[b, a/cp, s, d]`. Then ordinary SDPA runs on $a/\mathrm{cp}$ heads of the **whole** sequence (with the
# whole sequence's causal mask), and `heads_to_sequence` sends the output back. It moves elements only,
# so it must be exact:

# %%
# %%px
ulysses_results, ulysses_shapes = {}, {}
for cp, group in cp_groups.items():
    me = dist.get_rank(group)
    local = split_sequence(whole["q"], dim=2, cp_rank=me, cp_size=cp, layout="contiguous")  # [b, a, s/cp, d]
    heads = sequence_to_heads(local, group)                                                # [b, a/cp, s, d]
    mine = slice(me * A // cp, (me + 1) * A // cp)
    assert torch.equal(heads, whole["q"][:, mine]), "my heads, every token, bitwise"
    assert torch.equal(heads_to_sequence(heads, group), local), "and back, bitwise"
    ulysses_shapes[cp] = (tuple(local.shape), tuple(heads.shape))
    for causal in (False, True):
        run = run_parallel(functools.partial(ulysses_attention, cp_group=group, causal=causal), group,
                           "contiguous")
        ulysses_results[(cp, causal)] = r = ratios(run, causal, "contiguous")
        assert max(r.values()) <= 1, (cp, causal, r)
try:
    six = torch.zeros(B, 6, S // 4, D, device=device)  # 6 heads on 4 ranks
    ulysses_attention(six, six, six, cp_group=cp_groups[4], causal=True)
    heads_error = None
except ValueError as e:
    heads_error = str(e)
assert heads_error is not None and "do not divide by cp = 4" in heads_error

# %%
shapes, res, heads_error = ranks.run(lambda: (ulysses_shapes, ulysses_results, heads_error))[0]
for cp, (before, after) in shapes.items():
    print(f"cp={cp}: sequence_to_heads {before} -> {after}, exact and inverted by heads_to_sequence")
for (cp, causal), r in res.items():
    print(f"cp={cp} causal={causal!s:5s} Ulysses: largest |error| / tolerance {max(r.values()):.2f} | "
          + " ".join(f"{n} {v:.2f}" for n, v in r.items()))
print("6 heads at cp = 4:", heads_error)

# %% [markdown]
# Ulysses equals one-device attention too. Its limit is printed last: a rank must get whole heads, so
# `cp` cannot exceed the number of heads (after tensor parallelism, the local heads), and must divide it.
# The ring has no such limit, but its traffic, below, does not shrink with `cp`.
#
# ## 6. Bytes per rank and layer
#
# Now the whole GPT under `apply_context_parallel` (every block's attention replaced, the positions those
# of the rank's tokens). The tracer records every `isend` of the ring with the bytes of the tensor handed
# to it, and every all-to-all of Ulysses with its payload, one forward and one backward. What should they
# be? Per rank, with $n = \mathrm{cp}$, $e$ the bytes of an element and $b\,a\,\frac{s}{n}\,d$ the local
# K (or V) block:
#
# * ring, forward: $n - 1$ K/V blocks, $2(n-1)\,b\,a\,\frac{s}{n}\,d\,e$, i.e. $\frac{n-1}{n}$ of the
#   **whole** sequence's K and V, whatever $n$;
# * ring, backward: the K/V blocks again plus as much in dK/dV (our ring sends those in float32);
# * Ulysses: four all-to-alls each way (q, k, v in and the output back; dO in and dQ, dK, dV back), each
#   sending all but the block addressed to itself, $\frac{n-1}{n}$ of the local tensor: it **falls**,
#   roughly as $1/n$.
#
# The planner has this as `refimpl.planner.communication.context_parallel_bytes` (per rank, per layer);
# the measured side comes from the tracer.

# %%
# %%px
gcfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=32)
GB, GS = 2, 32
tokens = torch.randint(0, gcfg.vocab_size, (GB, GS), generator=torch.Generator().manual_seed(1)).to(device)


def traced_gpt(method, group, config=gcfg):
    """One forward (tracer step 0) and backward (step 1) of the context-parallel GPT on this rank's tokens."""
    model = apply_context_parallel(GPT(config, seed=1).to(device), cp_group=group, method=method)
    x = split_for_context_parallel(tokens, cp_group=group, method=method)  # [b, s/cp]
    with CommTracer() as tracer:
        loss = lm_loss(model(x), x)
        tracer.step()
        loss.backward()
    return tracer


def per_layer(tracer, method, step):
    """Bytes this rank sent in one pass, per layer, from the tensors handed to each call: a ring send puts
    its tensor on the wire; an equal-split all-to-all sends every block of its input but the one addressed
    to this rank, (n-1)/n of the payload whatever algorithm moves it."""
    if method == "ring":
        return tracer.measured_bytes_sent(step=step) / gcfg.num_layers
    calls = [e for e in tracer.select(step=step) if e.op == "all_to_all"]
    return sum(e.nbytes * (e.group_size - 1) // e.group_size for e in calls) / gcfg.num_layers


def ulysses_payloads(tracer, step):
    """The payload of every all-to-all of one pass, measured from its input tensor (bytes)."""
    return {e.nbytes for e in tracer.select(step=step) if e.op == "all_to_all"}


measured_bytes, calls = {}, {}
for cp, group in cp_groups.items():
    for method in ("ring", "ulysses"):
        tracer = traced_gpt(method, group)
        measured_bytes[(method, cp)] = {p: per_layer(tracer, method, s)
                                        for s, p in enumerate(("forward", "backward"))}
        calls[(method, cp)] = [len([e for e in tracer.select(step=s) if e.op in ("isend", "all_to_all")])
                               for s in (0, 1)]
        if method == "ulysses":  # each call moves one rank's q, k, v, output (or their gradients):
            local = GB * gcfg.num_attention_heads * (GS // cp) * gcfg.head_dim * 4  # [b, a, s/cp, d] float32
            assert ulysses_payloads(tracer, 0) == ulysses_payloads(tracer, 1) == {local}, (cp, local)
for cp in cp_groups:
    L = gcfg.num_layers
    assert calls[("ring", cp)] == [2 * (cp - 1) * L, 4 * (cp - 1) * L], calls  # K, V; K, V, dK, dV per hop
    assert calls[("ulysses", cp)] == [4 * L, 4 * L], calls

# %%
from refimpl.planner.communication import context_parallel_bytes

measured_bytes = ranks.run(lambda: measured_bytes)[0]
gcfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=32)
planned = {(m, cp): context_parallel_bytes(gcfg, micro_batch=2, seq_len=32, cp=cp, method=m)
           for m in ("ring", "ulysses") for cp in (2, 4, 8, 16) if m == "ring" or cp <= 4}  # Ulysses: cp <= a
for (method, cp), got in measured_bytes.items():
    assert got == planned[(method, cp)], (method, cp, got, planned[(method, cp)])  # tracer == planner, exact
    print(f"cp={cp} {method:8s}: measured forward {got['forward']:>8,.0f} B, backward "
          f"{got['backward']:>8,.0f} B per rank per layer | planner {planned[(method, cp)]['forward']:>8,d} "
          f"B, {planned[(method, cp)]['backward']:>8,d} B")
kv_bytes = 2 * 2 * 32 * 32 * 4  # the whole sequence's K and V: 2 tensors of b s h float32 elements
print(f"the whole sequence's K and V: {kv_bytes:,d} B")

fig, ax = plt.subplots(figsize=(7, 3.4))
for method, colour in (("ring", "tab:blue"), ("ulysses", "tab:red")):
    cps = sorted(cp for m, cp in planned if m == method)
    for p, style in (("forward", "-"), ("backward", "--")):
        ax.plot(cps, [planned[(method, c)][p] / 1024 for c in cps], style, color=colour,
                label=f"{method} {p} (planner)" + (", up to cp = heads" if method == "ulysses" else ""))
        ax.plot([2, 4], [measured_bytes[(method, c)][p] / 1024 for c in (2, 4)], "o", color=colour,
                mfc="none" if p == "backward" else colour)
ax.axhline(kv_bytes / 1024, color="grey", ls=":", label="whole sequence's K + V")
ax.set_xscale("log", base=2)
ax.set_xlabel("cp")
ax.set_ylabel("KiB sent per rank per layer")
ax.set_title("context-parallel bytes: measured (dots) vs planner (lines), b=2, s=32, h=32, fp32")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# The tracer's bytes equal the planner's exactly. At cp = 2 both methods send the same forward; beyond,
# the ring's forward bytes per rank approach the whole sequence's K and V as `cp` grows (what shrinks is
# only the block each step has to hide behind its compute), and Ulysses sends less and less per rank,
# but its all-to-alls make every rank talk to every other at once (across nodes, they contend for the
# network, where each of the ring's sends goes to one neighbour), and it stops at `cp` = heads.
# (Ulysses' numbers are the all-to-all's payload, measured from the tensors, times the $\frac{n-1}{n}$
# that an equal-split all-to-all sends: exact for these equal blocks.)
#
# **Grouped-query attention shrinks the ring.** The Llama form (chapter 01) has $g$ key/value heads for
# $a$ query heads, and only K and V travel the ring: ours sends them at their own $g$ heads and each block
# expands them to the query heads it meets (`expand_groups`; dK/dV are summed back per group before they
# travel), so the ring's bytes fall to $g/a$ of multi-head attention's. Repeating K/V to $a$ heads before
# the ring (picotron does) would send $a/g$ times more. Ulysses moves q and the output at $a$ heads and
# k, v at $g$. The same tracer, the same planner formula with `num_key_value_heads`:

# %%
# %%px
from refimpl.config import LLAMA  # noqa: E402


def traced_llama(kv_heads, method, group):
    """The Llama form (RoPE, RMSNorm, SwiGLU) with ``kv_heads`` key/value heads, one forward and backward."""
    cfg = ModelConfig(**LLAMA, num_layers=2, hidden_size=32, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_seq_len=32)
    return traced_gpt(method, group, cfg)


gqa_bytes = {(kv, method, cp): {p: per_layer(traced_llama(kv, method, group), method, s)
                                for s, p in enumerate(("forward", "backward"))}
             for kv in (4, 2, 1) for cp, group in cp_groups.items() for method in ("ring", "ulysses")
             if method == "ring" or kv % cp == 0}

# %%
from refimpl.config import LLAMA  # noqa: E402, F811 (the kernel's own import; the cell above ran on the engines)

gqa_bytes = ranks.run(lambda: gqa_bytes)[0]
for (kv, method, cp), got in sorted(gqa_bytes.items()):
    cfg = ModelConfig(**LLAMA, num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv,
                      max_seq_len=32)
    plan = context_parallel_bytes(cfg, micro_batch=2, seq_len=32, cp=cp, method=method)
    assert got == plan, (kv, method, cp, got, plan)  # tracer == planner, exact
    mha = gqa_bytes[(4, method, cp)]["forward"]
    print(f"{method:8s} cp={cp} kv heads {kv}: forward {got['forward']:>8,.0f} B per rank per layer "
          f"({got['forward'] / mha:.3g} of multi-head's), planner {plan['forward']:,d} B")
for cp in (2, 4):
    assert gqa_bytes[(1, "ring", cp)]["forward"] * 4 == gqa_bytes[(4, "ring", cp)]["forward"]  # g/a = 1/4

# %% [markdown]
# ## 7. Activation memory per rank falls as 1/cp
#
# The point of the technique. The saved-tensor meter of chapter 05 (`SavedTensorMeter`) measures what each
# block keeps for backward on one rank, for the whole sequence on one device (cp = 1) and for the rank's
# part at cp = 2 and 4, next to the planner's count (`refimpl.planner.activation_bytes_per_layer(...,
# cp=, cp_method=)`), which must equal it byte for byte on a CPU (its attention kernel is the one counted).

# %%
# %%px
acfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=64)
AB, AS = 2, 64
atokens = torch.randint(0, 256, (AB, AS), generator=torch.Generator().manual_seed(2)).to(device)
saved = {}
for cp, group in {1: None, **cp_groups}.items():
    for method in ("ring", "ulysses"):
        model = GPT(acfg, seed=1).to(device)
        if group is not None:
            apply_context_parallel(model, cp_group=group, method=method)
        x = atokens if group is None else split_for_context_parallel(atokens, cp_group=group, method=method)
        with SavedTensorMeter(model) as meter:
            lm_loss(model(x), x)
        saved[(method, cp)] = meter.report.per_block()
        assert len(set(saved[(method, cp)])) == 1, "every block saves the same"
planned_saved = {(m, cp): activation_bytes_per_layer(acfg, micro_batch=AB, seq_len=AS, cp=cp,
                                                    cp_method=m).total for m, cp in saved}
if device.type == "cpu":  # CPU attention kernels: the planner counts them byte for byte
    assert planned_saved == {k: v[0] for k, v in saved.items()}, (planned_saved, saved)
for method in ("ring", "ulysses"):
    block = {cp: saved[(method, cp)][0] for cp in (1, 2, 4)}
    assert block[4] < block[2] < block[1]
    if device.type == "cpu":  # the CPU attention kernels (GPU ones save a few fixed-size tensors more)
        assert 2 * block[2] == 4 * block[4], "cp x bytes per rank is the same at cp 2 and 4: exactly 1/cp"
        assert 2 * block[2] - block[1] == AB * AS * acfg.hidden_size * 4, "one device keeps one s b h less"

# %%
saved, planned_saved = ranks.run(lambda: (saved, planned_saved))[0]
for (method, cp), blocks in saved.items():
    print(f"{method:8s} cp={cp}: {blocks[0]:>7,d} B saved per block per rank = "
          f"{blocks[0] / saved[(method, 1)][0]:.3f} of one device (1/cp = {1 / cp:.3f}) | planner "
          f"{planned_saved[(method, cp)]:>7,d} B")

fig, ax = plt.subplots(figsize=(6, 3.2))
for method, marker in (("ring", "o"), ("ulysses", "s")):
    cps = [1, 2, 4]
    ax.plot(cps, [saved[(method, c)][0] / 1024 for c in cps], marker=marker, label=f"{method} (measured)")
ax.plot([1, 2, 4], [saved[("ring", 1)][0] / 1024 / c for c in (1, 2, 4)], "k:", label="one device / cp")
ax.plot([1, 2, 4], [planned_saved[("ring", c)] / 1024 for c in (1, 2, 4)], "k_", markersize=20, mew=1.5,
        label="planner (ring)")
ax.set_xscale("log", base=2)
ax.set_xticks([1, 2, 4], ["1", "2", "4"])
ax.set_xlabel("cp")
ax.set_ylabel("KiB saved per block per rank")
ax.set_title("activation bytes per rank, float32, b=2, s=64, h=32")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# From cp = 2 to cp = 4 the bytes per rank halve exactly (asserted: cp x bytes is the same). Against one
# device they are a little above $1/\mathrm{cp}$, by one $s\,b\,h$ float32 tensor per block (asserted on
# CPU): on one device the CPU flash kernel lays its output out in memory like its queries, which in our
# model are a view of the `[b, s, a, 3, d]` projection, so the output is `[b, s, a, d]` in memory and the
# output projection's input `[b, s, h]` is a view of the tensor attention already saved; ring attention and
# Ulysses return a `[b, a, s/cp, d]` tensor, and the reshape to `[b, s/cp, h]` makes a copy, which the
# projection saves too (the planner counts it). Everything else a block keeps is per token and is split
# by `cp`.
#
# ## 8. A timeline of one ring forward
#
# The ring hides each transfer behind the attention of the block already there: at step $k$ a rank posts
# the send of its block and the receive of the next, computes, then waits. `RingTimeline` records each
# step's compute span and transfer span (posted to waited) on every rank; below, one causal zig-zag forward
# at cp = 4 with a longer sequence, so that there is something to see. (Times on a CPU shared by 4 ranks are
# only a picture of the order of events, never a benchmark.)

# %%
# %%px
gen_t = torch.Generator().manual_seed(5)
tq, tk, tv = (split_sequence(torch.randn(1, 4, 512, 32, generator=gen_t), dim=2, cp_rank=rank, cp_size=4,
                             layout="zigzag").to(device) for _ in range(3))
ring_attention(tq, tk, tv, cp_group=dist.group.WORLD, causal=True)  # warm-up
timeline = RingTimeline()
dist.barrier()
ring_attention(tq, tk, tv, cp_group=dist.group.WORLD, causal=True, timeline=timeline)
spans = [(s.kind, s.step, s.start, s.end) for s in timeline.spans]

# %%
per_rank = ranks.run(lambda: spans)
t0 = min(start for spans_r in per_rank for _, _, start, _ in spans_r)
fig, ax = plt.subplots(figsize=(9, 2.8))
for r, spans_r in enumerate(per_rank):
    for kind, step, start, end in spans_r:
        y = r + (0.2 if kind == "compute" else -0.2)
        ax.barh(y, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.35,
                color="tab:green" if kind == "compute" else "tab:grey", alpha=0.5 + 0.5 * (step % 2),
                edgecolor="black", lw=0.3)
        ax.text((start - t0) * 1e3, y, f"{step}", fontsize=6, va="center")
ax.set_yticks(range(4), [f"rank {r}" for r in range(4)])
ax.set_xlabel("ms (green: compute of step k; grey: the transfer posted at step k, until its wait returned)")
ax.set_title("one causal ring-attention forward, cp = 4, zig-zag, s = 512")
fig.tight_layout()
exposed = ranks.run(lambda: timeline.exposed_transfer_seconds())
print("transfer time not hidden behind the same step's compute, per rank (ms):",
      [round(x * 1e3, 2) for x in exposed])

# %% [markdown]
# Each grey bar starts before the green bar of its step and ends after it, by construction: the code posts
# the exchange, computes, then waits (nothing here is asserted, since the order of the timestamps is the
# order of the code). What the picture cannot show is when the bytes actually moved: gloo's handle does not
# report the moment a transfer finished, so a transfer that only ran during the wait would draw the same
# bars. Only the part of a grey bar after its green bar can be exposed (printed: the wait that was left
# after the compute). On a GPU the NCCL kernels run on their own stream and the overlap is seen in a
# profiler trace. A step moves a K/V block of $O(c\,d)$ elements and computes $O(c^2 d)$ FLOPs of
# attention on the block it holds ($c$ tokens a chunk), so the longer the chunks, the more of the transfer
# the compute hides; here, with 4 ranks sharing a CPU and tiny chunks, some of it stays exposed.

# %% [markdown]
# **The overlap, timed.** The timeline cannot tell a hidden transfer from one that ran during the wait;
# a clock can, once the link and not the cores sets the pace. Behind a loopback shaped to 1 Gbit/s
# (`run_ranks(..., link="1gbit")`, `refimpl/launch/shaped_link.py`, as chapters 03 and 04 time theirs),
# `refimpl.parallel.overlap.ring_overlap` runs the causal zig-zag ring attention of this section on 2 ranks
# (8 heads of 64, 2 x 1024 tokens per rank, forward and backward) as built, each K/V block posted before the
# block attention computed meanwhile and waited for after it, against its **serialized control**
# (`overlap=False`: the same code waiting as soon as it has posted). The two kinds of step alternate, median
# of 5; the output and dQ, dK, dV must be bitwise equal (the control changes when the bytes move, not what
# is computed), and the overlapped step must take at most 0.9 of the serialized one.

# %%
from refimpl.parallel.overlap import ring_overlap, time_overlap  # noqa: E402
from refimpl.viz import plot_timed_overlap  # noqa: E402

timed = time_overlap(ring_overlap)  # asserts bitwise-equal outputs and gradients and a ratio <= 0.9
if isinstance(timed, str):
    print(f"no shaped link on this machine ({timed}): the timing is skipped")
else:
    print(f"1 Gbit/s link: ring attention overlapped {timed['overlapped']:.2f} s, serialized "
          f"{timed['serialized']:.2f} s per forward and backward: {timed['ratio']:.2f} of it; outputs and "
          "gradients bitwise equal")
    fig = plot_timed_overlap(timed, xlabel="seconds per forward + backward (median of 5, slowest rank)",
                             title="ring attention vs its serialized control, 1 Gbit/s")

# %% [markdown]
# ## 9. Training at cp = 2
#
# `refimpl.parallel.parallelize` applies context parallelism as its second step (after tensor parallelism,
# before the data-parallel wrapper, which then averages gradients over the `dp x cp` group: each cp rank's
# loss is the mean over its $b\,s/\mathrm{cp}$ tokens, and every rank holds as many, so the mean of the
# means is the global batch's mean). The trainer exposes it as `--cp N --cp-method {ring,ulysses}`; on our 4
# ranks `--cp 2` is two context-parallel pairs, each a data-parallel replica reading half of each global
# batch, each rank its half of every sequence of that half.
#
# The reference is the same trainer on one device (here, in the notebook's own process). The tolerance, as
# in chapter 06: the one-device run with one sequence per micro-batch (a pure change of summation order)
# gives the **spread**, and the cp runs must stay within `FACTOR x spread` of the one-device losses at every
# step. The negative control trains at cp = 2 with positions that do not follow the split (every rank's
# tokens numbered from 0, as if its part were a whole sequence). The same for the Llama form (chapter 01),
# where the positions are RoPE's: each block rotates q and k by their positions, so under the zig-zag split
# a rank's two chunks must be rotated by their *global* positions (the model declares its rotations as
# position modules, and `apply_context_parallel` gives them the chunks' positions); rotated from 0, the
# attention scores of every pair of tokens on different chunks come out wrong, and the run misses. The
# Llama form is compared with its own one-device runs.

# %%
import contextlib
import dataclasses
import io
import shutil
import tempfile
from pathlib import Path

from refimpl.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.data import make_corpus_file
from refimpl.distributed import DistributedContext
from refimpl.train import RunOptions, train

work = Path(tempfile.mkdtemp(prefix="chapter07-"))
corpus = make_corpus_file(work / "corpus.txt", num_bytes=20_000)
# the tiny run: 2 blocks of width 32, 4 heads, 16 tokens, a global batch of 4 sequences, 6 steps
TINY = TrainConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16),
                   data=DataConfig(data=str(corpus), cache_dir=str(work / "cache"), seq_len=16,
                                   global_batch_size=4),
                   optim=OptimConfig(lr=1e-2, warmup_steps=2), steps=6, log_every=100)
LLAMA_GQA = {**LLAMA, "num_key_value_heads": 2}  # RoPE, RMSNorm, SwiGLU, GQA 4/2


def tiny(name, *, model=None, **data):
    """TINY writing to work/name, with the model fields and the data fields given replaced."""
    return dataclasses.replace(TINY, out=str(work / name), model=dataclasses.replace(TINY.model, **(model or {})),
                               data=dataclasses.replace(TINY.data, **data))


def trainer_losses(ctx, config):
    """The trainer's per-step losses for `config` on one device (its progress kept out of the page)."""
    with contextlib.redirect_stdout(io.StringIO()):
        records = train(config, ctx, RunOptions(report=False))  # no report at the end
    return [r["loss"] for r in records]


here_device = torch.device(ranks.run(lambda: str(device))[0])  # rank 0's: the ranks' kernels
here = DistributedContext(rank=0, world_size=1, local_rank=0, device=here_device, backend="gloo")
runs = {"one device": trainer_losses(here, tiny("one-device")),
        "one device, 1 sequence per micro-batch": trainer_losses(here, tiny("one-device-micro",
                                                                            micro_batch_size=1))}
llama_runs = {"one device": trainer_losses(here, tiny("one-device-llama", model=LLAMA_GQA)),
              "one device, 1 sequence per micro-batch": trainer_losses(
                  here, tiny("one-device-llama-micro", model=LLAMA_GQA, micro_batch_size=1))}

# %%
# %%px
from contextlib import redirect_stdout
from io import StringIO

import refimpl.parallel.context_parallel.context_parallel as cp_module
from refimpl.distributed.env import DistributedContext as RankContext
from refimpl.train import RunOptions, train  # noqa: F811 (the engines' own import)

ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, device=device,
                  backend=dist.get_backend(), timeout_s=120)


def positions_from_zero(seq_len, device, *, rank, size, layout):
    """Wrong on purpose (the negative control): this rank's tokens numbered 0..s/cp-1."""
    return torch.arange(seq_len, device=device)


def cp_runs(plans):
    """Each plan's per-step losses on this rank: ``plans[name] = (TrainConfig, ParallelConfig)``; the
    names with "from 0" run with the wrong positions."""
    def losses(name):
        config, parallel = plans[name]
        with redirect_stdout(StringIO()):
            return [r["loss"] for r in train(config, ctx, RunOptions(parallel=parallel, report=False))]

    out = {name: losses(name) for name in plans if "from 0" not in name}
    right = cp_module._positions
    cp_module._positions = positions_from_zero
    try:
        out |= {name: losses(name) for name in plans if "from 0" in name}
    finally:
        cp_module._positions = right
    return out


# %%
RING, ULYSSES = ParallelConfig(cp=2, cp_method="ring"), ParallelConfig(cp=2, cp_method="ulysses")
plans = {"cp 2 x dp 2, ring": (tiny("cp2-ring"), RING),
         "cp 2 x dp 2, Ulysses": (tiny("cp2-ulysses"), ULYSSES),
         "Llama: cp 2 x dp 2, ring": (tiny("cp2-ring-llama", model=LLAMA_GQA), RING),
         "cp 2 x dp 2, ring, positions from 0": (tiny("cp2-wrong"), RING),
         "Llama: cp 2 x dp 2, ring, RoPE from 0": (tiny("cp2-wrong-llama", model=LLAMA_GQA), RING)}
per_rank = ranks.run(lambda plans: cp_runs(plans), plans)  # cp_runs: the engines' own
assert all(r == per_rank[0] for r in per_rank), "every rank reports the same global losses"
llama_runs |= {k.removeprefix("Llama: "): v for k, v in per_rank[0].items() if k.startswith("Llama: ")}
runs |= {k: v for k, v in per_rank[0].items() if not k.startswith("Llama: ")}
llama_drift = {name: max(abs(a - b) for a, b in zip(losses, llama_runs["one device"], strict=True))
               for name, losses in llama_runs.items()}
LLAMA_TOL = FACTOR * llama_drift["one device, 1 sequence per micro-batch"]
assert LLAMA_TOL > 0 and llama_drift["cp 2 x dp 2, ring"] <= LLAMA_TOL, (LLAMA_TOL, llama_runs)
assert llama_drift["cp 2 x dp 2, ring, RoPE from 0"] > LLAMA_TOL, "the RoPE negative control must fail"
for name, d in llama_drift.items():
    print(f"Llama form, {name:38s} max |diff| from its one device {d:.1e}")
print(f"Llama form: tolerance = 4 x its spread = {LLAMA_TOL:.1e}")


def drift(name):
    return max(abs(a - b) for a, b in zip(runs[name], runs["one device"], strict=True))


spread = drift("one device, 1 sequence per micro-batch")
TOL = FACTOR * spread
assert spread > 0, "a zero yardstick would make the tolerance vacuous"
assert drift("cp 2 x dp 2, ring") <= TOL and drift("cp 2 x dp 2, Ulysses") <= TOL, (TOL, runs)
assert drift("cp 2 x dp 2, ring, positions from 0") > TOL, "the negative control must fail"
assert runs["one device"][-1] < runs["one device"][0] - 1, "it trains"
for name, losses in runs.items():
    print(f"{name:40s} {' '.join(f'{v:.4f}' for v in losses)} | max |diff| {drift(name):.1e}")
print(f"tolerance = 4 x the spread = {TOL:.1e}")

fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, losses in runs.items():
    ax.plot(losses, label=name)
    if name != "one device":
        bx.plot([max(abs(a - b), 1e-12) for a, b in zip(losses, runs["one device"], strict=True)], label=name,
                marker=".")
bx.axhline(TOL, color="grey", ls="--", label="tolerance (4 x spread)")
bx.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats/token)")
ax.set_title("training at cp = 2 (x dp 2) and on one device")
bx.set_xlabel("step")
bx.set_ylabel("|loss - one device| (0 drawn at 1e-12)")
bx.set_title("difference from one device")
ax.legend(fontsize=7)
bx.legend(fontsize=6, loc="center right")
fig.tight_layout()
shutil.rmtree(work)

# %% [markdown]
# Both methods train to the one-device losses within the tolerance; numbering each rank's tokens from 0
# misses by far: the model would learn position embeddings for a sequence that does not exist. The Llama
# form's ring run stays within its own tolerance, and RoPE rotated from 0 on every rank misses it by
# orders of magnitude (printed above): a smaller miss than GPT-2's in absolute terms, since only the pairs
# of tokens on different chunks see wrong relative positions, but a wrong model all the same. In the
# trainer: `python -m refimpl.train --nproc-per-node 4 --cp 2 --cp-method ring` (with `--dp` given by the
# rest of the ranks; it composes with `--tp`, ZeRO and the precisions).

# %%
ranks.stop()

# %% [markdown]
# ## What to take away
#
# * Context parallelism splits the sequence: every layer but attention runs on the rank's tokens alone,
#   and the activations per rank fall as $1/\mathrm{cp}$.
# * Ring attention is exact: blocks merged by their log-sum-exp. It sends $\frac{cp-1}{cp}$ of the whole
#   sequence's K and V per layer forward (and that plus the gradients backward), to neighbours only,
#   posted before the block attention of each step so that the two can overlap.
# * Under a causal mask, split the sequence zig-zag (chunks $i$ and $2\,\mathrm{cp}-1-i$): equal work.
# * Ulysses trades the ring for all-to-alls in and out of attention (four each way: q, k, v in and the
#   output back): fewer bytes per rank as `cp` grows, whole heads per rank, so `cp` divides the number of
#   heads.
#
# ## Exercise
#
# Open `exercises/07_context_parallel.py` and implement `merge_partial_attention` (two partial attentions
# into one, by their log-sum-exp), `zigzag_split` (this rank's chunks of $2\,\mathrm{cp}$) and
# `ring_attention_step` (what a rank does with one K/V block: its attention under the causal mask, merged
# into what it has so far), then the ring itself on real ranks: `ring_attention_forward` (the send/receive
# loop), `ring_attention_backward` (dQ, dK, dV) and Ulysses' `sequence_to_heads` / `heads_to_sequence`.
# Grade your work with
#
# ```
# make grade CH=07
# ```
#
# which simulates rings of 2 and 4 ranks in one process for the first three, runs the last three on 4
# ranks (a ring of 3 and a group of one), and compares with full-sequence attention and its autograd
# (a merge that averages the outputs fails, and so does a step that does not take out each row's maximum
# on scores of about $10^4$).
#
# ## Questions
#
# 1. Why is the log-sum-exp merge exact, and why can the blocks arrive in any order?
# 2. With a contiguous split under a causal mask, which rank is the slowest and by how much? How does the
#    zig-zag split fix it, and why does it need $2\,\mathrm{cp}$ chunks rather than `cp`?
# 3. The ring's forward bytes per rank tend to the whole sequence's K and V as `cp` grows, while
#    Ulysses' fall as $1/\mathrm{cp}$. Why would anyone use the ring?
# 4. Why must Ulysses' heads divide by `cp`, and what happens to that condition after tensor parallelism?
# 5. In backward, why does dQ stay where it is while dK and dV travel round the ring back to their owners?
