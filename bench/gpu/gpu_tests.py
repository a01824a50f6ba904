"""The ``gpu``-marked tests, run by bench/gpu/check.py when pytest is importable.

The tests stay on the CPU unless asked (docs/ARCHITECTURE.md, "GPUs"): ``REFIMPL_TEST_GPU=1`` asks. Only the
modules that mention the marker are handed to pytest (``pytest.mark.gpu`` in a module, at any depth under
tests/): collecting the whole suite would import what a bare GPU image lacks (ipyparallel, nbval, ...) and
fail on that instead. ``--smoke`` only collects
them: a CPU cannot run what they check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from bench.gpu.environment import has_module

MARK = re.compile(r"mark\.gpu\b")


def gpu_test_files(root: Path) -> list[str]:
    """The test modules under tests/ (at any depth) that carry the ``gpu`` marker (module docstring),
    relative to ``root``."""
    tests = root / "tests"
    found = {p for p in tests.rglob("test_*.py") if MARK.search(p.read_text(encoding="utf-8"))}
    return sorted(str(p.relative_to(root)) for p in found)


def _verdict(code: int) -> str:
    if code == 0:
        return "pass"
    return "skip" if code == 5 else "fail"  # 5: pytest selected no test


def run_gpu_tests(root: Path, *, timeout_s: float, collect_only: bool) -> dict[str, object]:
    """``python -m pytest -m gpu -q`` over ``gpu_test_files`` with ``REFIMPL_TEST_GPU=1`` (only
    ``--collect-only`` when ``collect_only``): the verdict, the command and the end of its output."""
    if not has_module("pytest"):
        return {"status": "skip", "detail": "pytest not installed"}
    files = gpu_test_files(root)
    if not files:
        return {"status": "skip", "detail": "no test module in tests/ carries the gpu marker"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           *(["--collect-only"] if collect_only else []), *files]
    try:
        proc = subprocess.run(cmd, cwd=root, env={**os.environ, "REFIMPL_TEST_GPU": "1"}, capture_output=True,
                              text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return {"status": "fail", "command": " ".join(cmd[1:]),
                "detail": f"timed out after {timeout_s:.0f} s"}
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    summary = lines[-1] if lines else ""
    return {"status": _verdict(proc.returncode), "returncode": proc.returncode,
            "command": " ".join(cmd[1:]), "files": files,
            "detail": ("collected only (--smoke): " if collect_only else "") + summary,
            "tail": "\n".join(lines[-40:])}
