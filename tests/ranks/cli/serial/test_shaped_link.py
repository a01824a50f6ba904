"""Ranks behind a rate-limited loopback: ``run_ranks(..., link=...)`` (refimpl/launch/shaped_link.py).

Two ranks all-reduce 4 MiB of float32 on plain loopback and behind a 200 Mbit/s link. The ring all-reduce of 2
ranks has each send the whole tensor once; the shaped loopback is one link that both ranks' bytes cross, ``8
MiB / 25 MB/s`` = 0.34 s at the nominal rate. Measured on this 2-core container: 0.28-0.32 s (0.83-0.94 of it:
htb lets somewhat more through than its nominal rate on loopback), against 5-8 ms unshaped; at 400 Mbit/s
0.14-0.16 s. Checked: the shaped all-reduce takes at least half the nominal time (the link, not the cores,
sets it) while the plain one fails that check (the control), and the result is the same sum. A rank that
raises behind the link is reported as from plain ``run_ranks``, by rank; a rate that ``tc`` would not take is
refused before anything starts. Where the kernel refuses an unprivileged network namespace, or ``tc`` is
missing, the timing tests are skipped with the reason (``.ci/run`` installs iproute2).

The trainer's ``--link`` (``python -m refimpl.train --nproc-per-node 2 --link 20mbit``): its torchrun and
ranks run behind the shaped loopback, so each step lasts at least half the time its bytes (the tracer's,
both ranks') take at the link's rate; the same run without ``--link`` fails that check (the control). A bad
rate, or ``--link`` without ``--nproc-per-node``, is one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refimpl.launch import RankFailed, run_ranks
from refimpl.launch.shaped_link import check_link, shaped_link_unavailable
from refimpl.launch.timed import _autogroup_nice
from tests.support.timeouts import SPAWN_TIMEOUT_S

MIB = 1 << 20
ELEMENTS = MIB  # float32: 4 MiB
RATE, RATE_BYTES_PER_S = "200mbit", 200e6 / 8

WHY = shaped_link_unavailable()
needs_link = pytest.mark.skipif(WHY is not None, reason=f"no shaped link on this machine: {WHY}")


def _all_reduce(ctx) -> tuple[float, float]:
    x = torch.full((ELEMENTS,), float(ctx.rank + 1))
    dist.all_reduce(x.clone())  # warm-up: the connections are made
    times = []
    for _ in range(2):
        y = x.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - start)
    return min(times), float(y[0])


def _raises(ctx) -> None:
    if ctx.rank == 1:
        raise ValueError("planted on rank 1")
    dist.barrier()


@pytest.fixture(scope="module")
def timed() -> dict:
    return {link: run_ranks(_all_reduce, 2, link=link, timeout_s=SPAWN_TIMEOUT_S) for link in (None, RATE)}


@needs_link
@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
def test_the_shaped_link_is_the_bottleneck_and_the_sum_is_the_same(timed):
    nominal = 2 * 4 * ELEMENTS / RATE_BYTES_PER_S  # both ranks' 4 MiB cross the one shaped loopback
    plain, shaped = max(t for t, _ in timed[None]), min(t for t, _ in timed[RATE])
    assert shaped >= 0.5 * nominal, (shaped, nominal)
    assert plain < 0.5 * nominal, (plain, nominal)  # the control: unshaped, the same check fails
    assert {s for _, s in timed[RATE]} == {s for _, s in timed[None]} == {3.0}


@needs_link
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_rank_that_raises_behind_the_link_is_named():
    with pytest.raises(RankFailed) as failed:
        run_ranks(_raises, 2, link=RATE, timeout_s=SPAWN_TIMEOUT_S)
    assert failed.value.rank == 1 and "planted on rank 1" in failed.value.summary


def _priority(ctx) -> tuple[int, int, int | None]:
    return os.getsid(0), os.getpriority(os.PRIO_PROCESS, 0), _autogroup_nice()


@needs_link
@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_a_timed_run_has_a_session_of_its_own_at_raised_priority():
    """Under autogroup scheduling a thread's nice counts only within its session (refimpl/launch/timed.py):
    a timed run's ranks run in a session of their own at raised priority, whose autogroup is raised too
    where autogroup scheduling applies (``/proc/self/autogroup`` reads a nice; in a sandbox whose processes
    sit outside it the file reads empty, and only the threads' nice counts); an untimed run's do not (the
    control)."""
    timed = run_ranks(_priority, 2, link=RATE, timeout_s=SPAWN_TIMEOUT_S, priority=10)
    plain = run_ranks(_priority, 2, link=RATE, timeout_s=SPAWN_TIMEOUT_S)
    mine = _autogroup_nice()
    assert {sid for sid, _, _ in plain} == {os.getsid(0)} and {g for _, _, g in plain} == {mine}
    assert len({sid for sid, _, _ in timed}) == 1 and timed[0][0] != os.getsid(0)
    assert {n for _, n, _ in timed} == {os.getpriority(os.PRIO_PROCESS, 0) - 10}
    if mine is not None:  # autogroup scheduling applies here: the timed ranks' session has its own
        assert {g for _, _, g in timed} == {max(-20, mine - 10)}


@pytest.mark.parametrize("link", ["400", "fast", "400mb", "-1gbit", ""])
def test_a_rate_tc_would_not_take_is_refused_before_anything_starts(link):
    with pytest.raises(ValueError, match="give a rate such as '400mbit'"):
        check_link(link)
    with pytest.raises(ValueError, match="give a rate"):
        run_ranks(_raises, 2, link=link)


def test_rates_tc_takes_are_kept():
    assert [check_link(r) for r in ("400mbit", "1GBIT", " 2.5gbit ", "800kbit")] == \
        ["400mbit", "1gbit", "2.5gbit", "800kbit"]


TRAINER = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4",
           "--seq-len", "32", "--batch-size", "4", "--steps", "3", "--warmup-steps", "1", "--log-every", "1",
           "--checkpoint-every", "0", "--no-report", "--no-demo-fault"]
TRAINER_RATE, TRAINER_RATE_BYTES_PER_S = "20mbit", 20e6 / 8


def _train(corpus: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "refimpl.train", *TRAINER, "--data", str(corpus["corpus"]), "--cache-dir",
           str(corpus["cache"]), "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=SPAWN_TIMEOUT_S)


def _steps_against_the_link(out: Path) -> list[tuple[float, float]]:
    """Per step after the first: (its seconds, the seconds its bytes take at the link's rate), from
    metrics.jsonl (both ranks' bytes cross the one shaped loopback)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = 4 * 32  # --batch-size x --seq-len
    return [(tokens / r["tokens_per_s"], 2 * sum(r["bytes_sent"].values()) / TRAINER_RATE_BYTES_PER_S)
            for r in records[1:]]


@needs_link
@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
def test_the_trainer_runs_its_ranks_behind_the_link(corpus, tmp_path):
    shaped = _train(corpus, tmp_path / "shaped", "--nproc-per-node", "2", "--link", TRAINER_RATE)
    assert shaped.returncode == 0, shaped.stderr[-3000:]
    steps = _steps_against_the_link(tmp_path / "shaped")
    assert steps and all(seconds >= 0.5 * link for seconds, link in steps), steps
    plain = _train(corpus, tmp_path / "plain", "--nproc-per-node", "2")  # the control: no link
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not any(seconds >= 0.5 * link for seconds, link in _steps_against_the_link(tmp_path / "plain"))


@pytest.mark.parametrize("extra, message", [
    (["--nproc-per-node", "2", "--link", "fast"], "--link: link='fast': give a rate such as"),
    (["--link", "20mbit"], "--link shapes the link between the ranks the trainer launches"),
])
def test_a_bad_link_is_one_line_and_exit_2(corpus, tmp_path, capsys, extra, message):
    from refimpl.train.cli import main

    argv = [*TRAINER, "--data", str(corpus["corpus"]), "--out", str(tmp_path / "bad"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
