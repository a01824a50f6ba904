"""The README's training commands, run as it shows them, in its order, on a fresh clone.

A new user's path: ``make train`` (the default run: 200 steps on 2 CPU ranks, the demonstrated fault and
restart), ``make train`` again in the same folder (a finished run: nothing to train, said in one line),
then the README's own example with a corpus of their own, ``make train ARGS="--steps 50 --data my.txt
--out runs/mine"``. Each command is read from README.md, split as a shell would, and run in a ``git
clone`` of this repository (make, and git for the clone, are the README's requirements: no skip without
them); the only addition is where make finds the environment (``VENV=`` this suite's, ``-o`` its stamp: no
reinstall), as tests/course/browser/serial/test_browser.py starts ``make lab``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from refimpl.data import make_corpus_file
from refimpl.train import build_parser

ROOT = Path(__file__).resolve().parents[5]
TIMEOUT_S = 300  # one command; make train measured 67 s on this 2-core machine at load 2


def _readme_commands() -> list[list[str]]:
    """``make train`` (the quick start's first command) and every ``make train ARGS="..."`` example, in the
    README's order, as a shell splits them."""
    text = (ROOT / "README.md").read_text()
    first = re.search(r"^make train\s+#", text, re.MULTILINE)
    assert first, "the README's quick start no longer starts with make train"
    examples = [shlex.split(m.group(0)) for m in re.finditer(r'make train ARGS="[^"]*"', text)]
    return [["make", "train"], *examples]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    venv = Path(sys.prefix)
    make = [command[0], "-o", str(venv / ".installed"), f"VENV={venv}", *command[1:]]
    # a fresh user's environment: not the one of a `make test ARGS=...` around this test, whose variables
    # make exports to its recipes (ARGS=--durations=9 reached `make train` and its parser once)
    makes = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "ARGS", "TRAIN_ARGS", "CH", "ONLY", "TORCH_SPEC")
    env = {k: v for k, v in os.environ.items() if k not in makes}
    return subprocess.run(make, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(4 * TIMEOUT_S)
def test_the_readmes_make_train_examples_run_in_order_on_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    commands = _readme_commands()
    assert commands[1] == ["make", "train", "ARGS=--steps 50 --data my.txt --out runs/mine"], commands
    make_corpus_file(clone / "my.txt", num_bytes=60_000)  # the user's own text

    first = _run(commands[0], clone)
    assert first.returncode == 0, first.stderr[-3000:]
    default = clone / "runs" / "default"
    assert [r["step"] for r in _metrics(default)] == list(range(200))
    summary = json.loads((default / "summary.json").read_text())
    assert summary["restart_count"] == 1 and summary["resumed_from_step"] == 50, summary  # the demo fault
    model = json.loads((default / "config.json").read_text())["model"]  # the Llama form, 2 key/value heads
    assert (model["normalization"], model["position_embedding"], model["num_key_value_heads"]) == \
        ("rmsnorm", "rope", 2), model

    again = _run(commands[0], clone)  # the README: running make train again in the same folder resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train" in again.stdout + again.stderr

    for command in commands[1:]:
        proc = _run(command, clone)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        args = build_parser().parse_args(shlex.split(command[-1].removeprefix("ARGS=")))
        assert [r["step"] for r in _metrics(clone / args.out)] == list(range(args.steps))
    assert len(_metrics(default)) == 200  # the default run was left as it was
