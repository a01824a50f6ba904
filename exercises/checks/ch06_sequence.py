"""Chapter 06's checks of sequence parallelism's conjugates and of the fused-qkv shard (re-exported as
tasks by ``exercises/checks/ch06.py``; the 4-rank world of two pairs: ``exercises.checks.ch06_harness``).

* ``scatter_to_sequence_parallel_region``, ``gather_from_sequence_parallel_region`` and
  ``reduce_scatter_to_sequence_parallel_region`` (Korthikanti et al. 2022) on integer-valued ``[b, s, h]``
  tensors with ``b = 2`` (so that a gather along dim 0 where dim 1 is meant shows), different per rank where
  the contract says so: forward and backward bit for bit against their definitions (my chunk of dim 1;
  the chunks side by side in rank order; my chunk of the sum over the pair), exactly the collective each
  contract names in each direction with the full tensor's bytes (a reduce-scatter built from an
  all-reduce sends twice the bytes and fails), the input never modified, the identity on a group of the
  rank alone, a sequence that does not divide (``ValueError``).
* ``shard_fused_qkv``: a fused ``[3h, h]`` weight and ``[3h]`` bias in nanoGPT's ``[3, a, d]`` row order;
  the shard, loaded into refimpl's tensor-parallel attention with ``a/t`` heads, must give this rank's
  heads of the one-device attention (nanoGPT's split of the same weights, in float64: the same arithmetic
  per head, compared within ``FACTOR`` x the float32-vs-float64 spread measured in the same run); a plain
  row block (rank 0: all of q and half of k) fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exercises.checks.ch06_harness import (
    TIMEOUT_S,
    WORLD,
    T,
    expect,
    groups,
    ints,
    pair_seed,
    raises_value_error,
)
from exercises.grading import load_module, probe_stub

B, S, H = 2, 6, 5  # b = 2: a gather along dim 0 instead of the sequence (dim 1) is visible
FACTOR = 4.0

# which: (x's sequence length, x the same on both ranks?, forward op, backward op, odd sizes must raise)
_SPEC = {
    "scatter_to_sequence_parallel_region": (S, True, None, "all_gather", True),
    "gather_from_sequence_parallel_region": (S // T, False, "all_gather", "reduce_scatter", False),
    "reduce_scatter_to_sequence_parallel_region": (S, False, "reduce_scatter", "all_gather", True),
}


def _want(which: str, xs: list, dys: list, r: int, ranks: range) -> tuple:
    """The contract's output and input gradient on rank ``r`` of ``ranks``."""
    n = len(ranks)
    if which.startswith("scatter"):
        c = S // n
        return xs[r][:, r * c:(r + 1) * c], torch.cat([dys[k] for k in ranks], dim=1)
    if which.startswith("gather"):
        c = xs[r].shape[1]
        return torch.cat([xs[k] for k in ranks], dim=1), sum(dys[k] for k in ranks)[:, r * c:(r + 1) * c]
    c = S // n
    return sum(xs[k] for k in ranks)[:, r * c:(r + 1) * c], torch.cat([dys[k] for k in ranks], dim=1)


def _sequence_on_rank(ctx, path: str, which: str) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    fn = getattr(load_module(path), which)
    g = groups()
    seq, same, fwd_op, bwd_op, odd = _SPEC[which]
    for group, ranks, where in ((g.pair, range(T), "on the pair"), (g.alone, range(1), "on a group of your "
                                                                                       "rank alone")):
        r, n = (g.rank if group is g.pair else 0), len(ranks)
        x_seq = seq if group is g.pair or not which.startswith("gather") else S
        out_seq = {"scatter": S // n, "gather": x_seq * n, "reduce": S // n}[which.split("_")[0]]
        xs = [ints((B, x_seq, H), pair_seed(1 if same else 1 + k, g), ctx.device) for k in range(T)]
        dys = [ints((B, out_seq, H), pair_seed(10 + k, g), ctx.device) for k in range(T)]
        if group is g.alone:
            xs, dys = [xs[g.rank]], [dys[g.rank]]
        x = xs[r].clone().requires_grad_()
        with CommTracer() as tracer:
            y = fn(x, group)
            tracer.step()
            if isinstance(y, torch.Tensor) and y.requires_grad:
                (y * dys[r]).sum().backward()  # not y.backward(dy): that imports sympy (1 s a rank)
        want_y, want_dx = _want(which, xs, dys, r, ranks)
        name = f"{which} {where}"
        assert isinstance(y, torch.Tensor) and y.shape == want_y.shape, (
            f"{name}: output of shape {tuple(getattr(y, 'shape', ()))}, want {tuple(want_y.shape)} "
            "(the sequence is dim 1 of [batch, seq, hidden])")
        assert torch.equal(x.detach(), xs[r]), f"{name} modified its input in place"
        assert torch.equal(y.detach(), want_y), f"{name}: the forward's values are not the contract's"
        assert x.grad is not None and x.grad.shape == x.shape, f"{name}: no gradient of x's shape reached x"
        own = dys[r][:, r * seq:(r + 1) * seq]
        if which.startswith("gather") and group is g.pair and torch.equal(x.grad, own):
            raise AssertionError(f"{name}: backward kept this rank's chunk of its own dy; every rank's "
                                 "branch used the whole sequence: the chunk of the sum over the ranks")
        assert torch.equal(x.grad, want_dx), f"{name}: the input gradient is not the contract's"
        if group is g.pair:
            full = B * S * H * 4
            expect(tracer, 0, [] if fwd_op is None else [(fwd_op, full)], f"{which} forward")
            expect(tracer, 1, [(bwd_op, full)], f"{which} backward")
    if odd:
        raises_value_error(lambda: fn(ints((B, S + 1, H), 0, ctx.device), g.pair),
                           f"{which} of a sequence of {S + 1} on 2 ranks", "it does not divide into 2 chunks")


def _run_sequence(path: str, which: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(getattr(load_module(path), which), torch.zeros(B, S, H), None)
    run_ranks(_sequence_on_rank, WORLD, path, which, timeout_s=TIMEOUT_S)


def check_scatter(path: str) -> None:
    _run_sequence(path, "scatter_to_sequence_parallel_region")


def check_gather(path: str) -> None:
    _run_sequence(path, "gather_from_sequence_parallel_region")


def check_reduce_scatter(path: str) -> None:
    _run_sequence(path, "reduce_scatter_to_sequence_parallel_region")


# ---- the fused qkv shard ---------------------------------------------------------------------------------


def _nanogpt_attention(x, w, b, heads):
    """One device, nanoGPT's split: q, k, v = qkv.split(h); causal SDPA per head. [b, s, h] -> [b, s, h]."""
    bsz, s, h = x.shape
    q, k, v = F.linear(x, w, b).split(h, dim=-1)                             # 3 x [b, s, h]
    q, k, v = (z.view(bsz, s, heads, h // heads).transpose(1, 2) for z in (q, k, v))  # [b, a, s, d]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)   # [b, s, a, d]


def _qkv_on_rank(ctx, path: str) -> None:
    from refimpl.config import ModelConfig
    from refimpl.models import GPT
    from refimpl.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    fn = load_module(path).shard_fused_qkv
    g = groups()
    heads, h, s = 4, 16, 8
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, max_seq_len=s)
    gen = torch.Generator().manual_seed(pair_seed(3, g))
    w, b = torch.randn(3 * h, h, generator=gen), torch.randn(3 * h, generator=gen)  # nanoGPT's [3, a, d] rows
    x = torch.randn(2, s, h, generator=gen)
    w0, b0 = w.clone(), b.clone()
    shard_w, shard_b = fn(w, num_heads=heads, group=g.pair), fn(b, num_heads=heads, group=g.pair)
    assert torch.equal(w, w0) and torch.equal(b, b0), "shard_fused_qkv modified the full tensor"
    for got, full in ((shard_w, w), (shard_b, b)):
        want = (3 * h // T, *full.shape[1:])
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == want, (
            f"shard_fused_qkv of a {tuple(full.shape)} tensor gave {tuple(getattr(got, 'shape', ()))}, "
            f"want {want} (3h/t rows)")
    attn = apply_tensor_parallel(GPT(cfg, seed=0), tp_group=g.pair).layers[0].self_attention
    mine = slice(g.rank * h // T, (g.rank + 1) * h // T)  # this rank's heads' features
    with torch.no_grad():
        attn.query_key_value.weight.copy_(shard_w)
        attn.query_key_value.bias.copy_(shard_b)
        attn.dense.weight.copy_(torch.eye(h)[:, mine])  # dense = identity: its all-reduce lays the pair's
        attn.dense.bias.zero_()                         # heads side by side (the others add zeros)
        got = attn(x)                                   # [b, s, h]: every head, from both ranks
        ref32 = _nanogpt_attention(x, w, b, heads).reshape(2, s, h)
        ref64 = _nanogpt_attention(x.double(), w.double(), b.double(), heads).reshape(2, s, h)
    spread = float((ref32.double() - ref64).abs().max())
    assert spread > 0, "grader: float32 equals float64 here; no spread to derive a tolerance from"
    for k, rank_heads in enumerate((slice(0, h // T), slice(h // T, h))):
        err = float((got[..., rank_heads].double() - ref64[..., rank_heads]).abs().max())
        assert err <= FACTOR * spread, (
            f"with your shard, rank {k} of the pair computes other heads than heads {k * heads // T}.."
            f"{(k + 1) * heads // T - 1} of the one-device model (off by {err:.3g}, tolerance "
            f"{FACTOR * spread:.3g}): each rank needs q, k and v of its own whole heads, in the order "
            "refimpl's attention reads them")
    raises_value_error(lambda: fn(torch.zeros(9, 3), num_heads=3, group=g.pair),
                       "shard_fused_qkv with 3 heads on 2 ranks", "whole heads cannot be split into 2")


def check_qkv(path: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(lambda: load_module(path).shard_fused_qkv(torch.zeros(12, 4), num_heads=2, group=None))
    run_ranks(_qkv_on_rank, WORLD, path, timeout_s=TIMEOUT_S)
