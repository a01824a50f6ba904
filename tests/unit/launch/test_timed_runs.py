"""Timed runs take turns (refimpl/launch/timed.py): a second timed run waits while the first holds the
machine's lock, measures anyway once its wait is up (it never hangs), and gets the lock once the first
has let go; a raised priority covers every thread of the process (its session too, where autogroup
scheduling applies) and is given back after."""

from __future__ import annotations

import os
import threading
import time

from refimpl.launch import timed


def test_a_timed_run_waits_for_the_other_and_never_hangs(tmp_path, monkeypatch):
    monkeypatch.setattr(timed, "TIMING_LOCK", tmp_path / "timed-runs.lock")
    with timed.one_timed_run_at_a_time() as first:
        assert first
        start = time.monotonic()
        with timed.one_timed_run_at_a_time(wait_s=0.5) as second:
            assert not second  # the first holds it: after its wait, the second measures without it
        assert 0.5 <= time.monotonic() - start < 5
    with timed.one_timed_run_at_a_time(wait_s=0.5) as third:
        assert third  # released


def test_a_raised_priority_reaches_every_thread_and_is_given_back():
    ready, done, seen = threading.Event(), threading.Event(), {}

    def worker():  # started before the section, like gloo's threads before a notebook's timed cell
        seen["tid"] = threading.get_native_id()
        ready.set()
        done.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait(10)
    before = os.getpriority(os.PRIO_PROCESS, seen["tid"])
    try:
        group = timed._autogroup_nice()
        with timed.raised_priority(5) as allowed:
            inside = os.getpriority(os.PRIO_PROCESS, seen["tid"])
            assert inside == (before - 5 if allowed else before)
            if allowed and group is not None:  # the session's nice too (autogroup scheduling)
                assert timed._autogroup_nice() == max(-20, group - 5)
        assert timed._autogroup_nice() == group
    finally:
        done.set()
        thread.join()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_a_timed_section_waits_for_the_lock_no_longer_than_it_is_told(tmp_path, monkeypatch):
    """The other ranks wait in a barrier while rank 0 waits for the lock: ``wait_s`` bounds that wait
    (under the process group's timeout), then the section measures without the lock."""
    import torch.distributed as dist

    monkeypatch.setattr(timed, "TIMING_LOCK", tmp_path / "timed-runs.lock")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with timed.one_timed_run_at_a_time():  # another timed run holds the lock
            start = time.monotonic()
            with timed.timed_section(wait_s=0.5):
                waited = time.monotonic() - start
        assert 0.5 <= waited < 5, waited
    finally:
        dist.destroy_process_group()


def test_where_autogroup_does_not_apply_only_the_threads_are_raised(tmp_path, monkeypatch):
    """In a sandbox whose processes sit outside autogroup scheduling (this project's CI) the file reads
    empty: there is no session nice to raise or give back, and the threads' priority still is."""
    empty = tmp_path / "autogroup"
    empty.write_text("")
    monkeypatch.setattr(timed, "AUTOGROUP", empty)
    assert timed._autogroup_nice() is None
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with timed.raised_priority(3) as allowed:
        assert os.getpriority(os.PRIO_PROCESS, 0) == (before - 3 if allowed else before)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before and empty.read_text() == ""
