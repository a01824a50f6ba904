"""The course as a learner meets it: JupyterLab in a real browser, and the book.

docs/ARCHITECTURE.md, "The two commands, and the suite".

One test starts JupyterLab through ``make lab`` itself, the README's command (headless: 127.0.0.1, a free
port, a random token, given in its ``ARGS``), checks that it serves the repository root and opens chapter 00,
and drives Debian's chromium through Playwright's sync API (launched by its path; no browser is ever
downloaded). For EVERY chapter it double-clicks the file in the file browser, checks that it opened as a
notebook (the project's ``defaultViewers`` override, not the text editor), waits for the kernel, runs cells:

* chapter 00: Run All (its ranks, a collective, a failing rank on purpose, torchrun, the figure);
* chapter 02: the cells up to and including ``start_ranks``; then the kernel is shut down with its 4 ranks
  alive, and none of the ranks' processes (controller, zygote and engines, reaper) may survive it;
* every other chapter: the cells before its first ``start_ranks`` or ``run_command`` (those that launch
  no ranks), at most ``CELL_CAP`` code cells. The chapters run in full under nbval
  (tests/course/chapters/test_chapters.py); here what is tested is the browser: the notebook opens, runs,
  renders.

It fails on an error output, a cell of the run left without an execution count, a figure (an ``image/png``
output) whose ``<img>`` does not render (``naturalWidth > 0``), and on chapter 04's Ψ slider if it does not
start at the code's 7.5 or if moving it does not redraw the chart. Lab's autosave stays on: the chapters
must stay byte-identical (jupytext.toml) and ``git status chapters/`` unchanged. In the meantime
``tools/book.py --only 00`` builds the book for one chapter; chromium then opens its index and the chapter
page, follows the links, and checks the figures. At the end the kernels, the server and every process they
started (found by an environment marker) must be gone; ipyparallel processes left on the machine are reported.

Without chromium the test is skipped, with that reason (``.ci/run`` installs it with apt).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jupytext
import psutil
import pytest
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from refimpl.launch import free_port

ROOT = Path(__file__).resolve().parents[4]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
MARK = "REFIMPL_BROWSER_TEST"  # every process the test's server starts inherits it
FULL_RUN = "00_orientation"  # Run All, ranks included
LIVE_RANKS = "02_collectives"  # run through start_ranks, then shut the kernel down under its ranks
CELL_CAP = 6  # code cells run at most in the other chapters
WIDGET_CHAPTER = "04_zero"
SERVER_START_S, KERNEL_READY_S, RUN_S, FULL_RUN_S, BOOK_S = 90, 90, 150, 240, 300
# Lab in a throwaway settings folder: every cell in the DOM (windowing off, so that outputs and figures can
# be inspected), no news or update checks. defaultViewers comes from the project (.venv's overrides.json).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}

CELLS_JS = """(stop) => {
  const w = window.jupyterapp.shell.currentWidget;
  const out = [];
  w.content.widgets.slice(0, stop).forEach((c, i) => {
    if (c.model.type !== 'code') return;
    const outs = c.model.outputs.toJSON();
    out.push({i: i, count: c.model.executionCount,
              errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
              pngs: outs.filter(o => o.data && o.data['image/png']).length,
              imgs: [...c.node.querySelectorAll('.jp-OutputArea-output img')].map(
                im => im.complete ? im.naturalWidth : -1)});
  });
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return {status: kernel ? kernel.status : null, cells: out};
}"""


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARK) == mark:
                found.append(proc)
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
    return out


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _tracked_state() -> tuple[str, dict[str, str]]:
    status = subprocess.run(["git", "status", "--porcelain", "chapters/"], cwd=ROOT, capture_output=True,
                            text=True, check=True, timeout=30).stdout
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "chapters/"], cwd=ROOT,
                           capture_output=True, text=True, check=True, timeout=30).stdout.split()
    return status, {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest() for f in files}


def _cells_to_run(source: Path) -> tuple[int, bool]:
    """(stop, run_all): run the cells [0, stop) or all of them."""
    nb = jupytext.read(source)
    if source.stem == FULL_RUN:
        return len(nb.cells), True
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]

    def calls(i: int, name: str) -> bool:
        text = nb.cells[i].source
        return name in text and "import" not in text.split(name)[0].splitlines()[-1]

    starts = [i for i in code if calls(i, "start_ranks(")]
    if source.stem == LIVE_RANKS:
        assert starts, f"{source.name} no longer starts ranks: pick another chapter for LIVE_RANKS"
        return starts[0] + 1, False
    # ranks or a torchrun launch (run_command): the chapter's own test runs those
    # (tests/course/chapters/test_chapters.py)
    launches = [i for i in code if i in starts or calls(i, "run_command(")]
    before = [i for i in code if not launches or i < launches[0]][:CELL_CAP]
    return (before[-1] + 1 if before else 0), False


def _item(page: Page, name: str):
    """The file browser's entry ``name``."""
    return page.locator(".jp-DirListing-item", has=page.get_by_text(name, exact=True)).first


def _is_rank_process(cmdline: str) -> bool:
    """A notebook rank's process: ipyparallel's controller (or an engine it launched), the zygote that forks
    the engines on Linux (the engines keep its command line) or the reaper."""
    return any(k in cmdline for k in ("ipyparallel", "refimpl.launch.engine_zygote", "refimpl.launch.reaper"))


def _enter_folder(page: Page, name: str, expect: str, attempts: int = 3) -> None:
    """Double-click folder ``name`` in the file browser until its entry ``expect`` shows. The listing
    refreshes when the root changes (tests/course/chapters/test_chapters.py creates ``build/`` there while
    this test runs), and a refresh between the two clicks of a double-click lands them on a neighbour (seen:
    ``build`` opened instead of ``chapters``); then go back to the root and try again."""
    for _ in range(attempts - 1):
        _item(page, name).dblclick()
        try:
            _item(page, expect).wait_for(timeout=20_000)
            return
        except PlaywrightTimeout:
            page.evaluate("window.jupyterapp.commands.execute('filebrowser:go-to-path', {path: '/'})")
            _item(page, name).wait_for()
    _item(page, name).dblclick()
    _item(page, expect).wait_for()


def _make_lab(port: int, token: str) -> list[str]:
    """``make lab`` as the README gives it, with the flags a test needs in its ``ARGS``: the command tested is
    the learner's (its root, its chapter, ``--allow-root`` as root). ``VENV`` is this test's environment (the
    suite's .venv under ``make test``), and ``-o`` keeps make from reinstalling it (its stamp taken as
    up to date)."""
    flags = ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             "--LabApp.expose_app_in_browser=True"]
    make = shutil.which("make") or "make"
    return [make, "--no-print-directory", "-C", str(ROOT), "-o", f"{sys.prefix}/.installed", "lab",
            f"VENV={sys.prefix}", f"ARGS={' '.join(flags)}"]


def _check_lab_root(url: str, token: str, runtime: Path) -> None:
    """``make lab`` serves the repository root (refimpl/ and exercises/ one click away) and opens chapter 00:
    the root's listing, and the page Lab would open in the learner's browser (its redirect file)."""
    req = urllib.request.Request(f"{url}/api/contents", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        names = {c["name"] for c in json.load(resp)["content"]}
    assert {"chapters", "refimpl", "exercises", "README.md"} <= names, \
        f"make lab does not serve the repository root: its root lists {sorted(names)}"
    opens = [p.read_text() for p in runtime.glob("jpserver-file-to-run-*-open.html")]
    target = f"/lab/tree/{CHAPTERS[0].relative_to(ROOT).as_posix()}?"
    assert len(opens) == 1 and target in opens[0], \
        f"make lab does not open {target[:-1]} (Lab's file-to-run page: {opens})"


def _log(msg: str) -> None:
    print(msg, flush=True)


def _open_chapter(page: Page, name: str) -> None:
    _item(page, name).dblclick(timeout=30_000)
    page.wait_for_function(
        """(path) => { const w = window.jupyterapp.shell.currentWidget;
                       return !!w && !!w.context && w.context.path === path; }""",
        arg=f"chapters/{name}", timeout=30_000)
    kind = page.evaluate("""() => { const n = window.jupyterapp.shell.currentWidget.node.classList;
        return n.contains('jp-NotebookPanel') ? 'notebook' : [...n].join(' '); }""")
    assert kind == "notebook", f"a double-click on {name} opened {kind!r}, not a notebook"
    page.wait_for_function(
        """() => { const s = window.jupyterapp.shell.currentWidget.sessionContext;
          return s.isReady && s.session && s.session.kernel && s.session.kernel.status === 'idle'; }""",
        timeout=KERNEL_READY_S * 1000)


def _run_and_check(page: Page, name: str, stop: int, run_all: bool, timeout_s: float) -> dict:
    page.evaluate(
        """([stop, all]) => { const app = window.jupyterapp, nb = app.shell.currentWidget.content;
             if (all) { app.commands.execute('notebook:run-all-cells'); return; }
             nb.activeCellIndex = stop; app.commands.execute('notebook:run-all-above'); }""",
        [stop, run_all])
    deadline = time.monotonic() + timeout_s
    while True:
        state = page.evaluate(CELLS_JS, stop)
        errors = [(c["i"], e) for c in state["cells"] for e in c["errors"]]
        assert not errors, f"{name}: error output in cell(s) {errors}"
        pending = [c["i"] for c in state["cells"] if c["count"] is None]
        if not pending and state["status"] == "idle":
            break
        assert time.monotonic() < deadline, f"{name}: cells {pending} not executed after {timeout_s} s"
        time.sleep(0.5)
    # every figure rendered: as many loaded <img> as image/png outputs (decoding may take a moment)
    for _ in range(40):
        state = page.evaluate(CELLS_JS, stop)
        broken = [(c["i"], c["pngs"], c["imgs"]) for c in state["cells"]
                  if sum(w > 0 for w in c["imgs"]) < c["pngs"]]
        if not broken:
            break
        time.sleep(0.25)
    assert not broken, f"{name}: figures not rendered (cell, png outputs, img naturalWidths): {broken}"
    return state


def _check_slider(page: Page) -> float:
    """Chapter 04's Ψ slider starts at the code's 7.5, and moving it redraws the chart; returns the lag."""
    slider = page.locator(".widget-hslider", has=page.get_by_text("Ψ (billions)", exact=True)).first
    readout = slider.locator(".widget-readout")
    start_value = readout.inner_text(timeout=20_000).strip()
    assert start_value == "7.5", f"the Ψ slider starts at {start_value}, the code says 7.5"
    cell = page.locator(".jp-CodeCell", has=slider)
    figure = cell.locator(".jp-OutputArea-output img").first
    page.wait_for_function("(im) => im.complete && im.naturalWidth > 0", arg=figure.element_handle(),
                           timeout=20_000)
    before = figure.get_attribute("src")
    handle = slider.locator(".noUi-handle").first
    # A drag can miss: output arriving elsewhere in the notebook may move the page between reading the
    # handle's box and pressing the mouse (CI saw a 30 s wait for a redraw that no value change asked for).
    # So the drag is retried, the box read again, until the readout leaves 7.5; only then is the redraw
    # waited for. Three misses in a row fail with their own message.
    for attempt in range(3):
        handle.scroll_into_view_if_needed()
        box = handle.bounding_box()
        assert box is not None, "the Ψ slider's handle is not visible"
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        start = time.monotonic()
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x + 25, y, steps=5)
        page.mouse.up()
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_function("(el) => el.innerText.trim() !== '7.5'", arg=readout.element_handle(),
                                   timeout=5_000)
        if readout.inner_text().strip() != "7.5":
            break
        _log(f"04 slider: drag {attempt + 1} did not move the handle, retrying")
    else:
        raise AssertionError("three drags of the Ψ slider's handle left it at 7.5")
    page.wait_for_function(
        """([cellNode, before]) => { const im = cellNode.querySelector('.jp-OutputArea-output img');
             return !!im && im.getAttribute('src') !== before && im.complete && im.naturalWidth > 0; }""",
        arg=[cell.element_handle(), before], timeout=60_000)
    lag = time.monotonic() - start
    return lag


def _shutdown_kernel(page: Page) -> None:
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


def _check_book(page: Page, book: Path, chapter: Path) -> None:
    title = next(line[4:] for line in chapter.read_text().splitlines() if line.startswith("# # "))
    page.goto((book / "index.html").as_uri())
    link = page.get_by_role("link", name=title, exact=True)
    assert link.count() == 1, f"the book's index has no link {title!r}"
    link.click()
    page.wait_for_load_state("load")
    assert page.url.endswith(f"/{chapter.stem}.html"), page.url
    widths = page.eval_on_selector_all("img", "els => els.map(e => e.complete ? e.naturalWidth : -1)")
    n_png = sum(1 for c in jupytext.read(chapter).cells if c.cell_type == "code" and "plt." in c.source)
    assert widths and all(w > 0 for w in widths) and len(widths) >= n_png, \
        f"book page {chapter.stem}.html: figures {widths} (expected at least {n_png}, all rendered)"
    assert page.get_by_role("link", name="course map").count() == 2, "the page has no links to the course map"
    page.get_by_role("link", name="course map").first.click()
    page.wait_for_load_state("load")
    assert page.url.endswith("/index.html"), page.url


@pytest.mark.timeout(SERVER_START_S + 7 * RUN_S + FULL_RUN_S)  # the budget is ~6 min; this is a backstop
def test_course_in_jupyterlab_and_book(tmp_path: Path):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: the browser test needs Debian's chromium "
                    "(apt-get install chromium; .ci/run does it), Playwright never downloads one")
    assert CHAPTERS, "no chapters found"
    status_before, hashes_before = _tracked_state()
    checkpoints = ROOT / "chapters" / ".ipynb_checkpoints"
    had_checkpoints = checkpoints.exists()
    mark, token, port = secrets.token_hex(8), secrets.token_hex(16), free_port()
    settings = tmp_path / "lab-settings"
    for rel, value in LAB_SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env.update({MARK: mark, "JUPYTERLAB_SETTINGS_DIR": str(settings),
                "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
                "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "IPYTHONDIR": str(tmp_path / "ipython"),
                "REFIMPL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)})
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):  # a learner's shell, not `make test`'s
        env.pop(var, None)
    cmd = _make_lab(port, token)
    book = tmp_path / "book"
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=(tmp_path / "lab.log").open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    # the book for one chapter builds meanwhile (its own kernel), checked in chromium at the end
    book_cmd = [sys.executable, str(ROOT / "tools" / "book.py"), "--only", FULL_RUN[:2], "--out", str(book)]
    book_proc = subprocess.Popen(book_cmd, cwd=ROOT, env=env, stdout=(tmp_path / "book.log").open("w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    leftovers: list[str] = []
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                lab_log = (tmp_path / "lab.log").read_text()[-3000:]
                assert server.poll() is None, f"jupyter lab exited:\n{lab_log}"
                assert time.monotonic() < deadline, "jupyter lab did not answer"
                time.sleep(0.5)
        timings["server"] = time.monotonic() - t0
        _check_lab_root(url, token, tmp_path / "runtime")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=60_000)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"{url}/lab?token={token}")
                page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-DirListing')")
                _enter_folder(page, "chapters", CHAPTERS[0].name)
                for source in CHAPTERS:
                    _log(f"{time.monotonic() - t0:6.1f} s: {source.stem}")
                    t = time.monotonic()
                    _open_chapter(page, source.name)
                    stop, run_all = _cells_to_run(source)
                    _run_and_check(page, source.stem, stop, run_all, FULL_RUN_S if run_all else RUN_S)
                    if source.stem == WIDGET_CHAPTER:
                        timings["04 slider lag"] = _check_slider(page)
                    ranks = [p for p in _marked(mark) if _is_rank_process(" ".join(p.cmdline()))]
                    if source.stem == LIVE_RANKS:
                        assert len(ranks) >= 4, f"{source.stem}: expected its ranks alive: {_describe(ranks)}"
                    _shutdown_kernel(page)
                    survivors = _wait_gone(ranks, timeout_s=15)
                    assert not survivors, (f"{source.stem}: the kernel's ranks outlived its shutdown: "
                                           f"{_describe(survivors)}")
                    timings[source.stem] = time.monotonic() - t
                t = time.monotonic()
                book_proc.wait(timeout=BOOK_S)
                log = (tmp_path / "book.log").read_text()
                assert book_proc.returncode == 0, f"tools/book.py --only 00 failed:\n{log[-3000:]}"
                _check_book(page, book, CHAPTERS[0])
                timings["book (after Lab)"] = time.monotonic() - t
            except BaseException:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(tmp_path / "failure.png"))
                    _log(f"screenshot: {tmp_path / 'failure.png'}")
                raise
            finally:
                browser.close()
    finally:
        for proc in (book_proc, server):
            if proc.poll() is None and proc is book_proc:
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):  # the server's own shutdown: kernels first
            req = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=10).close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        leftovers = _describe(_wait_gone(_marked(mark), timeout_s=10))
        for proc in _marked(mark):  # never leave them, even when failing
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if not had_checkpoints and checkpoints.exists():
            shutil.rmtree(checkpoints, ignore_errors=True)
    timings["total"] = time.monotonic() - t0
    others = [p for p in psutil.process_iter(["cmdline"])
              if _is_rank_process(" ".join(p.info["cmdline"] or []))]
    print("browser test timings (s):", {k: round(v, 1) for k, v in timings.items()})
    print("ipyparallel processes on this machine after the test (not ours):", _describe(others) or "none")
    assert not leftovers, f"processes started by the test's JupyterLab outlived it: {leftovers}"
    status_after, hashes_after = _tracked_state()
    changed = sorted(f for f in hashes_before.keys() | hashes_after.keys()
                     if hashes_before.get(f) != hashes_after.get(f))
    lab_log = (tmp_path / "lab.log").read_text(errors="replace")
    saved = sorted({f for f in changed if f"Saving file at /{f}" in lab_log})
    assert not changed, (f"chapters changed during the test (Lab's saves must keep them byte-identical): "
                         f"{changed}; of these, JupyterLab saved {saved} (the others were edited by "
                         "something else while the test ran)")
    assert status_after == status_before, \
        f"git status chapters/ changed:\n{status_before}\n->\n{status_after}"
