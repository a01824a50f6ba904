"""The project's history reads in one line per change: every commit subject since the rule was adopted
(the commits after ``RULE_FROM``) is at most 72 characters, the detail in the body, so that
``git log --oneline`` stays readable. (It runs git: the subprocess tier, tests/conftest.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RULE_FROM = "02e1907"  # the last commit whose subject ran past 72 characters
SUBJECT_MAX = 72


def _subjects_since(commit: str) -> list[str]:
    """The subjects of the commits after ``commit`` (every commit in a shallow clone that lacks it)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)

    known = git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0
    out = git("log", "--format=%h %s", *([f"{commit}..HEAD"] if known else []))
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _no_history() -> bool:
    return shutil.which("git") is None or not (ROOT / ".git").exists()


def test_commit_subjects_are_at_most_72_characters():
    if _no_history():
        pytest.skip("not a git checkout: no history to read")
    long = [line for line in _subjects_since(RULE_FROM) if len(line.split(" ", 1)[1]) > SUBJECT_MAX]
    assert not long, f"commit subjects over {SUBJECT_MAX} characters (put the detail in the body): {long}"


def test_the_subject_rule_sees_the_history_before_it():
    """Negative control: from the root, the history has subjects over the limit (the rule's reason)."""
    if _no_history():
        pytest.skip("not a git checkout: no history to read")
    root = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout.split()[0]
    subjects = _subjects_since(root)
    if len(subjects) < 100:
        pytest.skip("a shallow clone: the early history is not here")
    assert any(len(line.split(" ", 1)[1]) > SUBJECT_MAX for line in subjects)
