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
# # 06 · Tensor and sequence parallelism, Megatron-style
#
# Data parallelism and ZeRO (chapters 03-04) split the *batch* and the *state*, but every rank still
# runs whole matrix multiplies, with whole weights in front of them and whole activations behind. When
# one layer's matmuls are too large or too slow for one device, split **each matmul** across devices.
# Shoeybi et al. 2019 ("Megatron-LM") showed that a transformer block needs only two collectives forward
# and two backward for that, if each weight is split the right way; Korthikanti et al. 2022 ("Reducing
# Activation Recomputation in Large Transformer Models") added **sequence parallelism**, which splits what
# is left (layer norms, the residual stream) along the sequence, for the same bytes per all-reduce pair plus
# one all-gather per column layer in backward (so that it keeps only its share of the input).
#
# Everything here lives in `refimpl.parallel.tensor_parallel`: the conjugate collectives `f` and `g`
# (`tp_communications`), `ColumnParallelLinear` and `RowParallelLinear` (`layers`), the vocabulary-parallel
# embedding and loss (`vocab_parallel`) and `apply_tensor_parallel`, which turns our GPT into its
# tensor-parallel form (`transformer`). This chapter proves, with assertions:
#
# 1. a column-parallel layer followed by a row-parallel one (the MLP; attention with its heads split) gives
#    the one-device output and gradients at tp = 2 and 4, with and without sequence parallelism, with
#    exactly one all-reduce forward and one backward (with SP an all-gather and a reduce-scatter each way,
#    and one more all-gather backward); the whole GPT's calls, counted and sized from their tensors on every
#    rank, equal the planner's count, and under SP the embedding reduce-scatters, half an all-reduce's bytes;
# 2. the fused query/key/value weight must be split per head: split by plain rows in nanoGPT's layout,
#    the output is wrong;
# 3. the whole GPT equals one device, loss and every gradient, and so does PyTorch's own tensor
#    parallelism (`parallelize_module`, `loss_parallel`) on the same weights; so does the Llama form with
#    grouped-query attention, also with fewer key/value heads than ranks (their gradients summed over the
#    ranks that share them; not summed, they are wrong);
# 4. the vocabulary-parallel loss equals `F.cross_entropy` without any rank holding the full logits;
# 5. the activation bytes per rank fall with $t$ and with sequence parallelism, measured equal to the
#    planner's count byte for byte;
# 6. a training run at tp = 2 has the one-device losses;
# 7. the collective matmul (the sequence-parallel all-gather and reduce-scatter as rings hidden behind the
#    chunks' matmuls) gives the same layer.

# %%
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Rectangle

from refimpl.launch import start_ranks
from refimpl.measure import format_bytes

torch.set_num_threads(1)  # small matrices: one thread is as fast, and leaves the second core to the ranks
print("torch", torch.__version__)

# %% [markdown]
# ## 1. Two ways to split a linear layer
#
# A linear layer computes $Y = XA^\top$ with $A$ of shape `[out, in]`. On $t$ devices, cut $A$ one of two
# ways:
#
# * **column parallel** (Megatron's name: the columns of $A^\top$, i.e. the *output* features): rank $r$
#   holds the rows $A_r$ and computes $Y_r = XA_r^\top$, its block of the output features. It needs the
#   whole input $X$ on every rank.
# * **row parallel** (the *input* features): rank $r$ holds the columns $A_{:,r}$, multiplies its block
#   $X_r$ of the input features and gets a **partial sum**: $Y = \sum_r X_r A_{:,r}^\top$.
#
# The MLP $Y = \phi(XA^\top)B^\top$ chains the two: column parallel for $A$, then $\phi$ element by element
# on the local features, then row parallel for $B$, whose input is exactly what the column layer left on
# each rank. The only communication is the sum at the end. The other order would be wrong: a row-parallel
# $A$ produces partial sums, and $\phi$ of a partial sum is not a part of $\phi$ of the sum. With small
# integers in float64 every product and sum below is exact, so the check is bit for bit.

# %%
gen = torch.Generator().manual_seed(0)
X = torch.randint(-3, 4, (4, 8), generator=gen).double()   # [tokens, h]
A = torch.randint(-3, 4, (16, 8), generator=gen).double()  # [4h, h]: the first linear
Bw = torch.randint(-3, 4, (8, 16), generator=gen).double()  # [h, 4h]: the second
phi = torch.relu  # any element-wise function (GeLU in our model; ReLU keeps integers exact)
Y = phi(X @ A.T) @ Bw.T
for t in (2, 4):
    column_then_row = sum(phi(X @ A_r.T) @ B_r.T for A_r, B_r in zip(A.chunk(t, 0), Bw.chunk(t, 1),
                                                                    strict=True))
    row_then_column = torch.cat([sum(phi(X_r @ A_c.T) for X_r, A_c in zip(X.chunk(t, 1), A.chunk(t, 1),
                                                                          strict=True)) @ Bw.T])
    assert torch.equal(column_then_row, Y), "column -> phi -> row, then one sum: exactly the MLP"
    assert not torch.equal(row_then_column, Y), "phi of partial sums is not the MLP"
    print(f"t = {t}: column->row max error {(column_then_row - Y).abs().max().item()}, "
          f"row->column (phi on partial sums) max error {(row_then_column - Y).abs().max().item()}")

# %% [markdown]
# On devices the sum is an all-reduce. Megatron packages it as two autograd functions, conjugate to each
# other, placed around every column -> row pair:
#
# | | forward | backward |
# |---|---|---|
# | $f$ = `copy_to_tensor_parallel_region` (in front of the column layer) | identity | all-reduce of $\partial L/\partial X$ |
# | $g$ = `reduce_from_tensor_parallel_region` (after the row layer) | all-reduce of the partial sums | identity |
#
# $f$'s backward all-reduce is needed because every rank's branch used the whole $X$, so each holds only
# its branch's share of $X$'s gradient. Attention is the same pattern: the fused query/key/value
# projection is column parallel (each rank gets $a/t$ whole heads), attention runs locally on those heads,
# and the output projection `dense` is row parallel. Per transformer block: 2 all-reduces forward, 2
# backward.
#
# **Sequence parallelism.** Between the pairs, the layer norms and the residual additions run on the
# whole activation, replicated on every rank: $t$ copies of the same work and of the same bytes.
# Korthikanti et al. split it along the sequence instead: $g$ becomes a **reduce-scatter** (each rank
# keeps the sum for $s/t$ positions) and $f$ an **all-gather** of the sequence (and their backwards the
# mirror ones). A reduce-scatter plus an all-gather move what one all-reduce moves, so the traffic is the
# same. The layer norms' weights then see only $s/t$ tokens per rank: their gradients are summed over the
# group after backward (`allreduce_sequence_parallel_grads`). One more detail, Megatron-LM's: the column
# layer needs the gathered input $[b, s, h]$ again in backward (for its weight gradient). Saving it would
# keep $t$ times what the rank holds, so it saves only its $s/t$ shard and all-gathers it once more in
# backward (`sequence_parallel_linear`): one more all-gather per column layer, for activation memory.
#
# ## 2. Four ranks, two layouts
#
# One cluster of 4 ranks serves both sizes: the whole world is one tensor-parallel group of 4, and ranks
# {0, 1} and {2, 3} are two groups of 2 that run the same experiment side by side.

# %%
ranks = start_ranks(4, timeout_s=120)
ranks

# %%
# %%px
import copy
import datetime

import numpy as np

from refimpl.comm import CommTracer, ops
from refimpl.config import ModelConfig
from refimpl.distributed.placement import module_shards
from refimpl.models import GPT, lm_loss
from refimpl.parallel.tensor_parallel import (
    allreduce_sequence_parallel_grads,
    apply_tensor_parallel,
    full_state_dict,
    tp_lm_loss,
)

timeout = datetime.timedelta(seconds=120)
pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]  # every rank
tp_groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
FACTOR = 4.0  # tolerance = FACTOR x the spread measured in this run (the numerics rule)


def spread_of(r32, r64):
    """Per quantity, max |one device in float32 - the same in float64|: one device's own rounding."""
    return {k: float((r32[k].detach().double() - r64[k].detach()).abs().max()) for k in r32}


def worst(ours, ref, spread):
    """The quantity with the largest |ours - ref| / (FACTOR x spread), and that ratio."""
    ratios = {k: float((ours[k].double() - ref[k].double()).abs().max()) / (FACTOR * spread[k])
              for k in ours}
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


# %% [markdown]
# ## 3. One layer at a time: the MLP and attention, against one device
#
# Every rank builds the same one-device GPT (seeded) and a copy turned tensor parallel by
# `apply_tensor_parallel`, whose rank $r$ keeps its block of each weight. We take block 0's MLP and its
# attention, feed the same input, and compare the output and every gradient with the one-device
# layer's, in the **box** each module says it holds (`module_shards`: the block of rows or columns of the
# global tensor). With sequence parallelism a rank's input and output are its $s/t$ positions.
#
# **How close is "equal"?** The ranks add the same products in another order (partial sums, then the
# all-reduce), so the results differ by rounding. The tolerance is measured in the same run: the
# one-device layer in float32 against itself in float64, per quantity, times `FACTOR = 4`.
#
# The tracer (`refimpl.comm.CommTracer`) records every collective with the bytes of the tensor handed
# to it, measured from the tensor.

# %%
# %%px
B, S = 2, 8
cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, max_seq_len=S)
H = cfg.hidden_size
dense = GPT(cfg, seed=1).to(device)
gen = torch.Generator().manual_seed(3)
x_in = torch.randn(B, S, H, generator=gen).to(device)       # what a layer receives
weights_c = torch.randn(B, S, H, generator=gen).to(device)  # loss = sum(c * y): every output counts


def run_layer(layer, x, c):
    """Output, input gradient, parameter gradients of ``sum(c * layer(x))``; the collectives per pass."""
    x = x.clone().requires_grad_()
    with CommTracer() as tracer:
        y = layer(x)
        tracer.step()
        (y * c).sum().backward()
        tracer.step()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    passes = [[(e.op, e.nbytes) for e in tracer.select(step=s)] for s in (0, 1)]
    return {"y": y.detach(), "x": x.grad, **grads}, passes


def one_device(kind, dtype):
    layer = getattr(copy.deepcopy(dense).to(dtype).layers[0], kind)
    return run_layer(layer, x_in.to(dtype), weights_c.to(dtype))[0]


layer_results = {}
for kind in ("mlp", "self_attention"):
    r32, r64 = one_device(kind, torch.float32), one_device(kind, torch.float64)
    spread = spread_of(r32, r64)
    for t, group in tp_groups.items():
        me = dist.get_rank(group)
        for sp in (False, True):
            tp = apply_tensor_parallel(copy.deepcopy(dense), tp_group=group, sequence_parallel=sp)
            layer = getattr(tp.layers[0], kind)
            seq = slice(me * S // t, (me + 1) * S // t) if sp else slice(None)  # this rank's positions
            ours, passes = run_layer(layer, x_in[:, seq], weights_c[:, seq])
            if sp:
                allreduce_sequence_parallel_grads(layer, group)  # the row bias saw s/t tokens
            boxes = {n: s.box.slices() for n, s in module_shards(layer).items()}
            boxes |= {"y": (slice(None), seq), "x": (slice(None), seq)}
            ref = {k: r32[k][b] for k, b in boxes.items()}
            name, ratio = worst(ours, ref, {k: spread[k] for k in boxes})
            layer_results[(kind, t, sp)] = {"worst": name, "ratio": ratio, "passes": passes}
            assert ratio <= 1, f"{kind} tp={t} sp={sp}: {name} is {ratio:.1f} x the tolerance"

act = B * S * H * x_in.element_size()  # bytes of one whole [b, s, h] activation
for (kind, t, sp), res in layer_results.items():
    fwd, bwd = res["passes"]
    if sp:  # the all-gather in front of the column layer, the reduce-scatter after the row layer; backward:
        # the row layer's all-gather, the column layer's input gathered again, its reduce-scatter
        assert fwd == [("all_gather", act), ("reduce_scatter", act)], (kind, t, fwd)
        assert bwd == [("all_gather", act), ("all_gather", act), ("reduce_scatter", act)], (kind, t, bwd)
    else:   # g forward, f backward
        assert fwd == bwd == [("all_reduce", act)], (kind, t, fwd, bwd)

# %%
for (kind, t, sp), res in ranks.run(lambda: layer_results)[0].items():
    fwd, bwd = res["passes"]
    print(f"{kind:14s} tp={t} sp={sp!s:5s}: largest error {res['ratio']:.2f} x tolerance ({res['worst']}) | "
          f"forward {fwd} | backward {bwd}")

# %% [markdown]
# Each layer matches one device within its tolerance, at both sizes, with and without sequence
# parallelism, and the tracer sees one collective of the whole activation each way, no more; with SP an
# all-gather and a reduce-scatter forward, and backward those two plus the column layer's second
# all-gather of its input.
#
# **What the whole GPT's calls move.** The tracer measured the payload of each layer's collective, from
# the tensor handed to it (`nbytes`: the input of an all-reduce or a reduce-scatter, the output of an
# all-gather). Now the whole tensor-parallel GPT (section 5 proves it equals one device): one forward and
# backward at $t = 2$ and 4, with and without sequence parallelism, every call of every rank recorded, and
# per op the count and the bytes compared with the planner's `tensor_parallel_collectives`, a formula
# written from the layers' code (`refimpl.planner.communication`):
#
# * without SP, all-reduces of $bsh$: the vocabulary-parallel embedding's sum, two per block forward
#   ($g$), two per block and the head's in backward ($f$); and the loss's three of $bs$ numbers;
# * with SP, the embedding **reduce-scatters** its partial lookups straight into the rank's $s/t$
#   positions (Megatron-Core's `reduce_scatter_embeddings`; backward: an all-gather of the gradient),
#   each block's pairs become all-gathers and reduce-scatters, the column layers gather their input again
#   in backward, and the layer norms' and row biases' gradients are summed after backward.

# %%
# %%px
from refimpl.planner import tensor_parallel_collectives, wire_bytes

ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(2)).to(device)
traffic = {}
for t, group in tp_groups.items():
    for sp in (False, True):
        model = apply_tensor_parallel(copy.deepcopy(dense), tp_group=group, sequence_parallel=sp)
        with CommTracer() as tracer:
            tp_lm_loss(model(ids), ids, tp_group=group, vocab_size=cfg.vocab_size).backward()
            if sp:
                allreduce_sequence_parallel_grads(model, group)
        measured = {op: (total.count, total.nbytes) for op, total in tracer.summary().items()}
        kw = dict(num_layers=cfg.num_layers, hidden_size=H, micro_batch=B, seq_len=S, tp=t)
        assert measured == tensor_parallel_collectives(sequence_parallel=sp, **kw), (t, sp, measured)
        assert measured != tensor_parallel_collectives(sequence_parallel=not sp, **kw), "tells SP apart"
        embedding = (tracer.events[0].op, tracer.events[0].nbytes)  # the first call of the forward
        assert embedding == ("reduce_scatter" if sp else "all_reduce", act), embedding
        traffic[(t, sp)] = {"measured": measured, "embedding": (*embedding, wire_bytes(*embedding, t)),
                            "ring model": {op: wire_bytes(op, n, t) for op, (_, n) in measured.items()}}

# %%
traffic = ranks.run(lambda: traffic)  # every rank's own record
assert all(r == traffic[0] for r in traffic), "every rank of a group hands the same payloads to its calls"
for (t, sp), res in traffic[0].items():
    calls = ", ".join(f"{op} {n} x = {b:,d} B (ring model sends {res['ring model'][op]:,.0f} B)"
                      for op, (n, b) in res["measured"].items())
    op, nbytes, ring = res["embedding"]
    print(f"tp={t} sp={sp!s:5s}: {calls}\n{'':17s}embedding forward: {op} of {nbytes:,d} B, "
          f"ring model sends {ring:,.0f} B per rank")

# %% [markdown]
# Every rank's calls, counted and sized from the tensors, equal the planner's count, at both sizes, with and
# without sequence parallelism.
#
# **Bytes on the wire are a model.** What a rank *sends* for a payload depends on the algorithm, and no
# backend reports it. The "ring model" figures above are what the bandwidth-optimal ring of chapter 02
# sends: $2\frac{t-1}{t}$ of the payload per rank for an all-reduce, $\frac{t-1}{t}$ for a reduce-scatter or
# an all-gather (`refimpl.comm.tracer.wire_bytes`). Chapter 02 measured that on our own ring, built from
# `isend`/`irecv`; the layers here call the backend's collectives, so for them it is a model, not a
# measurement. NCCL itself picks, per call, a ring, a tree or, on NVSwitch machines such as an HGX H100,
# NVLS (the switch does the reduction), and those send other amounts; gloo, on this CPU, has its own
# algorithms (its reduce-scatter is built from an all-reduce), so neither its bytes nor its timings say
# anything about NCCL.
#
# In the ring model, per block and per pass, tensor parallelism sends $2 \times 2\frac{t-1}{t}bsh$ elements
# per rank (attention and MLP), and sequence parallelism the same, plus $2 \times \frac{t-1}{t}bsh$ in
# backward for the two column layers' second all-gather. The embedding's forward *halves* under sequence
# parallelism: a reduce-scatter of $bsh$, $\frac{t-1}{t}bsh$, where the all-reduce sent $2\frac{t-1}{t}bsh$
# and the rank then kept only $1/t$ of the result. At $t = 4$ an all-reduce is 1.5 $bsh$ elements,
# *every layer, every micro-batch*, on the critical path: nothing else can run while the next layer waits
# for its input. That is why tensor parallelism stays inside a node (NVLink), and data parallelism goes
# across nodes.

# %% [markdown]
# ## 4. The fused query/key/value trap
#
# Our attention computes q, k and v with one fused `[3h, h]` linear, `query_key_value`. Column parallelism
# hands rank $r$ a contiguous block of $3h/t$ rows. Whether that block is *whole heads* depends on the
# order of the rows:
#
# * **Megatron's per-head layout** (ours, `refimpl.models.CausalSelfAttention`): the output is viewed as
#   `[b, s, a, 3, d]`, so rows $[3d\,i, 3d\,(i+1))$ are q, k and v of head $i$. A block of $3h/t$ rows is
#   q, k and v of $a/t$ whole heads: each rank computes its heads' attention alone.
# * **nanoGPT's layout**: `q, k, v = qkv.split(h, dim=-1)`, i.e. `[b, s, 3, a, d]`: all of q first, then
#   all of k, then all of v. The same row block gives rank 0 at $t = 2$ *all of q and half of k*, and no v.
#
# The same weights in nanoGPT's row order are an equally good model on one device. Split by plain rows, the
# second layout attends with the wrong vectors:

# %%
# %%px
def nanogpt_rows(tp_attention, full_attention, t, me):
    """Load this rank's plain row block of the fused weight in nanoGPT's [3, a, d] row order."""
    a, d = cfg.num_attention_heads, cfg.head_dim
    w = full_attention.query_key_value.weight.detach()  # [3h, h] in the per-head [a, 3, d] row order
    b = full_attention.query_key_value.bias.detach()
    w3 = w.view(a, 3, d, H).transpose(0, 1).reshape(3 * H, H)  # the same rows in nanoGPT's [3, a, d] order
    b3 = b.view(a, 3, d).transpose(0, 1).reshape(3 * H)
    rows = slice(me * 3 * H // t, (me + 1) * 3 * H // t)
    with torch.no_grad():
        tp_attention.query_key_value.weight.copy_(w3[rows])
        tp_attention.query_key_value.bias.copy_(b3[rows])


r32, r64 = one_device("self_attention", torch.float32), one_device("self_attention", torch.float64)
trap = {}
for t, group in tp_groups.items():
    tp = apply_tensor_parallel(copy.deepcopy(dense), tp_group=group)
    nanogpt_rows(tp.layers[0].self_attention, dense.layers[0].self_attention, t, dist.get_rank(group))
    out, _ = run_layer(tp.layers[0].self_attention, x_in, weights_c)
    trap[t] = {"error": (out["y"] - r32["y"]).abs().max().item(), "size": r32["y"].abs().max().item(),
               "tolerance": FACTOR * spread_of(r32, r64)["y"]}
    assert trap[t]["error"] > 100 * trap[t]["tolerance"], "the trap is not a rounding error"

# %%
for t, res in ranks.run(lambda: trap)[0].items():
    print(f"tp={t}, nanoGPT rows split by rows: attention output off by {res['error']:.3f} (outputs up to "
          f"{res['size']:.3f}; the tolerance the right split met: {res['tolerance']:.1e})")

# %% [markdown]
# Not a rounding error: the wrong split is off by more than the size of the outputs themselves. Nothing crashes,
# and the shapes are right: only a comparison with one device shows it. Converting a nanoGPT or Hugging
# Face checkpoint for Megatron therefore permutes the rows of the fused weight first (`[3, a, d]` to
# `[a, 3, d]`), or splits q, k and v separately.
#
# Below, every weight of block 0 as each rank holds it: the boxes the modules declare (gathered from the
# ranks at $t = 4$), coloured by rank, and for the fused qkv weight the rows' meaning in both layouts.

# %%
boxes_t4 = ranks.run(lambda: {n: (s.box.offsets, s.box.shape, s.box.global_shape) for n, s in
                              module_shards(apply_tensor_parallel(copy.deepcopy(dense),
                                                                  tp_group=tp_groups[4])).items()})
h_fig, a_fig, d_fig = 16, 4, 4  # the chapter's model: h = 16, a = 4 heads, d = 4
shown = {"layers.0.self_attention.query_key_value.weight": "query_key_value\n(column)",
         "layers.0.self_attention.dense.weight": "dense\n(row)",
         "layers.0.mlp.dense_h_to_4h.weight": "dense_h_to_4h\n(column)",
         "layers.0.mlp.dense_4h_to_h.weight": "dense_4h_to_h\n(row)",
         "embedding.word_embeddings.weight": "word_embeddings = tied output layer\n(vocabulary)",
         "layers.0.input_layernorm.weight": "layer norm\n(replicated)"}
colours = plt.get_cmap("tab10").colors
fig, axes = plt.subplots(1, len(shown) + 2, figsize=(13, 4.2),
                         gridspec_kw={"width_ratios": [1, 1, 1, 1, 4, 1, 1, 1]})
for ax, name in zip(axes, shown, strict=False):
    for r, boxes in enumerate(boxes_t4):
        offsets, shape, global_shape = boxes[name]
        (row0, col0), (rows, cols), (grows, gcols) = ((*v, fill)[:2] for v, fill in  # a 1-D weight: 1 column
                                                      ((offsets, 0), (shape, 1), (global_shape, 1)))
        if (rows, cols) == (grows, gcols):  # every rank holds all of it
            ax.add_patch(Rectangle((0, 0), cols, rows, facecolor="lightgrey", hatch="//", edgecolor="grey"))
        else:
            ax.add_patch(Rectangle((col0, row0), cols, rows, color=colours[r], alpha=0.8, label=f"rank {r}"))
    ax.set_xlim(0, gcols)
    ax.set_ylim(grows, 0)
    ax.set_aspect("auto")
    ax.set_title(shown[name], fontsize=7)
    ax.set_xlabel(f"[{grows}, {gcols}]", fontsize=7)
    ax.tick_params(labelsize=6)
for ax, (layout, title) in zip(axes[-2:], (("megatron", "qkv rows: Megatron\n[a, 3, d]"),
                                           ("nanogpt", "qkv rows: nanoGPT\n[3, a, d]")), strict=True):
    for row in range(3 * h_fig):
        if layout == "megatron":
            head, comp = row // (3 * d_fig), (row // d_fig) % 3
        else:
            comp, head = row // h_fig, (row % h_fig) // d_fig
        ax.add_patch(Rectangle((0, row), 1, 1, color=colours[head], alpha=(1.0, 0.6, 0.3)[comp]))
        if row % d_fig == 0:
            ax.text(0.5, row + d_fig / 2, f"{'qkv'[comp]}{head}", ha="center", va="center", fontsize=6)
    for r in range(1, 4):
        ax.axhline(r * 3 * h_fig / 4, color="black", lw=2)
    ax.set_xlim(0, 1)
    ax.set_ylim(3 * h_fig, 0)
    ax.set_xticks([])
    ax.set_title(title, fontsize=7)
    ax.set_xlabel("black: rank boundaries", fontsize=6)
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="upper right", fontsize=7, ncol=4)
fig.suptitle("block 0 at tp = 4: who holds what (hatched: replicated). Right: the 48 rows of the fused qkv "
             "weight, colour = head, shade = q/k/v", fontsize=8, y=0.02, va="bottom")
fig.tight_layout(rect=(0, 0.05, 1, 0.92))

# %% [markdown]
# Read it left to right: `query_key_value` and `dense_h_to_4h` are split by rows (their outputs),
# `dense` and `dense_4h_to_h` by columns (their inputs), the word embedding by rows (the vocabulary,
# section 6) and the layer norms are whole on every rank. In Megatron's layout each rank's quarter of
# the qkv rows is one head's q, k and v; in nanoGPT's, rank 0's quarter is q of heads 0-2.
#
# ## 5. The whole GPT, against one device and against PyTorch
#
# Now all of it: `apply_tensor_parallel` on a copy of the one-device GPT (embedding split by vocabulary,
# every block's attention and MLP, the output layer on the same vocabulary shard), its loss taken on the
# logits shard (`tp_lm_loss`, never the full logits). At $t = 2$ and 4, with and without sequence
# parallelism, with the output layer tied to the embedding and untied. The tolerance is per tensor as
# above (float32 against float64 on one device, `FACTOR = 4`); for the loss, whose float32 value often
# rounds exactly to the float64 one, at least one ulp.
#
# **PyTorch's own tensor parallelism** on the same weights: `parallelize_module` with `ColwiseParallel`
# for `query_key_value` and `dense_h_to_4h`, `RowwiseParallel` for `dense` and `dense_4h_to_h`, and the
# output layer column-parallel with its logits left sharded (`Shard(-1)`) for `loss_parallel`. Its
# layers turn their outputs back into plain local tensors (`use_local_output=True`, the default): on a CPU
# `scaled_dot_product_attention` does not accept DTensors, and attention only needs its local heads
# anyway; as with ours, each attention module is told it now has $a/t$ heads. With sequence parallelism
# the residual stream between the pairs is sharded along the sequence (`Shard(1)`): the column layers take
# it as their input layout (and all-gather it), the row layers reduce-scatter into it, the layer norms
# are `SequenceParallel` and the embedding's output is redistributed to it (`PrepareModuleOutput`).
# (Untied only: a DTensor weight cannot also be the plain embedding's.)
#
# Negative control: sequence parallelism *without* summing the layer norms' gradients over the group.

# %%
# %%px
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

tokens, labels = (torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(4))
                  .to(device) for _ in range(2))


def gpt_reference(config, dtype):
    model = GPT(config, seed=1).to(device, dtype)
    loss = lm_loss(model(tokens), labels)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def pytorch_tp(config, t, sp):
    """The one-device GPT under torch.distributed.tensor.parallel on a mesh of t ranks (sp: the sequence,
    dim 1, sharded between the pairs: the embedding's output redistributed, the layer norms SequenceParallel)."""
    mesh = init_device_mesh(device.type, (world_size // t, t), mesh_dim_names=("replica", "tp"))["tp"]
    model = GPT(config, seed=1).to(device)
    between = Shard(1) if sp else Replicate()  # the layout of the residual stream between the pairs
    plan = {"output_layer": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        plan |= {"embedding": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                 "final_layernorm": SequenceParallel()}
    for i in range(config.num_layers):
        plan |= {f"layers.{i}.self_attention.query_key_value": ColwiseParallel(input_layouts=between),
                 f"layers.{i}.self_attention.dense": RowwiseParallel(output_layouts=between),
                 f"layers.{i}.mlp.dense_h_to_4h": ColwiseParallel(input_layouts=between),
                 f"layers.{i}.mlp.dense_4h_to_h": RowwiseParallel(output_layouts=between)}
        if sp:
            plan |= {f"layers.{i}.input_layernorm": SequenceParallel(),
                     f"layers.{i}.post_attention_layernorm": SequenceParallel()}
    parallelize_module(model, mesh, plan)
    for block in model.layers:
        block.self_attention.num_heads = config.num_attention_heads // t
    with loss_parallel():
        loss = lm_loss(model(tokens), labels)
        loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = g.redistribute(placements=p.placements).to_local() if hasattr(g, "to_local") else g
    return loss.full_tensor(), grads


gpt_results = {}
for tied in (True, False):
    config = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, max_seq_len=S,
                         tie_word_embeddings=tied)
    (l32, g32), (l64, g64) = gpt_reference(config, torch.float32), gpt_reference(config, torch.float64)
    for t, group in tp_groups.items():
        boxes = {n: s.box.slices() for n, s in module_shards(
            apply_tensor_parallel(GPT(config, seed=1).to(device), tp_group=group)).items()}
        ref = {"loss": l32.detach(), **{n: g32[n][b] for n, b in boxes.items()}}
        spread = spread_of(ref, {"loss": l64, **{n: g64[n][b] for n, b in boxes.items()}})
        spread["loss"] = max(spread["loss"], float(np.spacing(np.float32(l32.item()))))  # at least 1 ulp
        variants = {"ours": (False, True), "ours, SP": (True, True), "SP, norms' grads not summed": (True, False)}
        for name, (sp, sum_grads) in variants.items():
            model = apply_tensor_parallel(GPT(config, seed=1).to(device), tp_group=group, sequence_parallel=sp)
            loss = tp_lm_loss(model(tokens), labels, tp_group=group, vocab_size=config.vocab_size)
            loss.backward()
            if sum_grads:
                allreduce_sequence_parallel_grads(model, group)
            params = dict(model.named_parameters())
            got = {"loss": loss.detach(), **{n: params[n].grad for n in boxes}}
            gpt_results[(tied, t, name)] = worst(got, ref, spread)
        for sp in (False, True) if not tied else ():
            loss, grads = pytorch_tp(config, t, sp)
            got = {"loss": loss.detach()}
            for n, b in boxes.items():  # DTensor keeps the embedding whole: compare our box of it
                got[n] = grads[n][b] if grads[n].shape == g32[n].shape else grads[n]
            gpt_results[(tied, t, "PyTorch parallelize_module" + (", SP" if sp else ""))] = worst(got, ref, spread)

for (tied, t, name), (where, ratio) in gpt_results.items():
    if name.startswith("SP, norms'"):
        assert ratio > 1, f"the negative control passed (tp={t}): the check cannot see that mistake"
    else:
        assert ratio <= 1, f"{name} tp={t} tied={tied}: {where} is {ratio:.1f} x the tolerance"

# %%
for (tied, t, name), (where, ratio) in ranks.run(lambda: gpt_results)[0].items():
    print(f"tied={tied!s:5s} tp={t} {name:28s}: largest |difference| / tolerance {ratio:8.2f} at {where}")

# %% [markdown]
# Our tensor-parallel GPT and PyTorch's both equal one device within the measured tolerance, at both
# sizes, and so does sequence parallelism. The largest ratios (printed) sit mostly in the layer norms'
# gradients: each is a sum over every token of the incoming gradient times the normalised input, and
# that incoming gradient is itself a sum of $t$ ranks' partial gradients (the backward all-reduce of
# $f$), added in another order than one device's single matmul; a long sum of terms of both signs
# loses the most digits. The negative control misses by far: the layer norms' weights would be stepped
# with the gradient of $s/t$ of the tokens, a different value on every rank.
#
# `full_state_dict` assembles the plain model's weights from the boxes (one all-reduce per sharded
# tensor), so a tensor-parallel run's weights are the one-device model's, bit for bit:

# %%
# %%px
tp4 = apply_tensor_parallel(copy.deepcopy(dense), tp_group=tp_groups[4], sequence_parallel=True)
assembled = full_state_dict(tp4, tp_groups[4])
assert assembled.keys() <= dense.state_dict().keys()
assert all(torch.equal(v, dense.state_dict()[k]) for k, v in assembled.items()), "bitwise"
if rank == 0:
    print(f"{len(assembled)} tensors assembled from 4 ranks, all equal to the one-device model bit for bit")

# %% [markdown]
# **Grouped-query attention** (the Llama form, chapter 01: $g$ key/value heads for $a$ query heads) keeps
# the same rule one level up: our fused `query_key_value` lays its rows out by *query group*, the $a/g$
# query heads of key/value head $j$, then its key, then its value, so a contiguous block of rows is whole
# groups whenever $t$ divides $g$, and the plain row split is right again. With fewer key/value heads than
# ranks ($g < t$, as MQA at any $t$) the $r = t/g$ ranks of a group share its key/value head. The weights
# stay split in contiguous blocks (each rank holds $1/r$ of its group's rows, so ZeRO, clipping and the
# checkpoint see every weight once); the projections are all-gathered and each rank keeps its $a/t$ query
# heads with its group's k and v (`SharedKeyValueQKV`, Megatron's sub-sharding of the activations). The
# trap is the backward of that gather: each shared k/v row is read by $r$ ranks, so its gradient is the
# *sum* of what they send back (a reduce-scatter). A replica that keeps only its own heads' share, the
# bug behind a diverging MQA run at tp > 1 (bigcode-project/Megatron-LM#35), trains without an error. Below:
# the Llama form with 4 query heads in 2 groups (RMSNorm, RoPE, SwiGLU with its gate and up rows
# interleaved for the same reason) at tp 2 (a whole group per rank) and tp 4 (two ranks per group),
# against one device, with and without sequence parallelism; then tp 4 with the k/v gradients not summed.

# %%
# %%px
from refimpl.config import LLAMA  # noqa: E402
from refimpl.parallel.tensor_parallel import gather_from_tensor_parallel_region  # noqa: E402

llama_cfg = ModelConfig(**LLAMA, num_layers=2, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                        max_seq_len=S)
(l32, g32), (l64, g64) = gpt_reference(llama_cfg, torch.float32), gpt_reference(llama_cfg, torch.float64)
llama_results = {}
for t in (2, 4):
    boxes = {n: s.box.slices() for n, s in module_shards(
        apply_tensor_parallel(GPT(llama_cfg, seed=1).to(device), tp_group=tp_groups[t])).items()}
    ref = {"loss": l32.detach(), **{n: g32[n][b] for n, b in boxes.items()}}
    spread = spread_of(ref, {"loss": l64, **{n: g64[n][b] for n, b in boxes.items()}})
    spread["loss"] = max(spread["loss"], float(np.spacing(np.float32(l32.item()))))  # at least 1 ulp
    for variant in ("", ", SP", ", k/v gradients not summed")[:3 if t == 4 else 2]:
        model = apply_tensor_parallel(GPT(llama_cfg, seed=1).to(device), tp_group=tp_groups[t],
                                      sequence_parallel=variant == ", SP")
        if "not summed" in variant:  # the replica bug: the gather's backward keeps this rank's share only
            for block in model.layers:
                block.self_attention.query_key_value.gather = gather_from_tensor_parallel_region
        loss = tp_lm_loss(model(tokens), labels, tp_group=tp_groups[t], vocab_size=llama_cfg.vocab_size)
        loss.backward()
        allreduce_sequence_parallel_grads(model, tp_groups[t])  # the RMSNorms' gradients under SP
        params = dict(model.named_parameters())
        qkv = [n for n in boxes if n.endswith("query_key_value.weight")]
        llama_results[f"tp {t}{variant}"] = (  # string keys: ipyparallel sorts them
            worst({"loss": loss.detach(), **{n: params[n].grad for n in boxes}}, ref, spread),
            worst({n: params[n].grad for n in qkv}, ref, spread))

# %%
llama_runs = ranks.run(lambda: llama_results)
for name in llama_runs[0]:
    (where, ratio), (_, qkv_ratio) = max((r[name] for r in llama_runs), key=lambda w: w[0][1])
    print(f"Llama form, GQA 4/2, {name}: largest |difference| / tolerance {ratio:.3g} at {where} "
          f"(fused qkv weights: {qkv_ratio:.3g})")
    if "not summed" in name:  # the negative control fails, and in the shared k/v rows' own gradients
        assert ratio > 1 and max(r[name][1][1] for r in llama_runs) > 1, name
    else:
        assert ratio <= 1, name

# %% [markdown]
# ## 6. The vocabulary-parallel loss
#
# The output layer is the largest matmul of a small model, and its output, the logits $[b, s, V]$, the
# largest activation. Split by the vocabulary, rank $r$ computes its logits shard
# $[b, s, V/t]$. The cross entropy $\log\sum_v e^{z_v} - z_{y}$ then needs three all-reduces of one
# number per token, never the shard's full partner: the max (for a stable exponent), the target logit
# (only its owner has it; the others add 0) and the sum of the exponentials. In backward each rank's
# gradient is its slice of $\mathrm{softmax}(z) - \mathrm{onehot}(y)$, local.
#
# We compare `vocab_parallel_cross_entropy` with `F.cross_entropy` on the logits gathered from the
# ranks, per token and in the gradients (tolerance: `F.cross_entropy` in float32 against float64), and
# measure what each keeps: the bytes saved for backward (`refimpl.measure.SavedTensorMeter`) and the
# largest tensor any operation creates (a `TorchDispatchMode` that watches every result).

# %%
# %%px
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from refimpl.measure import SavedTensorMeter
from refimpl.parallel.tensor_parallel import vocab_parallel_cross_entropy


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any aten operation returns while active."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.nbytes = max(self.nbytes, o.numel() * o.element_size())
        return out


def measured(loss_fn, z):
    """Loss per token, gradient, bytes saved for backward, largest tensor (forward and backward)."""
    z = z.clone().requires_grad_()
    holder = nn.Module()
    holder.layers = nn.ModuleList()  # the meter attributes to blocks; here there are none
    with SavedTensorMeter(holder) as meter, LargestTensor() as largest:
        loss = loss_fn(z)
        loss.sum().backward()
    return loss.detach(), z.grad, meter.report.total, largest.nbytes


V = 4096
vgen = torch.Generator().manual_seed(5)
full_logits = (3 * torch.randn(4, 64, V, generator=vgen)).to(device)  # [b, s, V], the same on every rank
target = torch.randint(0, V, (4, 64), generator=vgen).to(device)


def cross_entropy(z):  # [b, s, V] -> [b, s]
    return F.cross_entropy(z.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


vocab_results = {}
for t, group in tp_groups.items():
    me = dist.get_rank(group)
    cols = slice(me * V // t, (me + 1) * V // t)
    shard = full_logits[..., cols].contiguous()  # what this rank's output layer produced: [b, s, V/t]
    pieces = [torch.empty_like(shard) for _ in range(t)]
    ops.all_gather(pieces, shard, group=group)
    gathered = torch.cat(pieces, dim=-1)  # [b, s, V]: the logits no rank needs to hold
    ours = measured(lambda z: vocab_parallel_cross_entropy(z, target, tp_group=group), shard)  # noqa: B023
    full = measured(cross_entropy, gathered)
    full64 = measured(cross_entropy, gathered.double())
    tol = {"loss": FACTOR * (full[0].double() - full64[0]).abs().max().item(),
           "grad": FACTOR * (full[1].double() - full64[1]).abs().max().item()}
    err = {"loss": (ours[0].double() - full[0].double()).abs().max().item(),
           "grad": (ours[1].double() - full[1][..., cols].double()).abs().max().item()}
    assert all(err[k] <= tol[k] for k in err), (t, err, tol)
    assert ours[3] < full[3] and ours[2] < full[2], "ours neither keeps nor makes a [b, s, V] tensor"
    assert full[3] >= gathered.numel() * gathered.element_size(), "F.cross_entropy makes one"
    vocab_results[t] = {"err": err, "tol": tol, "saved": (ours[2], full[2]), "largest": (ours[3], full[3]),
                        "logits": (shard.numel() * 4, gathered.numel() * 4)}

# %%
for t, res in ranks.run(lambda: vocab_results)[0].items():
    print(f"tp={t}: |ours - F.cross_entropy| loss {res['err']['loss']:.1e} (tol {res['tol']['loss']:.1e}), "
          f"grad {res['err']['grad']:.1e} (tol {res['tol']['grad']:.1e})")
    print(f"       saved for backward: ours {format_bytes(res['saved'][0])}, full {format_bytes(res['saved'][1])}"
          f" | largest tensor: ours {format_bytes(res['largest'][0])}, full {format_bytes(res['largest'][1])}"
          f" | logits: shard {format_bytes(res['logits'][0])}, gathered {format_bytes(res['logits'][1])}")

# %% [markdown]
# The loss is `F.cross_entropy`'s within the measured tolerance, and the largest thing either pass keeps
# or makes is the $[b, s, V/t]$ shard (its softmax, saved for backward), $1/t$ of the full loss's. The
# gathered logits were built here only to have a reference; the model never builds them.
#
# ## 7. Activation memory per rank
#
# Tensor parallelism splits the matmuls' weights, and also the activations *inside* each column -> row
# pair: q, k, v, the attention output, the GeLU input and output are $1/t$ per rank. What lies between the
# pairs is whole on every rank: the layer norms' inputs and the inputs of the column layers. Sequence
# parallelism splits the layer norms along the sequence. We measure the bytes each block saves for
# backward (`SavedTensorMeter`, as in chapter 05) on one device and per rank at $t = 2, 4$, with and
# without SP, in float32 ($e$ = 4 bytes, FFN width $f = 4h$), and compare them with the planner
# (`refimpl.planner.activation_bytes_per_layer(..., tp=t, sequence_parallel=sp)`), which counts chapter
# 05's terms with each split tensor divided by $t$:
#
# | term (chapter 05) | one device | tensor parallel | + sequence parallel |
# |---|---|---|---|
# | 2 layer-norm inputs, their mean and rstd | $e(2sbh + 4sb)$ | whole | $/t$ |
# | the 2 column layers' inputs (qkv, MLP) | $2e\,sbh$ | whole | $/t$ (the shard, gathered again) |
# | q, k, v, attention output, log-sum-exp | $e(4sbh + asb)$ | $/t$ | $/t$ |
# | GeLU input and output | $2e\,sbf$ | $/t$ | $/t$ |
#
# On a CPU, whose fused attention kernel saves exactly its output and log-sum-exp, the measurement must
# equal the planner byte for byte (GPU attention kernels add a few small tensors). Korthikanti et al.'s
# formulas, for their 16-bit Megatron layer, are drawn beside them.

# %%
# %%px
from refimpl.planner import activation_bytes_per_layer, korthikanti_bytes_per_layer

act_cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_seq_len=64)
AB, AS = 2, 64
xa = torch.randint(0, 256, (AB, AS), generator=torch.Generator().manual_seed(6)).to(device)
one = GPT(act_cfg).to(device)
with SavedTensorMeter(one) as meter:
    lm_loss(one(xa), xa)
activation = {(1, False): meter.report.per_block()[0]}
for t, group in tp_groups.items():
    for sp in (False, True):
        model = apply_tensor_parallel(GPT(act_cfg).to(device), tp_group=group, sequence_parallel=sp)
        with SavedTensorMeter(model) as meter:
            tp_lm_loss(model(xa), xa, tp_group=group, vocab_size=act_cfg.vocab_size)
        blocks = meter.report.per_block()
        assert blocks[0] == blocks[1], "every block saves the same"
        activation[(t, sp)] = blocks[0]
planner = {(t, sp): activation_bytes_per_layer(act_cfg, micro_batch=AB, seq_len=AS, tp=t,
                                               sequence_parallel=sp).total for t, sp in activation}
korthikanti = {(t, sp): korthikanti_bytes_per_layer(seq_len=AS, micro_batch=AB, hidden_size=64, num_heads=4,
                                                    tp=t, sequence_parallel=sp) for t, sp in activation}
for t in tp_groups:
    assert activation[(t, False)] < activation[(1, False)] and activation[(t, True)] < activation[(t, False)]
if device.type == "cpu":
    assert activation == planner, (activation, planner)  # measured == planner, byte for byte
    assert all(activation[(t, True)] * t == activation[(1, False)] for t in tp_groups), "SP: all of it / t"

# %%
activation, planner, korthikanti = ranks.run(lambda: (activation, planner, korthikanti))[0]
sbh = 64 * 2 * 64
for key, nbytes in activation.items():
    t, sp = key
    print(f"tp={t} sp={sp!s:5s}: measured {nbytes:>9,d} B per block per rank = {nbytes / sbh:6.2f} sbh "
          f"({nbytes / activation[(1, False)]:4.0%} of one device) | planner {planner[key]:>9,d} B | "
          f"Korthikanti (16-bit) {korthikanti[key]:>9,d} B ({korthikanti[key] / korthikanti[(1, False)]:4.0%})")

fig, ax = plt.subplots(figsize=(7.5, 3.6))
keys = list(activation)
xs = range(len(keys))
ax.bar([x - 0.2 for x in xs], [activation[k] / 1024 for k in keys], width=0.4, label="measured (SavedTensorMeter)")
ax.bar([x + 0.2 for x in xs], [planner[k] / 1024 for k in keys], width=0.4, label="planner", alpha=0.7)
ax.plot(xs, [korthikanti[k] / 1024 for k in keys], "k_", markersize=25, mew=2,
        label="Korthikanti et al. (16-bit Megatron layer)")
ax.set_xticks(xs, [f"t={t}" + (", SP" if sp else "") for t, sp in keys])
ax.set_ylabel("KiB saved per block per rank")
ax.set_title("activation bytes per rank, float32, b=2, s=64, h=64, a=4")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# The measurement equals the planner at every size. **Against Korthikanti et al.** Their layer keeps
# $sbh(10 + 24/t + 5as/(ht))$ bytes per rank under tensor parallelism and $sbh(34/t + 5as/(ht))$ with
# sequence parallelism. The $10\,sbh$ that tensor parallelism cannot split are the two layer norms'
# inputs, the two column layers' inputs and the dropout masks; sequence parallelism splits all of them,
# the column inputs because they are saved as shards and gathered again in backward. Our block keeps
# other bytes than theirs (float32, no dropout, and fused attention, so no $5as^2b$ term: chapter 05),
# so their 16-bit count is another model, drawn for its trend; the fractions of one device printed
# above compare like with like. With sequence parallelism every saved tensor of our block is split, and
# its bytes per rank are one device's divided by $t$.

# %% [markdown]
# ## 8. Training at tp = 2
#
# `refimpl.parallel.parallelize` applies tensor parallelism as its first step (before data parallelism,
# which wraps the result): `ParallelDims(dp=2, tp=2)` on our 4 ranks is two tensor-parallel pairs,
# {0, 1} and {2, 3}, each a data-parallel replica reading half of the global batch. Its optimizer setup
# knows what tensor parallelism needs: the gradient norm for clipping counts each element of the model
# once (a replicated layer norm on one rank of the pair), and under SP the layer norms' gradients are
# summed over the pair before the step. The loop below is the trainer's step, read top to bottom
# (`refimpl.train.step`).
#
# The reference is one device on the whole global batch. The tolerance: the same one-device run with
# the batch in 2 micro-batches (a pure change of summation order) gives the **spread**, and the
# tensor-parallel losses must stay within `FACTOR x spread` of the one-device ones at every step. The
# negative control drops the layer norms' gradient sum under SP.

# %%
# %%px
from refimpl.config import OptimConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.distributed.mesh import ParallelDims
from refimpl.optim import lr_at, set_lr
from refimpl.parallel.parallelize import parallelize

train_cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=32)
optim_cfg = OptimConfig(lr=1e-2, warmup_steps=2)
batches = ShardedBatches(prepare_corpus(None).tokens, seq_len=32, global_batch_size=8, seed=0)
STEPS = 8
layout = ParallelDims(dp=2, tp=2).build(rank=rank, world_size=world_size, timeout_s=120)


def train(dims_or_groups, *, sp=False, micro=1, sum_sp_grads=True):
    """STEPS AdamW steps; the loss of the whole global batch at each step (averaged over dp)."""
    dims = getattr(dims_or_groups, "dims", dims_or_groups)  # the groups carry their layout
    par = parallelize(GPT(train_cfg).to(device), dims_or_groups, dims.config(sequence_parallel=sp))
    opt = par.build_optimizer(optim_cfg)
    dp_size, dp_rank = (layout.dims.dp, layout.coords.dp) if par.tp_group is not None else (1, 0)
    losses = []
    for step in range(STEPS):
        set_lr(opt.optimizer, lr_at(step, optim_cfg, STEPS))
        x, y = (v.to(device) for v in batches.batch(step, dp_rank, dp_size))  # this replica's half
        loss_sum = torch.zeros((), device=device)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            loss = par.loss(par.forward(xm), ym) / micro  # the vocab-parallel loss under TP
            par.mp.backward(loss)
            loss_sum += loss.detach()
        if par.sync is not None:
            par.sync.finish_gradient_synchronization()  # the data-parallel average
        if sum_sp_grads:
            opt.finish_gradients()  # SP: the layer norms' gradients summed over the tp pair
        opt.step(par.mp, grad_clip=optim_cfg.grad_clip)  # clip by the layout's norm, AdamW, zero_grad
        if par.group is not None:
            ops.all_reduce(loss_sum, group=par.group)  # the mean over the replicas' halves
            loss_sum /= dp_size
        losses.append(loss_sum.item())
    return losses


runs = {"one device": train(ParallelDims(dp=1)), "one device, 2 micro-batches": train(ParallelDims(dp=1), micro=2),
        "tp 2 x dp 2": train(layout), "tp 2 x dp 2, SP": train(layout, sp=True),
        "tp 2 x dp 2, SP, norms' grads not summed": train(layout, sp=True, sum_sp_grads=False)}


def drift(name):
    return max(abs(a - b) for a, b in zip(runs[name], runs["one device"], strict=True))


spread = drift("one device, 2 micro-batches")
TOL = FACTOR * spread
assert spread > 0, "a zero yardstick would make the tolerance vacuous"
assert drift("tp 2 x dp 2") <= TOL and drift("tp 2 x dp 2, SP") <= TOL, (spread, runs)
assert drift("tp 2 x dp 2, SP, norms' grads not summed") > TOL, "the negative control must fail"
assert runs["one device"][-1] < runs["one device"][0] - 1, "it trains"

# %%
runs, TOL = ranks.run(lambda: (runs, TOL))[0]
for name, losses in runs.items():
    d = max(abs(a - b) for a, b in zip(losses, runs["one device"], strict=True))
    print(f"{name:42s} {' '.join(f'{v:.4f}' for v in losses)} | max |diff| {d:.1e}")
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
ax.set_title("training at tp = 2 (x dp 2) and on one device")
bx.set_xlabel("step")
bx.set_ylabel("|loss - one device| (0 drawn at 1e-12)")
bx.set_title("difference from one device")
ax.legend(fontsize=7)
bx.legend(fontsize=6, loc="center right")
fig.tight_layout()

# %% [markdown]
# ## 9. Collective matmul: the all-gather hidden behind the matmul
#
# Under sequence parallelism the column layer cannot start before the all-gather of the sequence has
# finished, and the row layer's reduce-scatter cannot start before its matmul has: the communication
# sits on the critical path, twice per block each way. But a matmul of a gathered sequence is a matmul
# of each sequence chunk, so the collective can be cut into the $t$ steps of a ring and each step's
# transfer hidden behind the matmul of the chunk already there (Wang et al. 2023, "Overlap
# Communication with Dependent Computation via Decomposition in Large Deep Learning Models"; the
# "collective matmul" of *How to Scale Your Model*; Megatron's `--tp-comm-overlap`, torchtitan's async
# TP, `torch.distributed._symmetric_memory.fused_all_gather_matmul` on GPUs).
#
# `refimpl.parallel.tensor_parallel.collective_matmul`: rank $r$ sends to $r+1$ and receives from $r-1$,
# one `batch_isend_irecv` per step. **All-gather-matmul** (the column layer): at step $i$ rank $r$
# multiplies chunk $(r - i) \bmod t$, $Y_r[:, c] = X_c A_r^\top + b_r$, while passing it on.
# **Matmul-reduce-scatter** (the row layer): at step $i$ rank $r$ computes its term for destination
# $d = (r - 1 - i) \bmod t$, $X[:, d] B_r^\top$, while the running sum for $d$ arrives from $r - 1$;
# it adds the two and passes the sum on, which ends at $d$ after $t$ steps. Backward, each is the
# other: the input gradient of an all-gather-matmul is a matmul-reduce-scatter, and the reverse. The
# same bytes as the collectives, $t-1$ chunks of $s/t$ tokens per rank each way.
#
# The table below is recorded from the ring functions on the 4 ranks (which chunk each one multiplies at
# each step), not typed. Then the MLP of section 3 with `tp_comm_overlap` on: the same output and
# gradients as one device within the chapter's tolerance, and as the unfused layers up to the order of
# the sums (the ring adds the row layer's partial sums in ring order, so that side is not bitwise;
# tests/ranks/test_collective_matmul.py derives the bound).

# %%
# %%px
from refimpl.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tensor_parallel import collective_matmul as cm

seen = {"all-gather": [], "reduce-scatter": []}  # the chunk this rank multiplies at each step
probe = torch.zeros(1, 1, 1, device=device)
cm.ring_all_gather(probe, lambda c, x: seen["all-gather"].append(c) or x, group=dist.group.WORLD)
cm.ring_reduce_scatter(lambda d: seen["reduce-scatter"].append(d) or probe, group=dist.group.WORLD)


def cm_mlp(t, *, overlap, dtype=torch.float32):
    """Section 3's column -> GeLU -> row under SP over tp_groups[t] (t = 1: one device): output and grads."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32).to(device, dtype), nn.Linear(32, 16).to(device, dtype)
    g = torch.Generator().manual_seed(1)
    x_full, c_full = (torch.randn(2, 8, 16, generator=g).to(device, dtype) for _ in range(2))
    group = tp_groups.get(t)
    r = dist.get_rank(group) if t > 1 else 0
    if t > 1:
        fc1 = ColumnParallelLinear.from_linear(fc1, tp_group=group, sequence_parallel=True)
        fc2 = RowParallelLinear.from_linear(fc2, tp_group=group, sequence_parallel=True)
        fc1.tp_comm_overlap = fc2.tp_comm_overlap = overlap
    x = x_full.chunk(t, 1)[r].clone().requires_grad_()  # [2, 8/t, 16]: this rank's tokens
    y = fc2(F.gelu(fc1(x)))
    (y * c_full.chunk(t, 1)[r]).sum().backward()
    if t > 1:
        allreduce_sequence_parallel_grads(fc2, group)  # the row bias saw s/t tokens
    return {"y": y.detach(), "x": x.grad, "fc1.weight": fc1.weight.grad, "fc2.weight": fc2.weight.grad,
            "fc2.bias": fc2.bias.grad}


def box(name, ref, t, r):
    """This rank's box of the one-device quantity ``name``."""
    dim = {"y": 1, "x": 1, "fc1.weight": 0, "fc2.weight": 1}.get(name)
    return ref[name] if dim is None else ref[name].chunk(t, dim)[r]


one32, one64 = cm_mlp(1, overlap=False), cm_mlp(1, overlap=False, dtype=torch.float64)
cm_spread = spread_of(one32, one64)
cm_results = {}
for t in (2, 4):
    r = dist.get_rank(tp_groups[t])
    ring, unfused = cm_mlp(t, overlap=True), cm_mlp(t, overlap=False)
    ref = {k: box(k, one32, t, r) for k in one32}
    name, ratio = worst(ring, ref, cm_spread)
    assert ratio <= 1.0 and worst(ring, unfused, cm_spread)[1] <= 1.0, (t, name, ratio)
    cm_results[t] = {"worst vs one device": (name, ratio),
                     "max |ring - unfused|": max(float((ring[k] - unfused[k]).abs().max()) for k in ring)}

# %%
cm_out = ranks.run(lambda: (seen, cm_results))
for kind in ("all-gather", "reduce-scatter"):
    print(f"{kind}: the chunk each rank multiplies at steps 0..3")
    for r, (order, _) in enumerate(cm_out):
        print(f"  rank {r}: {order[kind]}")
for t in (2, 4):
    for r, (_, res) in enumerate(cm_out):
        name, ratio = res[t]["worst vs one device"]
        print(f"tp {t} rank {r}: worst |ring - one device| = {ratio:.2f} x tolerance ({name}); "
              f"max |ring - unfused| = {res[t]['max |ring - unfused|']:.1e}")

# %% [markdown]
# The ring pays off only when a transfer takes about as long as a chunk's matmul, and only if the
# machine can send while it computes: on a GPU the copy engines and NVLink do it; on this laptop's CPU
# over plain loopback the bytes are nearly free and the two cores are busy computing, so there is
# nothing to hide. Behind a rate-limited loopback (`refimpl.launch.shaped_link`, 1 Gbit/s) the
# communication sets the pace, and there tests/ranks/cli/test_overlap.py measures the ring against its serialized
# control (`serialized=True`: the same code, each transfer waited for before the chunk's matmul, bitwise
# the same results), and `python -m bench.bench_collective_matmul` against the unfused layers and
# DTensor's (bench/RESULTS.md). In the trainer: `--tp 2 --sequence-parallel --tp-comm-overlap`.

# %%
ranks.stop()

# %% [markdown]
# ## What to take away
#
# * A column-parallel layer followed by a row-parallel one needs one all-reduce forward ($g$) and one
#   backward ($f$): per block two each way, of $2\frac{t-1}{t}bsh$ elements per rank, on the critical
#   path. Keep $t$ within a node.
# * Sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather: the same bytes
#   (plus one all-gather per column layer in backward, to save only the input's shard; the embedding's
#   forward, a reduce-scatter, halves), activation bytes divided by $t$, and replicated parameters (layer
#   norms) whose gradients must be summed. Bytes on the wire are the ring model's: NCCL may run a tree or
#   NVLS instead.
# * A fused weight is split by what its rows *mean*: q, k and v of whole heads, not a plain row block.
# * The loss never needs the full logits: three all-reduces of one number per token.
# * Sequence parallelism's collectives can hide behind the matmuls they feed: cut into ring steps along the
#   sequence, each transfer travels while the chunk already there is multiplied (collective matmul).
#
# In the trainer: `python -m refimpl.train --nproc-per-node 4 --tp 2 --sequence-parallel` (with `--dp`
# given by the rest of the ranks, ZeRO-1/2 via `--zero-stage`).
#
# ## Exercise
#
# Open `exercises/06_tensor_parallel.py` and implement `f` (`copy_to_tensor_parallel_region`) and `g`
# (`reduce_from_tensor_parallel_region`), `ColumnParallelLinear` and `RowParallelLinear` built from a full
# `nn.Linear`, `vocab_parallel_cross_entropy`, sequence parallelism's three conjugates along the sequence
# (`scatter_to_sequence_parallel_region`, `gather_from_sequence_parallel_region`,
# `reduce_scatter_to_sequence_parallel_region`) and `shard_fused_qkv`, a rank's whole heads of a fused
# qkv weight saved in nanoGPT's order. Grade your work with
#
# ```
# make grade CH=06
# ```
#
# which runs each piece on a world of 4 ranks split into two tensor-parallel pairs with their own data,
# against the one-device layer or `F.cross_entropy`, and counts your collectives (an `f` that all-reduces
# in forward fails, and so does a layer that takes the world's rank instead of its group's).
#
# ## Questions
#
# 1. Why does a column-parallel layer followed by a row-parallel layer need only one all-reduce each way?
#    And why is the row-parallel bias added once, after the reduction, while a column-parallel bias is
#    added before any communication (what changes under sequence parallelism)?
# 2. What goes wrong if `f` all-reduces in forward?
# 3. Why must a fused qkv weight be split per head, and why does nothing crash when it is not?
# 4. What does sequence parallelism save, and what does it cost in bytes?
# 5. Why does the vocab-parallel loss need three all-reduces of `[b, s]` numbers forward, and none in
#    backward?
