"""The suite in two lanes at once: the tests that compute, and beside them the tests that mostly wait.

    python tools/run_tests.py [-m EXPR] [--sequential] [pytest arguments ...]

``make test`` and ``.ci/run`` call this (docs/ARCHITECTURE.md, "Commands").

The ``serial`` tests (tests/conftest.py: a hang named within its timeout, a process gone within a bound,
an elastic restart loop, chapter 08's bubble timed with sleeping stages, the browser) spend most of their
time waiting: on a 2-core machine they kept about half a core busy, one at a time. The rest of the suite
computes (forked ranks training, notebooks' engines), one test at a time on both cores. So the two lanes
run at the same time, each a plain pytest process running its tests one after the other:

1. **the compute lane**: every test not marked ``serial``; its output streams as it runs;
2. **the waiting lane**: the ``serial`` tests, in order; its output is printed when it ends.

The waiting lane therefore runs beside one busy pytest process, never beside several: its tests' bounds
were measured with load on the machine (their modules say how) and must hold under it (the design's rule:
verdicts must not depend on load). ``--sequential`` runs the lanes one after the other, the waiting lane
alone on the machine (to tell a load-dependent verdict from a real failure).

``-m EXPR`` selects within both lanes (``-m numerics``: CI's rerun). A lane that selects nothing (pytest's
exit 5) is not a failure unless both select nothing. The exit status is the first failing lane's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def lane_commands(marker: str | None, rest: list[str]) -> list[list[str]]:
    """The two pytest command lines: the compute lane and the waiting (``serial``) lane."""
    def select(lane: str) -> str:
        return f"({marker}) and {lane}" if marker else lane

    pytest = [sys.executable, "-m", "pytest", "-q"]
    return [[*pytest, "-m", select("not serial"), *rest], [*pytest, "-m", select("serial"), *rest]]


def combined_status(statuses: list[int]) -> int:
    """0 if every lane passed or selected nothing (but not all nothing), else the first failure."""
    if all(s == NO_TESTS for s in statuses):
        return NO_TESTS
    return next((s for s in statuses if s not in (0, NO_TESTS)), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression, for both lanes")
    parser.add_argument("--sequential", action="store_true",
                        help="run the waiting lane after the compute lane, alone on the machine")
    args, rest = parser.parse_known_args(argv)
    compute, waiting = lane_commands(args.marker, rest)
    with tempfile.TemporaryFile("w+") as waiting_log:
        if args.sequential:
            print(f"== compute lane: {' '.join(compute[1:])}", flush=True)
            statuses = [subprocess.run(compute).returncode]
            print(f"== waiting lane: {' '.join(waiting[1:])}", flush=True)
            statuses.append(subprocess.run(waiting).returncode)
            return combined_status(statuses)
        print(f"== waiting lane, beside (printed when it ends): {' '.join(waiting[1:])}", flush=True)
        print(f"== compute lane: {' '.join(compute[1:])}", flush=True)
        beside = subprocess.Popen(waiting, stdout=waiting_log, stderr=subprocess.STDOUT, text=True)
        try:
            statuses = [subprocess.run(compute).returncode, beside.wait()]
        finally:
            if beside.poll() is None:  # interrupted: the lane's tests end with it (their ranks too)
                beside.terminate()
                beside.wait()
        waiting_log.seek(0)
        print(f"== waiting lane: {' '.join(waiting[1:])}", flush=True)
        print(waiting_log.read(), end="", flush=True)
    return combined_status(statuses)


if __name__ == "__main__":
    sys.exit(main())
