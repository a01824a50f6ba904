"""The suite's tiers and its one timeout scale (docs/ARCHITECTURE.md: tests).

**Markers by folder**, so that no test file and no list of names has to remember them: a module carries
the markers of every folder it lies in below tests/ (``FOLDER_MARKERS``; tests/ranks/cli/serial/x.py is
``spawn``, ``subprocess`` and ``serial``). The folders above them say what is tested: unit/ (one module of
the package, in one process), ranks/, trainer/ (the trainer at a layout), planner/, course/ (chapters,
exercises, the README, the project's text), cli/; support/ holds helpers, not tests.

- ``spawn`` (``ranks/``): starts rank processes (``refimpl.launch.run_ranks``, torchrun, ipyparallel
  engines);
- ``subprocess`` (``cli/``): runs a child Python (the trainer's command line, the grader, the planner's CLI);
- ``chapter`` (``chapters/``, with ``spawn`` and ``subprocess``): executes a chapter as a notebook under
  nbval;
- ``browser`` (``browser/``, with ``subprocess``): drives JupyterLab in Debian's chromium;
- ``serial`` (``serial/``): it mostly waits, and its verdict reads a clock; tools/run_tests.py
  (``make test``) runs these one after the other, beside the rest of the suite.
- ``lane2`` (``lane2/``, and per chapter in tests/course/chapters/test_chapters.py): a computing test that
  tools/run_tests.py runs in the serial tests' lane once they are done, so that both lanes end together;
  CI's numerics rerun has no serial test, so there its ``lane2`` tests run beside the others from the start
  (the trainer equivalence modules with the heaviest fixtures: about half of the rerun).

``make test-unit`` runs what carries none of them (one process, about 23 s: the edit loop); ``make test``
runs everything. A module that starts processes in some tests only carries the marker as a whole: the
unit tier is what surely starts nothing.

**One timeout scale**: ``REFIMPL_TEST_TIMEOUT_SCALE=2`` doubles every test's time limit (each
``@pytest.mark.timeout`` and the default in pyproject.toml) on a machine slower than the 2-core one the
limits were measured on. Limits inside a test (a rank's collective timeout, ``run_ranks``' own bound) are
the test's measured design and stay as written.

**One spawn timeout**: ``tests.support.timeouts.SPAWN_TIMEOUT_S`` bounds one spawn of a module's ranks
(``run_ranks``' ``timeout_s``) and the pytest limits built on it; a module that needs more says so with an
explicit multiple of it (tests/unit/test_tiers.py fails a module that sets a spawn timeout of its own).

**GPUs only when asked**: unless ``REFIMPL_TEST_GPU=1``, this module hides the GPUs at import
(``CUDA_VISIBLE_DEVICES=""``, before torch initialises CUDA; the ranks and child Pythons inherit it), so the
suite runs on CPU and gloo on a GPU box too, as its bitwise references were measured. Tests marked ``gpu``
(tests/ranks/test_gpu.py: what only CUDA and NCCL show) are deselected, the reason printed after collection,
unless ``REFIMPL_TEST_GPU=1`` and CUDA is there: ``REFIMPL_TEST_GPU=1 pytest -m gpu tests/ranks/test_gpu.py``.

**Session fixtures** for work several modules repeat: ``corpus`` (the trainer tests' 20 kB pseudo-text and
its token cache: every module that trains on it takes this one, tests/unit/test_tiers.py checks that none
writes its own) and ``one_device_references`` (tests/support/one_device.py's one-device runs, computed once
per ``TrainConfig`` and step count: test_train_tp, _cp and _zero3 compare their layouts with the same
runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

GPU_ENV = "REFIMPL_TEST_GPU"
_GPU_DESELECTED = pytest.StashKey[str]()  # the collection report's line on the gpu tests left out
if os.environ.get(GPU_ENV) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: the suite runs on CPU and gloo

TESTS = Path(__file__).resolve().parent
# A module's tiers are the folders it lies in (docs/ARCHITECTURE.md, "Tests"): each folder below tests/
# named here gives its markers to every module under it, at any depth; the other folders (unit/, trainer/,
# planner/, course/, support/ ...) say what is tested and give none.
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "ranks": ("spawn",),  # the test starts rank processes
    "cli": ("subprocess",),  # the test runs a child Python
    "chapters": ("chapter", "spawn", "subprocess"),  # nbval's kernel, and the chapter's engines
    "browser": ("browser", "subprocess"),  # JupyterLab's server, driven in chromium
    # Tests that mostly wait, judged by a clock (a hang named within its timeout, a process gone within a
    # bound, an elastic restart loop, a browser's redraw): tools/run_tests.py runs them in their own lane,
    # one after the other, beside the computing tests. test_chapters marks its own (08's bubble, timed) per
    # parameter.
    "serial": ("serial",),
    # Computing tests for the second lane (above): the README's runs and the device lint (no numerics), the
    # trainer equivalence modules with the heaviest fixtures (numerics: about half of CI's rerun, which
    # would otherwise run in one lane).
    "lane2": ("lane2",),
}
TIERS = ("spawn", "subprocess", "chapter", "browser", "serial", "lane2")


def folder_markers(path: Path) -> set[str]:
    """The tiers of the test module at ``path`` (under tests/): the markers of the folders it lies in."""
    path = Path(path).resolve()
    if TESTS not in path.parents:
        return set()
    folders = path.relative_to(TESTS).parts[:-1]
    return {marker for folder in folders for marker in FOLDER_MARKERS.get(folder, ())}


def tier_folders(tier: str) -> list[Path]:
    """The outermost folders under tests/ whose modules all carry ``tier`` (their name gives it)."""
    found = [d for d in sorted(TESTS.rglob("*")) if d.is_dir() and tier in FOLDER_MARKERS.get(d.name, ())]
    return [d for d in found if not any(other in d.parents for other in found)]


def timeout_scale() -> float:
    """``REFIMPL_TEST_TIMEOUT_SCALE`` (default 1), refused in one line when it is not a positive number."""
    raw = os.environ.get("REFIMPL_TEST_TIMEOUT_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise pytest.UsageError(f"REFIMPL_TEST_TIMEOUT_SCALE must be a positive number, got {raw!r}")
    return scale


def gpu_tests_off() -> str | None:
    """Why the ``gpu`` tests do not run here (None: they do): ``REFIMPL_TEST_GPU=1`` and CUDA are needed."""
    if os.environ.get(GPU_ENV) != "1":
        return f"{GPU_ENV}=1 not set (the suite hides the GPUs: CUDA_VISIBLE_DEVICES=\"\")"
    import torch

    if not torch.cuda.is_available():
        return f"{GPU_ENV}=1 but torch.cuda.is_available() is False"
    return None


def _deselect_gpu_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remove the ``gpu``-marked items unless ``gpu_tests_off`` says they run; the count and the reason
    go to the collection report (``pytest_report_collectionfinish``)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    why = gpu_tests_off() if gpu else None
    if why is None:
        return
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    config.hook.pytest_deselected(items=gpu)
    config.stash[_GPU_DESELECTED] = f"{len(gpu)} gpu test(s) deselected: {why}"


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    return config.stash.get(_GPU_DESELECTED, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_gpu_tests(config, items)
    scale = timeout_scale()
    default = float(config.getini("timeout") or 0)
    markers: dict[Path, set[str]] = {}
    for item in items:
        for marker in sorted(markers.setdefault(item.path, folder_markers(item.path))):
            item.add_marker(marker)
        if scale != 1 and (limit := scaled_timeout(item.get_closest_marker("timeout"), default, scale)):
            item.add_marker(pytest.mark.timeout(limit), append=False)  # first: the closest marker wins


def scaled_timeout(mark: pytest.Mark | None, default: float, scale: float) -> float:
    """The time limit of a test with ``mark`` (``@pytest.mark.timeout(s)`` or none: ``default``) x
    ``scale``; 0 (no limit) stays 0."""
    if mark is None:
        limit = default
    else:
        limit = float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
    return limit * scale


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{"corpus": the 20 kB pseudo-text (refimpl.data.make_corpus_file's default seed), "cache": its token
    cache directory}``, shared by the trainer tests' modules (the file is never written after this)."""
    from refimpl.data import make_corpus_file

    root = tmp_path_factory.mktemp("corpus")
    return {"corpus": make_corpus_file(root / "corpus.txt", num_bytes=20_000), "cache": root / "cache"}


@pytest.fixture(scope="session")
def one_device_references(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``get(config, steps=n)``: ``tests.support.one_device.one_device_losses`` of the ``TrainConfig``
    ``config``, computed the first time a module asks for that config and step count and handed to the
    next (a read-only dict: a module that adds entries copies it first)."""
    from tests.support.one_device import one_device_losses

    cache: dict[tuple, dict] = {}

    def get(config, *, steps: int) -> dict:
        key = (config, steps)
        if key not in cache:
            cache[key] = one_device_losses(config, tmp_path_factory.mktemp("one_device"), steps=steps)
        return cache[key]

    return get
