"""Run a function on N local ranks, for tests, graders and benchmarks (chapter 00).

``run_ranks`` spawns ``world_size`` processes, gives each the torchrun environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), initialises a gloo (or NCCL) process
group with an explicit timeout, calls ``fn(ctx, *args)`` and returns the results in rank order. The caller
hosts the rendezvous store (``host_store``), as torchrun's agent does, on a port the OS gives it and it
keeps: a port merely found free and handed to rank 0 can be taken in between (CI saw ``EADDRINUSE`` once,
two test lanes launching ranks side by side).
It never hangs: the first rank that fails kills the others and is raised in the caller as
``RankFailed``, whose first line names the rank and the exception and whose traceback follows; a whole
run longer than ``timeout_s`` is killed too. No rank outlives the caller, even one killed by SIGKILL (a
test's timeout): each rank watches the caller's pid and kills itself when the caller exits
(``refimpl.distributed.env.exit_with_process``, a pidfd). Its parent, the fork server, is no help: it
exits only when the caller and every rank have closed its "alive" pipe, so without the watch a rank blocked
in a receive stays until its collective timeout, one in a loop for ever
(``tests/ranks/cli/serial/test_rank_lifetime.py``).

``fn`` must be importable (defined at module level in an importable module): spawned processes cannot
receive functions defined in a notebook; notebooks use ``refimpl.launch.start_ranks`` instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out.

    The message reads short first, then long: its first line names the rank and the exception
    (``rank 1: AssertionError: grad of layers.0 ...``), the rank's traceback follows. ``summary`` is
    that first line, for a grader's one-line verdict.
    """

    def __init__(self, rank: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank

    @property
    def summary(self) -> str:
        return str(self).split("\n", 1)[0]


def _exception_line(tb: str) -> str:
    """The last line of a traceback that is not blank: the exception and its message's first line."""
    lines = [line for line in tb.splitlines() if line.strip()]
    if not lines:
        return "(no traceback)"
    # a multi-line message: the exception line is the first line that starts without indentation after
    # the last frame ("  File ..." and the code lines under it are indented)
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=None)
    if last_frame is None:  # not Python's format (e.g. IPython's): the exception is the last line
        return lines[-1].strip()
    tail = [line for line in lines[last_frame + 1 :] if not line.startswith("    ")]
    return (tail[0] if tail else lines[-1]).strip()


# A rank whose peer died first fails in its next collective with one of these: it is not the cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "recvBytes",
              "Socket Timeout")


def _first_cause(errors: list[tuple[int, str]]) -> tuple[int, str]:
    """Of the ranks that failed, the one whose failure looks like the cause, not a consequence."""
    for rank, tb in errors:
        if not any(marker in _exception_line(tb) for marker in _SECONDARY):
            return rank, tb
    return errors[0]


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes ports from for ``bind(port 0)`` and for every outgoing connection."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):  # not Linux: IANA's dynamic range
        return 49152, 65535


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a program that must bind it itself (torchrun).

    It is drawn below the OS's ephemeral range, so that the OS hands it to no one in between: each of the
    many connections gloo opens takes an ephemeral port, and so does every ``bind(0)``. Only another
    caller of this function could take it, with odds of one in thousands. A launcher that can bind the port
    itself should (``host_store``): that leaves no window at all.
    """
    import random

    low, _ = _ephemeral_ports()
    first = 20000 if low > 21000 else 1024
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(first, low) if low > first else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw was taken: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int, timeout_s: float) -> Any:
    """A rendezvous store served by this process on ``127.0.0.1`` and a port the OS picks; ``.port`` names it.

    The ranks connect as clients when their environment holds ``TORCHELASTIC_USE_AGENT_STORE=True`` (see
    ``AGENT_STORE_ENV``), which is how torchrun's own workers reach the store its agent hosts. Bound
    before any rank starts, the port cannot be taken by another process in between. The store lives as
    long as the returned object: keep it until the ranks have finished their rendezvous (here: the run).
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


# what tells torch.distributed's env:// rendezvous to connect to a store the launcher hosts (torchrun sets it)
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def _context() -> mp.context.ForkServerContext | mp.context.SpawnContext:
    """A fork server that has imported torch once, so each rank starts in milliseconds, not seconds.

    Ranks are forked from a clean server process (not from the caller, whose threads and CUDA state must
    not be forked); like ``spawn`` the function is sent by name. Where fork servers do not exist (Windows,
    macOS defaults aside) we fall back to ``spawn``.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the optimizers' constructors import it lazily, about 2 s of CPU in every rank (an
    # 8-rank spawn that builds AdamW measured 25-29 s without it, 6-14 s with it, on 2 loaded cores).
    # refimpl itself is not preloaded: a notebook's ranks must see the package as it is on disk now.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy"])
    return ctx


# a process target: multiprocessing passes its arguments positionally
def _worker(  # noqa: PLR0917
    caller: int,
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    backend: str | None,
    env: dict[str, str],
    results: Any,
) -> None:
    from refimpl.distributed.env import exit_with_process

    exit_with_process(caller)  # first: a caller already gone ends this rank now
    os.environ.clear()  # the caller's environment as it is now, not the fork server's from its start
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        from refimpl.distributed import init_distributed, teardown

        ctx = init_distributed(timeout_s=timeout_s, backend=backend, watch_parent=False)
        value = fn(ctx, *args)
        # Plain pickle copies tensor bytes into the message. The queue's own pickler would pass a tensor's
        # storage as a shared-memory file descriptor, which the caller can only fetch while this process
        # lives: a rank that exits first made the caller fail in unpickling (seen once in the suite).
        results.put((rank, "ok", pickle.dumps(value)))
        teardown()
    except BaseException:  # noqa: BLE001 - report everything, including CheckpointException / SystemExit
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
    backend: str | None = None,
    env: dict[str, str] | None = None,
    link: str | None = None,
    priority: int = 0,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh processes; return the per-rank results in rank order.

    ``collective_timeout_s`` (default ``timeout_s / 2``) bounds each collective, so a rank stuck in one
    fails with a message; ``timeout_s`` bounds the whole run. Results must be picklable. ``link`` (e.g.
    ``"400mbit"``): the ranks talk over a loopback shaped to that rate, in a private network namespace
    (``refimpl.launch.shaped_link``; a ``RuntimeError`` saying why where the machine cannot);
    ``priority``: with ``link``, raise the ranks' scheduling priority by that much where allowed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if link is not None:
        kwargs = {"timeout_s": timeout_s, "collective_timeout_s": collective_timeout_s, "backend": backend,
                  "env": env}
        return _run_on_shaped_link(fn, world_size, args, kwargs, link=link, priority=priority)
    ctx = _context()
    results = ctx.Queue()
    store = host_store(world_size, timeout_s)
    procs = [
        ctx.Process(
            target=_worker,
            args=(os.getpid(), fn, args, rank, world_size, store.port, collective_timeout_s or timeout_s / 2,
                  backend, {**os.environ, **(env or {}), **AGENT_STORE_ENV}, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            report = _next_report(results, procs, out, deadline=deadline, timeout_s=timeout_s)
            if report is None:
                continue
            rank, status, value = report
            if status == "error":
                _raise_first_cause(results, [(rank, value)], reported=len(out), world_size=world_size)
            out[rank] = pickle.loads(value)
    finally:
        _stop(procs, results, all_reported=len(out) == world_size)
        del store  # the ranks are gone: nothing connects to it any more
    return [out[r] for r in range(world_size)]


def _run_on_shaped_link(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict[str, Any], *,
                        link: str, priority: int) -> list[Any]:
    """``run_ranks`` with its ``kwargs``, over a loopback shaped to ``link``
    (``refimpl.launch.shaped_link``)."""
    from refimpl.launch.shaped_link import run_shaped

    status, *value = run_shaped(fn, world_size, args, kwargs, link=link, priority=priority)
    if status == "error":
        raise RankFailed(*value)
    return value[0]


def _next_report(results: Queue[Any], procs: Sequence[BaseProcess], out: dict[int, Any], *, deadline: float,
                 timeout_s: float) -> tuple[int, str, Any] | None:
    """The next ``(rank, status, value)`` a rank put in ``results``; None when none came within 0.2 s and
    every rank that has not reported (``out``: those that have) still runs. Raises ``RankFailed`` when a
    rank died without a report, or once ``deadline`` has passed."""
    try:
        return results.get(timeout=0.2)
    except queue.Empty:
        dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
        if dead:
            # The rank may have put its report just before exiting: drain once more.
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                r = dead[0]
                raise RankFailed(r, f"rank {r} died with exit code {procs[r].exitcode} "
                                    "without a Python traceback") from None
        elif time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in out]
            message = f"ranks {missing} did not finish within {timeout_s:.0f} s"
            raise RankFailed(None, message) from None
        return None


def _raise_first_cause(results: Queue[Any], errors: list[tuple[int, str]], *, reported: int,
                       world_size: int) -> NoReturn:
    """Raise ``RankFailed`` for the rank whose error looks like the cause (``_first_cause``) among
    ``errors`` and those that follow within a second (``reported``: the ranks that returned)."""
    # the others fail a moment later in their next collective: wait briefly so the report
    # names the rank that caused it, not the first peer that noticed
    settle = time.monotonic() + 1.0
    while len(errors) + reported < world_size and (left := settle - time.monotonic()) > 0:
        try:
            r, st, v = results.get(timeout=left)
        except queue.Empty:
            break
        if st == "error":
            errors.append((r, v))
    rank, tb = _first_cause(errors)
    raise RankFailed(rank, f"rank {rank}: {_exception_line(tb)}\n\n{tb}")


def _stop(procs: Sequence[BaseProcess], results: Queue[Any], *, all_reported: bool) -> None:
    """Join the ranks (5 s each once all reported, else 0.1 s), kill those still alive, close ``results``."""
    for p in procs:
        p.join(timeout=5 if all_reported else 0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    results.close()
