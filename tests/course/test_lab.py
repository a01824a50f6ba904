"""The course as JupyterLab opens it: chapters stay byte-identical when opened, run and saved.

JupyterLab saves a jupytext chapter through jupytext's contents manager, with what a run adds: the
kernel's kernelspec, ``language_info``, widget state, cell outputs and execution counts, per-cell metadata
(timings, "scrolled"), and the jupytext version in the header. The project's ``jupytext.toml`` filters
all of that out. This test does what Lab does to every chapter through the same contents manager (with
the project's configuration, in a copy of the repository's files) and compares the bytes. The negative
control: without ``jupytext.toml`` the same save changes the file. And ``make lab``'s setting, which
makes a double-click open a chapter as a notebook, is the one the Makefile installs; its recipe gives Lab the
repository root.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from jupytext import TextFileContentsManager

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


def _open_run_save(root: Path, name: str) -> None:
    """Open ``name`` under ``root`` as Lab does, add what running and saving it adds, save it."""
    cm = TextFileContentsManager(root_dir=str(root))
    model = cm.get(name)
    nb = model["content"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.2", "mimetype": "text/x-python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    header = nb.metadata.setdefault("jupytext", {}).setdefault("text_representation", {})
    header["jupytext_version"] = "1.19.6"
    for i, cell in enumerate(nb.cells):
        cell.metadata["execution"] = {"iopub.status.busy": "2026-12-01T08:00:00.000Z"}
        cell.metadata["scrolled"] = True
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"output {i}\n")]
            cell.execution_count = i + 1
    cm.save(model, name)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_a_chapter_saved_by_lab_is_byte_identical(chapter: Path, tmp_path: Path):
    shutil.copy(ROOT / "jupytext.toml", tmp_path / "jupytext.toml")
    shutil.copy(chapter, tmp_path / chapter.name)
    _open_run_save(tmp_path, chapter.name)
    assert (tmp_path / chapter.name).read_bytes() == chapter.read_bytes(), (
        f"{chapter.name} changed when saved from JupyterLab: fix its header or jupytext.toml")


def test_without_the_project_config_a_save_changes_the_chapter(tmp_path: Path):  # the negative control
    chapter = CHAPTERS[0]
    shutil.copy(chapter, tmp_path / chapter.name)
    _open_run_save(tmp_path, chapter.name)
    assert (tmp_path / chapter.name).read_bytes() != chapter.read_bytes()


def test_lab_opens_python_files_as_notebooks():
    settings = json.loads((ROOT / "lab" / "overrides.json").read_text())
    viewers = settings["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers["python"] == "Jupytext Notebook"
    makefile = (ROOT / "Makefile").read_text()
    assert "lab/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json" in makefile


def test_make_lab_serves_the_repository_root():
    """The recipe's text (tests/course/browser/serial/test_browser.py runs it: ``make lab`` with its
    ``ARGS``): the root given, since with a file alone Lab serves the file's folder (chapters/), and the
    test's flags passed through."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nlab:", 1)[1].split("\n\n", 1)[0]
    assert "--ServerApp.root_dir=." in recipe and "$(ARGS)" in recipe, recipe
    assert "chapters/00_orientation.py" in recipe and "--allow-root" in recipe, recipe
