"""tests/conftest.py: the tiers' markers cover every module that starts a process, and the timeout scale."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import LANE2, SERIAL, SPAWN, SUBPROCESS, scaled_timeout, timeout_scale

TESTS = Path(__file__).resolve().parent
# what starts a process: the rank launcher, a child Python, torchrun, ipyparallel's engines
STARTS = re.compile(r"run_ranks|subprocess|Popen|sys\.executable|torchrun|ipyparallel|start_ranks")


def unmarked_starters(sources: dict[str, str]) -> list[str]:
    """The modules whose source can start a process but which carry neither ``spawn`` nor ``subprocess``."""
    return sorted(m for m, text in sources.items() if STARTS.search(text) and m not in SPAWN | SUBPROCESS)


def test_every_module_that_starts_a_process_is_out_of_the_unit_tier():
    sources = {p.stem: p.read_text() for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name}
    assert unmarked_starters(sources) == []
    # negative control: a new module that calls run_ranks and is in no table is caught
    assert unmarked_starters({"test_new": "from refimpl.launch import run_ranks"}) == ["test_new"]


def test_timeout_scale(monkeypatch):
    monkeypatch.delenv("REFIMPL_TEST_TIMEOUT_SCALE", raising=False)
    assert timeout_scale() == 1
    monkeypatch.setenv("REFIMPL_TEST_TIMEOUT_SCALE", "2.5")
    assert timeout_scale() == 2.5
    for bad in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv("REFIMPL_TEST_TIMEOUT_SCALE", bad)
        with pytest.raises(pytest.UsageError, match="positive number"):
            timeout_scale()


def test_scaled_timeout_takes_the_tests_own_limit_else_the_default():
    assert scaled_timeout(pytest.mark.timeout(120).mark, 300, 2) == 240
    assert scaled_timeout(pytest.mark.timeout(timeout=10).mark, 300, 3) == 30
    assert scaled_timeout(None, 300, 2) == 600
    assert scaled_timeout(None, 0, 2) == 0  # no limit stays no limit


def _run_tests_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_tests", TESTS.parent / "tools" / "run_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_two_lanes_split_the_selection_and_an_empty_lane_is_no_failure():
    run_tests = _run_tests_module()
    first, second = run_tests.lane_commands("numerics", ["tests/test_zero.py"])
    selections = [" ".join(c) for c in (*first, *second)]
    assert [s.split(" -m pytest -q ")[1] for s in selections] == [
        "-m (numerics) and not serial and not lane2 tests/test_zero.py",
        "-m (numerics) and serial tests/test_zero.py",
        "-m (numerics) and not serial and lane2 tests/test_zero.py"]
    serial, lane2 = run_tests.lane_commands(None, [])[1]
    assert serial[3:6] == ["-q", "-m", "serial"] and lane2[3:6] == ["-q", "-m", "not serial and lane2"]
    assert {Path(f).stem for f in serial[6:]} == SERIAL | {"test_chapters"}  # only their files collected
    assert {Path(f).stem for f in lane2[6:]} == LANE2 | {"test_chapters"}
    assert run_tests.combined_status([0, 5]) == 0 and run_tests.combined_status([5, 0]) == 0
    assert run_tests.combined_status([5, 5]) == 5  # nothing selected anywhere is not a pass
    assert run_tests.combined_status([1, 0]) == 1 and run_tests.combined_status([0, 2]) == 2


def test_every_serial_module_exists():
    assert SERIAL | LANE2 <= {p.stem for p in TESTS.glob("test_*.py")}


def test_only_conftest_and_the_chapters_give_the_lane_markers():
    """The second lane collects only its tiers' files (tools/run_tests.py, ``tier_files``): a module that
    marked its own tests ``serial`` or ``lane2`` would not be collected there, nor run in the first lane."""
    own = [p.name for p in TESTS.glob("test_*.py") if p.name not in ("test_chapters.py", "test_tiers.py")
           and re.search(r"mark\.(serial|lane2)\b", p.read_text())]
    assert not own, f"give the lane marker in tests/conftest.py (SERIAL, LANE2), not in {own}"


def test_the_lanes_cover_every_test_once():
    """Each test falls in exactly one of the three selections, whatever its markers."""
    run_tests = _run_tests_module()
    selections = [c[c.index("-q") + 2] for lane in run_tests.lane_commands(None, []) for c in lane]
    for serial in (False, True):
        for lane2 in (False, True):
            env = {"serial": serial, "lane2": lane2}
            chosen = [s for s in selections if eval(s, {}, env)]
            assert len(chosen) == 1, (env, chosen)


def test_lane2_names_chapters_that_exist_and_none_is_serial():
    from tests.test_chapters import CHAPTERS, LANE2
    from tests.test_chapters import SERIAL as SERIAL_CHAPTERS

    assert LANE2 <= {p.stem for p in CHAPTERS} and not LANE2 & SERIAL_CHAPTERS
