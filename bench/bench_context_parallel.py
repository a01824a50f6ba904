"""Benchmark of chapter 07: ring attention vs Ulysses vs an all-gather of K/V, and one-device SDPA.

    python -m bench.bench_context_parallel [--cp 2 4] [--repeats 9] [--warmup 2] [--micro-batch 2]
                                           [--seq-len 1024]

Forward + backward of one causal attention layer's core (``q, k, v [b, a, s, d] -> out``, the heads and
head dim of the course's default GPT, float32) over a sequence split across ``cp`` CPU ranks (gloo,
world = cp), three ways, each on the same global tensors:

* **ring** (Liu et al. 2023): ``refimpl.parallel.context_parallel.ring_attention.ring_attention``,
  zig-zag layout (Brandon et al. 2023), K/V blocks round the ring by ``isend``/``irecv``, lse-merged;
* **Ulysses** (Jacobs et al. 2023): ``refimpl.parallel.context_parallel.ulysses_attention``, contiguous
  layout, all-to-all to head shards and back (four each way);
* **all-gather K/V**: the naive baseline written here (``allgather_kv_attention``): all-gather K and V
  over the group, the local (zig-zag) queries attend to the whole K/V with
  ``F.scaled_dot_product_attention`` under the causal mask of their global positions; backward is
  autograd's, the K/V gradients reduce-scattered back to their owners.

Before anything is timed each method's output and dQ, dK, dV, gathered, must equal one-device SDPA of the
whole sequence in float64 within ``FACTOR`` x the spread (SDPA float32 vs float64) measured in the same
run; a negative control (the baseline's mask built from contiguous positions) must fail that check.

Reported: the median forward + backward time over ``--repeats`` (after ``--warmup``), methods interleaved
with a barrier before each, the slowest rank, **over** one-device SDPA on the whole sequence (rank 0, timed
in the same loop while the others wait); bytes each rank sent per layer, forward and backward, traced by
``refimpl.comm.CommTracer`` (the ring's ``isend`` bytes measured; Ulysses' all-to-alls and the
baseline's all-gathers / reduce-scatters booked by the tracer's ring model, as torch does not say what
gloo sends) against ``refimpl.planner.context_parallel_bytes`` (ring, Ulysses) and
``allgather_kv_bytes`` (the baseline, stated here); the ring forward's exposed transfer
(``RingTimeline.exposed_transfer_seconds``, the transfer time not hidden behind the step's compute)
as a share of its forward, per rank the median over the passes. Exposed time includes
waiting for a neighbour that has not reached its send yet: with more ranks than free cores that is the
scheduler's doing as much as the wire's. A rank waiting in a barrier or an ``irecv`` sleeps (gloo), so
the one-device pass on rank 0 has the cores the other ranks leave. CPU: compare ratios only.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; the tensors on
``ctx.device``, the CPU under gloo): the ratios compare implementations on the same CPU ranks.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from refimpl.comm import ops
from refimpl.parallel.context_parallel import gather_sequence, sequence_positions

KiB = 1024
FACTOR = 4.0  # stated, as in tests/ranks/test_ring_attention.py: error <= 4 x SDPA's own float32 spread
METHODS = {"ring": "zigzag", "ulysses": "contiguous", "all-gather K/V": "zigzag"}  # method -> layout


class _AllGatherSequence(torch.autograd.Function):
    """All-gather of this rank's ``[b, a, s/cp, d]`` into ``[cp, b, a, s/cp, d]``; backward reduce-scatters
    the gradient, ``[cp, ...] -> [...]``, each rank keeping the sum over ranks of its own block's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))          # [cp b, a, s/cp, d]: gloo's layout
        ops.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(n, *x.shape)                                # [cp, b, a, s/cp, d]

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        dx = dout.new_empty(dout.shape[1:])                         # [b, a, s/cp, d]
        ops.reduce_scatter_tensor(dx, dout.flatten(0, 1).contiguous(), group=ctx.group)  # [cp b, a, s/cp, d]
        return dx, None


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           cp_group: dist.ProcessGroup | None, causal: bool, layout: str = "zigzag",
                           positions_layout: str | None = None) -> torch.Tensor:
    """The naive context parallelism: every rank gathers the whole K and V, then plain attention.

    ``q, k, v``: this rank's ``[b, a, s/cp, d]`` in ``layout``; returns its rows of
    ``softmax(Q K^T / sqrt(d) + M) V`` for the whole sequence, ``M`` the causal mask of the rank's global
    query positions (``sequence_positions``) against ``0..s-1``. ``positions_layout`` only for the
    negative control (a mask built from the wrong positions). Forward sends ``(cp-1)/cp`` of the whole K
    and V (ring model), backward as much in dK/dV, and every rank holds the whole ``[b, a, s, d]`` K/V.
    """
    n, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    s = n * q.shape[2]
    whole = [gather_sequence(list(_AllGatherSequence.apply(t, cp_group).unbind(0)), dim=2, layout=layout)
             for t in (k, v)]                                       # K, V: [b, a, s, d] in sequence order
    mask = None
    if causal:
        pos = sequence_positions(seq_len=s, cp_rank=r, cp_size=n, layout=positions_layout or layout)
        mask = pos.to(q.device)[:, None] >= torch.arange(s, device=q.device)[None, :]  # [s/cp, s]
    return F.scaled_dot_product_attention(q, *whole, attn_mask=mask)


def allgather_kv_bytes(*, micro_batch: int, heads: int, head_dim: int, seq_len: int, cp: int,
                       element_size: int) -> dict[str, int]:
    """The baseline's bytes per rank and layer (ring model): two all-gathers of ``cp x`` forward and two
    reduce-scatters of ``cp x`` backward, ``(cp-1)/cp`` of each: ``2 (cp-1) p x`` each way, with
    ``x = b a (s/cp) d`` (the ring's forward bytes; its backward sends twice that, K/V again + dK/dV)."""
    x = micro_batch * heads * (seq_len // cp) * head_dim
    return {"forward": 2 * (cp - 1) * element_size * x, "backward": 2 * (cp - 1) * element_size * x}


def _globals(b: int, a: int, s: int, d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(b, a, s, d, generator=g) for n in ("q", "k", "v", "do")}


def _worker(ctx, micro_batch: int, seq_len: int, repeats: int, warmup: int) -> dict:
    from refimpl.comm import CommTracer
    from refimpl.config import ModelConfig
    from refimpl.parallel.context_parallel import RingTimeline, split_sequence, ulysses_attention
    from refimpl.parallel.context_parallel.ring_attention import ring_attention

    torch.set_num_threads(1)
    cfg = ModelConfig(max_seq_len=seq_len)
    group, r, n = dist.group.WORLD, ctx.rank, ctx.world_size
    whole = {k: t.to(ctx.device) for k, t in _globals(micro_batch, cfg.num_attention_heads, seq_len,
                                                       cfg.head_dim).items()}
    parts = {lay: {k: split_sequence(t, dim=2, cp_rank=r, cp_size=n, layout=lay) for k, t in whole.items()}
             for lay in set(METHODS.values())}
    fns = {"ring": lambda q, k, v, tl: ring_attention(q, k, v, cp_group=group, causal=True, timeline=tl),
           "ulysses": lambda q, k, v, tl: ulysses_attention(q, k, v, cp_group=group, causal=True),
           "all-gather K/V": lambda q, k, v, tl: allgather_kv_attention(q, k, v, cp_group=group, causal=True)}

    def fwd_bwd(name: str, tracer: CommTracer | None = None, timeline: RingTimeline | None = None):
        p = parts[METHODS[name]]
        q, k, v = (p[t].clone().requires_grad_() for t in "qkv")
        out = fns[name](q, k, v, timeline)
        if tracer is not None:
            tracer.step()                                  # step 0: forward, step 1: backward
        (out * p["do"]).sum().backward()
        return out, q, k, v

    out: dict = {"results": {}, "sent": {}, "times": {m: [] for m in [*METHODS, "one device"]}, "exposed": []}
    for name in METHODS:                                   # the check (and the bytes) before any timing
        with CommTracer() as tracer:
            o, q, k, v = fwd_bwd(name, tracer)
        out["results"][name] = {t: x.detach().cpu().numpy() for t, x in (("out", o), ("dq", q.grad),
                                                                          ("dk", k.grad), ("dv", v.grad))}
        out["sent"][name] = [tracer.bytes_sent(step=s) for s in (0, 1)]
        out["sent"][name + " measured"] = [tracer.measured_bytes_sent(step=s) for s in (0, 1)]
    p = parts["zigzag"]
    bad = allgather_kv_attention(p["q"], p["k"], p["v"], cp_group=group, causal=True,
                                 positions_layout="contiguous")
    out["results"]["negative control"] = {"out": bad.cpu().numpy()}
    for i in range(warmup + repeats):
        for name in [*METHODS, "one device"]:
            dist.barrier()
            timeline = RingTimeline() if name == "ring" else None
            t0 = time.perf_counter()
            if name != "one device":
                fwd_bwd(name, timeline=timeline)
            elif r == 0:                                   # the whole sequence on one process
                q, k, v = (whole[t].clone().requires_grad_() for t in "qkv")
                (F.scaled_dot_product_attention(q, k, v, is_causal=True) * whole["do"]).sum().backward()
            elapsed = time.perf_counter() - t0
            if i >= warmup and (name != "one device" or r == 0):
                out["times"][name].append(elapsed)
                if timeline is not None:
                    spans = timeline.spans
                    forward = max(sp.end for sp in spans) - min(sp.start for sp in spans)
                    out["exposed"].append(timeline.exposed_transfer_seconds() / forward)
    out["median_s"] = {m: statistics.median(t) for m, t in out.pop("times").items() if t}
    out["exposed_share"] = statistics.median(out.pop("exposed"))
    return out


def _reference(micro_batch: int, seq_len: int, heads: int, head_dim: int) -> dict:
    """One device, float32 and float64: SDPA's output and dQ, dK, dV of the whole sequence."""
    t = _globals(micro_batch, heads, seq_len, head_dim)
    refs = {}
    for dtype in (torch.float32, torch.float64):
        q, k, v = (t[n].to(dtype, copy=True).requires_grad_() for n in "qkv")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (o * t["do"].to(dtype)).sum().backward()
        refs[dtype] = {n: x.detach().double().numpy() for n, x in (("out", o), ("dq", q.grad), ("dk", k.grad),
                                                                    ("dv", v.grad))}
    return refs


def _error_ratio(per_rank: list[dict], name: str, layout: str, refs: dict) -> float:
    """Max over out, dQ, dK, dV of error vs float64 SDPA / (FACTOR x SDPA's float32 spread)."""
    worst = 0.0
    for n in per_rank[0]["results"][name]:
        whole = gather_sequence([torch.from_numpy(p["results"][name][n]) for p in per_rank], dim=2,
                                layout=layout).double().numpy()
        spread = float(np.abs(refs[torch.float32][n] - refs[torch.float64][n]).max())
        worst = max(worst, float(np.abs(whole - refs[torch.float64][n]).max()) / (FACTOR * spread))
    return worst


def _formula(name: str, cfg, micro_batch: int, seq_len: int, cp: int) -> dict[str, int]:
    from refimpl.planner import context_parallel_bytes

    if name == "all-gather K/V":
        return allgather_kv_bytes(micro_batch=micro_batch, heads=cfg.num_attention_heads,
                                  head_dim=cfg.head_dim, seq_len=seq_len, cp=cp, element_size=4)
    return context_parallel_bytes(cfg, micro_batch=micro_batch, seq_len=seq_len, cp=cp, method=name)


def run(sizes: list[int], micro_batch: int, seq_len: int, repeats: int, warmup: int) -> str:
    from refimpl.config import ModelConfig
    from refimpl.launch import run_ranks

    cfg = ModelConfig(max_seq_len=seq_len)
    refs = _reference(micro_batch, seq_len, cfg.num_attention_heads, cfg.head_dim)
    lines = ["| cp | method | forward + backward / one-device SDPA | error / (4 x SDPA's fp32 spread) | "
             "sent per rank, forward | backward | formula (forward, backward) | exposed ring transfer |",
             "|---|---|---|---|---|---|---|---|"]
    for cp in sizes:
        per_rank = run_ranks(_worker, cp, micro_batch, seq_len, repeats, warmup, timeout_s=600,
                             backend="gloo")
        control = _error_ratio(per_rank, "negative control", "zigzag", refs)
        if not control > 1.0:
            raise SystemExit(f"cp = {cp}: the negative control (a mask from the wrong positions) passed the "
                             f"equality check (ratio {control:.3g}): the check cannot fail")
        one = per_rank[0]["median_s"]["one device"]
        lines.append(f"| {cp} | one-device SDPA (whole sequence) | 1.000 | - | - | - | - | - |")
        for name, layout in METHODS.items():
            ratio = _error_ratio(per_rank, name, layout, refs)
            if ratio > 1.0:
                raise SystemExit(f"cp = {cp}: {name} differs from one-device SDPA: error {ratio:.3g} x the "
                                 f"allowed {FACTOR:g} x spread; not timing a wrong implementation")
            slowest = max(p["median_s"][name] for p in per_rank)
            sent = [p["sent"][name] for p in per_rank]
            measured = [p["sent"][name + " measured"] for p in per_rank]
            plan = _formula(name, cfg, micro_batch, seq_len, cp)
            equal = all(s == [plan["forward"], plan["backward"]] for s in sent)
            how = "measured (isend)" if measured == sent else "ring model of the traced collectives"
            same = "" if all(s == sent[0] for s in sent) else " (ranks differ)"
            exposed = ("per rank " + ", ".join(f"{p['exposed_share']:.1%}" for p in per_rank)
                       + " of its forward" if name == "ring" else "-")
            lines.append(f"| {cp} | {name} | {slowest / one:.2f} | {ratio:.2f} | "
                         f"{sent[0][0] / KiB:,.0f} KiB{same} | {sent[0][1] / KiB:,.0f} KiB, {how} | "
                         f"{plan['forward'] / KiB:,.0f} / {plan['backward'] / KiB:,.0f} KiB: "
                         f"{'equal' if equal else 'DIFFERENT'} | {exposed} |")
        lines.append(f"| {cp} | negative control: all-gather, mask from contiguous positions | - | "
                     f"{control:.3g} (fails, as it must) | - | - | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_context_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="context-parallel sizes (= ranks)")
    p.add_argument("--repeats", type=int, default=9, help="timed forward + backward passes per method")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024, help="the whole sequence (each rank holds s/cp)")
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.cp, args.micro_batch, args.seq_len, args.repeats, args.warmup)
    print(table)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\n(median of {args.repeats} interleaved passes after {args.warmup} warm-up, slowest rank; "
          f"causal, {args.micro_batch} x {args.seq_len} tokens, default GPT heads and head dim, float32; "
          f"gloo on CPU ranks, 1 thread each; torch {torch.__version__}, {machine}; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
