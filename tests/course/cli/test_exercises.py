"""The autograder is itself tested (docs/ARCHITECTURE.md, the chapter contract, point 3).

For every chapter with checks (``exercises/checks/chNN.py``):

* refimpl's answers (``exercises/reference/chNN.py``) score full marks;
* the untouched stubs (``exercises/NN_*.py``) score zero on every task, as "not implemented yet";
* each plausible wrong answer in the checks' ``MUTANTS`` (one source per task, or a list of them) fails
  its own task and only that one, so no check passes everything (negative controls);
* each independent right answer in the checks' optional ``CORRECT`` (one source per task, or a list)
  passes (the mutants are wrong only where they differ from it);

and ``python -m exercises.grade`` behaves as a command: exit 1 below full marks, 0 with ``--reference``,
one clear line for a chapter that has no exercise.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exercises.grading import exercise_path, grade, reference_path

ROOT = Path(__file__).resolve().parents[3]
CHAPTERS = sorted(p.stem[2:] for p in (ROOT / "exercises" / "checks").glob("ch[0-9][0-9].py"))


def _summary(report) -> str:
    return "\n".join(f"  {r.name}: {r.earned}/{r.points} {r.message}" for r in report.results)


def _mutant_params() -> list:
    params = []
    for chapter in CHAPTERS:
        try:
            mutants = getattr(importlib.import_module(f"exercises.checks.ch{chapter}"), "MUTANTS", {})
        except Exception as exc:  # surface a broken checks module as a failing test, not a collection error
            params.append(pytest.param(chapter, None, repr(exc), id=f"ch{chapter}-import-error"))
            continue
        if not mutants:  # every grader needs a negative control: a test that cannot fail is a defect
            params.append(pytest.param(chapter, None, "declares no MUTANTS", id=f"ch{chapter}-no-mutants"))
        for task, sources in sorted(mutants.items()):
            if isinstance(sources, str):
                params.append(pytest.param(chapter, task, sources, id=f"ch{chapter}-{task}"))
                continue
            for k, source in enumerate(sources):  # several wrong answers to one task
                params.append(pytest.param(chapter, task, source, id=f"ch{chapter}-{task}-{k}"))
    return params


def _correct_params() -> list:
    """A chapter's optional ``CORRECT``: task -> an independent right answer (not refimpl's), which the
    chapter's mutants are written against; it must pass its task, so the mutants differ from a right answer
    only where they are wrong."""
    params = []
    for chapter in CHAPTERS:
        try:
            correct = getattr(importlib.import_module(f"exercises.checks.ch{chapter}"), "CORRECT", {})
        except Exception:  # noqa: BLE001 - reported by _mutant_params' import-error case
            continue
        for task, sources in sorted(correct.items()):
            sources = sources if isinstance(sources, list) else [sources]
            params += [pytest.param(chapter, task, source, id=f"ch{chapter}-{task}" + (f"-{i}" if i else ""))
                       for i, source in enumerate(sources)]
    return params


def test_there_are_exercises():
    assert "01" in CHAPTERS


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_reference_scores_full_marks(chapter: str):
    report = grade(chapter, reference_path(chapter), verbose=False)
    assert report.results, f"chapter {chapter} has no tasks"
    assert report.passed, f"refimpl's reference answers lose points in chapter {chapter}:\n{_summary(report)}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_untouched_stubs_score_zero(chapter: str):
    report = grade(chapter, exercise_path(chapter), verbose=False)
    assert report.earned == 0 and all(r.earned == 0 for r in report.results), _summary(report)
    assert all(r.message == "not implemented yet" for r in report.results), (
        f"every stub must raise NotImplementedError:\n{_summary(report)}")


@pytest.mark.parametrize("chapter, task, source", _mutant_params())
def test_wrong_answer_fails_its_task_only(chapter: str, task: str | None, source: str | None, tmp_path: Path):
    assert task is not None, f"exercises/checks/ch{chapter}.py: {source} (a grader needs negative controls)"
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", task)  # task names may hold spaces, dots and slashes
    path = tmp_path / f"mutant_ch{chapter}_{slug}.py"
    path.write_text(source)
    report = grade(chapter, path, verbose=False)
    by_name = {r.name: r for r in report.results}
    assert task in by_name, f"MUTANTS names {task!r}, which is not a task of chapter {chapter}"
    wrong = by_name[task]
    assert wrong.earned == 0, f"the wrong answer for {task!r} was accepted:\n{_summary(report)}"
    assert wrong.message not in ("ok", "not implemented yet"), wrong.message
    # the learner reads one short line per task ("rank 1: AssertionError: ..."), the traceback after it
    assert "\n" not in wrong.message and "Traceback" not in wrong.message, wrong.message
    others = [r for r in report.results if r.name != task and r.earned != r.points]
    assert not others, f"a wrong {task!r} alone must not fail other tasks:\n{_summary(report)}"


@pytest.mark.parametrize("chapter, task, source", _correct_params())
def test_independent_answer_passes_its_task(chapter: str, task: str, source: str, tmp_path: Path):
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", task)
    path = tmp_path / f"correct_ch{chapter}_{slug}.py"
    path.write_text(source)
    report = grade(chapter, path, verbose=False)
    assert task in {r.name for r in report.results}, f"CORRECT names {task!r}, not a task of {chapter}"
    assert report.passed, f"an independent right answer to {task!r} loses points:\n{_summary(report)}"


def test_each_task_reports_its_own_failure(tmp_path: Path):
    """Two rank tasks of chapter 09 wrong at once: their calls fail in one folded spawn, which is split and
    each call run alone. Each task's traceback is that of its own call, not opened by the other task's
    failure (the folded spawn's, which Python chained to the split's as the exception's context)."""
    checks = importlib.import_module("exercises.checks.ch09")
    header = "from exercises.reference.ch09 import *  # noqa: F403\n"
    first, second = checks.MUTANTS[checks.EXCHANGE][0], checks.MUTANTS[checks.EXPERT_GRADS][0]
    assert second.startswith(header)
    path = tmp_path / "two_wrong.py"
    path.write_text(first + second[len(header):])  # the second's import would restore the first's names
    report = grade("09", path, verbose=False)
    failed = {r.name: r for r in report.results if r.earned != r.points}
    assert set(failed) == {checks.EXCHANGE, checks.EXPERT_GRADS}, _summary(report)
    for name, result in failed.items():
        (other,) = (r for n, r in failed.items() if n != name)
        theirs = other.message.split(": ", 1)[1]  # "rank N: Error: ..." without the rank
        assert theirs not in result.detail, f"{name}'s traceback holds {other.name}'s:\n{result.detail}"
        assert "During handling" not in result.detail and "folded call" not in result.detail, result.detail


def test_hint_for_a_common_mistake(tmp_path: Path):
    """Chapter 01: counting the tied output layer twice fails with a message that says so."""
    path = tmp_path / "tied_twice.py"
    path.write_text(
        "from exercises.reference.ch01 import *  # noqa: F403\n"
        "from refimpl.planner import param_count\n"
        "def count_parameters(config):\n"
        "    c = param_count(config)\n"
        "    return c.total + (config.hidden_size * config.vocab_size if config.tie_word_embeddings else 0)\n"
    )
    report = grade("01", path, verbose=False)
    result = {r.name: r for r in report.results}["count_parameters"]
    assert result.earned == 0
    assert "count it once" in result.message, result.message


def _grade_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "exercises.grade", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_cli_stubs_exit_nonzero():
    proc = _grade_cli("01")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "chapter 01: 0/" in proc.stdout, proc.stdout


def test_cli_reference_full_marks_with_table():
    proc = _grade_cli("01", "--reference")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = importlib.import_module("exercises.checks.ch01")
    for task in checks.TASKS:
        assert f"[PASS] {task.name}" in proc.stdout, proc.stdout
    total = sum(t.points for t in checks.TASKS)
    assert f"chapter 01: {total}/{total} points" in proc.stdout, proc.stdout


def test_cli_unknown_chapter_is_a_clear_error():
    proc = _grade_cli("99")
    assert proc.returncode != 0
    assert "no exercise for chapter 99" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def _ok(ctx, x: int) -> int:
    return x * 10 + ctx.rank


def _wrong(ctx, x: int) -> int:
    raise AssertionError(f"wrong answer {x}")


def test_a_failed_fold_keeps_the_calls_before_the_failure(monkeypatch: pytest.MonkeyPatch):
    """``exercises.rank_batch``: of calls A, B, C folded where B fails, A keeps its results from the folded
    spawn (it completed on every rank), B runs alone (its failure is that spawn's) and only C folds again.
    The ranks are played in this process by a stand-in for refimpl's run_ranks that records each spawn."""
    import traceback
    from types import SimpleNamespace

    import refimpl.launch
    from exercises import rank_batch
    from refimpl.launch import RankFailed

    spawns: list[list[str]] = []

    def spawn(fn, world_size, *args, **_):
        calls = args[0] if fn is rank_batch._calls_on_rank else [(fn, args)]
        spawns.append([f"{f.__name__}({a[0]})" for f, a in calls])
        out, failed = [], []
        for r in range(world_size):  # each rank runs until its own failure, as the processes would
            try:
                out.append(fn(SimpleNamespace(rank=r), *args))
            except Exception as exc:  # noqa: BLE001 - as a rank's failure reads
                failed.append(f"rank {r}: {traceback.format_exception_only(exc)[-1].strip()}")
        if failed:
            raise RankFailed(0, failed[0])
        return out

    monkeypatch.setattr(refimpl.launch, "run_ranks", spawn)
    with rank_batch.folded() as batch:
        for fn, x in ((_ok, 1), (_wrong, 2), (_ok, 3)):
            with pytest.raises(rank_batch.Deferred):
                rank_batch.run_ranks(fn, 2, x)
        batch.run_pending()
        assert rank_batch.run_ranks(_ok, 2, 1) == [10, 11]
        assert rank_batch.run_ranks(_ok, 2, 3) == [30, 31]
        with pytest.raises(RankFailed, match=r"^rank 0: AssertionError: wrong answer 2$"):
            rank_batch.run_ranks(_wrong, 2, 2)
    assert sorted(spawns) == sorted([["_ok(1)", "_wrong(2)", "_ok(3)"], ["_wrong(2)"], ["_ok(3)"]]), spawns
