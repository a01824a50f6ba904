"""The reliability suite (chapter 11): the trainer under torchrun survives killed, hung and lost ranks.

Every case starts real ``torchrun`` agents on a tiny run (1 layer, width 32, 32 tokens, 6 steps,
checkpoints every 2 steps) and is bounded twice: ``timeout -k`` around each command and a pytest timeout
around each test. What the checkpoint library guarantees by itself (damaged files, a crash in the middle
of a save, resharding 4 -> 2 and 4 -> 3, the asynchronous snapshot) is tested in ``test_checkpoint.py``;
here it is the trainer and the elastic agent:

* a rank killed in the middle of a step: the group restarts once, the run resumes from the checkpoint on
  disk and ends with exactly (bitwise) the losses of an uninterrupted run; and the restart loop ten times
  in one job (a rank lost in ten successive attempts, asynchronous saves), again bitwise;
* a hung rank: the collective timeout fires, the survivors name the stalled rank, the run restarts;
* more faults than ``--max-restarts``: a non-zero exit and a report of every failure;
* scale-down: two agents (``--nnodes=1:2``), one machine lost, the survivor resumes at world size 1.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from refimpl import elastic
from refimpl.launch import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[4]
RUN_TIMEOUT_S = 150  # one torchrun job: 2 attempts of 2 ranks, each a fresh interpreter importing torch
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "1", "--steps", "6",
        "--checkpoint-every", "2"]


def _env(cache: Path) -> dict[str, str]:
    base = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                        if p))
    return elastic.elastic_env(base, REFIMPL_CACHE=str(cache), MPLBACKEND="Agg")


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus: dict) -> dict[str, Path]:
    """The shared corpus (tests/conftest.py); the token cache is this module's: it is also the runs'
    ``REFIMPL_CACHE``."""
    root = tmp_path_factory.mktemp("elastic")
    return {"root": root, "corpus": corpus["corpus"], "cache": root / "cache"}


def _flags(data, out: Path, *extra: str) -> list[str]:
    return [*TINY, "--data", str(data["corpus"]), "--cache-dir", str(data["cache"]), "--out", str(out),
            *extra]


def _run(cmd: list[str], data, timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    bounded = ["timeout", "-k", "10", str(int(timeout_s)), *cmd]
    return subprocess.run(bounded, cwd=data["root"], env=_env(data["cache"]), capture_output=True, text=True,
                          timeout=timeout_s + 30)


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def two_agents_one_lost(data, tmp_path: Path, flags: Callable[..., list[str]], *, nproc_per_node: int,
                        timeout_s: float) -> tuple[int, int, str]:
    """Two torchrun agents of ``nproc_per_node`` ranks (``--nnodes=1:2``, a c10d rendezvous): A starts first
    and hosts the store; B joins once A serves it, and its rank kills B (a lost machine) in step 3. Returns
    both exit codes and both logs; no process outlives the call. ``flags(*extra)``: the trainer's flags."""
    port, job = free_port(), uuid.uuid4().hex[:8]
    env = _env(data["cache"])

    def agent(name: str, *extra: str) -> subprocess.Popen:
        # last_call_timeout: how long a rendezvous that has its minimum (1) waits for more agents
        cmd = elastic.torchrun_command(flags("--timeout", "60", *extra), nproc_per_node=nproc_per_node,
                                       max_restarts=1, nnodes="1:2", rdzv_endpoint=f"127.0.0.1:{port}",
                                       rdzv_id=job, rdzv_conf="last_call_timeout=10")
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
        return subprocess.Popen(["timeout", "-k", "10", str(int(timeout_s)), *cmd], cwd=data["root"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    a = agent("a")
    b = None
    try:
        deadline = time.monotonic() + 60
        while True:  # B starts once A serves the store, so that A (the survivor) is the rendezvous host
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and a.poll() is None, (tmp_path / "a.log").read_text()
                time.sleep(0.1)
        b = agent("b", "--fail-at-step", "3", "--fail-node")
        code_a = a.wait(timeout=timeout_s + 20)
        code_b = b.wait(timeout=30)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
    return code_a, code_b, "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()}" for n in ("a", "b"))


def _reference_worker(ctx, flags: dict[int, list[str]]) -> dict[int, list[float]]:
    from refimpl.train import build_parser, config_from_args, train

    out = {}
    for steps, run_flags in flags.items():  # no checkpoints, no faults
        out[steps] = [r["loss"] for r in train(config_from_args(build_parser().parse_args(run_flags)), ctx)]
    return out


@pytest.fixture(scope="module")
def references(data) -> dict[int, list[float]]:
    """The losses of uninterrupted 2-rank runs of 6 and of 10 steps (same flags, same arithmetic)."""
    flags = {n: _flags(data, data["root"] / f"reference{n}", "--steps", str(n)) for n in (6, 10)}
    losses = run_ranks(_reference_worker, 2, flags, timeout_s=RUN_TIMEOUT_S)[0]
    assert all(len(set(losses[n])) == n for n in (6, 10))
    return losses


@pytest.fixture(scope="module")
def reference(references) -> list[float]:
    return references[6]


# ------------------------------------------------------------------------------------------------ kill
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_killed_rank_resumes_bitwise_and_reports_one_restart(data, reference, tmp_path):
    out = tmp_path / "killed"
    flags = _flags(data, out, "--fail-at-step", "3", "--fail-rank", "1", "--timeout", "60")
    cmd = elastic.torchrun_command(flags, nproc_per_node=2, max_restarts=1)
    proc = _run(cmd, data)
    assert proc.returncode == 0, _report(proc)
    lines = _metrics(out)
    assert [r["step"] for r in lines] == list(range(6)), _report(proc)
    assert [r["loss"] for r in lines] == reference, _report(proc)  # bitwise, not approximately
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restart_count"] == 1 and "restarts: 1" in proc.stdout, _report(proc)
    assert summary["resumed_from_step"] == 2  # the newest checkpoint on disk before the death in step 3
    assert [r["attempt"] for r in lines] == [0, 0, 1, 1, 1, 1]
    failures = [(f["attempt"], f["rank"], f["step"], f["kind"]) for f in elastic.read_failures(out)]
    assert sorted(failures) == [(0, 0, 3, "error"), (0, 1, 3, "kill")], failures
    assert "rank 1 stopped behind the others" in proc.stderr  # rank 0's report names the dead rank


# The restart loop, ten times in one job (--max-restarts 10): attempt i loses rank RANKS[i] in step
# DEATHS[i]. Checkpoints after every 2 steps, written asynchronously; 10 steps. Attempt 1 finds nothing on
# disk (its restart counter says 1, the disk says start over), attempt 3 dies in the step it resumed at,
# several attempts resume from the same checkpoint, and the store's host (rank 0) dies half of the time.
DEATHS = (1, 2, 2, 3, 5, 5, 6, 8, 9, 9)
RANKS = (1, 0, 1, 0, 1, 0, 1, 0, 1, 0)


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_restart_loop_ten_times_without_a_flake(data, references, tmp_path):
    out = tmp_path / "loop"
    extra = ["--steps", "10", "--async-checkpoint", "--timeout", "60",
             "--fail-at-step", ",".join(map(str, DEATHS)), "--fail-rank", ",".join(map(str, RANKS))]
    cmd = elastic.torchrun_command(_flags(data, out, *extra), nproc_per_node=2, max_restarts=len(DEATHS))
    proc = _run(cmd, data, timeout_s=3 * RUN_TIMEOUT_S)
    assert proc.returncode == 0, _report(proc)
    lines = _metrics(out)
    assert [r["step"] for r in lines] == list(range(10)), _report(proc)
    assert [r["loss"] for r in lines] == references[10], _report(proc)  # bitwise after ten resumes
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restart_count"] == len(DEATHS) and f"restarts: {len(DEATHS)}" in proc.stdout
    kills = [(f["attempt"], f["rank"], f["step"]) for f in elastic.read_failures(out) if f["kind"] == "kill"]
    assert kills == list(zip(range(len(DEATHS)), RANKS, DEATHS, strict=True)), kills
    # where each attempt started: from the disk, never after the step its predecessor died in
    starts = {}
    for line in proc.stdout.splitlines():
        if line.startswith("attempt "):
            attempt = int(line.split()[1])
            starts[attempt] = int(line.split("(step ")[1].split(",")[0]) if "resuming" in line else 0
    assert sorted(starts) == list(range(len(DEATHS) + 1)), proc.stdout
    assert starts[1] == 0  # restart count 1, nothing on disk: starts over
    for attempt in range(1, len(DEATHS) + 1):
        assert starts[attempt] <= DEATHS[attempt - 1], starts
        assert starts[attempt] % 2 == 0, starts  # a checkpoint step (every 2) or 0


# ------------------------------------------------------------------------------------------------ hang
HANG_TIMEOUT_S = 15


@pytest.mark.timeout(RUN_TIMEOUT_S + 2 * HANG_TIMEOUT_S + 60)
def test_hung_rank_is_named_within_the_timeout_and_the_run_restarts(data, reference, tmp_path):
    out = tmp_path / "hang"
    extra = ["--hang-at-step", "3", "--fail-rank", "0", "--timeout", str(HANG_TIMEOUT_S)]
    # two restarts allowed: a very slow start on a loaded machine must not use up the one the hang needs
    cmd = elastic.torchrun_command(_flags(data, out, *extra), nproc_per_node=2, max_restarts=2)
    proc = _run(cmd, data, timeout_s=RUN_TIMEOUT_S + 2 * HANG_TIMEOUT_S)
    assert proc.returncode == 0, _report(proc)
    assert "Timed out" in proc.stderr, _report(proc)
    assert "rank 0 stopped behind the others" in proc.stderr, _report(proc)  # rank 1 names the stalled one
    failures = elastic.read_failures(out)
    hang = [f for f in failures if f["kind"] == "hang"]
    detected = [f for f in failures if f["kind"] == "error" and f["rank"] == 1]
    assert len(hang) == 1 and hang[0]["rank"] == 0 and hang[0]["step"] == 3, failures
    assert detected and "rank 0 stopped behind" in detected[0]["message"], failures
    waited = detected[0]["time"] - hang[0]["time"]
    assert HANG_TIMEOUT_S - 1 <= waited <= HANG_TIMEOUT_S + 30, waited  # the collective timeout, not later
    assert json.loads((out / "summary.json").read_text())["restart_count"] >= 1
    assert [r["loss"] for r in _metrics(out)] == reference


# ------------------------------------------------------------------------------------ the demonstration
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_demo_fault_reads_as_planned_and_the_run_resumes_bitwise(data, reference, tmp_path):
    """The self-launched demonstration (what `make train` does, here on the tiny run). The killed
    rank says in one line that the fault was planned; no traceback and no SIGTERM promise of a save that
    cannot happen; the restart resumes from the checkpoint and ends with an uninterrupted run's losses."""
    out = tmp_path / "demo"
    proc = _run([sys.executable, "-m", "refimpl.train", *_flags(data, out, "--timeout", "60"), "--demo-fault",
                 "--nproc-per-node", "2"], data)
    assert proc.returncode == 0, _report(proc)
    assert ("demo: rank 1 will kill itself once, in step 3, to show an elastic restart" in proc.stdout
            and "they resume from the checkpoint of step 2" in proc.stdout), _report(proc)
    assert "[rank 1] step 3: demo fault, as planned: this rank kills itself (SIGKILL)" in proc.stderr, \
        _report(proc)
    for noise in ("Traceback", "SIGTERM: saving", "failed: RuntimeError", "stopped behind", "error:"):
        assert noise not in proc.stdout + proc.stderr, (noise, _report(proc))
    torchrun_log = re.compile(r"^[DIWEF]\d{4} ")  # the agent's own lines (glog style), not ours to change
    ours = [line for line in proc.stderr.splitlines()  # splitlines cuts the progress bar at each \r too
            if line.strip() and not line.startswith("train:") and not torchrun_log.match(line)]
    assert len(ours) == 1, ours  # the killed rank's line
    assert "resuming from" in proc.stdout and "restarts: 1" in proc.stdout, _report(proc)
    assert [r["loss"] for r in _metrics(out)] == reference, _report(proc)
    failures = [(f["rank"], f["step"], f["kind"]) for f in elastic.read_failures(out)]
    assert (1, 3, "kill") in failures, failures


def _sigterm_after_demo_step(data, step: int, rank: int) -> subprocess.CompletedProcess:
    """A process that runs ``FaultPlan.before_step`` of ``step`` as ``rank`` of 2 under the demo's plan
    (rank 1 killed in step 3), then sends itself SIGTERM."""
    code = ("import os, signal, time\n"
            "from refimpl.elastic import FaultPlan\n"
            "plan = FaultPlan(fail_at_step=(3,), rank=(1,), demo=True)\n"
            f"plan.before_step({step}, rank={rank}, world_size=2)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n"
            "print('still alive')\n")
    return subprocess.run([sys.executable, "-c", code], env=_env(data["cache"]), capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(120)
def test_in_the_demo_step_a_sigterm_stops_the_other_ranks_quietly(data):
    """In the step in which the demonstration kills rank 1, torchrun's SIGTERM ends the other ranks at once,
    silently, with status 143 (the trainer's own handler would promise a save their dead peer prevents);
    before that step, and on the killed rank, SIGTERM is left alone (here: its default action)."""
    survivor = _sigterm_after_demo_step(data, 3, 0)
    assert survivor.returncode == 143 and survivor.stdout == survivor.stderr == "", survivor
    for step, rank in ((2, 0), (3, 1)):
        other = _sigterm_after_demo_step(data, step, rank)
        assert other.returncode == -15, (step, rank, other)


def test_in_the_demo_step_a_failing_rank_is_marked_planned_and_says_nothing(tmp_path, monkeypatch, capfd):
    import torch

    from refimpl.distributed import DistributedContext
    from refimpl.elastic.faults import FaultPlan, is_planned
    from refimpl.train import RunOptions
    from refimpl.train.probes import RunProbes

    monkeypatch.delenv(elastic.RESTART_COUNT_ENV, raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    ctx = DistributedContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    plan = FaultPlan(fail_at_step=(3,), demo=True)
    assert plan.killed_in(3, 2) == 1 and plan.killed_in(2, 2) is None
    assert plan.peer_killed_in(3, rank=0, world_size=2) and not plan.peer_killed_in(3, rank=1, world_size=2)
    assert not FaultPlan(fail_at_step=(3,)).peer_killed_in(3, rank=0, world_size=2)  # not the demo's
    probes = RunProbes(RunOptions(faults=plan), ctx, tmp_path)
    exc = RuntimeError("Connection closed by peer")
    probes.on_failure(3, None, exc)
    assert is_planned(exc) and capfd.readouterr().err == ""
    assert [(f["rank"], f["step"], f["message"]) for f in elastic.read_failures(tmp_path)] == \
        [(0, 3, "RuntimeError (the planned demo fault: rank 1 was killed in this step)")]
    other = RuntimeError("a failure of its own")  # negative control: another step is reported as before
    probes.on_failure(2, None, other)
    assert not is_planned(other) and "[rank 0] step 2 failed: RuntimeError" in capfd.readouterr().err


# ----------------------------------------------------------------------------- more faults than restarts
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_more_faults_than_max_restarts_exits_non_zero_with_a_report(data, tmp_path):
    out = tmp_path / "doomed"
    flags = _flags(data, out, "--fail-at-step", "3,3", "--timeout", "60")  # attempts 0 and 1
    launch = ["--nproc-per-node", "2", "--max-restarts", "1"]
    proc = _run([sys.executable, "-m", "refimpl.train", *flags, *launch], data)
    assert proc.returncode != 0, _report(proc)
    report = proc.stderr[proc.stderr.index("error: training failed"):]
    assert "--max-restarts 1" in report, report
    for attempt in (0, 1):
        assert f"attempt {attempt}, rank 1, step 3: injected fault" in report, report
        assert f"attempt {attempt}, rank 0, step 3: RuntimeError (-> rank 1 stopped behind" in report, report
    assert "newest valid checkpoint:" in report and "step_00000002 (step 2)" in report, report
    assert "Traceback" not in report, report


# ---------------------------------------------------------------------------------------- scale-down
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_two_agents_one_lost_the_survivor_resumes_at_world_size_1(data, reference, tmp_path):
    """``--nnodes=1:2``: agent A starts first and hosts the c10d rendezvous store; agent B joins, and its
    rank kills B (a lost machine) in step 3. A's rank fails in the collective, A restarts it, the
    rendezvous closes with A alone, and the survivor reshards the 2-rank checkpoint of step 2."""
    out = tmp_path / "elastic"
    code_a, code_b, logs = two_agents_one_lost(data, tmp_path, lambda *extra: _flags(data, out, *extra),
                                               nproc_per_node=1, timeout_s=RUN_TIMEOUT_S)
    assert code_a == 0, logs[-8000:]
    assert code_b != 0, logs[-8000:]  # its agent was killed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["checkpoint_world_size"] == 2, (summary, logs[-8000:])
    assert summary["restart_count"] == 1 and summary["resumed_from_step"] == 2, (summary, logs[-8000:])
    assert "resharded" in logs
    lines = _metrics(out)
    assert [r["step"] for r in lines] == list(range(6))
    assert [r["world_size"] for r in lines] == [2, 2, 1, 1, 1, 1]
    losses = np.array([r["loss"] for r in lines])
    assert losses[:2].tolist() == reference[:2]  # before the loss: the same 2-rank run
    # After: one rank computes the mean over 4 rows where two ranks averaged two means of 2 rows, so the
    # sums are ordered differently: equal to about 1 ulp of float32, as in test_train's 2-rank vs 1-rank
    # comparison (1e-5 is far below the step-to-step change, ~0.3).
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
