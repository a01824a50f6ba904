"""The project's text speaks for itself: no file refers to a tracker's issue by number ("issue 34",
"Issue #12"), which a reader of the repository cannot look up; say what was asked instead. (A public
project's own tracker, e.g. ``pytorch/pytorch#160285``, names its repository and stays.) Nor does it use
Sphinx's roles (a colon, the role's name, a colon, then the target in single backticks): no Sphinx build
renders them, so a docstring names what it points at in double backticks, as it reads in the source."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const)" + ":`")
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

