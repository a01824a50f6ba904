"""Every chapter executes as a notebook under nbval, with its assertions (docs/ARCHITECTURE.md: chapters).

The jupytext percent-format source ``chapters/NN_topic.py`` is converted to ``build/chapters/NN_topic.ipynb``
inside the test (never a manual step) and executed by ``pytest --nbval-lax`` in a child process, so a chapter
that raises in any cell, on any rank, fails here with the failing cell's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[3]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
CHAPTER_TIMEOUT_S = 420
# Chapters whose assertions compare floating-point results that are not bitwise (one device vs many ranks,
# ours vs PyTorch's) carry the numerics marker: CI reruns them under ATEN_CPU_CAPABILITY=default.
NUMERICS = {"03_data_parallel", "04_zero", "05_mixed_precision", "06_tensor_parallel",
            "07_context_parallel", "08_pipeline_parallel", "09_mixture_of_experts", "10_fp8",
            "11_checkpoint_elastic", "12_3d_parallelism"}
# Chapters that mostly wait, judged by a clock (08 times a pipeline's bubble with sleeping stages): the
# waiting lane of tools/run_tests.py, beside the computing tests.
SERIAL = {"08_pipeline_parallel"}
# Chapters that tools/run_tests.py runs in the second lane once its serial tests are done, beside the
# first lane's computing tests, with the modules in tests/'s lane2/ folders, so both lanes end together: in
# CI's `make test` the serial tests took ~680 s and the second lane's computing tests ~700 s, against
# the first lane's ~1,370 s, before the heaviest trainer equivalence modules moved to the second lane
# (for CI's numerics rerun, which has no chapter) and chapters 05, 06 and 12 to the first. Chapter 01
# moved back to the second lane when chapters 03, 04 and 07 grew their timed sections: in a fresh-clone
# run the first lane took 1,223 s and the second 629 + 492 s, chapter 01 51 s of the first.
LANE2 = {"01_single_device", "09_mixture_of_experts", "10_fp8", "11_checkpoint_elastic"}
PARAMS = [pytest.param(p, id=p.stem, marks=[*([pytest.mark.numerics] if p.stem in NUMERICS else []),
                                            *([pytest.mark.serial] if p.stem in SERIAL else []),
                                            *([pytest.mark.lane2] if p.stem in LANE2 else [])])
          for p in CHAPTERS]


def test_there_are_chapters():
    assert CHAPTERS, "no chapters found"


def test_every_chapter_and_exercise_names_its_own_number():
    """A chapter's title ("# # NN · ...") and its exercise's grade command carry the file's number (a
    renumbering once left chapter 11 titled "09" and its exercise pointing at chapter 09's grader)."""
    for path in CHAPTERS:
        number = path.stem[:2]
        title = next(line for line in path.read_text().splitlines() if line.startswith("# # "))
        assert title.startswith(f"# # {number} ·"), (path.name, title)
        exercise = ROOT / "exercises" / path.name
        if exercise.exists():
            graded = set(re.findall(r"exercises\.grade (\d\d)|CH=(\d\d)", exercise.read_text()))
            assert {a or b for a, b in graded} == {number}, (exercise.name, graded)


@pytest.mark.timeout(CHAPTER_TIMEOUT_S + 60)
@pytest.mark.parametrize("source", PARAMS)
def test_chapter_executes(source: Path, tmp_path: Path):
    build = ROOT / "build" / "chapters"
    build.mkdir(parents=True, exist_ok=True)
    notebook = build / f"{source.stem}.ipynb"
    jupytext.write(jupytext.read(source), notebook, fmt="ipynb")
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel draws inline, as in Lab
    env = dict(env, PYTHONPATH=str(ROOT), REFIMPL_CACHE=str(tmp_path / "cache"),
               REFIMPL_PX_STREAM="0",  # nbval then reports the failing rank's traceback
               # every %%px cell as NCCL takes it (distributed/device_lint.py); .ci/run's numerics rerun
               # turns it off (REFIMPL_DEVICE_LINT=0): its verdicts do not depend on the CPU's kernels
               REFIMPL_DEVICE_LINT=os.environ.get("REFIMPL_DEVICE_LINT", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-cell-timeout=300", "--timeout", str(CHAPTER_TIMEOUT_S), "--rootdir", str(build),
           str(notebook)]
    proc = subprocess.run(cmd, cwd=ROOT / "chapters", env=env, capture_output=True, text=True,
                          timeout=CHAPTER_TIMEOUT_S + 30)
    tail = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"chapter {source.name} failed under nbval:\n{tail}"
    assert " passed" in proc.stdout, f"nbval ran no cell of {source.name}:\n{tail}"
