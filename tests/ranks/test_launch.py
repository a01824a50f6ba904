"""run_ranks: N local ranks with a process group, results in rank order, and no hang on any failure.

The worker functions are defined at module level: spawned processes import this module to find them.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from refimpl.launch import RankFailed, free_port, run_ranks
from refimpl.launch.run_ranks import _ephemeral_ports, _exception_line, _first_cause
from tests.support.timeouts import SPAWN_TIMEOUT_S


def _rank_and_sum(ctx, offset):
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item(), os.environ["RANK"], torch.get_num_threads()


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError(f"rank one exploded: marker-7f3a at t={time.time():.3f}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return ctx.rank


def _exit_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)  # no Python traceback, no report: only the exit code tells
    return ctx.rank


def _collective_only_on_rank_0(ctx):
    if ctx.rank == 0:
        t, start = torch.ones(1), time.monotonic()
        try:
            dist.all_reduce(t)  # rank 1 never joins
        except Exception as exc:
            raise RuntimeError(f"all_reduce failed after {time.monotonic() - start:.2f} s") from exc
        return t.item()
    time.sleep(20)  # stay alive (and out of any collective) so that only the collective timeout can end it
    return ctx.rank


def _who_listens_on_the_rendezvous_port(ctx, caller):
    import psutil

    port = int(os.environ["MASTER_PORT"])

    def listens(pid):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))

    return listens(caller), listens(os.getpid())


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_caller_holds_the_rendezvous_port_so_no_other_process_can_take_it():
    """CI once failed with EADDRINUSE: the port was found free by the caller and bound by rank 0 a moment
    later, and in between another lane's process took it. Now the caller binds it before any rank starts
    (torchrun's agent store). Negative control: under the old scheme rank 0 listened, not the caller."""
    results = run_ranks(_who_listens_on_the_rendezvous_port, 2, os.getpid(), timeout_s=SPAWN_TIMEOUT_S)
    assert results == [(True, False), (True, False)]


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """Below the range the OS hands out to connections and bind(0), so gloo's sockets cannot take it."""
    low, _ = _ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(isinstance(p, int) and 1024 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random, not one fixed port that two callers would share
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_results_in_rank_order_with_an_all_reduce():
    results = run_ranks(_rank_and_sum, 2, 10, timeout_s=SPAWN_TIMEOUT_S)
    # ranks 0 and 1 contribute 10 and 11: the all_reduce sum is 21 on both
    assert results == [(0, 2, 21.0, "0", 1), (1, 2, 21.0, "1", 1)]


@pytest.mark.timeout(150)
def test_a_raising_rank_fails_quickly_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        # Rank 0's collective could wait 120 s; the failure of rank 1 must not wait for it.
        run_ranks(_raise_on_rank_1, 2, timeout_s=120, collective_timeout_s=120)
    caught = time.time()
    message = str(info.value)
    assert info.value.rank == 1
    # short first: the rank and the exception on the first line, the traceback after it
    assert info.value.summary.startswith("rank 1: ValueError: rank one exploded: marker-7f3a"), message[:300]
    assert message.index("Traceback") > message.index("\n")
    assert "Traceback" in message and "ValueError: rank one exploded: marker-7f3a" in message
    assert "_raise_on_rank_1" in message  # the frame of the failing function
    # Measured from the raise, not from the start: spawning and importing torch is slow on a busy CPU.
    raised = float(message.rsplit("marker-7f3a at t=", 1)[1].split()[0])
    assert caught - raised < 15, f"{caught - raised:.0f} s from the raise: the launcher waited for rank 0"


@pytest.mark.timeout(90)
def test_a_rank_that_exits_is_reported_with_its_exit_code():
    with pytest.raises(RankFailed) as info:
        run_ranks(_exit_on_rank_1, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "exit code 3" in str(info.value)


@pytest.mark.timeout(120)
def test_a_collective_only_rank_0_enters_fails_within_the_collective_timeout():
    # timeout_s leaves room for spawning two ranks on a busy 2-core machine; the collective gets 3 s.
    with pytest.raises(RankFailed) as info:
        run_ranks(_collective_only_on_rank_0, 2, timeout_s=60, collective_timeout_s=3)
    message = str(info.value)
    # Rank 0's all_reduce times out and reports it: not the launcher's deadline (rank None).
    assert info.value.rank == 0, message
    assert "Traceback" in message
    waited = float(message.rsplit("all_reduce failed after ", 1)[1].split()[0])
    assert 2.5 <= waited < 15, f"the collective failed after {waited} s, with a 3 s timeout"


def test_the_report_names_the_cause_not_the_peer_that_noticed():
    frame = '  File "x.py", line 3, in f\n    dist.all_reduce(t)\n'
    peer = f"Traceback (most recent call last):\n{frame}RuntimeError: [gloo] Connection closed by peer [1]\n"
    cause = ("Traceback (most recent call last):\n  File \"x.py\", line 9, in g\n    assert ok, msg\n"
             "    ^^^^^^^^^^\nAssertionError: grad differs\nsecond line of the message\n")
    assert _exception_line(cause) == "AssertionError: grad differs"
    assert _exception_line(peer) == "RuntimeError: [gloo] Connection closed by peer [1]"
    assert _first_cause([(0, peer), (1, cause)]) == (1, cause)
    assert _first_cause([(0, peer)]) == (0, peer)  # nothing better known: the first report
