"""The project's text speaks for itself: no file refers to a tracker's issue by number ("issue 34",
"Issue #12"), which a reader of the repository cannot look up; say what was asked instead. (A public
project's own tracker, e.g. ``pytorch/pytorch#160285``, names its repository and stays.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)


def test_no_tracked_file_cites_an_issue_number():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = []
    for name in files.split():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".json", ".sh", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in ISSUE.finditer(text)]
    assert not found, found


def test_the_pattern_finds_what_it_names():
    """Negative control: the forms the rule is about are matched, a project's own tracker is not."""
    for text in ("see issue 34", "Issue #12", "issues 33 and 34", "(issue 26)"):
        assert ISSUE.search(text), text
    for text in ("pytorch/pytorch#160285", "an issue with 2 ranks", "Megatron PR #5243"):
        assert not ISSUE.search(text), text
