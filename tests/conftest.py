"""The suite's tiers and its one timeout scale (docs/ARCHITECTURE.md: tests).

**Markers**, given here per module so that no test file has to remember them:

- ``spawn``: starts rank processes (``refimpl.launch.run_ranks``, torchrun, ipyparallel engines);
- ``subprocess``: runs a child Python (the trainer's command line, the grader, the planner's CLI);
- ``chapter``: executes a chapter as a notebook under nbval;
- ``browser``: drives JupyterLab in Debian's chromium;
- ``serial``: it mostly waits, and its verdict reads a clock; tools/run_tests.py (``make test``) runs these
  one after the other, beside the rest of the suite.
- ``lane2`` (``LANE2`` here, and per chapter in tests/test_chapters.py): a computing test that
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

**GPUs only when asked**: unless ``REFIMPL_TEST_GPU=1``, this module hides the GPUs at import
(``CUDA_VISIBLE_DEVICES=""``, before torch initialises CUDA; the ranks and child Pythons inherit it), so the
suite runs on CPU and gloo on a GPU box too, as its bitwise references were measured. Tests marked ``gpu``
(tests/test_gpu.py: what only CUDA and NCCL show) are deselected, the reason printed after collection,
unless ``REFIMPL_TEST_GPU=1`` and CUDA is there: ``REFIMPL_TEST_GPU=1 pytest -m gpu tests/test_gpu.py``.

**Session fixtures** for work several modules repeat: ``corpus`` (the trainer tests' 20 kB pseudo-text and
its token cache) and ``one_device_references`` (tests/one_device.py's one-device runs, computed once per set
of trainer flags and step count: test_train_tp and test_train_cp compare their layouts with the same runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest

GPU_ENV = "REFIMPL_TEST_GPU"
_GPU_DESELECTED = pytest.StashKey[str]()  # the collection report's line on the gpu tests left out
if os.environ.get(GPU_ENV) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: the suite runs on CPU and gloo

SPAWN = {
    "test_boundary_bytes", "test_checkpoint", "test_checkpoint_fully_shard", "test_comm",
    "test_context_parallel_gpt", "test_data_parallel",
    "test_elastic", "test_elastic_3d", "test_launch", "test_mesh", "test_notebook", "test_notebook_lifetime",
    "test_p2p_strict", "test_param_placements", "test_parallelize", "test_pipeline_gpt", "test_planner_3d",
    "test_planner_cp", "test_planner_pp", "test_planner_tp", "test_precision", "test_rank_lifetime",
    "test_ring_attention", "test_tp_communications", "test_tp_layers", "test_tp_plan", "test_tp_transformer",
    "test_train", "test_train_3d", "test_train_zero3", "test_fsdp_tp", "test_planner_zero3",
    "test_train_checkpoint", "test_train_cp", "test_train_pp", "test_train_tp", "test_train_llama",
    "test_ulysses",
    "test_vocab_parallel", "test_zero", "test_chapters", "test_expert_parallel", "test_fp8_communication",
    "test_moe_model", "test_train_moe", "test_train_fp8", "test_planner_moe", "test_fp8_zero3", "test_gpu",
    "test_device_lint", "test_train_pairs", "test_readme", "test_bring_your_own_model",
    "test_parallelize_byom", "test_shaped_link", "test_overlap", "test_collective_matmul",
}
SUBPROCESS = {
    "test_browser", "test_chapters", "test_deploy", "test_elastic", "test_exercises", "test_notebook",
    "test_p2p_strict", "test_plan_cli", "test_planner_layout", "test_pp_schedules", "test_rank_lifetime",
    "test_train", "test_train_fp8", "test_device_lint", "test_bench_gpu", "test_readme", "test_shaped_link",
    "test_overlap", "test_history",
}
CHAPTER = {"test_chapters"}
BROWSER = {"test_browser"}
# Tests that mostly wait, judged by a clock (a hang named within its timeout, a process gone within a bound,
# an elastic restart loop, a browser's redraw): tools/run_tests.py runs them in their own lane, one after
# the other, beside the computing tests. test_chapters marks its own (08's bubble, timed) per parameter.
SERIAL = {"test_elastic", "test_elastic_3d", "test_p2p_strict", "test_rank_lifetime",
          "test_notebook_lifetime", "test_browser", "test_shaped_link"}
# Computing tests for the second lane (above): the README's runs and the device lint (no numerics), the
# trainer equivalence modules with the heaviest fixtures (numerics: about half of CI's rerun, which
# would otherwise run in one lane).
LANE2 = {"test_readme", "test_device_lint", "test_train_pairs", "test_train_3d", "test_train_zero3",
         "test_zero", "test_train_moe", "test_train_llama"}
TIERS = {"spawn": SPAWN, "subprocess": SUBPROCESS, "chapter": CHAPTER, "browser": BROWSER, "serial": SERIAL,
         "lane2": LANE2}


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
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        for marker, modules in TIERS.items():
            if module in modules:
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
def one_device_references(tmp_path_factory: pytest.TempPathFactory, corpus: dict) -> Callable[..., dict]:
    """``get(flags, steps=n)``: ``tests.one_device.one_device_losses`` for the trainer's ``flags`` on
    ``corpus``, computed the first time a module asks for those flags and steps and handed to the next
    (a read-only dict: a module that adds entries copies it first)."""
    from refimpl.train import build_parser
    from tests.one_device import one_device_losses

    cache: dict[tuple, dict] = {}

    def get(flags: Sequence[str], *, steps: int) -> dict:
        key = (tuple(flags), steps)
        if key not in cache:
            def args_for(out, *extra: str):
                return build_parser().parse_args([*flags, "--data", str(corpus["corpus"]), "--cache-dir",
                                                  str(corpus["cache"]), "--out", str(out), *extra])
            cache[key] = one_device_losses(args_for, tmp_path_factory.mktemp("one_device"), steps=steps)
        return cache[key]

    return get
