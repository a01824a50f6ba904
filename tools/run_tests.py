"""The suite in two lanes at once: the tests that compute, and beside them the tests that mostly wait,
followed in that lane by a share of the computing tests.

    python tools/run_tests.py [-m EXPR] [--sequential] [pytest arguments ...]
    python tools/run_tests.py --unit [-m EXPR] [pytest arguments ...]

``make test`` and ``.ci/run`` call this (docs/ARCHITECTURE.md, "Commands"); ``make test-unit`` calls it with
``--unit`` (``unit_command``).

The ``serial`` tests (tests/conftest.py: a hang named within its timeout, a process gone within a bound,
an elastic restart loop, chapter 08's bubble timed with sleeping stages, the browser) spend most of their
time waiting: on a 2-core machine they kept about half a core busy, one at a time. The rest of the suite
computes (forked ranks training, notebooks' engines), one test at a time; its ranks wait on each other's
messages too, so one such test keeps the two cores about two-thirds busy (sampled from /proc/stat during
CI's numerics rerun). So two lanes run at the same time, each a pytest process after another:

1. **the first lane**: every computing test not marked ``lane2``; its output streams as it runs;
2. **the second lane**: the ``serial`` tests, in order, then the computing tests marked ``lane2`` (some
   of the slowest chapters, tests/course/chapters/test_chapters.py, and the modules in
   tests/'s ``lane2/`` folders, tests/conftest.py: chosen so that both lanes end together); its output is
   printed when it ends. CI's numerics rerun selects no serial test, so there the second lane computes from
   the start.

The serial tests therefore run beside one busy pytest process, never beside several: their bounds were
measured with load on the machine (their modules say how) and must hold under it (the design's rule:
verdicts must not depend on load). ``--sequential`` runs every command one after the other, alone on the
machine (to tell a load-dependent verdict from a real failure).

``-m EXPR`` selects within every command (``-m numerics``: CI's rerun). A command that selects nothing
(pytest's exit 5) is not a failure unless all select nothing. The exit status is the first failure's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "tests" / "course" / "chapters" / "test_chapters.py"  # it marks its own lanes
NOT_UNIT = ("spawn", "subprocess", "chapter", "browser")  # tests/conftest.py's tiers that start a process
UNIT = " and ".join(f"not {tier}" for tier in NOT_UNIT)


def unit_command(marker: str | None, rest: list[str]) -> list[str]:
    """``make test-unit``: the tests that start no process, ``-m UNIT`` (and ``marker``, if given), in one
    pytest process. The folders of the other tiers (tests/conftest.py gives the markers by folder) are not
    even imported (``--ignore``): ``-m`` deselects every test in them, but only once it has collected the
    whole suite (13 s of CPU to collect instead of 8 s). ``-m`` stays: the same tests are chosen."""
    if str(ROOT) not in sys.path:  # run as a script: tools/ is on the path, not the repository
        sys.path.insert(0, str(ROOT))
    from tests.conftest import tier_folders  # (it also hides the GPUs in os.environ, as it does in pytest)

    others = {folder for tier in NOT_UNIT for folder in tier_folders(tier)}
    others = sorted(f for f in others if not others & set(f.parents))  # the outermost of them
    return [sys.executable, "-m", "pytest", "-q", "-m", f"({marker}) and {UNIT}" if marker else UNIT,
            *(f"--ignore={folder}" for folder in others), *rest]


def tier_files(tier: str) -> list[str]:
    """The files and folders that can hold ``tier``'s tests: tests/conftest.py's folders of that tier and
    tests/course/chapters/test_chapters.py, which marks its chapters itself (tests/unit/test_tiers.py checks
    that no other module does). The second lane's commands collect only these: each pytest process
    otherwise imports the whole suite to deselect most of it (about 12 s of CPU per command)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.conftest import tier_folders

    return [*(str(folder) for folder in tier_folders(tier)), str(CHAPTERS)]


def _names_tests(rest: list[str]) -> bool:
    """Whether the pytest arguments ``rest`` name files or tests to run (then they are the selection)."""
    return any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in rest)


def lane_commands(marker: str | None, rest: list[str]) -> list[list[list[str]]]:
    """The two lanes, each the pytest command lines it runs one after the other: the first lane's
    computing tests; the second lane's ``serial`` tests, then its computing (``lane2``) tests (only their
    tiers' files collected, unless ``rest`` names what to run)."""
    def command(lane: str, files: list[str]) -> list[str]:
        return [sys.executable, "-m", "pytest", "-q", "-m", f"({marker}) and {lane}" if marker else lane,
                *rest, *([] if _names_tests(rest) else files)]

    return [[command("not serial and not lane2", [])],
            [command("serial", tier_files("serial")), command("not serial and lane2", tier_files("lane2"))]]


def combined_status(statuses: list[int]) -> int:
    """0 if every command passed or selected nothing (but not all nothing), else the first failure."""
    if all(s == NO_TESTS for s in statuses):
        return NO_TESTS
    return next((s for s in statuses if s not in (0, NO_TESTS)), 0)


class _Lane(threading.Thread):
    """Runs its commands one after the other, output to ``log``; ``stop`` ends the one running."""

    def __init__(self, commands: list[list[str]], log: IO[str]) -> None:
        super().__init__(daemon=True)
        self.commands, self.log, self.statuses = commands, log, []
        self._lock, self._process, self._stopped = threading.Lock(), None, False

    def run(self) -> None:
        for command in self.commands:
            with self._lock:
                if self._stopped:
                    return
                self.log.write(f"== {' '.join(command[1:])}\n")
                self.log.flush()
                self._process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                                 text=True)
            self.statuses.append(self._process.wait())

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._process is not None and self._process.poll() is None:  # its tests end (their ranks too)
                self._process.terminate()
                self._process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", dest="marker", default=None, help="pytest marker expression, for every lane")
    parser.add_argument("--sequential", action="store_true",
                        help="run every command one after the other, alone on the machine")
    parser.add_argument("--unit", action="store_true",
                        help="only the tests that start no process, in one pytest process (make test-unit)")
    args, rest = parser.parse_known_args(argv)
    if args.unit:
        if args.sequential:
            parser.error("--unit runs one pytest process: --sequential does not apply")
        return subprocess.run(unit_command(args.marker, rest)).returncode
    first, second = lane_commands(args.marker, rest)
    if args.sequential:
        statuses = []
        for command in (*first, *second):
            print(f"== {' '.join(command[1:])}", flush=True)
            statuses.append(subprocess.run(command).returncode)
        return combined_status(statuses)
    with tempfile.TemporaryFile("w+") as log:
        then = " then ".join(" ".join(c[3:]) for c in second)
        print(f"== second lane, beside (printed when it ends): {then}", flush=True)
        print(f"== first lane: {' '.join(first[0][1:])}", flush=True)
        beside = _Lane(second, log)
        beside.start()
        try:
            statuses = [subprocess.run(first[0]).returncode]
            beside.join()
        finally:
            if beside.is_alive():  # interrupted
                beside.stop()
                beside.join()
        log.seek(0)
        print("== second lane:", flush=True)
        print(log.read(), end="", flush=True)
    return combined_status([*statuses, *beside.statuses])


if __name__ == "__main__":
    sys.exit(main())
