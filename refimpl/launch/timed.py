"""Timed runs take turns on the machine and run at raised priority (the overlap timings of chapters 03,
04, 07, 08 and 09, the pipeline bubble of chapter 08, their tests and benches).

On a machine busy with other work (a test suite's other lane), a timed run measures that work too: a
rank woken late adds idle time, and two timed runs at raised priority take each other's cores. So a timed
run holds the machine's lock of timed runs (an ``flock`` on ``TIMING_LOCK`` in the temp folder) while it
measures, and raises its scheduling priority (where allowed, e.g. as root). Two levels of priority:
Linux's autogroup scheduling (on by default on desktops, and on this project's development machine) shares
the CPU fairly between *sessions* first, and a thread's ``nice`` counts only within its session. Measured
on one core: a process at ``nice -10`` in a session of its own got 0.50 of it against one at ``nice 0`` in
another session, and 0.90 once its session's nice (``/proc/self/autogroup``) was -10. So a timed run
lowers both, and ``run_shaped`` starts its helper in a session of its own. Where autogroup scheduling
does not apply to a process (the file reads empty, as in this project's CI sandbox), the threads' nice
alone counts, and it is all that is raised.

``one_timed_run_at_a_time`` is the lock (``refimpl.launch.shaped_link.run_shaped`` takes it for its
helper), ``raise_this_process`` the priority of a process about to start ranks (its session's too),
``raised_priority`` that of this process's threads and session for a while, and ``timed_section`` both
for ranks already running (a notebook's engines): rank 0 holds the lock, every rank raises its priority."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TIMING_LOCK", "one_timed_run_at_a_time", "raise_this_process", "raised_priority", "timed_section"]

TIMING_LOCK = Path(tempfile.gettempdir()) / "refimpl-timed-runs.lock"
AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-<id> nice <n>" where autogroup scheduling is on


@contextlib.contextmanager
def one_timed_run_at_a_time(wait_s: float = 300.0) -> Iterator[bool]:
    """Hold the machine's lock of timed runs (an ``flock`` on ``TIMING_LOCK``) while the body measures.
    Waits up to ``wait_s`` for another timed run to end, then measures anyway (it never hangs and never
    fails for the lock); yields whether it holds the lock. The kernel drops the lock with the process
    that held it."""
    with open(TIMING_LOCK, "a") as handle:
        deadline, held = time.monotonic() + wait_s, False
        while not held and time.monotonic() < deadline:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except OSError:  # another timed run holds it
                time.sleep(0.2)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _threads() -> list[int]:
    """This process's thread ids (Linux: a nice value is a thread's, and gloo's threads already run)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: the calling thread


def _autogroup_nice() -> int | None:
    """This session's nice under autogroup scheduling (None where there is none)."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(nice: int) -> bool:
    try:
        AUTOGROUP.write_text(str(max(-20, min(19, nice))))
        return True
    except OSError:  # not allowed (lowering needs CAP_SYS_NICE), or no autogroup
        return False


def raise_this_process(by: int) -> None:
    """This process (and what it starts) ``by`` less nice, and its session's autogroup too: for a process
    that has just started a session of its own (``subprocess``'s ``start_new_session``, then this as its
    ``preexec_fn``). Where not allowed, the default priority."""
    with contextlib.suppress(OSError):
        os.nice(-by)
    if (nice := _autogroup_nice()) is not None:
        _set_autogroup_nice(nice - by)


@contextlib.contextmanager
def raised_priority(by: int) -> Iterator[bool]:
    """Every thread of this process at ``by`` less ``nice`` for the body (higher priority), and this
    session's autogroup too, then both back. Yields whether it was allowed (raising a priority needs
    ``CAP_SYS_NICE``, e.g. root; elsewhere the body runs at the default priority). The session is
    shared: a notebook's engines raise their kernel's with them."""
    before: dict[int, int] = {}
    for tid in _threads():
        with contextlib.suppress(OSError):  # not allowed, or the thread has ended
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(-20, nice - by))
            before[tid] = nice
    group = _autogroup_nice()
    group_raised = group is not None and _set_autogroup_nice(group - by)
    try:
        yield bool(before)
    finally:
        for tid, nice in before.items():
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        if group_raised and group is not None:
            _set_autogroup_nice(group)


@contextlib.contextmanager
def timed_section(*, priority: int = 10, group: Any = None, wait_s: float = 60.0) -> Iterator[None]:
    """For ranks that are already running (a notebook's engines; every rank of ``group`` enters it): the
    group's rank 0 holds the lock of timed runs (waiting for it at most ``wait_s``: the other ranks wait
    in a barrier meanwhile, so keep it under the process group's timeout), every rank raises its priority
    by ``priority``, and a barrier before and after the body makes them measure together and let go after
    the last."""
    import torch.distributed as dist

    first = dist.get_rank(group) == 0
    lock = one_timed_run_at_a_time(wait_s) if first else contextlib.nullcontext()
    with lock, raised_priority(priority):
        dist.barrier(group=group)
        yield
        dist.barrier(group=group)
