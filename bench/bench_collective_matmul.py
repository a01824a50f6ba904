"""Benchmark of chapter 06's collective matmul: the ring against the unfused sequence-parallel layers and
DTensor's tensor parallelism, on plain loopback and behind shaped links.

    python -m bench.bench_collective_matmul [--links none 400mbit 1gbit] [--repeats 3]

One sequence-parallel MLP (column -> GeLU -> row, no bias; tp 2, 512 tokens per rank, hidden 512, 1024 MLP
columns per rank; forward and backward), four ways on the same tensors: ``collective matmul``
(``refimpl.parallel.tensor_parallel.collective_matmul``: ``all_gather_matmul`` then
``matmul_reduce_scatter``), ``ring, serialized`` (the same code with ``serialized=True``: each transfer
waited for before the chunk's matmul, the overlap's control), ``unfused`` (our sequence-parallel layers: an
all-gather then the matmul, the matmul then a reduce-scatter) and ``DTensor`` (``parallelize_module`` with
``ColwiseParallel(input_layouts=Shard(1))`` / ``RowwiseParallel(output_layouts=Shard(1))``). ``none`` is the
machine's own loopback, a rate runs the ranks in a private network namespace whose loopback is shaped to it
(``run_ranks(..., link=...)``, ``refimpl.launch.shaped_link``). Each measurement is one ``run_ranks``: the
four kinds of step interleaved, a barrier before each, 5 of each after a warm-up, the slowest rank's median
per kind, the ring's results checked bitwise equal to its serialized control's; ``--repeats`` measurements per
cell give each kind's median time over the unfused layers' and the spread (min-max). CPU: ratios only.
gloo's reduce-scatter is an all-reduce underneath (twice the bytes of a ring's), so on CPU the unfused and
DTensor rows pay for that too; the ring against its serialized control is the overlap alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.launch import run_ranks
from refimpl.launch.shaped_link import check_link, shaped_link_unavailable
from refimpl.parallel.tensor_parallel import reduce_scatter_to_sequence_parallel_region
from refimpl.parallel.tensor_parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from refimpl.parallel.tensor_parallel.sequence_parallel_linear import linear_with_sequence_parallel_gather

TOKENS, HIDDEN, FFN, REPEATS = 512, 512, 1024, 5  # per rank: s/t tokens, ffn/t columns
KINDS = ("collective matmul", "ring, serialized", "unfused", "DTensor")


class _MLP(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * FFN, bias=False), nn.Linear(2 * FFN, HIDDEN, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(w1)
            self.fc2.weight.copy_(w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _ours(kind: str, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One forward of the MLP on this rank's ``[1, s/t, h]``, the ring or the unfused layers."""
    if kind == "unfused":
        h = linear_with_sequence_parallel_gather(x, w1, None, None)                   # [1, s, ffn/t]
        return reduce_scatter_to_sequence_parallel_region(F.linear(F.gelu(h), w2), None)  # [1, s/t, h]
    serialized = kind == "ring, serialized"
    h = all_gather_matmul(x, w1, group=None, serialized=serialized)                    # [1, s, ffn/t]
    return matmul_reduce_scatter(F.gelu(h), w2, group=None, serialized=serialized)     # [1, s/t, h]


def _step(kind: str, x: torch.Tensor, grad: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], dtensor: Any):
    def run() -> list[torch.Tensor]:
        xx = x.clone().requires_grad_()
        if kind == "DTensor":
            dtensor.zero_grad(set_to_none=True)
            out = dtensor(xx)
        else:
            w1, w2 = (t.clone().requires_grad_() for t in w)
            out = _ours(kind, xx, w1, w2)
        (out * grad).sum().backward()
        assert xx.grad is not None
        return [out.detach(), xx.grad]
    return run


def worker(ctx: Any) -> dict:
    """Per rank: the median seconds of each kind of step and whether the ring equals its control bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    t = ctx.world_size
    gen = torch.Generator().manual_seed(0)  # the whole weights, the same on every rank
    w1_full = torch.randn(t * FFN, HIDDEN, generator=gen) / HIDDEN**0.5       # [ffn, h]
    w2_full = torch.randn(HIDDEN, t * FFN, generator=gen) / (t * FFN)**0.5    # [h, ffn]
    mine = torch.Generator().manual_seed(ctx.rank + 1)
    x, grad = (torch.randn(1, TOKENS, HIDDEN, generator=mine) for _ in range(2))  # [1, s/t, h]
    w = (w1_full.chunk(t, 0)[ctx.rank], w2_full.chunk(t, 1)[ctx.rank])  # [ffn/t, h], [h, ffn/t]
    dtensor = parallelize_module(_MLP(w1_full, w2_full), init_device_mesh("cpu", (t,)),
                                 {"fc1": ColwiseParallel(input_layouts=Shard(1)),
                                  "fc2": RowwiseParallel(output_layouts=Shard(1))})
    steps = {kind: _step(kind, x, grad, w, dtensor) for kind in KINDS}
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    ends: dict[str, list[torch.Tensor]] = {}
    for i in range(REPEATS + 1):
        for kind, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            ends[kind] = step()
            if i:
                times[kind].append(time.perf_counter() - start)
    equal = all(torch.equal(a, b) for a, b in zip(ends[KINDS[0]], ends[KINDS[1]], strict=True))
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "equal": equal}


def measure(link: str | None, repeats: int) -> dict[str, list[float]]:
    """``repeats`` measurements behind ``link`` (None: plain): per kind, its time / the unfused layers'."""
    from bench import bench_collective_matmul as this  # the worker by its importable name, not __main__'s

    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        per_rank = run_ranks(this.worker, 2, link=link, timeout_s=300, backend="gloo", priority=10)
        assert all(r["equal"] for r in per_rank), "the serialized control changed the results"
        slowest = {kind: max(r["median"][kind] for r in per_rank) for kind in KINDS}
        for kind in KINDS:
            ratios[kind].append(slowest[kind] / slowest["unfused"])
    return ratios


def run(links: list[str | None], repeats: int) -> str:
    why = shaped_link_unavailable()
    rows = ["| link | collective matmul / unfused | ring, serialized / unfused | DTensor / unfused | "
            "collective matmul / its serialized control |", "|---|---|---|---|---|"]
    for link in links:
        if link is not None and why is not None:
            rows.append(f"| {link} | - | - | - | {why} |")
            continue
        r = measure(link, repeats)
        control = [a / b for a, b in zip(r["collective matmul"], r["ring, serialized"], strict=True)]
        cells = [*(r[kind] for kind in ("collective matmul", "ring, serialized", "DTensor")), control]
        rows.append(f"| {link or 'plain loopback'} | "
                    + " | ".join(f"{statistics.median(c):.2f} ({min(c):.2f} - {max(c):.2f})" for c in cells)
                    + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_collective_matmul",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--links", nargs="+", default=["none", "400mbit", "1gbit"],
                   help="'none' (plain loopback) or rates tc takes (400mbit, 1gbit)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per link")
    args = p.parse_args(argv)
    try:
        links = [None if link == "none" else check_link(link) for link in args.links]
    except ValueError as exc:
        p.error(str(exc))
    start = time.time()
    print(run(links, args.repeats))
    print(f"\n(median (min - max) of {args.repeats} measurements per link, each the slowest rank's median of "
          f"{REPEATS} interleaved steps of each kind after a warm-up, 2 gloo ranks at raised priority; torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f} at the end; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
