"""Timed runs take turns (refimpl/launch/shaped_link.py, ``one_timed_run_at_a_time``): a second timed run
waits while the first holds the machine's lock, measures anyway once its wait is up (it never hangs), and
gets the lock once the first has let go."""

from __future__ import annotations

import time

from refimpl.launch import shaped_link


def test_a_timed_run_waits_for_the_other_and_never_hangs(tmp_path, monkeypatch):
    monkeypatch.setattr(shaped_link, "TIMING_LOCK", tmp_path / "timed-runs.lock")
    with shaped_link.one_timed_run_at_a_time() as first:
        assert first
        start = time.monotonic()
        with shaped_link.one_timed_run_at_a_time(wait_s=0.5) as second:
            assert not second  # the first holds it: after its wait, the second measures without it
        assert 0.5 <= time.monotonic() - start < 5
    with shaped_link.one_timed_run_at_a_time(wait_s=0.5) as third:
        assert third  # released
