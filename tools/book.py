"""``make book``: the executed course as static HTML, for readers who want to read before they run.

Each chapter ``chapters/NN_topic.py`` (jupytext percent format) is converted to a notebook, executed by
nbconvert's ExecutePreprocessor (a fresh kernel per chapter, its cwd the chapters folder, ``PYTHONPATH`` the
repository root, a timeout per cell) and exported with nbconvert's HTML exporter (figures inline as data
URIs) to ``build/book/NN_topic.html``, with "previous / course map / next" links on every page.
``build/book/index.html`` is the course map: each chapter's title is its first markdown heading.
A chapter that fails to execute stops the build with its cell and error, and a non-zero exit status.
docs/ARCHITECTURE.md, "The two commands, and the suite".

    python tools/book.py [--only 00 03] [--src chapters] [--out build/book] [--timeout 600]
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
STYLE = """<style>
.book-nav { display: flex; justify-content: space-between; gap: 1em; max-width: 1100px; margin: 0.6em auto;
  padding: 0.4em 1em; font: 14px sans-serif; border-bottom: 1px solid #ccc; }
.book-nav a { text-decoration: none; }
.book-nav .book-none { color: #aaa; }
</style>"""


@dataclass(frozen=True)
class Chapter:
    source: Path
    number: str  # "00"
    title: str  # the first markdown heading

    @property
    def page(self) -> str:
        return f"{self.source.stem}.html"


def chapter_title(notebook: nbformat.NotebookNode, fallback: str) -> str:
    """The text of the first markdown heading of the notebook (``# 00 · Orientation ...``)."""
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            match = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
            if match:
                return match.group(1)
    return fallback


def find_chapters(src: Path, only: list[str] | None) -> list[Chapter]:
    sources = sorted(src.glob("[0-9][0-9]_*.py"))
    if only:
        wanted = {o.zfill(2) for o in only}
        unknown = wanted - {p.name[:2] for p in sources}
        if unknown:
            raise SystemExit(f"book: no chapter {', '.join(sorted(unknown))} in {src}")
        sources = [p for p in sources if p.name[:2] in wanted]
    if not sources:
        raise SystemExit(f"book: no chapter (NN_topic.py) in {src}")
    return [Chapter(p, p.name[:2], chapter_title(jupytext.read(p), p.stem)) for p in sources]


class ProgressExecutor(ExecutePreprocessor):
    """ExecutePreprocessor that advances a tqdm bar by one per code cell."""

    bar: tqdm | None = None

    def preprocess_cell(self, cell, resources, index):  # noqa: D102 (nbconvert's hook)
        out = super().preprocess_cell(cell, resources, index)
        if self.bar is not None and cell.cell_type == "code":
            self.bar.update(1)
        return out


def execute(chapter: Chapter, timeout_s: int, position: int) -> nbformat.NotebookNode:
    notebook = jupytext.read(chapter.source)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                       "language": "python"}
    n_code = sum(c.cell_type == "code" for c in notebook.cells)
    executor = ProgressExecutor(timeout=timeout_s, kernel_name="python3", startup_timeout=120)
    with tqdm(total=n_code, desc=chapter.source.stem, unit="cell", position=position, leave=True) as bar:
        executor.bar = bar
        executor.preprocess(notebook, {"metadata": {"path": str(chapter.source.parent)}})
    return notebook


def nav(chapters: list[Chapter], i: int) -> str:
    def link(j: int, arrow: str) -> str:
        if 0 <= j < len(chapters):
            c = chapters[j]
            return f'<a href="{c.page}">{arrow} {html.escape(c.title)}</a>'
        return f'<span class="book-none">{arrow}</span>'

    return (f'<nav class="book-nav">{link(i - 1, "&larr;")}<a href="index.html">course map</a>'
            f'{link(i + 1, "&rarr;")}</nav>')


def render(notebook: nbformat.NotebookNode, chapters: list[Chapter], i: int) -> str:
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": chapters[i].title}})
    bar = nav(chapters, i)
    body = body.replace("</head>", STYLE + "\n</head>", 1)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + "\n" + bar, body, count=1)
    return body.replace("</body>", bar + "\n</body>", 1)


def index_page(chapters: list[Chapter]) -> str:
    items = "\n".join(f'<li><a href="{c.page}">{html.escape(c.title)}</a></li>' for c in chapters)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Distributed training of language models</title>
{STYLE}
<style>body {{ font: 16px/1.5 sans-serif; max-width: 900px; margin: 2em auto; }}</style></head>
<body>
<h1>Distributed training of language models: the course map</h1>
<p>Each page is the chapter as executed by <code>make book</code>: its outputs and figures as a run printed
them. To run a chapter yourself: <code>make lab</code>.</p>
<ol class="book-map">
{items}
</ol>
</body></html>
"""


def build(src: Path, out: Path, only: list[str] | None, timeout_s: int) -> list[Path]:
    chapters = find_chapters(src, only)
    out.mkdir(parents=True, exist_ok=True)
    # The kernels import refimpl from this repository, wherever the command is run from.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)
    os.environ.setdefault("REFIMPL_PX_STREAM", "0")  # a failing %%px cell reports the rank's traceback
    os.environ.pop("MPLBACKEND", None)  # figures inline, as in JupyterLab
    pages = []
    overall = tqdm(total=len(chapters), desc="book", unit="chapter", position=0)
    for i, chapter in enumerate(chapters):
        start = time.perf_counter()
        try:
            notebook = execute(chapter, timeout_s, position=1)
        except CellExecutionError as err:
            overall.close()
            first = str(err).strip().splitlines()
            tail = "\n".join(first[-25:])
            raise SystemExit(f"book: chapter {chapter.source.name} failed to execute:\n{tail}") from None
        page = out / chapter.page
        page.write_text(render(notebook, chapters, i), encoding="utf-8")
        pages.append(page)
        overall.write(f"{chapter.source.name}: {time.perf_counter() - start:.1f} s -> {page}")
        overall.update(1)
    overall.close()
    (out / "index.html").write_text(index_page(chapters), encoding="utf-8")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="only these chapters (e.g. --only 00 03)")
    parser.add_argument("--src", type=Path, default=ROOT / "chapters", help="folder of NN_topic.py chapters")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book", help="output folder")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run")
    args = parser.parse_args(argv)
    build(args.src.resolve(), args.out.resolve(), args.only, args.timeout)
    print(f"book: {args.out.resolve() / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
