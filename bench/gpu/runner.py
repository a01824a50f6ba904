"""The parts of bench/gpu/check.py in their order, each under a time cap inside the whole budget, and the
sizes of the two modes (one GPU; ``--smoke`` on the CPU).

A part is a function that returns its record (``status``: pass, fail or skip, and a ``detail``); an
exception or its time cap (``time_limit``) makes it a failure, recorded, and the next part runs. After
every part the results are written again (bench/gpu/report.py), so a run that the device's own limit stops
still leaves what it measured.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.gpu import environment, kernels, report, trainer_rows
from bench.gpu.gpu_tests import run_gpu_tests

MIN_PART_S = 5.0  # a part that would get less than this is not started (recorded as not run)


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: its device, trainer rows, kernel shapes, whole budget and per-part caps."""

    device: torch.device
    rows: tuple[trainer_rows.RowSpec, ...]
    fp8: tuple[tuple[int, int], ...]  # (tokens, hidden): the trainer's micro-batch tokens and width
    grouped: tuple[tuple[int, int, int, int], ...]  # (rows, k, n, groups)
    chain: tuple[int, int]  # the async-timing matrix size and chain length
    budget_s: float
    caps: dict[str, float] = field(default_factory=dict)


def gpu_sizes() -> Sizes:
    """One H100: the in-process parts take about 2 minutes, the gpu-marked tests get the rest of the 5.5;
    the caps keep one stuck part from taking everything."""
    return Sizes(device=torch.device("cuda", torch.cuda.current_device()), rows=trainer_rows.GPU_ROWS,
                 fp8=((32 * 1024, 768), (16 * 1024, 4096)),
                 grouped=((8192, 768, 3072, 8), (8192, 4096, 4096, 8)), chain=(8192, 30), budget_s=330.0,
                 caps={"process_group": 60, "scaled_mm": 60, "async_timing": 30, "row": 75, "grouped_mm": 45,
                       "pytest_gpu": 200})


def smoke_sizes() -> Sizes:
    """The CPU: one tiny model (the rows' loop is the same); K and N still multiples of 16. About 30 s of
    CPU; the budget and caps are far above it, so that a loaded machine (the suite runs two lanes on two
    cores) slows the smoke run down but never changes its verdict."""
    return Sizes(device=torch.device("cpu"), rows=trainer_rows.SMOKE_ROWS, fp8=((64, 64), (32, 128)),
                 grouped=((64, 64, 128, 4),), chain=(64, 4), budget_s=900.0,
                 caps={"process_group": 120, "scaled_mm": 120, "async_timing": 60, "row": 300,
                       "grouped_mm": 120, "pytest_gpu": 300})


class PartTimeout(Exception):
    """A part ran past its cap (raised in the main thread by SIGALRM)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``PartTimeout`` in the block after ``seconds`` (POSIX; elsewhere no limit). Python code is
    interrupted between bytecodes: a kernel or collective that never returns is the device run's timeout's."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise PartTimeout(f"stopped after its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def all_passed(result: dict) -> bool:
    """No check failed (a skip is not a failure: a CPU has no CUDA events, an image no pytest)."""
    checks = result["checks"]
    rows = checks.get("trainer", {}).get("rows", [])
    return bool(checks) and all(c.get("status") != "fail" for c in checks.values()) and all(
        r.get("status") != "fail" for r in rows)


class Run:
    """The run's state: the result dict (the JSON), where it is written, and the clock of the budget."""

    def __init__(self, sizes: Sizes, out: Path, *, smoke: bool, budget_s: float) -> None:
        self.sizes, self.out, self.smoke = sizes, out, smoke
        self.start, self.budget_s = time.monotonic(), budget_s
        self.result: dict = {"mode": "smoke" if smoke else "gpu", "ok": False, "stand_ins": [], "checks": {},
                             "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "budget_s": budget_s}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def part(self, name: str, fn: Callable[[], dict], cap: float) -> dict:
        """``fn()`` under ``min(cap, what is left)``: its record, or a failure's; timed, printed, written."""
        left = self.left()
        if left < MIN_PART_S:
            rec = {"status": "fail", "detail": f"not run: the check's {self.budget_s:.0f} s were spent"}
        else:
            t0 = time.perf_counter()
            try:
                with time_limit(min(cap, left)):
                    rec = fn()
            except Exception as exc:  # noqa: BLE001 - a failed part is a result; the others still run
                rec = {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:500],
                       "traceback": traceback.format_exc()[-3000:]}
            rec["seconds"] = time.perf_counter() - t0
        print(f"[{time.monotonic() - self.start:5.0f} s] {name}: {rec['status']}: "
              f"{rec.get('detail') or rec.get('error', '')}", flush=True)
        self.write()
        return rec

    def write(self) -> None:
        self.result["elapsed_s"] = time.monotonic() - self.start
        self.result["ok"] = all_passed(self.result)
        report.write(self.result, self.out)


def run_trainer(run: Run, work: Path) -> None:
    """The trainer rows, one part each, into ``checks["trainer"]``."""
    trainer = run.result["checks"].setdefault("trainer", {"rows": [], "status": "pass"})
    try:
        if trainer_rows.skip_report_without_matplotlib():
            run.result["stand_ins"].append("no matplotlib: the trainer's end-of-run report skipped")
    except ImportError:
        pass  # refimpl itself does not import: each row fails and says why
    for spec in run.sizes.rows:
        for precision in trainer_rows.PRECISIONS:
            row = run.part(f"trainer {spec.name} {precision}",
                           lambda s=spec, p=precision: trainer_rows.run_row(s, p, run.sizes.device, work),
                           run.sizes.caps["row"])
            trainer["rows"].append(row | {"model": spec.name, "precision": precision})
            trainer["fp8_over_bf16"] = trainer_rows.fp8_speedups(trainer["rows"])
            trainer["status"] = "fail" if any(r["status"] == "fail" for r in trainer["rows"]) else "pass"
            run.write()


def _teardown(run: Run) -> None:
    """Destroy the process group (before the grouped GEMMs, whose failure may end the CUDA context); a
    failure or a hang of 30 s is recorded on the process group's check, and the check goes on."""
    try:
        with time_limit(30):
            trainer_rows.destroy_group()
    except Exception as exc:  # noqa: BLE001 - recorded: the group is not used again
        group = run.result["checks"]["process_group"]
        group |= {"status": "fail", "teardown_error": f"{type(exc).__name__}: {exc}"[:300]}


def _release_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the GPU; a CUDA context that a device-side assert ended
    (the grouped GEMM's) refuses, and the tests run in processes of their own anyway."""
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass


def run_checks(run: Run, work: Path, root: Path) -> None:
    """Every part of bench/gpu/check.py's docstring, in its order."""
    s, checks = run.sizes, run.result["checks"]
    checks["process_group"] = run.part("process group", lambda: trainer_rows.init_group(s.device, work),
                                       s.caps["process_group"])
    checks["scaled_mm"] = run.part("fp8 GEMM", lambda: kernels.scaled_mm_check(list(s.fp8), s.device),
                                   s.caps["scaled_mm"])
    checks["async_timing"] = run.part("async timing", lambda: kernels.async_timing(
        s.device, size=s.chain[0], chain=s.chain[1]), s.caps["async_timing"])
    run_trainer(run, work)
    if s.device.type == "cuda":  # the clocks right after the load
        run.result["environment"]["nvidia_smi_after"] = environment.nvidia_smi()
    _teardown(run)
    checks["grouped_mm"] = run.part("grouped GEMM", lambda: kernels.grouped_mm_check(
        list(s.grouped), s.device), s.caps["grouped_mm"])
    _release_cached_memory(s.device)  # for the tests' own processes on the same GPU
    checks["pytest_gpu"] = run.part("gpu-marked tests", lambda: run_gpu_tests(
        root, timeout_s=min(s.caps["pytest_gpu"], run.left()) - 2, collect_only=run.smoke),
        s.caps["pytest_gpu"])


def run_check(args: argparse.Namespace, *, root: Path) -> int:
    """The whole check for bench/gpu/check.py's parsed flags; its exit status."""
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device visible: bench/gpu/check.py measures a GPU (--smoke runs the same code "
              "on the CPU)", file=sys.stderr)
        return 2
    sizes = smoke_sizes() if args.smoke else gpu_sizes()
    out = Path(args.out or os.environ.get("OUT") or root / "bench" / "out" / "gpu")
    run = Run(sizes, out, smoke=args.smoke, budget_s=args.budget_s or sizes.budget_s)
    if sizes.device.type == "cuda":
        torch.cuda.set_device(sizes.device)
    run.result["environment"] = environment.describe(sizes.device)  # first: what is installed, not stood in
    if environment.stand_in_for_tqdm():
        run.result["stand_ins"].append("no tqdm: a do-nothing progress bar")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        run_checks(run, Path(tmp), root)
    run.write()
    print(f"\n{report.markdown(run.result)}\nwrote {out / report.JSON_NAME} and {out / report.MD_NAME}")
    return 0 if run.result["ok"] else 1
