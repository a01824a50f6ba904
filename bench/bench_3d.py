"""Benchmark of chapter 12: the 3D trainer's layouts at world size 8, and the planner against the runs.

    python -m bench.bench_3d [--steps 6] [--warmup 2] [--repeats 3] [--quick]

One set of 8 CPU ranks (gloo, one thread each, ``refimpl.launch.run_ranks``) trains the same GPT
(``MODEL``: 4 blocks, width 64, 4 heads, 64 tokens, global batch 16, AdamW, clipping at 1.0) through
``refimpl.train.train`` at the ``dp x tp x pp`` layouts of ``LAYOUTS`` (ZeRO-1 at one, bf16 at one,
one with ``cp 2``), ``--steps`` steps each, no checkpoint. Per layout:

1. **Step time**: per rank the median of the step durations after ``--warmup`` steps (from the records'
   ``elapsed_s``), the slowest rank's; as a ratio to ``8x1x1`` measured in the same run. 8 ranks share the
   machine's cores, so a CPU figure is a ratio, never an absolute time. ``--repeats`` rounds of all the
   layouts, one after the other: the ratio's median and its range over the rounds (a shared box's drift).
2. **Planner vs measured**: ``refimpl.planner.predict_run`` for every rank against ``metrics.jsonl``'s
   ``bytes_sent`` per process group (the tracer: point-to-point sends measured, collectives by the ring
   model), every step; the largest difference over ranks and steps per group (0: equal), and the bytes of
   the rank that sends most. The schedule's bubble (``bubble_formula``) against the measured
   ``pipeline_idle`` (the idle share of the pp ranks from the executor's events, median of the timed
   steps): timing on a shared CPU (transfer delays, 8 processes on the cores), so reported, not asserted.

``--quick``: the tiny model of tests/planner/ranks/test_planner_3d.py, 3 steps, 1 warm-up, one round (a smoke
run).

**Pinned to gloo on the CPU**, also on a GPU box: ``run_ranks(..., backend="gloo")`` gives every rank the
CPU as ``ctx.device``, which the trainer builds on. Eight ranks would not find eight GPUs on most boxes, and
the figures here are CPU ratios and bytes; a GPU's are bench/gpu/check.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from refimpl.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig

WORLD = 8


def _run_config(*, layers: int, hidden: int, seq_len: int, batch: int) -> TrainConfig:
    """A GPT of ``layers`` blocks of width ``hidden``, 4 heads, ``seq_len`` tokens, a global batch of
    ``batch`` sequences, AdamW at 1e-3 after 1 warm-up step (its corpus, steps and folder set per run)."""
    return TrainConfig(model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                                         max_seq_len=seq_len),
                       data=DataConfig(seq_len=seq_len, global_batch_size=batch),
                       optim=OptimConfig(lr=1e-3, warmup_steps=1), log_every=1000)


MODEL = _run_config(layers=4, hidden=64, seq_len=64, batch=16)
QUICK = _run_config(layers=4, hidden=32, seq_len=16, batch=8)
LAYOUTS = {  # dp x tp x pp -> the trainer's layout at world size 8
    "8x1x1": ParallelConfig(dp=8),
    "4x2x1": ParallelConfig(tp=2),
    "2x2x2 ZeRO-1": ParallelConfig(tp=2, pp=2, zero_stage=1, microbatches=2),
    "1x4x2": ParallelConfig(tp=4, pp=2, microbatches=4),
    "2x1x4 bf16": ParallelConfig(pp=4, microbatches=4, precision="bf16"),
    "1x2x4": ParallelConfig(tp=2, pp=4, microbatches=4),
    "2x1x2 cp 2": ParallelConfig(cp=2, pp=2, microbatches=2),
}


def _run(ctx, name: str, model: TrainConfig, steps: int, root: Path) -> dict:
    """One layout's run on this rank: its records' elapsed seconds, bytes per group and idle share."""
    from refimpl.train import RunOptions, train

    config = dataclasses.replace(model, steps=steps, out=str(root / name.replace(" ", "-")),
                                 data=dataclasses.replace(model.data, data=str(root / "corpus.txt"),
                                                          cache_dir=str(root / "cache")))
    options = RunOptions(parallel=LAYOUTS[name], report=False)  # no checkpoint, no report at the end
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        records = train(config, ctx, options)  # its progress bar and log lines
    return {"elapsed": [r["elapsed_s"] for r in records], "bytes": [r["bytes_sent"] for r in records],
            "idle": [r.get("pipeline_idle") for r in records]}


def _predict(model: TrainConfig, name: str):
    from refimpl.planner import predict_run

    return predict_run(model.model, LAYOUTS[name], world_size=WORLD, seq_len=model.data.seq_len,
                       global_batch=model.data.global_batch_size, micro_batch=model.data.micro_batch_size,
                       grad_clip=model.optim.grad_clip)


def _describe(model: TrainConfig) -> str:
    """The run as the trainer's flags would say it."""
    m, d = model.model, model.data
    return (f"--num-layers {m.num_layers} --hidden-size {m.hidden_size} --num-heads {m.num_attention_heads} "
            f"--seq-len {d.seq_len} --batch-size {d.global_batch_size}")


def _step_time(per_rank: list[dict], warmup: int) -> float:
    """The slowest rank's median step duration after ``warmup`` steps."""
    medians = []
    for out in per_rank:
        t = [0.0, *out["elapsed"]]
        medians.append(statistics.median(b - a for a, b in zip(t[warmup:], t[warmup + 1:], strict=False)))
    return max(medians)


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all layouts (the ratio's spread)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, 1 warm-up, 1 round")
    a = parser.parse_args(argv)
    model, steps, warmup, repeats = (QUICK, 3, 1, 1) if a.quick else (MODEL, a.steps, a.warmup, a.repeats)
    from refimpl.data import make_corpus_file
    from refimpl.launch import run_ranks

    load0, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        make_corpus_file(Path(root) / "corpus.txt", num_bytes=50_000)
        per_rank = run_ranks(_run_all, WORLD, model, steps, root, repeats, timeout_s=900, backend="gloo")
    elapsed, load1 = time.perf_counter() - start, os.getloadavg()[0]
    print(f"# bench_3d: world {WORLD} on {_cpu()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}; "
          f"{_describe(model)}, {steps} steps ({warmup} warm-up), {repeats} rounds; "
          f"load average {load0:.1f} at the start, "
          f"{load1:.1f} at the end; {elapsed:.0f} s")
    base = [_step_time([out["8x1x1"][i] for out in per_rank], warmup) for i in range(repeats)]
    print("\n| layout (dp x tp x pp) | step time / 8x1x1, median (min - max) of the rounds | group: planner "
          "- measured, largest over ranks and steps | group: most bytes per step on a rank | bubble: formula "
          "| measured pipeline_idle, median (min - max) |")
    print("|---|---|---|---|---|---|")
    for name in LAYOUTS:
        ratios = [_step_time([out[name][i] for out in per_rank], warmup) / base[i] for i in range(repeats)]
        runs = [{k: [x for rnd in out[name] for x in (rnd[k] if k == "bytes" else rnd[k][warmup:])]
                 for k in ("bytes", "idle")} for out in per_rank]  # every round; idle: the timed steps
        plan = _predict(model, name)
        keys = sorted({k for r in plan.ranks for k in r.bytes_sent} | {k for out in runs for s in out["bytes"]
                                                                        for k in s})
        diff = {k: max(abs(r.bytes_sent.get(k, 0.0) - s.get(k, 0.0)) for r, out in zip(plan.ranks, runs,
                                                                                       strict=True)
                       for s in out["bytes"]) for k in keys}
        most = {k: max(s.get(k, 0.0) for out in runs for s in out["bytes"]) for k in keys}
        idle = [v for v in runs[0]["idle"] if v is not None]
        measured = (f"{statistics.median(idle):.1%} ({min(idle):.1%} - {max(idle):.1%})" if idle else "-")
        bubble = "-" if plan.bubble is None else f"{plan.bubble:.1%}"
        print(f"| {name} | {statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f}) | "
              + ", ".join(f"{k}: {diff[k]:g}" for k in keys) + " | "
              + ", ".join(f"{k}: {most[k] / 2**10:,.1f} KiB" for k in keys)
              + f" | {bubble} | {measured} |")


def _run_all(ctx, model: list[str], steps: int, root: str, repeats: int) -> dict:
    """Every layout ``repeats`` times, the rounds one after the other (each round all layouts)."""
    rounds = [{name: _run(ctx, name, model, steps, Path(root)) for name in LAYOUTS} for _ in range(repeats)]
    return {name: [r[name] for r in rounds] for name in LAYOUTS}


if __name__ == "__main__":
    main()
