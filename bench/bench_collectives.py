"""Benchmark of chapter 02: our ring all-reduce (isend/irecv in Python) against ``dist.all_reduce``.

    python -m bench.bench_collectives [--ranks 2 4] [--sizes 4 65536 1048576 16777216] [--repeats 15]

For each world size one set of CPU ranks (gloo) all-reduces float32 buffers of each size with
``refimpl.comm.ring.ring_all_reduce``, with ``torch.distributed.all_reduce`` and with the naive
all-reduce through rank 0 (``refimpl.comm.ring.naive_all_reduce``), **alternating** them call by call so
that all see the same machine load. Every call starts after a barrier and is timed on every rank; the
slowest rank's time is the call's time, and the median over the repeats (after a warm-up) is reported.

**Pinned to gloo on the CPU**, also on a GPU box: ``run_ranks(..., backend="gloo")``, and every buffer on
``ctx.device`` (the CPU under gloo). What it compares is our Python ring against gloo's all-reduce on the
same CPU; on GPUs the rings would race NCCL's kernels, another benchmark.

Printed: a markdown table with, per world size and size, the three medians and the ratios ring / torch
and naive / torch, and the bytes the busiest rank sends in the ring and rank 0 in the naive version,
**measured** by a ``refimpl.comm.tracer.CommTracer`` (the tensors handed to ``isend``/``send`` in one
extra traced call) and checked against the formulas (2(n-1)/n S when n divides the length, (n-1) S).
What ``dist.all_reduce`` sends is not measured (the tracer could only book the ring model). Then, per
world size, the alpha-beta model (``refimpl.planner.time_model``) fitted to a ping-pong between ranks 0 and
1, with its R² (how much of the measured times the fit explains; a low R² means the fitted alpha and beta
describe nothing). On CPU, compare ratios only; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

KIB, MIB = 2**10, 2**20


def _human(nbytes: float) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _worker(ctx, sizes: list[int], repeats: int, warmup: int) -> tuple[list[dict], object]:
    import torch.distributed as dist

    from refimpl.comm.ring import naive_all_reduce, ring_all_reduce
    from refimpl.comm.tracer import CommTracer
    from refimpl.measure import measure_p2p

    impls = {"ring": ring_all_reduce, "torch": lambda t: dist.all_reduce(t), "naive": naive_all_reduce}
    rows = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=ctx.device)  # finite sums
        times: dict[str, list[float]] = {k: [] for k in impls}
        for i in range(warmup + repeats):
            for name, fn in impls.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn(buf)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        slowest = {}
        for name, ts in times.items():  # each call lasts as long as its slowest rank
            t = torch.tensor(ts, dtype=torch.float64, device=ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[name] = statistics.median(t.tolist())
        sent = {}
        for name in ("ring", "naive"):  # one more call each, traced: the bytes this rank handed to (i)send
            with CommTracer() as tracer:
                impls[name](buf)
            sent[name] = torch.tensor([tracer.measured_bytes_sent()], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(sent[name], op=dist.ReduceOp.MAX)  # the busiest rank
        rows.append({"size": size, **slowest, "ring_sent": int(sent["ring"].item()),
                     "naive_sent": int(sent["naive"].item())})
    p2p = measure_p2p(repeats=repeats, warmup=warmup)  # ranks 0 <-> 1, 4 B .. 4 MiB, on the group's device
    return rows, p2p


def run(ranks: list[int], sizes: list[int], repeats: int, warmup: int) -> str:
    from refimpl.launch import run_ranks
    from refimpl.planner import ring_bytes_sent

    lines = [
        "| ranks | message | dist.all_reduce | ring (ours) | naive via rank 0 | ring / torch | "
        "naive / torch | ring: bytes sent by the busiest rank (measured) | naive: by rank 0 (measured) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    from refimpl.planner import fit_alpha_beta

    fits = []
    for world in ranks:
        rows, p2p = run_ranks(_worker, world, sizes, repeats, warmup, timeout_s=1800, backend="gloo")[0]
        fit = fit_alpha_beta(p2p.sizes_bytes, p2p.seconds)
        fits.append(f"- {world} ranks running, ping-pong 0 <-> 1: alpha = {fit.alpha_s * 1e6:.1f} us, "
                    f"beta = {fit.beta_bytes_per_s / 1e9:.2f} GB/s, R^2 (log T) = {fit.r2:.3f} "
                    f"(one-way times {', '.join(f'{t * 1e6:.0f}' for t in p2p.seconds)} us for "
                    f"{', '.join(_human(s) for s in p2p.sizes_bytes)})")
        for row in rows:
            numel = max(1, row["size"] // 4)
            s = numel * 4
            ring_bytes = max(ring_bytes_sent(numel, world, r, 4) for r in range(world))  # 2(n-1)/n S if even
            assert row["ring_sent"] == ring_bytes, (world, s, row["ring_sent"])  # measured = formula
            assert row["naive_sent"] == (world - 1) * s, (world, s, row["naive_sent"])
            lines.append(
                f"| {world} | {_human(s)} | {row['torch'] * 1e3:.3f} ms | {row['ring'] * 1e3:.3f} ms | "
                f"{row['naive'] * 1e3:.3f} ms | {row['ring'] / row['torch']:.2f} | "
                f"{row['naive'] / row['torch']:.2f} | {_human(row['ring_sent'])} | "
                f"{_human(row['naive_sent'])} |")
    return "\n".join(lines) + "\n\nAlpha-beta fit of a point-to-point ping-pong:\n" + "\n".join(fits)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_collectives", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 64 * KIB, MIB, 16 * MIB],
                   help="message sizes in bytes (float32 buffers)")
    p.add_argument("--repeats", type=int, default=15, help="measured calls per implementation and size")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.ranks, args.sizes, args.repeats, args.warmup)
    print(table)
    print(f"\n(median of {args.repeats} calls after {args.warmup} warm-up, implementations alternating; "
          f"gloo on CPU; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
