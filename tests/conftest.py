"""The suite's tiers and its one timeout scale (docs/ARCHITECTURE.md: tests).

**Markers**, given here per module so that no test file has to remember them:

- ``spawn``: starts rank processes (``refimpl.launch.run_ranks``, torchrun, ipyparallel engines);
- ``subprocess``: runs a child Python (the trainer's command line, the grader, the planner's CLI);
- ``chapter``: executes a chapter as a notebook under nbval;
- ``browser``: drives JupyterLab in Debian's chromium.

``make test-unit`` runs what carries none of them (one process, seconds: the edit loop); ``make test``
runs everything. A module that starts processes in some tests only carries the marker as a whole: the
unit tier is what surely starts nothing.

**One timeout scale**: ``REFIMPL_TEST_TIMEOUT_SCALE=2`` doubles every test's time limit (each
``@pytest.mark.timeout`` and the default in pyproject.toml) on a machine slower than the 2-core one the
limits were measured on. Limits inside a test (a rank's collective timeout, ``run_ranks``' own bound) are
the test's measured design and stay as written.
"""

from __future__ import annotations

import os

import pytest

SPAWN = {
    "test_boundary_bytes", "test_checkpoint", "test_comm", "test_context_parallel_gpt", "test_data_parallel",
    "test_elastic", "test_elastic_3d", "test_launch", "test_mesh", "test_notebook", "test_notebook_lifetime",
    "test_p2p_strict", "test_parallelize", "test_pipeline_gpt", "test_planner_3d", "test_planner_cp",
    "test_planner_pp", "test_planner_tp", "test_precision", "test_rank_lifetime", "test_ring_attention",
    "test_tp_communications", "test_tp_layers", "test_tp_transformer", "test_train", "test_train_3d",
    "test_train_checkpoint", "test_train_cp", "test_train_pp", "test_train_tp", "test_ulysses",
    "test_vocab_parallel", "test_zero", "test_chapters",
}
SUBPROCESS = {
    "test_browser", "test_chapters", "test_deploy", "test_elastic", "test_exercises", "test_notebook",
    "test_p2p_strict", "test_plan_cli", "test_planner_layout", "test_pp_schedules", "test_rank_lifetime",
    "test_train",
}
CHAPTER = {"test_chapters"}
BROWSER = {"test_browser"}
TIERS = {"spawn": SPAWN, "subprocess": SUBPROCESS, "chapter": CHAPTER, "browser": BROWSER}


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
