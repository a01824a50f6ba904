"""Models declare, techniques apply: no technique, precision or planner file imports a model.

Every ``.py`` file under ``refimpl/parallel/``, ``refimpl/precision/`` and ``refimpl/planner/`` is parsed
and each ``import`` statement (at the top or inside a function, ``TYPE_CHECKING`` blocks included) is
checked: none names ``refimpl.models`` or a module under it. The techniques read what a model declares
(``refimpl/parallel/declarations.py``) and so take a user's own model the same way. Negative control: the
checker flags each form a model import can take.
"""

from __future__ import annotations

import ast
from pathlib import Path

REFIMPL = Path(__file__).resolve().parents[2] / "refimpl"
LAYERS = ("parallel", "precision", "planner")
MODELS = "refimpl.models"


def model_imports(source: str) -> list[str]:
    """The modules named by ``source``'s import statements that are ``refimpl.models`` or under it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if n == MODELS or n.startswith(MODELS + ".")]
    return found


def test_no_technique_precision_or_planner_file_imports_a_model():
    files = [p for layer in LAYERS for p in sorted((REFIMPL / layer).rglob("*.py"))]
    assert len(files) > 50  # the walk found the packages
    offenders = {str(p.relative_to(REFIMPL)): model_imports(p.read_text()) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_checker_flags_every_form_of_a_model_import():
    forms = ["from refimpl.models import GPT", "import refimpl.models.gpt as g", "from refimpl import models",
             "def f():\n    from refimpl.models.moe import MoEMLP\n",
             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from refimpl.models.gpt import GPT\n"]
    for source in forms:
        assert model_imports(source), source
    assert model_imports("from refimpl.parallel.declarations import declared\nimport refimpl.config") == []
