"""Benchmark of chapters 03, 04, 07, 08 and 09: each overlap of communication with computation against its
serialized control, on plain loopback and behind shaped links, and the planner's step time against both.

    python -m bench.bench_overlap [--links none 400mbit 1gbit] [--repeats 3] [--only pipeline]

The workers of ``refimpl.parallel.overlap`` (DP's bucketed all-reduce during backward against waiting in
each gradient hook; ZeRO-3's prefetch of the next unit against none; ring attention's send-while-compute
against waiting for each exchange; the MoE dispatch beside a shared expert against waiting for the tokens
first; the pipeline's transfers waited for when needed against before every action, interleaved 1F1B and
plain 1F1B) on 2 gloo ranks: ``none`` is the machine's own loopback, a rate runs the
ranks in a private network namespace whose loopback is shaped to it (``run_ranks(..., link=...)``,
``refimpl.launch.shaped_link``). Each measurement is one ``run_ranks`` (5 interleaved steps of each kind,
the pipeline's 10, after a warm-up, the slowest rank's medians, outputs checked bitwise equal);
``--repeats`` measurements per cell give the median ratio overlapped / serialized and its spread
(min-max). CPU: ratios only. Where the machine cannot shape a link the shaped rows say why. For DP and
ZeRO-3 behind a shaped link, the planner's step time (``refimpl.planner.step_time.layer_stack_step``, from
the step's compute timed in the same rounds and the link's rate) against each measurement: predicted /
measured - 1, the median over the measurements, overlapped and serialized.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import torch

from refimpl.launch import run_ranks
from refimpl.launch.shaped_link import RATE, check_link, shaped_link_unavailable
from refimpl.parallel.overlap import (
    data_parallel_overlap,
    moe_dispatch_overlap,
    overlap_ratio,
    pipeline_overlap,
    ring_overlap,
    zero3_overlap,
)
from refimpl.planner.step_time import layer_stack_step, prediction_error

WORKERS = {"DP bucketed all-reduce (ch. 03)": data_parallel_overlap,
           "ZeRO-3 prefetch (ch. 04)": zero3_overlap,
           "ring attention (ch. 07)": ring_overlap,
           "MoE dispatch beside a shared expert (ch. 09)": moe_dispatch_overlap,
           "pipeline transfers, interleaved 1F1B (ch. 08)": pipeline_overlap,
           "pipeline transfers, plain 1F1B (ch. 08)": functools.partial(pipeline_overlap, schedule="1f1b",
                                                                        virtual_stages=1)}
PREDICTED = {data_parallel_overlap: ("dp", 4), zero3_overlap: ("zero3", 6)}  # the workers' layer stacks
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits_per_s(link: str) -> float:
    """``link`` (``400mbit``, ``1gbit``) in bits per second."""
    m = RATE.match(link)
    assert m is not None, link  # check_link's
    return float(m.group(1)) * UNITS[m.group(3)]


def measure(worker, link: str | None, repeats: int) -> tuple[list[float], list[dict[str, float]]]:
    """``repeats`` ratios overlapped / serialized of ``worker`` on 2 ranks behind ``link`` (None: plain),
    and for a worker the planner predicts behind a shaped link, each measurement's prediction error."""
    ratios, errors = [], []
    for _ in range(repeats):
        per_rank = run_ranks(worker, 2, link=link, timeout_s=300, backend="gloo", priority=10)
        assert all(r["equal"] for r in per_rank), "the serialized control changed the results"
        ratios.append(overlap_ratio(per_rank))
        if worker in PREDICTED and link is not None:
            timed = {k: max(r["median"][k] for r in per_rank) for k in per_rank[0]["median"]}
            name, layers = PREDICTED[worker]
            predicted = layer_stack_step(name, layers=layers, width=1024, compute_s=timed["compute"],
                                         rate_bits_per_s=rate_bits_per_s(link), backend="gloo")
            errors.append(prediction_error(predicted, timed))
    return ratios, errors


def _planner_cell(errors: list[dict[str, float]]) -> str:
    if not errors:
        return "-"
    return ", ".join(f"{k} {statistics.median(e[k] for e in errors):+.1%}"
                     for k in ("overlapped", "serialized"))


def run(links: list[str | None], repeats: int, only: str = "") -> str:
    why = shaped_link_unavailable()
    rows = ["| overlap | link | overlapped / serialized (median) | spread (min - max) | measurements | "
            "planner predicted / measured - 1 (median) |",
            "|---|---|---|---|---|---|"]
    for name, worker in WORKERS.items():
        for link in links if only in name else []:
            if link is not None and why is not None:
                rows.append(f"| {name} | {link} | - | {why} | 0 | - |")
                continue
            ratios, errors = measure(worker, link, repeats)
            rows.append(f"| {name} | {link or 'plain loopback'} | {statistics.median(ratios):.2f} | "
                        f"{min(ratios):.2f} - {max(ratios):.2f} | {len(ratios)} | {_planner_cell(errors)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--links", nargs="+", default=["none", "400mbit", "1gbit"],
                   help="'none' (plain loopback) or rates tc takes (400mbit, 1gbit)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell")
    p.add_argument("--only", default="", help="the rows whose overlap's name contains this text")
    args = p.parse_args(argv)
    try:
        links = [None if link == "none" else check_link(link) for link in args.links]
    except ValueError as exc:
        p.error(str(exc))
    start = time.time()
    print(run(links, args.repeats, args.only))
    print(f"\n({args.repeats} measurements per cell, each 5 interleaved steps of each kind (the "
          "pipeline's 10) after a warm-up, "
          f"2 gloo ranks at raised priority; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
