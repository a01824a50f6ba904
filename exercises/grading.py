"""The autograder behind ``make grade CH=NN``: run each task's check, print a per-task score.

A chapter's checks live in ``exercises/checks/chNN.py`` as ``TASKS: list[Task]``. A check receives the
*path* of the module to grade (the learner's ``exercises/NN_topic.py``, or ``exercises/reference/chNN.py``
that re-exports refimpl's implementations) and raises on a wrong answer. Paths, not modules, so that a
check can load the module again inside the ranks it spawns (``refimpl.launch.run_ranks``).
The test suite grades both: the reference must score full marks and the untouched stubs zero.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from exercises.rank_batch import Batch, Deferred, folded

HERE = Path(__file__).resolve().parent
_MAX_ROUNDS = 20  # a check asks for ranks a few times in turn (chapter 02: 2 ranks, then 3); more is a bug


@dataclass(frozen=True, kw_only=True)
class Task:
    """One graded piece of an exercise: ``check(module_path)`` raises AssertionError on a wrong answer."""

    name: str
    points: int
    check: Callable[[str], None]


@dataclass(kw_only=True)
class TaskResult:
    name: str
    points: int
    earned: int
    message: str = ""
    detail: str = ""  # the traceback of a failed check, printed after the score table


@dataclass(kw_only=True)
class Report:
    chapter: str
    module_path: str
    results: list[TaskResult] = field(default_factory=list)

    @property
    def earned(self) -> int:
        return sum(r.earned for r in self.results)

    @property
    def total(self) -> int:
        return sum(r.points for r in self.results)

    @property
    def passed(self) -> bool:
        return self.earned == self.total


def load_module(path: str | Path) -> ModuleType:
    """Import a file by path under a private name (exercise files start with digits)."""
    path = Path(path).resolve()
    name = f"_graded_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def exercise_path(chapter: str) -> Path:
    """``exercises/NN_*.py`` for chapter ``NN``."""
    chapter = f"{int(chapter):02d}"
    matches = sorted(HERE.glob(f"{chapter}_*.py"))
    if not matches:
        available = sorted(p.name[:2] for p in HERE.glob("[0-9][0-9]_*.py"))
        raise SystemExit(f"error: no exercise for chapter {chapter}; available: {', '.join(available)}")
    return matches[0]


def reference_path(chapter: str) -> Path:
    return HERE / "reference" / f"ch{int(chapter):02d}.py"


def _checks_module(chapter: str) -> ModuleType:
    """``exercises.checks.chNN``, or a one-line error naming the chapters that have exercises."""
    name = f"exercises.checks.ch{chapter}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        available = sorted(p.stem[2:] for p in (HERE / "checks").glob("ch[0-9][0-9].py"))
        raise SystemExit(
            f"error: no exercise for chapter {chapter}; available: {', '.join(available) or 'none'}"
        ) from None


def grade(chapter: str, module_path: str | Path | None = None, *, verbose: bool = True) -> Report:
    """Grade ``module_path`` (default: the learner's exercise file) against chapter ``chapter``'s checks."""
    chapter = f"{int(chapter):02d}"
    checks = _checks_module(chapter)
    path = str(module_path or exercise_path(chapter))
    report = Report(chapter=chapter, module_path=path)
    results: dict[int, TaskResult] = {}
    with folded() as batch, _one_thread():  # the rank checks share spawns (exercises/rank_batch.py)
        for _ in range(_MAX_ROUNDS):
            if len(results) == len(checks.TASKS):
                break
            for k, task in enumerate(checks.TASKS):
                if k not in results:
                    try:
                        results[k] = _run_task(task, path)
                    except Deferred:
                        pass
                while verbose and len(report.results) in results:  # each task shown once its turn is known
                    _show(results[len(report.results)])
                    report.results.append(results[len(report.results)])
            batch.run_pending()
            _own_failures(batch)
        else:
            raise RuntimeError(f"chapter {chapter}: new rank calls after {_MAX_ROUNDS} rounds")
    report.results = [results[k] for k in range(len(checks.TASKS))]
    if verbose:
        print(f"chapter {chapter}: {report.earned}/{report.total} points", flush=True)
        for r in report.results:  # the long story after the table, for the tasks that failed
            if r.detail:
                print(f"\n--- {r.name}: {r.message}\n{r.detail.rstrip()}", flush=True)
    return report


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The checks that run here on one torch thread, as each rank runs (``init_distributed``): their
    tensors are tiny, and on a busy machine two threads make each small op wait for the other (a [24, 8]
    x [8, 48] matmul took 8 ms on two threads of 2 loaded cores, 77 us on one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _own_failures(batch: Batch) -> None:
    """Each call's failure reads as its own spawn's alone. A folded spawn that failed is split, and the spawns
    of its parts run while its failure is being handled, so Python chains that failure (another call's, often
    another task's) to theirs as ``__context__``: a task's traceback would open with another task's failure
    ("During handling of the above exception, another exception occurred"). The failure a task reads is
    that of its own call run alone (``exercises.rank_batch``): the chain is dropped."""
    for outcome in batch.outcomes.values():
        if isinstance(outcome, BaseException):
            outcome.__context__ = None
            outcome.__suppress_context__ = True


def _run_task(task: Task, path: str) -> TaskResult:
    """One task's verdict; ``exercises.rank_batch.Deferred`` passes through (its ranks have not run)."""
    try:
        task.check(path)
        return TaskResult(name=task.name, points=task.points, earned=task.points, message="ok")
    except NotImplementedError:
        return TaskResult(name=task.name, points=task.points, earned=0, message="not implemented yet")
    except Exception as exc:  # a wrong answer or a crash: show the learner why, short first
        short, detail = _explain(exc)
        return TaskResult(name=task.name, points=task.points, earned=0, message=short, detail=detail)


def _show(result: TaskResult) -> None:
    mark = "PASS" if result.earned == result.points else "FAIL"
    score = f"{result.earned}/{result.points}"
    print(f"  [{mark}] {result.name:<40s} {score}  {result.message}", flush=True)


def _explain(exc: Exception) -> tuple[str, str]:
    """(one line for the score table, the traceback for after it) of a failed check.

    A failure inside a rank (``RankFailed``) already reads ``rank N: Error: message`` on its first line.
    """
    text = str(exc)
    if "NotImplementedError" in text:  # a stub raised inside a rank
        return "not implemented yet", ""
    first = text.split("\n", 1)[0].strip()
    if text.startswith("rank "):
        short = first
    else:
        short = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return short, "".join(traceback.format_exception(exc))


def probe_stub(fn: Callable[..., object], *args: object) -> None:
    """Call ``fn`` here, without a process group: a stub raises NotImplementedError at once (so no ranks are
    started for it); an implementation may fail on its first collective, which is expected and ignored."""
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - e.g. "Default process group has not been initialized"
        pass
