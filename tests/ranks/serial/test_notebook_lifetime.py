"""Ranks started from a notebook never outlive it (refimpl.launch.reaper; docs/ARCHITECTURE.md).

A real Jupyter kernel starts 4 ranks and is then killed with SIGKILL, as a crashed or restarted kernel
is: within a few seconds no engine, nanny or controller of it may be left. And a clean ``stop()`` leaves
nothing behind and prints nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from refimpl.launch import start_ranks
from refimpl.launch.reaper import process_tree

ROOT = Path(__file__).resolve().parents[3]
GRACE_S = 10.0  # the reaper polls every 0.5 s; SIGKILL and reaping take well under a second more


def _left(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            pass
    return out


def _wait_gone(pids: list[int], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _left(pids)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


@pytest.mark.timeout(300)
def test_killing_the_kernel_kills_its_ranks():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    km, kc = start_new_kernel(kernel_name="python3", env=env, startup_timeout=120)
    pids: list[int] = []
    try:
        code = ("import json\nfrom refimpl.launch import start_ranks\n"
                "from refimpl.launch.reaper import process_tree\n"
                "ranks = start_ranks(4, timeout_s=30)\n"
                "print('PIDS', json.dumps(sorted(process_tree(ranks._pids, {}))))")
        out: list[str] = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = kc.execute_interactive(code, timeout=240, output_hook=hook)
        assert reply["content"]["status"] == "ok", "".join(out)
        line = next(x for x in "".join(out).splitlines() if x.startswith("PIDS "))
        pids = json.loads(line[5:])
        assert len(pids) >= 5, f"the controller and 4 engines at least: {pids}"  # + their nannies
        assert len(_left(pids)) == len(pids), "the ranks must be running before the kill"
        kernel_pid = km.provisioner.process.pid
        os.kill(kernel_pid, signal.SIGKILL)  # as a crash, or a restart that does not ask politely
        left = _wait_gone(pids, GRACE_S)
        assert not left, f"{len(left)} processes outlived their kernel by {GRACE_S} s:\n" + "\n".join(left)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        for pid in pids:  # never leave anything behind, even when the test fails
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


@pytest.mark.timeout(240)
def test_stop_leaves_nothing_and_says_nothing(capfd):
    ranks = start_ranks(2, timeout_s=30)
    pids = sorted(process_tree(ranks._pids, {}))
    assert len(pids) >= 3  # the controller and 2 engines, at least
    capfd.readouterr()
    ranks.stop()
    left = _wait_gone(pids, 5.0)
    captured = capfd.readouterr()
    assert not left, "\n".join(left)
    assert "Traceback" not in captured.err + captured.out, captured.err[-2000:]
    assert ranks._reaper is not None and ranks._reaper.poll() is not None, "the reaper must end with stop()"
