"""Run code on many ranks from a notebook: one ipyparallel engine per rank.

A chapter starts its ranks once and then runs ``%%px`` cells on all of them::

    ranks = start_ranks(4)          # 4 engines, each with an initialised process group

    %%px
    t = torch.ones(2, device=device)
    dist.all_reduce(t)              # every engine has rank, world_size, device, dist, torch

Engines keep their state between cells. A cell that raises on any rank fails in the notebook and shows
that rank's traceback. A collective that a rank never joins does not hang the notebook: the blocked ranks
raise after ``timeout_s`` (the process-group timeout, which gloo applies to each collective). After such
a timeout the process group is out of step and unusable: call ``ranks.stop()`` and start again.

``Ranks.run(fn, ...)`` calls a function on every rank and returns the results in rank order. Functions
are shipped by code, not by name when they are defined in the notebook: their global names are looked up
in each *engine's* namespace (where ``rank``, ``dist``, ... live), not in the notebook's, so pass data as
arguments. Module-level functions are imported on the engines by module name; the engines get the
notebook's ``sys.path`` plus the repository root, so ``import refimpl`` and the caller's modules work.

``run_command`` runs a script (e.g. ``torchrun ...``) from a cell and raises when it fails, which
``!torchrun`` does not (see DESIGN.md, "Running many ranks").
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["CommandFailed", "RankError", "Ranks", "run_command", "start_ranks"]

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankError(RuntimeError):
    """A function failed on one or more ranks; ``failures`` maps rank -> that rank's traceback text."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
        super().__init__(f"failed on rank(s) {sorted(failures)}:\n" + "\n".join(parts))


class CommandFailed(RuntimeError):
    """A command run by ``run_command`` exited non-zero or ran past its timeout."""

    def __init__(self, cmd: Sequence[str], returncode: int | None, output: str, timed_out: bool) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.output = output
        self.timed_out = timed_out
        tail = "\n".join(output.splitlines()[-40:])
        why = "timed out (process group killed)" if timed_out else f"exited with code {returncode}"
        super().__init__(f"command {shlex.join(self.cmd)} {why}; last output:\n{tail}")


def _setup_engine(
    rank_: int, world_size_: int, port: int, paths: list[str], backend: str | None, timeout_s: float
) -> tuple[str, str]:
    """Runs on each engine (shipped as an interactive function): env, sys.path, device, process group.

    It is self-contained (imports inside) because its globals are the engine's namespace, where it
    leaves ``rank``, ``world_size``, ``device``, ``dist`` and ``torch`` for the ``%%px`` cells.
    """
    import datetime
    import os
    import sys

    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(
        RANK=str(rank_), WORLD_SIZE=str(world_size_), LOCAL_RANK=str(rank_),
        LOCAL_WORLD_SIZE=str(world_size_), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    if backend is None:
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size_
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", rank_)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend, rank=rank_, world_size=world_size_, timeout=datetime.timedelta(seconds=timeout_s)
    )
    globals().update(rank=rank_, world_size=world_size_, device=device, dist=dist, torch=torch)
    return str(device), backend


def _teardown_engine() -> None:
    """Runs on each engine at stop: destroy the process group if there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Ranks:
    """``world_size`` ipyparallel engines, engine ``i`` in id order being rank ``i``.

    Attributes: ``view`` (a blocking DirectView whose targets are in rank order), ``world_size``,
    ``backend`` ("gloo" or "nccl"), ``devices`` (one per rank) and ``timeout_s``. Use as a context
    manager or call ``stop()``; both are bounded in time and ``stop()`` is idempotent.
    """

    def __init__(self, cluster: Any, client: Any, view: Any, backend: str, devices: list[str],
                 timeout_s: float) -> None:
        self.cluster = cluster
        self.client = client
        self.view = view
        self.world_size: int = len(view.targets)
        self.backend = backend
        self.devices = devices
        self.timeout_s = timeout_s
        self._engine_ids: list[int] = list(view.targets)
        self._stopped = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank at once; return the results in rank order.

        Output printed on the engines is shown after the call. Raises ``RankError`` with every failing
        rank's traceback if ``fn`` raised anywhere.
        """
        import ipyparallel as ipp

        if self._stopped:
            raise RuntimeError("these ranks were stopped")
        ar = self.view.apply_async(fn, *args, **kwargs)
        try:
            results = ar.get()
        except ipp.error.CompositeError as e:
            raise self._rank_error(e.elist) from None
        except ipp.error.RemoteError as e:
            raise self._rank_error([(e.ename, e.evalue, e.traceback, e.engine_info)]) from None
        ar.display_outputs()
        return list(results)

    def _rank_error(self, elist: list[Any]) -> RankError:
        failures: dict[int, str] = {}
        for ename, evalue, tb, info in elist:
            eid = (info or {}).get("engine_id", -1)
            rank = self._engine_ids.index(eid) if eid in self._engine_ids else eid
            failures[rank] = _ANSI.sub("", tb or f"{ename}: {evalue}")
        return RankError(failures)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Destroy the process groups, stop the engines and the controller. Idempotent, bounded."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout_s
        try:  # a rank stuck in a collective cannot answer: do not wait for it long
            self.view.apply_async(_teardown_engine).get(timeout=min(5.0, timeout_s / 3))
        except Exception:
            pass
        try:  # ask the engines to exit (fast); stop_cluster then TERMs, and KILLs after 5 s, what is left
            self.client.shutdown(targets="all", block=False)
        except Exception:
            pass
        stopper = threading.Thread(target=self._stop_cluster, daemon=True)
        stopper.start()
        stopper.join(max(1.0, deadline - time.monotonic()))
        if stopper.is_alive():  # last resort: kill the engine processes we started
            for engine_set in list(self.cluster.engines.values()):
                for launcher in getattr(engine_set, "launchers", {}).values():
                    pid = getattr(launcher, "pid", None)
                    if pid:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
        try:
            self.client.close()
        except Exception:
            pass

    def _stop_cluster(self) -> None:
        try:
            self.cluster.stop_cluster_sync()
        except Exception:
            pass

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"Ranks(world_size={self.world_size}, backend={self.backend!r}, {state})"


def start_ranks(world_size: int, *, timeout_s: float = 60.0, backend: str | None = None,
                activate: bool = True, startup_timeout_s: float = 180.0) -> Ranks:
    """Start ``world_size`` local engines, one per rank, each with an initialised process group.

    Each engine ends with ``rank``, ``world_size``, ``device``, ``dist`` (torch.distributed) and ``torch``
    in its namespace, env RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, and the notebook's
    ``sys.path`` plus the repository root on its path. ``backend=None`` picks NCCL on ``cuda:LOCAL_RANK``
    when there is a GPU per rank, else gloo on CPU (one intra-op thread per rank). ``timeout_s`` is the
    process-group timeout: a collective that some rank never joins raises after it. ``activate`` registers
    the ``%px``/``%%px`` magics on this view when running under IPython. Starting waits at most
    ``startup_timeout_s``; on failure everything started is stopped before raising.
    """
    import ipyparallel as ipp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import logging

    cluster = ipp.Cluster(n=world_size, engines="local", log_level=logging.WARNING,
                          engine_timeout=int(startup_timeout_s))
    client = None
    try:
        client = cluster.start_and_connect_sync(n=world_size)
        engine_ids = sorted(client.ids)[:world_size]
        view = client[engine_ids]
        view.block = True
        port = _free_port()
        paths = [_REPO_ROOT, *[p for p in sys.path if p]]
        setup = ipp.interactive(_setup_engine)
        pending = [client[eid].apply_async(setup, r, world_size, port, paths, backend, timeout_s)
                   for r, eid in enumerate(engine_ids)]
        deadline = time.monotonic() + startup_timeout_s
        done = [ar.get(timeout=max(1.0, deadline - time.monotonic())) for ar in pending]
        ranks = Ranks(cluster, client, view, done[0][1], [d for d, _ in done], timeout_s)
    except BaseException as e:
        _stop_quietly(cluster, client)
        if isinstance(e, ipp.error.RemoteError):
            raise RuntimeError(f"starting {world_size} ranks failed:\n{_ANSI.sub('', str(e))}") from e
        raise
    if activate:
        try:
            from IPython import get_ipython
        except ImportError:
            get_ipython = None  # type: ignore[assignment]
        if get_ipython is not None and get_ipython() is not None:
            view.activate()
    return ranks


def _stop_quietly(cluster: Any, client: Any) -> None:
    """Stop a half-started cluster without raising (used on a failed start)."""
    try:
        if client is not None:
            client.close()
        cluster.stop_cluster_sync()
    except Exception:
        pass


def run_command(cmd: Sequence[str] | str, *, timeout_s: float = 600.0, env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike[str] | None = None) -> str:
    """Run ``cmd`` (e.g. ``torchrun ...``) from a cell, print its output as it comes, return all of it.

    A string is split like a shell would (no shell is run). The child runs in its own process group with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and ``PYTHONUNBUFFERED=1`` unless ``env`` says otherwise.
    Raises ``CommandFailed`` (exit code and the tail of the output) on a non-zero exit, or after killing
    the whole process group when it runs past ``timeout_s`` (or on KeyboardInterrupt, which is re-raised).
    """
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    child_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1",
                 **(env or {})}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=child_env, cwd=cwd, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # a thread reads; the caller's thread prints (so output lands in the cell)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    timed_out, eof = False, False
    try:
        while not eof:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                eof = True
            else:
                out.append(line)
                print(line, end="", flush=True)
    finally:
        if timed_out or not eof:
            _kill_group(proc)
    try:
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # output closed early but the child lives on
        timed_out = True
        _kill_group(proc)
        returncode = proc.wait(timeout=10)
    reader.join(timeout=5)
    while not lines.empty():
        line = lines.get_nowait()
        if line is not None:
            out.append(line)
    output = "".join(out)
    if timed_out or returncode != 0:
        raise CommandFailed(argv, None if timed_out else returncode, output, timed_out)
    return output


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the child's whole process group (it was started in a new session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
