"""Nothing a notebook starts may outlive it: a small watchdog process that reaps the ranks' processes.

A notebook's ranks are ipyparallel engines (forked by ``refimpl.launch.engine_zygote``, or each with
a "nanny" child where ipyparallel starts them) and a controller, started by the
kernel but not in its process group: when the kernel exits, is restarted or is killed, nothing stops them,
and each engine holds a few hundred MB. ``start_reaper`` starts one watchdog per set of ranks, in a
session of its own (so whatever kills the kernel's group does not kill it). Every ``interval_s`` it
checks whether the kernel (``watched_pid``) still lives; when it does not, it SIGKILLs the given processes
and all their descendants, then exits. It also exits when every target is gone (``Ranks.stop()`` ends
it as well). psutil (an ipyparallel dependency) tells a dead PID from a reused one by its start time.
Chapter 00 explains the ranks; docs/ARCHITECTURE.md, "Running many ranks".

    python -m refimpl.launch.reaper --watch KERNEL_PID --start-time T --kill PID [PID ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil


def _alive(pid: int, start_time: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (
            start_time is None or abs(proc.create_time() - start_time) < 1e-3)
    except psutil.Error:
        return False


def process_tree(pids: Sequence[int], known: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """The targets and all their descendants now, keeping the Process objects already seen."""
    out = dict(known)
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = out.get(pid) or psutil.Process(pid)
            out[pid] = proc
    for proc in list(out.values()):
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                out.setdefault(child.pid, child)
    return {pid: p for pid, p in out.items() if p.is_running()}


def kill_tree(procs: dict[int, psutil.Process], timeout_s: float = 3.0) -> None:
    """SIGKILL every process (children first), then reap what we can: wait (at most ``timeout_s``) until
    each is gone or a zombie, which only its parent can reap (a killed nanny's engine: init reaps it)."""
    for proc in reversed(list(procs.values())):
        with contextlib.suppress(psutil.Error):
            proc.kill()
    pending, deadline = list(procs.values()), time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        _, pending = psutil.wait_procs(pending, timeout=0.05)  # reaps our own children
        pending = [p for p in pending if _alive(p.pid, None)]


def watch(watched_pid: int, start_time: float | None, pids: Sequence[int], interval_s: float = 0.5) -> int:
    """Wait until ``watched_pid`` dies (then kill the targets' trees) or every target is gone."""
    procs = process_tree(pids, {})
    while True:
        if not _alive(watched_pid, start_time):
            kill_tree(process_tree(pids, procs))
            return 0
        procs = process_tree(pids, procs)
        if not procs:
            return 0
        time.sleep(interval_s)


def start_reaper(pids: Sequence[int], *, watched_pid: int | None = None) -> subprocess.Popen[bytes]:
    """Start the watchdog for ``pids`` (default: watch this process); returns its handle."""
    watched_pid = os.getpid() if watched_pid is None else watched_pid
    start = psutil.Process(watched_pid).create_time()
    cmd = [sys.executable, "-m", "refimpl.launch.reaper", "--watch", str(watched_pid),
           "--start-time", repr(start), "--kill", *map(str, pids)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [_repo_root(), os.environ.get("PYTHONPATH")]
                                                      if p))
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refimpl.launch.reaper",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--watch", type=int, required=True, help="the PID whose death ends the targets")
    parser.add_argument("--start-time", type=float, default=None, help="its start time, vs PID reuse")
    parser.add_argument("--kill", type=int, nargs="+", required=True, help="PIDs to kill, and descendants")
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args(argv)
    return watch(args.watch, args.start_time, args.kill, args.interval)


if __name__ == "__main__":
    sys.exit(main())
