"""Benchmark of chapter 07: ring attention with grouped-query attention, K/V at their own heads vs repeated.

    python -m bench.bench_ring_gqa [--cp 2 4] [--kv-heads 1 2] [--heads 8] [--repeats 7] [--warmup 2]
                                   [--micro-batch 2] [--seq-len 1024]

Forward + backward of one causal attention core with ``a`` query heads and ``g`` key/value heads (Ainslie
et al. 2023; ``g = 1``: multi-query) over a sequence split across ``cp`` CPU ranks (gloo, world = cp,
zig-zag layout), two ways on the same tensors:

* **K/V at g heads**: ``refimpl.parallel.context_parallel.ring_attention.ring_attention`` with
  ``k, v [b, g, s/cp, d]``: the blocks travel the ring at ``g`` heads and are expanded to ``a`` per block
  on arrival (what chapter 07 builds);
* **K/V repeated**: ``k.repeat_interleave(a/g, dim=1)`` (and ``v``) before the same ring, as picotron's
  context parallelism does (``repeat_kv`` ahead of its ring): the blocks travel at ``a`` heads, and
  autograd sums the repeated heads' gradients back.

Both must give the same output and dQ, dK, dV (gathered, against one-device SDPA with ``enable_gqa`` in
float64, within ``FACTOR`` x SDPA's own float32 spread measured in the same run); a negative control, K/V
*tiled* (``k.repeat(1, a/g, 1, 1)``: query head ``i`` reads key/value head ``i mod g`` instead of
``i // (a/g)``), must fail that check where ``g > 1``. Reported per layout:
bytes each rank sent (the ring's ``isend`` bytes, measured by ``refimpl.comm.CommTracer``) forward
and backward, against ``refimpl.planner.context_parallel_bytes`` at ``g`` and at ``a`` heads, and the
median forward + backward time over ``--repeats`` (after ``--warmup``; the two interleaved with a barrier
before each, the slowest rank): repeated / own heads. CPU: compare ratios only.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

KiB = 1024
FACTOR = 4.0  # as tests/ranks/test_ring_attention.py: error <= 4 x SDPA's own float32 spread
HEAD_DIM = 32


def _globals(b: int, a: int, g: int, s: int, d: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(b, a, s, d, generator=gen), "k": torch.randn(b, g, s, d, generator=gen),
            "v": torch.randn(b, g, s, d, generator=gen), "do": torch.randn(b, a, s, d, generator=gen)}


def _worker(ctx, heads: int, kv_heads: int, micro_batch: int, seq_len: int, repeats: int,
            warmup: int) -> dict:
    from refimpl.comm import CommTracer
    from refimpl.parallel.context_parallel import split_sequence
    from refimpl.parallel.context_parallel.ring_attention import ring_attention

    torch.set_num_threads(1)
    group, r, n = dist.group.WORLD, ctx.rank, ctx.world_size
    whole = _globals(micro_batch, heads, kv_heads, seq_len, HEAD_DIM)
    part = {k: split_sequence(t, dim=2, cp_rank=r, cp_size=n, layout="zigzag").to(ctx.device)
            for k, t in whole.items()}
    rep = heads // kv_heads

    def fwd_bwd(repeated: bool, tracer: CommTracer | None = None):
        q, k, v = (part[t].clone().requires_grad_() for t in "qkv")
        kk, vv = (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if repeated else (k, v)
        out = ring_attention(q, kk, vv, cp_group=group, causal=True)
        if tracer is not None:
            tracer.step()  # step 0: forward, step 1: backward
        (out * part["do"]).sum().backward()
        return out, q, k, v

    out: dict = {"results": {}, "sent": {}, "times": {False: [], True: []}}
    tiled = ring_attention(part["q"], part["k"].repeat(1, rep, 1, 1), part["v"].repeat(1, rep, 1, 1),
                           cp_group=group, causal=True)  # the negative control: the wrong heads' groups
    out["tiled"] = tiled.cpu().numpy()
    for repeated in (False, True):  # the check and the bytes before any timing
        with CommTracer() as tracer:
            o, q, k, v = fwd_bwd(repeated, tracer)
        out["sent"][repeated] = [tracer.measured_bytes_sent(step=s) for s in (0, 1)]
        out["results"][repeated] = {name: x.detach().cpu().numpy() for name, x in
                                    (("out", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    for i in range(warmup + repeats):
        for repeated in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            fwd_bwd(repeated)
            if i >= warmup:
                out["times"][repeated].append(time.perf_counter() - t0)
    out["median_s"] = {k: statistics.median(v) for k, v in out.pop("times").items()}
    return out


def _reference(heads: int, kv_heads: int, micro_batch: int, seq_len: int) -> tuple[dict, dict]:
    """One-device SDPA (enable_gqa) in float32 and float64: the values and float32's own spread."""
    whole = _globals(micro_batch, heads, kv_heads, seq_len, HEAD_DIM)
    res = {}
    for dtype in (torch.float32, torch.float64):
        q, k, v = (whole[t].detach().to(dtype, copy=True).requires_grad_() for t in "qkv")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (o * whole["do"].to(dtype)).sum().backward()
        res[dtype] = {"out": o.detach().double().numpy(), "dq": q.grad.double().numpy(),
                      "dk": k.grad.double().numpy(), "dv": v.grad.double().numpy()}
    spread = {t: float(np.abs(res[torch.float32][t] - res[torch.float64][t]).max())
              for t in res[torch.float64]}
    return res[torch.float64], spread


def run(sizes: list[int], kv: list[int], heads: int, micro_batch: int, seq_len: int, repeats: int,
        warmup: int) -> str:
    from refimpl.config import ModelConfig
    from refimpl.launch import run_ranks
    from refimpl.parallel.context_parallel import gather_sequence
    from refimpl.planner import context_parallel_bytes

    lines = ["| cp | kv heads | K/V | error / (4 x SDPA's fp32 spread) | sent per rank, forward | backward | "
             "formula (forward, backward) | forward + backward / own heads' |",
             "|---|---|---|---|---|---|---|---|"]
    for g in kv:
        ref, spread = _reference(heads, g, micro_batch, seq_len)
        for cp in sizes:
            per_rank = run_ranks(_worker, cp, heads, g, micro_batch, seq_len, repeats, warmup, timeout_s=900,
                                 backend="gloo")
            times = {rep: max(r["median_s"][rep] for r in per_rank) for rep in (False, True)}
            for repeated in (False, True):
                got = {t: gather_sequence([torch.from_numpy(r["results"][repeated][t]) for r in per_rank],
                                          dim=2, layout="zigzag").numpy() for t in ref}
                error = max(float(np.abs(got[t] - ref[t]).max()) / (FACTOR * spread[t]) for t in ref)
                heads_moved = heads if repeated else g
                cfg = ModelConfig(hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                                  num_key_value_heads=heads_moved, max_seq_len=seq_len)
                want = context_parallel_bytes(cfg, micro_batch=micro_batch, seq_len=seq_len, cp=cp,
                                              method="ring")
                sent = [r["sent"][repeated] for r in per_rank]
                fwd, bwd = max(s[0] for s in sent), max(s[1] for s in sent)
                equal = all(list(s) == [want["forward"], want["backward"]] for s in sent)
                moved = f"repeated to {heads}" if repeated else "own"
                lines.append(f"| {cp} | {g} of {heads} | {moved} | "
                             f"{error:.2f} | {fwd / KiB:,.0f} KiB | {bwd / KiB:,.0f} KiB | "
                             f"{want['forward'] / KiB:,.0f} / {want['backward'] / KiB:,.0f} KiB: "
                             f"{'equal' if equal else 'DIFFERENT'} | {times[repeated] / times[False]:.2f} |")
                if repeated and g > 1:
                    tiled = gather_sequence([torch.from_numpy(r["tiled"]) for r in per_rank], dim=2,
                                            layout="zigzag").numpy()
                    bad = float(np.abs(tiled - ref["out"]).max()) / (FACTOR * spread["out"])
                    lines.append(f"| {cp} | {g} of {heads} | negative control: tiled (head i reads kv head i "
                                 f"mod {g}) | {bad:.3g} ({'fails, as it must' if bad > 1 else 'PASSES'}) | "
                                 "- | - | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_ring_gqa", description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="context-parallel sizes (= ranks)")
    p.add_argument("--kv-heads", type=int, nargs="+", default=[1, 2], help="key/value heads")
    p.add_argument("--heads", type=int, default=8, help="query heads (head dim 32)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args(argv)
    if any(args.heads % g for g in args.kv_heads):
        p.error(f"--kv-heads must divide --heads {args.heads}")
    start = time.time()
    print(run(args.cp, args.kv_heads, args.heads, args.micro_batch, args.seq_len, args.repeats, args.warmup))
    print(f"\n({args.repeats} measured passes after {args.warmup} warm-up, interleaved; {args.micro_batch} "
          f"x {args.seq_len} tokens, {args.heads} query heads of {HEAD_DIM}, float32, zig-zag; gloo on CPU "
          f"ranks; torch {torch.__version__}, {platform.processor() or platform.machine()}; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
