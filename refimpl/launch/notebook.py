"""Run code on many ranks from a notebook: one ipyparallel engine per rank.

See docs/ARCHITECTURE.md, "Running many ranks".

A chapter starts its ranks once and then runs ``%%px`` cells on all of them::

    ranks = start_ranks(4)          # 4 engines, each with an initialised process group

    %%px
    t = torch.ones(2, device=device)
    dist.all_reduce(t)              # every engine has rank, world_size, device, dist, torch

Engines keep their state between cells; engine id ``i`` is rank ``i`` (the ``[stdout:i]`` labels). A cell
that raises on any rank fails in the notebook and shows that rank's traceback. A collective that a rank
never joins does not hang the notebook: the blocked ranks raise after ``timeout_s`` (the process-group
timeout, which gloo applies to each collective). The group is then out of step (its next collective
fails): ``ranks.restart_process_group()`` makes a new one and keeps the engines' state. Interrupting the
kernel stops the waiting, not the engines.

``ranks.run(fn, *args)`` calls ``fn`` on every rank and returns the results in rank order. ipyparallel
ships a function's code (not by cloudpickle: with its own "canning" and pickle). A function defined in
the notebook looks its global names up in each *engine's* namespace (``rank``, ``dist``, ...), not in the
notebook's: pass data as arguments. A function defined in a module is run with that module imported on
the engine, by name; the engines get the notebook's ``sys.path`` plus the repository root, so
``refimpl`` and the notebook's own modules import there.

``refimpl.launch.run_command`` runs a script (e.g. ``torchrun ...``) from a cell and raises when it
fails, which ``!torchrun`` does not. What runs on the engines, and how their failures come back, is
``refimpl.launch.engine``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from refimpl.launch.engine import RankError, _failures, _init_engine, _prepare_engine, _teardown_engine
from refimpl.launch.run_ranks import host_store

__all__ = ["RankError", "Ranks", "start_ranks"]

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class Ranks:
    """``world_size`` ipyparallel engines, engine ``i`` in id order being rank ``i``.

    Attributes: ``view`` (a blocking DirectView whose targets are in rank order), ``world_size``,
    ``backend`` ("gloo" or "nccl"), ``devices`` (one per rank) and ``timeout_s``. Use as a context
    manager or call ``stop()``; both are bounded in time and ``stop()`` is idempotent.
    """

    def __init__(self, cluster: Any, client: Any, engine_ids: list[int], timeout_s: float) -> None:
        self.cluster = cluster
        self.client = client
        self.view = client[engine_ids]
        self.view.block = True
        self.world_size = len(engine_ids)
        self.timeout_s = timeout_s
        self.backend = ""
        self.devices: list[str] = []
        self._engine_ids = list(engine_ids)
        self._stopped = False
        self._pids: list[int] = []  # the controller, the zygote, the engines (and any nanny)
        self._reaper: subprocess.Popen[bytes] | None = None
        self._zygote: _Zygote | None = None  # what forked the engines, where it did (Linux)
        self._store: Any = None  # the rendezvous store this kernel hosts for the engines' process group

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results in rank order.

        Output printed on the engines is shown after the call. Raises ``RankError`` with every failing
        rank's traceback if ``fn`` raised anywhere.
        """
        return self._call(fn, args, kwargs, wait_s=None)

    def _call(self, fn: Callable[..., Any], args: Any, kwargs: Any, wait_s: float | None) -> list[Any]:
        """Apply ``fn`` on each rank's engine; wait at most ``wait_s`` (None: no limit) for all of them."""
        if self._stopped:
            raise RuntimeError("these ranks were stopped")
        pending = [self.client[eid].apply_async(fn, *args, **kwargs) for eid in self._engine_ids]
        self.client.wait(pending, timeout=-1 if wait_s is None else wait_s)
        failures = _failures(pending)
        if failures:
            raise RankError(failures)
        for ar in pending:
            ar.display_outputs()
        return [ar.get(0) for ar in pending]

    def restart_process_group(self, *, backend: str | None = None, timeout_s: float | None = None) -> None:
        """(Re)create the process group on every rank, on a fresh port; engine state is kept.

        Use it after a collective timed out: the old group is out of step (its next collectives fail),
        and so is every group made from it.
        """
        import ipyparallel as ipp

        self.timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._store = host_store(self.world_size, self.timeout_s)  # a fresh store: the old one holds old keys
        args = (self.world_size, self._store.port, backend or self.backend or None, self.timeout_s)
        init = ipp.interactive(_init_engine)
        pending = [self.client[eid].apply_async(init, r, *args) for r, eid in enumerate(self._engine_ids)]
        self.client.wait(pending, timeout=self.timeout_s + 60)
        failures = _failures(pending)
        if failures:
            raise RankError(failures)
        self.devices = [ar.get(0)[0] for ar in pending]
        self.backend = pending[0].get(0)[1]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Destroy the process groups, stop the engines and the controller. Idempotent, bounded."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout_s
        # a rank stuck in a collective cannot answer: do not wait for it long
        with contextlib.suppress(Exception):
            self.view.apply_async(_teardown_engine).get(timeout=min(5.0, timeout_s / 3))
        # ask the engines to exit (fast); stop_cluster then TERMs, and KILLs after 5 s, what is left
        with contextlib.suppress(Exception):
            self.client.shutdown(targets="all", block=False)
        from refimpl.launch.reaper import kill_tree, process_tree

        procs = process_tree(self._pids, {})  # now, while the nannies can still be found by their parent
        _stop_cluster(self.cluster, max(1.0, deadline - time.monotonic()))
        with contextlib.suppress(Exception):
            self.client.close()
        kill_tree(process_tree(self._pids, procs))  # whatever did not exit on request (nannies included)
        if self._zygote is not None:
            self._zygote.stop()
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(timeout=5)
        self._store = None  # the engines are gone: close the rendezvous store

    def __enter__(self) -> Ranks:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"Ranks(world_size={self.world_size}, backend={self.backend!r}, {state})"


def _stop_cluster(cluster: Any, timeout_s: float) -> None:
    """Stop the controller and engines, waiting at most ``timeout_s``, then SIGKILL what is left."""

    def stop() -> None:  # ipyparallel can raise while its launchers exit; what is left is killed below
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        for engine_set in list(cluster.engines.values()):
            for launcher in getattr(engine_set, "launchers", {}).values():
                if getattr(launcher, "pid", None):
                    with contextlib.suppress(OSError):
                        os.kill(launcher.pid, signal.SIGKILL)


class _Zygote:
    """The process that forks the engines (``refimpl.launch.engine_zygote``) and its log file."""

    def __init__(self, process: subprocess.Popen[bytes], log: Any) -> None:
        self.process = process
        self.log = log

    def tail(self, lines: int = 20) -> str:
        self.log.flush()
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Kill it (its engines die with it) and drop the log; idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.log.close()


def _start_zygote(cluster: Any, world_size: int) -> _Zygote | None:
    """On Linux, start the engines' zygote for ``cluster``'s controller (it may not be up yet: each
    engine waits up to 10 s for the controller's connection file); elsewhere None (ipyparallel's own
    launcher starts them, one new Python each: fork after ``import torch`` is unsafe on macOS)."""
    if sys.platform != "linux":
        return None
    log = tempfile.TemporaryFile()
    env = dict(os.environ, IPP_CLUSTER_ID=cluster.cluster_id, IPP_PROFILE_DIR=cluster.profile_dir,
               PYTHONPATH=os.pathsep.join(p for p in [_REPO_ROOT, os.environ.get("PYTHONPATH")] if p))
    process = subprocess.Popen([sys.executable, "-m", "refimpl.launch.engine_zygote", str(world_size)],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    return _Zygote(process, log)


def _wait_for_engines(client: Any, world_size: int, timeout_s: float, zygote: _Zygote | None) -> None:
    """Wait until ``world_size`` engines have registered; fail at once if the zygote died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.wait_for_engines(world_size, timeout=0.5, interactive=False)
            return
        except TimeoutError:
            pass
        if zygote is not None and zygote.process.poll() is not None:
            raise RuntimeError(f"the engines' process exited with {zygote.process.returncode} before "
                               f"{world_size} engines registered; its last lines:\n{zygote.tail()}")
        if time.monotonic() > deadline:
            last = f"; the engines' last lines:\n{zygote.tail()}" if zygote is not None else ""
            raise TimeoutError(f"{len(client.ids)} of {world_size} engines registered within "
                               f"{timeout_s:.0f} s{last}")


def start_ranks(
    world_size: int,
    *,
    timeout_s: float = 60.0,
    backend: str | None = None,
    activate: bool = True,
    stream: bool | None = None,
    startup_timeout_s: float = 180.0,
) -> Ranks:
    """Start ``world_size`` local engines, one per rank, each with an initialised process group.

    Each engine ends with ``rank``, ``world_size``, ``device``, ``dist`` (torch.distributed) and ``torch``
    in its namespace, env RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, and the notebook's
    ``sys.path`` plus the repository root on its path. ``backend=None`` picks NCCL on ``cuda:LOCAL_RANK``
    when there is a GPU per rank, else gloo on CPU (one intra-op thread per rank). ``timeout_s`` is the
    process-group timeout: a collective that some rank never joins raises after it. ``activate`` registers
    the ``%px``/``%%px`` magics on this view when running under IPython. ``stream`` (default: True unless
    env ``REFIMPL_PX_STREAM=0``) shows a ``%%px`` cell's output live; when streaming, a failing cell has
    already shown the tracebacks and raises a short ``AlreadyDisplayedError``, which is all nbval reports,
    so set ``REFIMPL_PX_STREAM=0`` under nbval to get the tracebacks in its report. Starting waits at
    most ``startup_timeout_s`` (plus ``timeout_s`` for the process group); on failure everything started
    is stopped before raising.
    """
    import ipyparallel as ipp

    from refimpl.launch.reaper import start_reaper

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # ERROR: the engines exit non-zero when stopped, and ipyparallel would dump their logs as warnings.
    # The hub pings every second, not every 3 s: it admits a new engine on a ping, so starting waits
    # about one period less (2.7 s measured); 30 missed pings still drop an engine after 30 s, as before.
    cluster = ipp.Cluster(n=world_size, engines="local", log_level=logging.ERROR,
                          controller_args=["--ping=1000", "--HeartMonitor.max_heartmonitor_misses=30"])
    ranks, zygote = None, None
    try:
        zygote = _start_zygote(cluster, world_size)  # imports torch while the controller starts
        cluster.start_controller_sync()
        if zygote is None:
            cluster.start_engines_sync(n=world_size)
        client = cluster.connect_client_sync()
        _wait_for_engines(client, world_size, startup_timeout_s, zygote)
        ranks = Ranks(cluster, client, sorted(client.ids)[:world_size], timeout_s)
        ranks._zygote = zygote
        paths = [_REPO_ROOT, *[p for p in sys.path if p]]
        ranks._call(ipp.interactive(_prepare_engine), (paths,), {}, wait_s=startup_timeout_s)
        engine_pids = ranks._call(os.getpid, (), {}, wait_s=startup_timeout_s)
        controller_pid = getattr(cluster.controller, "pid", None)
        zygote_pid = zygote.process.pid if zygote is not None else None
        ranks._pids = [p for p in [controller_pid, zygote_pid, *engine_pids] if p]
        ranks._reaper = start_reaper(ranks._pids)  # they die with this kernel, however it ends
        ranks.restart_process_group(backend=backend)
    except BaseException:
        if ranks is not None:
            ranks.stop()
        else:
            _stop_cluster(cluster, 30.0)
            if zygote is not None:
                zygote.stop()
        raise
    if activate:
        try:
            from IPython import get_ipython
        except ImportError:
            get_ipython = None
        ip = get_ipython() if get_ipython is not None else None
        if ip is not None:
            ranks.view.activate()
            if stream is None:
                stream = os.environ.get("REFIMPL_PX_STREAM", "1") != "0"
            # no "%px: 0%" widget: an executed notebook keeps a widget's text at its creation (nbval,
            # make book); the streamed output shows the cell's progress instead
            ip.run_line_magic("pxconfig", ("--stream" if stream else "--no-stream") + " --progress-after -1")
    return ranks
