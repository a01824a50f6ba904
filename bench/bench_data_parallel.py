"""Benchmark of chapter 03: DataParallelBucket against torch's DistributedDataParallel, side by side.

    python -m bench.bench_data_parallel [--ranks 2 4] [--steps 12] [--warmup 3]

For each world size one set of CPU ranks (gloo) builds the same GPT twice from the same seed, one wrapped in
``refimpl.parallel.data_parallel.DataParallelBucket``, one in ``torch.nn.parallel.DistributedDataParallel``,
both with the same bucket cap, and trains both on the same shards, **alternating** steps (ours, DDP,
ours, DDP, ...) so that both see the same machine load. A step is forward + backward + gradient
synchronisation + AdamW, timed on every rank; after the warm-up the median over steps is taken per rank,
and the slowest rank's median is the step time (the ranks wait for each other at every all-reduce).

Printed: a markdown table with, per world size and bucket cap, both medians, their ratio (ours / DDP; the
goal is <= 1.10), our bucket count, and the fraction of our communication left *exposed* after backward
(``SyncTimeline.exposed_fraction``: the part of the time a bucket's all-reduce is in flight that
lies after the end of the autograd pass; median over the measured steps). DDP's exposure is not observable
from outside its C++ reducer without changing it, so it is not reported. On CPU, compare ratios only;
absolute times depend on the machine and its load.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; models and batches on
``ctx.device``, the CPU under gloo): the ratio ours / DDP is measured on the same CPU ranks, and a GPU run
of the same comparison would need CUDA-event timing (docs/ARCHITECTURE.md, "GPUs").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MB = 2**20


def _worker(ctx, caps_mb: list[float], steps: int, warmup: int, micro_batch: int, seq_len: int) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from refimpl.config import ModelConfig, OptimConfig
    from refimpl.models import GPT, lm_loss
    from refimpl.optim import build_optimizer
    from refimpl.parallel.data_parallel import DataParallelBucket

    cfg = ModelConfig(max_seq_len=seq_len)  # the course's default GPT: 4 layers, hidden 128, tied
    g = torch.Generator().manual_seed(ctx.rank)
    data = [torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g).to(ctx.device)
            for _ in range(steps + warmup)]
    rows = []
    for cap in caps_mb:
        ours_model, ddp_model = GPT(cfg, seed=0).to(ctx.device), GPT(cfg, seed=0).to(ctx.device)
        ours = DataParallelBucket(ours_model, bucket_cap_mb=cap)
        ddp = DDP(ddp_model, bucket_cap_mb=cap)
        runs = {"ours": (ours, build_optimizer(ours_model, OptimConfig()), []),
                "ddp": (ddp, build_optimizer(ddp_model, OptimConfig()), [])}
        exposed = []
        for i, batch in enumerate(data):
            for name, (wrapper, opt, times) in runs.items():
                torch.distributed.barrier()  # both start each step together on every rank
                t0 = time.perf_counter()
                loss = lm_loss(wrapper(batch[:, :-1]), batch[:, 1:])
                loss.backward()
                if name == "ours":
                    wrapper.finish_gradient_synchronization()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    if name == "ours":
                        exposed.append(wrapper.last_timeline.exposed_fraction())
        rows.append({"cap_mb": cap, "buckets": ours.num_buckets, "grad_bytes": ours.grad_bytes,
                     "ours_s": statistics.median(runs["ours"][2]), "ddp_s": statistics.median(runs["ddp"][2]),
                     "exposed": statistics.median(exposed)})
    return rows


def run(ranks: list[int], caps_mb: list[float], steps: int, warmup: int, micro_batch: int,
        seq_len: int) -> str:
    from refimpl.launch import run_ranks

    lines = [
        "| ranks | bucket cap | our buckets | ours: median step | DDP: median step | ours / DDP | "
        "our comm. exposed after backward |",
        "|---|---|---|---|---|---|---|",
    ]
    for world in ranks:
        per_rank = run_ranks(_worker, world, caps_mb, steps, warmup, micro_batch, seq_len, timeout_s=1800,
                             backend="gloo")
        for k, cap in enumerate(caps_mb):
            ours = max(r[k]["ours_s"] for r in per_rank)
            theirs = max(r[k]["ddp_s"] for r in per_rank)
            exposed = statistics.median(r[k]["exposed"] for r in per_rank)
            row = per_rank[0][k]
            buckets = f"{row['buckets']} ({row['grad_bytes'] / MB:.2f} MB grads)"
            lines.append(f"| {world} | {cap:g} MB | {buckets} | {ours * 1e3:.1f} ms | "
                         f"{theirs * 1e3:.1f} ms | {ours / theirs:.3f} | {exposed:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_data_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--caps-mb", type=float, nargs="+", default=[25.0, 1.0])
    p.add_argument("--steps", type=int, default=12, help="measured steps per implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.ranks, args.caps_mb, args.steps, args.warmup, args.micro_batch, args.seq_len)
    print(table)
    print(f"\n({args.steps} measured steps after {args.warmup} warm-up, alternating ours/DDP; default GPT, "
          f"{args.micro_batch} x {args.seq_len} tokens per rank per step; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
