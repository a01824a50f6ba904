"""The project's text speaks for itself: no file refers to a tracker's issue by number ("issue 34",
"Issue #12"), which a reader of the repository cannot look up; say what was asked instead. (A public
project's own tracker, e.g. ``pytorch/pytorch#160285``, names its repository and stays.) Nor does it use
Sphinx's roles (a colon, the role's name, a colon, then the target in single backticks): no Sphinx build
renders them, so a docstring names what it points at in double backticks, as it reads in the source.
And its history reads in one line per change: every commit subject since the rule was adopted (the commit
after ``RULE_FROM``) is at most 72 characters, the detail in the body (``git log --oneline`` stays readable).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const)" + ":`")
RULE_FROM = "02e1907"  # the last commit whose subject ran past 72 characters
SUBJECT_MAX = 72
SUFFIXES = {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".json", ".sh", ".cfg", ""}


def _project_files() -> list[Path]:
    """The project's text files: the root's and those under its source folders (not .venv, build, runs),
    but this module, whose examples are the pattern's."""
    folders = ("chapters", "exercises", "refimpl", "tests", "docs", "bench", "tools", "deploy", "lab", ".ci")
    files = [p for p in ROOT.iterdir() if p.is_file()]
    files += [p for folder in folders if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in files if p.suffix in SUFFIXES and p != Path(__file__).resolve()]


def _found(pattern: re.Pattern) -> list[str]:
    """``file:line`` of each match of ``pattern`` in the project's text files."""
    found = []
    for path in _project_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                  for m in pattern.finditer(text)]
    return found


def test_no_project_file_cites_an_issue_number():
    assert not _found(ISSUE), _found(ISSUE)
    assert len(_project_files()) > 200  # control: the walk found the project


def test_no_project_file_uses_a_sphinx_role():
    found = _found(ROLE)
    assert not found, found[:20]


def test_the_pattern_finds_what_it_names():
    """Negative control: the forms the rule is about are matched, a project's own tracker is not."""
    for text in ("see issue 34", "Issue #12", "issues 33 and 34", "(issue 26)"):
        assert ISSUE.search(text), text
    for text in ("pytorch/pytorch#160285", "an issue with 2 ranks", "Megatron PR #5243"):
        assert not ISSUE.search(text), text
    for role in ("func", "class", "meth", "py:func"):  # the roles' pattern, built so this file has none
        assert ROLE.search(f"see :{role}:" + "`refimpl.plan`"), role
    assert not ROLE.search("see ``refimpl.plan`` and a ratio 1:2")


def _subjects_since(commit: str) -> list[str]:
    """The subjects of the commits after ``commit`` (every commit in a shallow clone that lacks it)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)

    known = git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0
    out = git("log", "--format=%h %s", *([f"{commit}..HEAD"] if known else []))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_commit_subjects_are_at_most_72_characters():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to read")
    long = [line for line in _subjects_since(RULE_FROM) if len(line.split(" ", 1)[1]) > SUBJECT_MAX]
    assert not long, f"commit subjects over {SUBJECT_MAX} characters (put the detail in the body): {long}"


def test_the_subject_rule_sees_the_history_before_it():
    """Negative control: from the root, the history has subjects over the limit (the rule's reason)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to read")
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout.split()[0]
    subjects = _subjects_since(root)
    if len(subjects) < 100:
        pytest.skip("a shallow clone: the early history is not here")
    assert any(len(line.split(" ", 1)[1]) > SUBJECT_MAX for line in subjects)
