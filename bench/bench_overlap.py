"""Benchmark of chapters 03, 04 and 07: each overlap of communication with computation against its
serialized control, on plain loopback and behind shaped links.

    python -m bench.bench_overlap [--links none 400mbit 1gbit] [--repeats 3]

The workers of ``refimpl.parallel.overlap`` (DP's bucketed all-reduce during backward against waiting in
each gradient hook; ZeRO-3's prefetch of the next unit against none; ring attention's send-while-compute
against waiting for each exchange) on 2 gloo ranks: ``none`` is the machine's own loopback, a rate runs the
ranks in a private network namespace whose loopback is shaped to it (``run_ranks(..., link=...)``,
``refimpl.launch.shaped_link``). Each measurement is one ``run_ranks`` (5 interleaved steps of each kind
after a warm-up, the slowest rank's medians, outputs checked bitwise equal); ``--repeats`` measurements per
cell give the median ratio overlapped / serialized and its spread (min-max). CPU: ratios only. Where the
machine cannot shape a link the shaped rows say why.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from refimpl.launch import run_ranks
from refimpl.launch.shaped_link import check_link, shaped_link_unavailable
from refimpl.parallel.overlap import data_parallel_overlap, overlap_ratio, ring_overlap, zero3_overlap

WORKERS = {"DP bucketed all-reduce (ch. 03)": data_parallel_overlap,
           "ZeRO-3 prefetch (ch. 04)": zero3_overlap,
           "ring attention (ch. 07)": ring_overlap}


def measure(worker, link: str | None, repeats: int) -> list[float]:
    """``repeats`` ratios overlapped / serialized of ``worker`` on 2 ranks behind ``link`` (None: plain)."""
    ratios = []
    for _ in range(repeats):
        per_rank = run_ranks(worker, 2, link=link, timeout_s=300, backend="gloo", priority=10)
        assert all(r["equal"] for r in per_rank), "the serialized control changed the results"
        ratios.append(overlap_ratio(per_rank))
    return ratios


def run(links: list[str | None], repeats: int) -> str:
    why = shaped_link_unavailable()
    rows = ["| overlap | link | overlapped / serialized (median) | spread (min - max) | measurements |",
            "|---|---|---|---|---|"]
    for name, worker in WORKERS.items():
        for link in links:
            if link is not None and why is not None:
                rows.append(f"| {name} | {link} | - | {why} | 0 |")
                continue
            ratios = measure(worker, link, repeats)
            rows.append(f"| {name} | {link or 'plain loopback'} | {statistics.median(ratios):.2f} | "
                        f"{min(ratios):.2f} - {max(ratios):.2f} | {len(ratios)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--links", nargs="+", default=["none", "400mbit", "1gbit"],
                   help="'none' (plain loopback) or rates tc takes (400mbit, 1gbit)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell")
    args = p.parse_args(argv)
    try:
        links = [None if link == "none" else check_link(link) for link in args.links]
    except ValueError as exc:
        p.error(str(exc))
    start = time.time()
    print(run(links, args.repeats))
    print(f"\n({args.repeats} measurements per cell, each 5 interleaved steps of each kind after a warm-up, "
          f"2 gloo ranks at raised priority; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
