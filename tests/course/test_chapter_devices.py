"""Chapters run unchanged on GPUs: no tensor, model, mesh or autocast on a hard-coded device.

Every chapter takes its device from the ranks (``device`` on each engine, see refimpl/launch/notebook.py) or
picks it once (``torch.device("cuda" if torch.cuda.is_available() else "cpu")``). Passing the literal
``"cpu"`` or ``"cuda"`` to a call (``torch.device("cpu")``, ``init_device_mesh("cpu", ...)``,
``torch.autocast("cpu")``, ``x.to("cpu")``, ``torch.zeros(..., device="cpu")``) or calling ``.cuda()``
would hand CPU tensors to NCCL, or CUDA tensors to a laptop. Such a call is allowed only on a line that
says why: ``# cpu on purpose: <reason>``. ``.cpu()`` stays allowed: it brings a result home to the
notebook for printing and plotting, which is right on every backend. See docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
DEVICES = {"cpu", "cuda"}
WAIVER = "# cpu on purpose:"


def hard_coded_devices(source: str) -> list[tuple[int, str]]:
    """(line, code) of every call that names a device by a literal, or calls ``.cuda()``, without a waiver."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        literals = [a for a in [*node.args, *(k.value for k in node.keywords)]
                    if isinstance(a, ast.Constant) and a.value in DEVICES]
        cuda_call = isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args
        for where in ([node] if cuda_call else []) + literals:
            line = lines[where.lineno - 1]
            if WAIVER not in line:
                found.append((where.lineno, line.strip()))
    return sorted(set(found))


def _code_of(path: Path) -> str:
    """The chapter's code cells as one Python source, line numbers kept (markdown lines left blank)."""
    notebook = jupytext.read(path)
    text = path.read_text()
    try:
        ast.parse(text)
        return text  # a percent-format file is Python: its line numbers are the file's
    except SyntaxError:
        return "\n".join(c.source for c in notebook.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_takes_its_device_from_the_ranks(path: Path):
    found = hard_coded_devices(_code_of(path))
    report = "\n".join(f"  {path.name}:{n}: {code}" for n, code in found)
    assert not found, (
        f"hard-coded devices (use the ranks' `device` / `device.type`, or add '{WAIVER} <why>'):\n{report}")


def test_the_check_finds_what_it_should():  # the negative control: each of these must be caught
    bad = ['m = init_device_mesh("cpu", (4,))', 'x = torch.zeros(3, device="cpu")', "y = x.to('cuda')",
           'd = torch.device("cpu")', 'with torch.autocast("cpu", dtype=torch.bfloat16): pass',
           "z = x.cuda()"]
    for code in bad:
        assert hard_coded_devices(code), code
    good = ['d = torch.device("cuda" if torch.cuda.is_available() else "cpu")', "x = x.to(device)",
            'if device.type == "cpu": pass', "print(x.cpu())", 'm = init_device_mesh(device.type, (4,))',
            f'x = torch.zeros(3, device="cpu")  {WAIVER} the sampler runs on the host']
    for code in good:
        assert not hard_coded_devices(code), code
