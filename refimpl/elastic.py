"""Elastic training: the resume decision, fault injection, heartbeats that name a stuck rank, and the
launch helpers (chapter 09).

**How a restart happens.** ``torchrun --max-restarts R`` runs an *agent* per machine. When one of its
workers exits non-zero (or is killed), the agent stops the others, meets the other agents again (the
*rendezvous*), and starts a fresh set of workers, at most ``R`` times. The new workers know nothing: the
trainer must find out where to continue. It does so **from the disk**: the newest checkpoint that
verifies (:meth:`refimpl.checkpoint.Checkpointer.resume_point`). ``TORCHELASTIC_RESTART_COUNT`` is not a
substitute: it counts the restarts *of this agent*, so a node that joins later, a job requeued by Slurm or
a run started again by hand all see 0 although checkpoints exist, and a restart whose previous attempt
died before its first save sees 1 although there is nothing to load. We read it for reports only
(:func:`restart_count`) and for the fault injector's "first attempt only".

**``--resume never`` and restarts.** ``never`` refuses a folder that holds checkpoints of *another* run.
The checkpoints this very job wrote before a restart are its own: they carry the job's
``TORCHELASTIC_RUN_ID`` (the rendezvous id, the same on every agent and every restart of one job) and
:func:`resume_mode` lets the restarted workers resume from them.

**Fault injection** (:class:`FaultPlan`), for teaching and tests: a rank kills itself with SIGKILL in the
middle of a step (after its forward pass, while the others already wait in the gradient all-reduce), stalls
there (a hang: only the collective timeout ends it), sends itself SIGTERM (a preemption), or kills its own
torchrun agent (a machine lost). Each takes one step per attempt: ``--fail-at-step 3`` fails the first
attempt only, ``--fail-at-step 1,2,2`` the first three.

**Naming the stuck rank** (:class:`Heartbeat`). A collective that times out says only that it timed out.
Every rank therefore posts its position (step and phase) to the process group's key-value store as it
goes; when a collective fails, each surviving rank reads all positions and names the rank that is behind
(:func:`explain_positions`).

**Where it runs** (:func:`torchrun_command`, :func:`elastic_env`). On one machine: ``--standalone``. On
several: every machine runs the same ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d
--rdzv-endpoint=HOST:PORT --rdzv-id=JOB``; the agent on ``HOST`` serves the rendezvous store, so that
machine is a single point of failure (if it dies, the others cannot meet again: the job must be started
again, and resumes from the checkpoints on shared storage). Under Slurm, one ``srun`` task per node runs
torchrun with HOST = the first node of the allocation and JOB = ``$SLURM_JOB_ID``; under Kubernetes, the
PyTorchJob / JobSet controllers start one pod per node with the same command and a headless service
naming the rendezvous pod; ``--max-restarts`` handles worker failures and the scheduler handles lost
nodes (requeue, pod restart), and both resume from the disk.

We set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for every launch: with the rendezvous store shared with
the workers (torch's default), restarted gloo workers can read stale addresses and hang (seen on 2.13).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
FAILURES = "failures.jsonl"

__all__ = [
    "FAILURES", "FaultPlan", "Heartbeat", "elastic_env", "explain_positions", "parse_steps",
    "read_failures", "record_failure", "restart_count", "resume_mode", "run_id", "summarize_failures",
    "torchrun_command",
]


def restart_count() -> int:
    """How many times *this agent* restarted its workers (0 outside torchrun). For reports only."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def run_id() -> str | None:
    """The job's rendezvous id (the same on every agent and restart of one torchrun job), or None."""
    return os.environ.get(RUN_ID_ENV) or None


def resume_mode(requested: str, folder: str | os.PathLike, job: str | None) -> str:
    """The resume mode to give the :class:`~refimpl.checkpoint.Checkpointer`, decided from the disk.

    ``auto`` stays ``auto``. ``never`` becomes ``auto`` when every checkpoint in ``folder`` was written by
    the job ``job`` (a restart of this job continues its own run) and stays ``never`` (which refuses the
    folder) when any was written by another run or by an unknown one.
    """
    if requested != "never" or not job:
        return requested
    from refimpl.checkpoint import CheckpointError, list_checkpoints, read_manifest

    found = list_checkpoints(folder)
    if not found:
        return "never"
    for path in found:
        try:
            owner = read_manifest(path).get("state", {}).get("run_id")
        except CheckpointError:
            return "never"  # unreadable: not provably ours
        if owner != job:
            return "never"
    return "auto"


# -- the failure log -----------------------------------------------------------------------------------

def record_failure(out: str | os.PathLike | None, **fields: Any) -> None:
    """Append one line to ``<out>/failures.jsonl`` (one short write: lines of ranks do not interleave)."""
    if out is None:
        return
    entry = {"time": time.time(), "attempt": restart_count(), **fields}
    path = Path(out) / FAILURES
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_failures(out: str | os.PathLike, *, since: float = 0.0) -> list[dict]:
    path = Path(out) / FAILURES
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if entry.get("time", 0.0) >= since:
            entries.append(entry)
    return entries


def summarize_failures(entries: Sequence[Mapping[str, Any]]) -> str:
    """One line per recorded failure, by attempt: what the report of a failed run lists."""
    if not entries:
        return "  (no failure was recorded by the trainer: a rank may have been killed from outside)"
    lines = []
    for e in sorted(entries, key=lambda e: (e.get("attempt", 0), e.get("time", 0.0))):
        where = f"step {e['step']}" if e.get("step") is not None else "before training"
        lines.append(f"  attempt {e.get('attempt', 0)}, rank {e.get('rank')}, {where}: {e.get('message')}")
    return "\n".join(lines)


# -- fault injection -----------------------------------------------------------------------------------

def parse_steps(text: str) -> tuple[int, ...]:
    """``"3"`` -> ``(3,)``; ``"1,2,2"`` -> ``(1, 2, 2)``: one entry per attempt (for argparse ``type=``)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"expected a step or a comma-separated list of steps, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"expected steps >= 0, got {text!r}")
    return values


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Faults to inject (``--fail-at-step``, ``--hang-at-step``, ``--preempt-at-step``; chapter 09).

    Each is a tuple with one step per attempt: entry ``i`` applies to the attempt whose
    ``TORCHELASTIC_RESTART_COUNT`` is ``i``, and attempts beyond the tuple run clean. So ``(3,)`` fails
    the first attempt only and ``(3, 3)`` the first two (more faults than ``--max-restarts 1`` allows).
    ``rank`` names the misbehaving rank per attempt in the same way (the last entry repeats; empty: the
    last rank). With ``node`` a failure is a lost machine instead: local rank 0 of every agent given the
    flag kills its torchrun agent and itself (give it to one agent's command line only).
    """

    fail_at_step: tuple[int, ...] = ()
    hang_at_step: tuple[int, ...] = ()
    preempt_at_step: tuple[int, ...] = ()
    rank: tuple[int, ...] = ()
    node: bool = False

    def __post_init__(self) -> None:
        from refimpl.config import ConfigError

        for name in ("fail_at_step", "hang_at_step", "preempt_at_step", "rank"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if any(v < 0 for v in value):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.node and not self.fail_at_step:
            raise ConfigError("--fail-node needs --fail-at-step (when the machine is lost)")

    @property
    def any(self) -> bool:
        return bool(self.fail_at_step or self.hang_at_step or self.preempt_at_step)

    def _planned(self, steps: tuple[int, ...], step: int, rank: int, world_size: int,
                 local_rank: int) -> bool:
        attempt = restart_count()
        if attempt >= len(steps) or steps[attempt] != step:
            return False
        if self.node:
            return local_rank == 0
        chosen = self.rank[min(attempt, len(self.rank) - 1)] if self.rank else world_size - 1
        return rank == chosen

    def before_step(self, step: int, *, rank: int, world_size: int, local_rank: int = 0,
                    out: str | os.PathLike | None = None) -> None:
        """At the start of ``step``: a preemption (SIGTERM to this process) if planned here."""
        if self._planned(self.preempt_at_step, step, rank, world_size, local_rank):
            message = "injected preemption: SIGTERM to this rank"
            _say(rank, step, message)
            record_failure(out, rank=rank, step=step, kind="preempt", message=message)
            os.kill(os.getpid(), signal.SIGTERM)

    def mid_step(self, step: int, *, rank: int, world_size: int, local_rank: int = 0,
                 out: str | os.PathLike | None = None) -> None:
        """After this rank's forward pass of ``step``: kill it, its agent, or stall it, if planned here."""
        if self._planned(self.fail_at_step, step, rank, world_size, local_rank):
            if self.node:
                agent = os.getppid()
                message = f"injected machine loss: SIGKILL to its torchrun agent (pid {agent}) and itself"
                _say(rank, step, message)
                record_failure(out, rank=rank, step=step, kind="node", message=message)
                os.kill(agent, signal.SIGKILL)
            else:
                message = "injected fault: the rank killed itself (SIGKILL) in the middle of the step"
                _say(rank, step, message)
                record_failure(out, rank=rank, step=step, kind="kill", message=message)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._planned(self.hang_at_step, step, rank, world_size, local_rank):
            message = "injected hang: the rank stalls in the middle of the step"
            _say(rank, step, message)
            record_failure(out, rank=rank, step=step, kind="hang", message=message)
            # A stalled rank is ended by the agent's SIGTERM once the others fail; the trainer's own SIGTERM
            # handler (save and stop) must not keep this one alive, so the default action comes back.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)


def _say(rank: int, step: int, message: str) -> None:
    # on a line of its own: rank 0's progress bar may be half-way through one
    print(f"\n[rank {rank}] step {step}: {message} (attempt {restart_count()})", file=sys.stderr, flush=True)


# -- heartbeats ----------------------------------------------------------------------------------------

class Heartbeat:
    """Each rank's position (step, phase) in the process group's store, to name a stuck rank.

    Positions are ordered ``(step, phase index)``; a collective that fails because some rank never came
    (it stalled, or died) leaves that rank *behind* the others, which :func:`explain_positions` reports.
    One small store write per phase (a TCP round trip to the store on rank 0). Disabled (every method a
    no-op) in a world of one or when the store cannot be reached.
    """

    PREFIX = "refimpl/heartbeat/"

    def __init__(self, rank: int, world_size: int, *, timeout_s: float = 5.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = None
        if world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            try:
                import torch.distributed as dist

                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=timeout_s),
                                           wait_for_workers=False)
            except Exception as exc:  # noqa: BLE001 - heartbeats are a diagnostic, never a reason to fail
                print(f"[rank {rank}] heartbeats disabled: {exc}", file=sys.stderr)

    def beat(self, step: int, phase_index: int, phase: str) -> None:
        if self.store is not None:
            try:
                position = json.dumps([step, phase_index, phase, time.time()])
                self.store.set(f"{self.PREFIX}{self.rank}", position)
            except Exception:  # noqa: BLE001 - the store's host may be gone; the failure is reported elsewhere
                self.store = None

    def positions(self) -> dict[int, tuple[int, int, str, float] | None]:
        """Every rank's last position (None: it never reported, or the store is unreachable)."""
        out: dict[int, tuple[int, int, str, float] | None] = {}
        for r in range(self.world_size):
            out[r] = None
            if self.store is None:
                continue
            try:
                key = f"{self.PREFIX}{r}"
                if self.store.check([key]):
                    step, index, phase, t = json.loads(self.store.get(key))
                    out[r] = (int(step), int(index), str(phase), float(t))
            except Exception:  # noqa: BLE001
                self.store = None
        return out

    def explain(self) -> str:
        if self.store is None:
            return "no heartbeats (world of one, or the store on rank 0 is gone with its host)"
        return explain_positions(self.positions())


def explain_positions(positions: Mapping[int, tuple[int, int, str, float] | None],
                      now: float | None = None) -> str:
    """A report naming the ranks that are behind the others (the stalled or dead ones)."""
    now = time.time() if now is None else now
    lines = []
    for r, pos in sorted(positions.items()):
        if pos is None:
            lines.append(f"    rank {r}: never reported")
        else:
            lines.append(f"    rank {r}: step {pos[0]}, {pos[2]} (last heard {now - pos[3]:.1f} s ago)")
    known = {r: p[:2] for r, p in positions.items() if p is not None}
    silent = sorted(r for r, p in positions.items() if p is None)
    if not known:
        verdict = "no rank reported a position"
    else:
        lowest, highest = min(known.values()), max(known.values())
        behind = silent + sorted(r for r, p in known.items() if p == lowest and lowest < highest)
        if behind:
            ranks = ", ".join(str(r) for r in behind)
            verdict = (f"rank{'s' if len(behind) > 1 else ''} {ranks} stopped behind the others: "
                       f"stalled or dead there")
        else:
            verdict = "every rank reached the same point: no single rank is behind (a network problem?)"
    return "positions:\n" + "\n".join(lines) + f"\n  -> {verdict}"


# -- launching -----------------------------------------------------------------------------------------

def elastic_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a torchrun launch: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see the module
    docstring), one intra-op thread per CPU rank, unbuffered output."""
    env = dict(os.environ if base is None else base)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                RESTART_COUNT_ENV, RUN_ID_ENV, "GROUP_RANK", "ROLE_RANK"):
        env.pop(var, None)  # a launch from inside a rank must not inherit that rank's identity
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun_command(args: Sequence[str], *, nproc_per_node: int, max_restarts: int = 0,
                     nnodes: str | None = None, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     rdzv_conf: str | None = None, module: str = "refimpl.train") -> list[str]:
    """``python -m torch.distributed.run ... -m module args``: standalone, or one agent of an elastic job
    (``nnodes="1:2"``, a c10d rendezvous at ``rdzv_endpoint`` named ``rdzv_id``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
           f"--max-restarts={max_restarts}"]
    if nnodes is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None or rdzv_id is None:
            raise ValueError("an elastic launch (nnodes) needs rdzv_endpoint and rdzv_id")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
        if rdzv_conf:
            cmd.append(f"--rdzv-conf={rdzv_conf}")
    return [*cmd, "-m", module, *args]
