"""The suite in two lanes: what no clock judges on several workers, then what a clock judges alone.

    python tools/run_tests.py [-m EXPR] [-n WORKERS] [pytest arguments ...]

``make test`` and ``.ci/run`` call this (docs/ARCHITECTURE.md, "The two commands, and the suite").

Most of the suite waits more than it computes: a forked rank blocks in a collective, a child interpreter
imports torch, a trainer sleeps through a heartbeat. On 2 cores one test at a time leaves a core idle much
of the time. So:

1. **the parallel lane**: every test not marked ``serial``, on ``WORKERS`` pytest-xdist workers (default 2,
   ``REFIMPL_TEST_WORKERS``), one module (one chapter) per xdist group so that a module's spawned fixture
   runs once (``--dist loadgroup``; the groups are given in tests/conftest.py);
2. **the serial lane**: the ``serial`` tests (tests/conftest.py: those whose verdict reads a clock: a hang
   named within its timeout, a process gone within a bound, chapter 08's measured bubble, the browser),
   one at a time, alone on the machine, as before.

``-m EXPR`` selects within both lanes (``-m numerics``: CI's rerun). A lane that selects nothing (pytest's
exit 5) is not a failure unless both select nothing. The exit status is the first failing lane's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def lane_commands(marker: str | None, workers: int, rest: list[str]) -> list[list[str]]:
    """The two pytest command lines: the parallel lane (``workers`` > 1) and the serial lane."""
    def select(lane: str) -> str:
        return f"({marker}) and {lane}" if marker else lane

    pytest = [sys.executable, "-m", "pytest", "-q"]
    parallel = [*pytest, "-m", select("not serial")]
    if workers > 1:
        parallel += ["-n", str(workers), "--dist", "loadgroup"]
    return [[*parallel, *rest], [*pytest, "-m", select("serial"), *rest]]


def combined_status(statuses: list[int]) -> int:
    """0 if every lane passed or selected nothing (but not all nothing), else the first failure."""
    if all(s == NO_TESTS for s in statuses):
        return NO_TESTS
    return next((s for s in statuses if s not in (0, NO_TESTS)), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression, for both lanes")
    parser.add_argument("-n", dest="workers", type=int,
                        default=int(os.environ.get("REFIMPL_TEST_WORKERS", "2")),
                        help="workers of the parallel lane (default 2, REFIMPL_TEST_WORKERS; 1: no xdist)")
    args, rest = parser.parse_known_args(argv)
    if args.workers < 1:
        parser.error(f"-n must be at least 1, got {args.workers}")
    statuses = []
    for lane, cmd in zip(("parallel", "serial"), lane_commands(args.marker, args.workers, rest), strict=True):
        print(f"== {lane} lane: {' '.join(cmd[1:])}", flush=True)
        statuses.append(subprocess.run(cmd).returncode)
    return combined_status(statuses)


if __name__ == "__main__":
    sys.exit(main())
