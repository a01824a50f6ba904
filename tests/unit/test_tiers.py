"""tests/conftest.py: the tiers' markers, given by folder, cover every module that starts a process; the
timeout scale; tools/run_tests.py's lanes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import FOLDER_MARKERS, TIERS, folder_markers, scaled_timeout, tier_folders, timeout_scale

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(TESTS.rglob("test_*.py"))
# what starts a process: the rank launcher, a child Python, torchrun, ipyparallel's engines
STARTS = re.compile(r"run_ranks|subprocess|Popen|sys\.executable|torchrun|ipyparallel|start_ranks")


def unmarked_starters(sources: dict[Path, str]) -> list[str]:
    """The modules whose source can start a process but which lie in no ``spawn`` or ``subprocess`` folder."""
    return sorted(p.name for p, text in sources.items()
                  if STARTS.search(text) and not folder_markers(p) & {"spawn", "subprocess"})


def test_every_module_that_starts_a_process_is_out_of_the_unit_tier():
    sources = {p: p.read_text() for p in MODULES if p != Path(__file__).resolve()}
    assert len(sources) > 80  # control: the walk found the suite
    assert unmarked_starters(sources) == []
    # negative control: a new module that calls run_ranks outside a ranks/ folder is caught
    assert unmarked_starters({TESTS / "unit" / "test_new.py": "from refimpl.launch import run_ranks"}) == [
        "test_new.py"]


def test_the_folders_give_the_markers():
    assert folder_markers(TESTS / "unit" / "parallel" / "test_new.py") == set()
    assert folder_markers(TESTS / "ranks" / "test_new.py") == {"spawn"}
    assert folder_markers(TESTS / "trainer" / "ranks" / "cli" / "lane2" / "test_new.py") == {
        "spawn", "subprocess", "lane2"}
    assert folder_markers(TESTS / "course" / "browser" / "serial" / "test_new.py") == {
        "browser", "subprocess", "serial"}
    assert folder_markers(TESTS.parent / "chapters" / "ranks" / "x.py") == set()  # outside tests/: none
    assert set(TIERS) == {m for markers in FOLDER_MARKERS.values() for m in markers}


def test_every_tier_folder_holds_a_module_and_every_folder_is_a_package():
    """A tier folder left empty (its modules moved away) would go unnoticed; a folder without
    ``__init__.py`` would make its modules' names (``tests.ranks.test_comm``) unimportable by others."""
    for tier in TIERS:
        for folder in tier_folders(tier):
            assert any(folder.rglob("test_*.py")), folder
    folders = {p.parent for p in TESTS.rglob("*.py")}
    assert all((folder / "__init__.py").exists() for folder in folders), sorted(
        str(f) for f in folders if not (f / "__init__.py").exists())


SPAWN_CONSTANT = re.compile(r"^([A-Z_][A-Z0-9_, ]*)=(.*)$", re.M)


def own_spawn_timeouts(sources: dict[Path, str]) -> list[str]:
    """The modules that set a spawn timeout of their own: a ``SPAWN_TIMEOUT...`` constant that is not
    built on tests/support/timeouts.py's ``SPAWN_TIMEOUT_S`` (a multiple of it says why, beside it)."""
    return sorted(p.name for p, text in sources.items() for lhs, rhs in SPAWN_CONSTANT.findall(text)
                  if "SPAWN_TIMEOUT" in lhs and "timeouts.SPAWN_TIMEOUT_S" not in rhs)


def test_one_spawn_timeout():
    sources = {p: p.read_text() for p in MODULES}
    assert own_spawn_timeouts(sources) == []
    assert sum("SPAWN_TIMEOUT_S" in text for text in sources.values()) > 40  # control: the modules use it
    # negative controls: a number of its own, alone or in a tuple, is caught; a multiple of the one is not
    for own in ("SPAWN_TIMEOUT = 120\n", "WORLD, SPAWN_TIMEOUT_S = 4, 300\n"):
        assert own_spawn_timeouts({TESTS / "ranks" / "test_new.py": own}) == ["test_new.py"], own
    multiple = "SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S  # why\n"
    assert own_spawn_timeouts({TESTS / "ranks" / "test_new.py": multiple}) == []


OWN_CORPUS = re.compile(r"make_corpus_file\([^)]*num_bytes=20_000")


def test_the_trainer_tests_share_one_corpus():
    """tests/conftest.py's ``corpus`` is the 20 kB pseudo-text: a module that made its own would prepare its
    tokens again (a smaller or larger text of a test's own design is not this one)."""
    own = [p.name for p in MODULES if OWN_CORPUS.search(p.read_text())]
    assert not own, f"take tests/conftest.py's corpus fixture in {own}"
    assert OWN_CORPUS.search((TESTS / "conftest.py").read_text())  # control: the fixture's own call matches
    users = [p for p in MODULES if re.search(r"def \w+\([^)]*\bcorpus\b", p.read_text())]
    assert len(users) > 15, len(users)


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
    first, second = run_tests.lane_commands("numerics", ["tests/ranks/lane2/test_zero.py"])
    selections = [" ".join(c) for c in (*first, *second)]
    assert [s.split(" -m pytest -q ")[1] for s in selections] == [
        "-m (numerics) and not serial and not lane2 tests/ranks/lane2/test_zero.py",
        "-m (numerics) and serial tests/ranks/lane2/test_zero.py",
        "-m (numerics) and not serial and lane2 tests/ranks/lane2/test_zero.py"]
    serial, lane2 = run_tests.lane_commands(None, [])[1]
    assert serial[3:6] == ["-q", "-m", "serial"] and lane2[3:6] == ["-q", "-m", "not serial and lane2"]
    chapters = str(TESTS / "course" / "chapters" / "test_chapters.py")  # only their folders collected
    assert serial[6:] == [*map(str, tier_folders("serial")), chapters]
    assert lane2[6:] == [*map(str, tier_folders("lane2")), chapters]
    assert all(Path(f).exists() for f in serial[6:] + lane2[6:])
    assert run_tests.combined_status([0, 5]) == 0 and run_tests.combined_status([5, 0]) == 0
    assert run_tests.combined_status([5, 5]) == 5  # nothing selected anywhere is not a pass
    assert run_tests.combined_status([1, 0]) == 1 and run_tests.combined_status([0, 2]) == 2


def test_only_the_folders_and_the_chapters_give_the_lane_markers():
    """The second lane collects only its tiers' folders (tools/run_tests.py, ``tier_files``): a module that
    marked its own tests ``serial`` or ``lane2`` would not be collected there, nor run in the first lane."""
    own = [p.name for p in MODULES if p.name not in ("test_chapters.py", "test_tiers.py")
           and re.search(r"mark\.(serial|lane2)\b", p.read_text())]
    assert not own, f"move the module to a serial/ or lane2/ folder (tests/conftest.py), not {own}"


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
    from tests.course.chapters.test_chapters import CHAPTERS, LANE2
    from tests.course.chapters.test_chapters import SERIAL as SERIAL_CHAPTERS

    assert LANE2 <= {p.stem for p in CHAPTERS} and not LANE2 & SERIAL_CHAPTERS
