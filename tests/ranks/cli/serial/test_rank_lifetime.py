"""No rank outlives its launcher (refimpl.distributed.env.exit_with_parent; chapter 11 on hangs).

A launcher killed with SIGKILL (a job's timeout, ``kill -9``) cannot stop its ranks; a rank blocked in a
receive would stay there until killed by hand. Here the launcher is killed while a rank hangs (the trainer's
``--hang-at-step``, a long collective timeout) or blocks in ``dist.recv``, and no rank may be left a few
seconds later:

* ``torchrun -m refimpl.train``: torchrun killed;
* ``python -m refimpl.train --nproc-per-node 2`` (the self-launch): the trainer that started torchrun
  killed, which takes torchrun and then the ranks with it;
* ``run_ranks``: the caller killed (the ranks' parent is its fork server); and behind a shaped link
  (``link="400mbit"``), where the ranks run under a helper in its own network namespace: the helper goes
  with the caller, the ranks with the helper.

The mechanism's unit test forks children that watch their parent by ``prctl``, by the fallback poller, by
its pid (a pidfd, and the poll where there is none), one that watches nothing (the negative control: it
outlives its parent, so the check does see a leftover), and one whose expected parent is not its parent
(the race check: it kills itself at once). Before the ranks of ``run_ranks`` watched the caller's pid
they only had ``PR_SET_PDEATHSIG`` towards their fork server, and this file's run_ranks test failed with
both ranks left: the fork server outlives the caller while a rank holds its "alive" pipe.

Processes are found and followed through ``/proc`` (pid, start time, state: a zombie counts as gone), every
wait is bounded, and whatever is left is killed in a ``finally``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from refimpl import elastic
from refimpl.launch.shaped_link import shaped_link_unavailable

ROOT = Path(__file__).resolve().parents[4]
GRACE_S = 10.0  # SIGKILL is delivered at once; this is for the kernel and a loaded machine to reap them
START_TIMEOUT_S = 150  # fresh interpreters importing torch, then steps of a tiny model, on 2 loaded cores
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--steps", "6", "--log-every", "1", "--checkpoint-every", "0", "--no-demo-fault"]


# ------------------------------------------------------------------------------- processes, via /proc
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a process, or None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces and ')'
    return int(fields[1]), fields[0], int(fields[19])


def _identity(pid: int) -> tuple[int, int]:
    stat = _stat(pid)
    assert stat is not None, f"process {pid} is not there"
    return pid, stat[2]


def _alive(proc: tuple[int, int]) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[1] not in "ZX"  # not reused, not a zombie


def _children(pid: int) -> list[tuple[int, int]]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) and stat[0] == pid:
            out.append((int(entry.name), stat[2]))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_gone(procs: list[tuple[int, int]], timeout_s: float) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill(procs: list[tuple[int, int]]) -> None:
    for p in procs:
        if _alive(p):
            os.kill(p[0], signal.SIGKILL)


def _wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert proc.poll() is None, f"exited with {proc.returncode} before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    return value


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return elastic.elastic_env(dict(env, PYTHONPATH=path, MPLBACKEND="Agg", OMP_NUM_THREADS="1"), **extra)


# ----------------------------------------------------------------------------- the mechanism itself
MODES = ("prctl", "poll", "pidfd", "pid-poll", "none")
CHILDREN = textwrap.dedent(f"""
    import os, sys, time
    from pathlib import Path
    import threading
    from refimpl.distributed import env
    from refimpl.distributed.env import exit_with_parent, exit_with_process

    folder = Path(sys.argv[1])
    race = os.fork()
    if race == 0:  # expects a parent it does not have: as if the parent had died just before the prctl
        exit_with_parent(parent_pid=os.getppid() + 4_000_000)
        os._exit(0)
    (folder / "race").write_text(str(os.waitstatus_to_exitcode(os.waitpid(race, 0)[1])))
    for mode in {MODES!r}:
        if os.fork() == 0:
            if mode == "prctl":
                assert exit_with_parent() == "prctl"
            elif mode == "poll":
                assert exit_with_parent(use_prctl=False, poll_s=0.1) == "poll"
            elif mode == "pidfd":  # the process watched by its pid, as run_ranks' ranks watch the caller
                assert exit_with_process(os.getppid()) == "pidfd"
            elif mode == "pid-poll":  # exit_with_process's fallback where there is no pidfd
                threading.Thread(target=env._poll_process, args=(os.getppid(), 0.1), daemon=True).start()
            (folder / f"{{mode}}.tmp").write_text(str(os.getpid()))
            (folder / f"{{mode}}.tmp").rename(folder / mode)
            time.sleep(120)  # bounded: a leftover ends by itself
            os._exit(0)
    time.sleep(120)
""")


@pytest.mark.timeout(120)
def test_a_child_that_watches_its_parent_dies_with_it_and_one_that_does_not_survives(tmp_path):
    log = tmp_path / "middle.log"
    with open(log, "w") as out:
        middle = subprocess.Popen([sys.executable, "-c", CHILDREN, str(tmp_path)], env=_env(), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    procs: dict[str, tuple[int, int]] = {}
    try:
        for mode in MODES:
            pid = int(_wait_for(f"the {mode} child", lambda m=mode: (tmp_path / m).is_file() and
                                (tmp_path / m).read_text(), START_TIMEOUT_S, middle, log))
            procs[mode] = _identity(pid)
        race = (tmp_path / "race").read_text()
        assert race == str(-signal.SIGKILL), f"a child with the wrong parent went on: exit {race}"
        assert [m for m, p in procs.items() if not _alive(p)] == [], "a child died before its parent"
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait(timeout=10)
        assert _wait_gone([p for m, p in procs.items() if m != "none"], GRACE_S) == []
        # negative control: the same check sees a child that watches nothing outlive its parent
        time.sleep(1.0)  # ten polling periods of the fallback
        assert _alive(procs["none"]), "the control child died with its parent: the check cannot fail"
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait(timeout=10)
        _kill(list(procs.values()))


# --------------------------------------------------------------------------------- torchrun ranks
def _trainer_flags(corpus: Path, out: Path) -> list[str]:
    # rank 0 stalls in step 2; rank 1 waits for it in the gradient all-reduce, under a 300 s timeout
    return [*TINY, "--data", str(corpus), "--cache-dir", str(out.parent / "cache"), "--out", str(out),
            "--hang-at-step", "2", "--fail-rank", "0", "--timeout", "300"]


def _hung(out: Path) -> bool:
    return any(f["kind"] == "hang" for f in elastic.read_failures(out)) if out.is_dir() else False


def _ranks_of(agent: int) -> list[tuple[int, int]]:
    return [p for p in _children(agent) if "refimpl.train" in _cmdline(p[0])]


@pytest.mark.timeout(START_TIMEOUT_S + 60)
@pytest.mark.parametrize("launch", ["torchrun", "self-launch"])
def test_killing_the_launcher_of_a_hung_run_leaves_no_rank(corpus, tmp_path, launch):
    out, log = tmp_path / "run", tmp_path / "launcher.log"
    flags = _trainer_flags(corpus["corpus"], out)
    if launch == "torchrun":
        cmd = elastic.torchrun_command(flags, nproc_per_node=2)
    else:
        cmd = [sys.executable, "-m", "refimpl.train", *flags, "--nproc-per-node", "2", "--max-restarts", "0"]
    with open(log, "w") as f:
        launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    procs: list[tuple[int, int]] = []
    try:
        _wait_for("the injected hang", lambda: _hung(out), START_TIMEOUT_S, launcher, log)
        if launch == "torchrun":
            agent = launcher.pid
        else:
            agents = [p for p in _children(launcher.pid) if "torch.distributed.run" in _cmdline(p[0])]
            assert len(agents) == 1, agents
            agent = agents[0][0]
            procs.append(agents[0])
        ranks = _ranks_of(agent)
        assert len(ranks) == 2, (ranks, [_cmdline(p) for p, _ in _children(agent)])
        procs += ranks
        assert all(_alive(p) for p in procs)  # both ranks still there: one asleep, one in the all-reduce
        time.sleep(1.0)
        assert all(_alive(p) for p in procs), "a rank ended before the launcher was killed"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        left = _wait_gone(procs, GRACE_S)
        assert left == [], [(p, _cmdline(p)) for p, _ in left]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
        _kill(procs)


# ---------------------------------------------------------------------------------- run_ranks ranks
def blocked_rank(ctx, folder: str) -> None:
    """Rank 0 sleeps; rank 1 waits in a receive from it. Each writes its pid first."""
    import torch
    import torch.distributed as dist

    path = Path(folder) / f"rank{ctx.rank}"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    if ctx.rank == 0:
        time.sleep(120)
    else:
        dist.recv(torch.empty(1), src=0)


CALLER = textwrap.dedent("""
    import sys
    from refimpl.launch import run_ranks
    from tests.ranks.cli.serial.test_rank_lifetime import blocked_rank

    if __name__ == "__main__":
        run_ranks(blocked_rank, 2, sys.argv[1], timeout_s=240, link=sys.argv[2] if sys.argv[2:] else None)
""")
LINK_WHY = shaped_link_unavailable()
SHAPED = pytest.param("400mbit", id="shaped link", marks=pytest.mark.skipif(
    LINK_WHY is not None, reason=f"no shaped link on this machine: {LINK_WHY}"))


@pytest.mark.timeout(START_TIMEOUT_S + 60)
@pytest.mark.parametrize("link", [pytest.param(None, id="plain"), SHAPED])
def test_killing_the_caller_of_run_ranks_leaves_no_rank(tmp_path, link):
    """Behind a shaped link (refimpl/launch/shaped_link.py) the ranks run under a helper in its own network
    namespace: killing the caller takes the helper and then the ranks."""
    log = tmp_path / "caller.log"
    with open(log, "w") as f:
        caller = subprocess.Popen([sys.executable, "-c", CALLER, str(tmp_path), *([link] if link else [])],
                                  cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    procs: list[tuple[int, int]] = []
    try:
        for r in range(2):
            path = tmp_path / f"rank{r}"
            pid = int(_wait_for(f"rank {r}", lambda p=path: p.is_file() and p.read_text(), START_TIMEOUT_S,
                                caller, log))
            procs.append(_identity(pid))
        time.sleep(1.0)  # rank 1 is in its receive
        if link:  # the helper the caller started (unshare, then python) goes too
            helpers = [c for c in _children(caller.pid) if "shaped_helper" in _cmdline(c[0])]
            assert len(helpers) == 1, [_cmdline(c[0]) for c in _children(caller.pid)]
            procs += helpers
        assert all(_alive(p) for p in procs)
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait(timeout=10)
        assert _wait_gone(procs, GRACE_S) == []
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(timeout=10)
        _kill(procs)
