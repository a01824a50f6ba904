"""Fault injection for teaching and tests (chapter 11): a rank that dies, hangs or is preempted mid-step.

A rank kills itself with SIGKILL in the middle of a step (after its forward pass, while the others already
wait in the gradient all-reduce), stalls there (a hang: only the collective timeout ends it), sends itself
SIGTERM (a preemption), or kills its own torchrun agent (a machine lost). Each takes one step per attempt:
``--fail-at-step 3`` fails the first attempt only, ``--fail-at-step 1,2,2`` the first three.

**The demonstration** (``demo=True``: the fault that the default ``make train`` plans, ``--demo-fault``) is
the same kill, told as planned: the killed rank says so in one line, and the other ranks, whose step fails
with it, stop without a word (the trainer's report of a failure and a traceback would read as a bug there):
from the start of that step a SIGTERM, which torchrun sends them to restart the group, ends them at once
(status 143; the save it would otherwise promise cannot happen, its peer is dead), and their failure in the
step is marked as planned (``is_planned``), which ``python -m refimpl.train`` ends with status 1 and no
traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from refimpl.elastic.failures import record_failure
from refimpl.elastic.restart import restart_count


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
    """Faults to inject (``--fail-at-step``, ``--hang-at-step``, ``--preempt-at-step``; chapter 11).

    Each is a tuple with one step per attempt: entry ``i`` applies to the attempt whose
    ``TORCHELASTIC_RESTART_COUNT`` is ``i``, and attempts beyond the tuple run clean. So ``(3,)`` fails
    the first attempt only and ``(3, 3)`` the first two (more faults than ``--max-restarts 1`` allows).
    ``rank`` names the misbehaving rank per attempt in the same way (the last entry repeats; empty: the
    last rank). With ``node`` a failure is a lost machine instead: local rank 0 of every agent given the
    flag kills its torchrun agent and itself (give it to one agent's command line only). ``demo``: the kill
    is the demonstration's (the module docstring): the same fault, reported as planned.
    """

    fail_at_step: tuple[int, ...] = ()
    hang_at_step: tuple[int, ...] = ()
    preempt_at_step: tuple[int, ...] = ()
    rank: tuple[int, ...] = ()
    node: bool = False
    demo: bool = False

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
        return rank == self._chosen_rank(attempt, world_size)

    def _chosen_rank(self, attempt: int, world_size: int) -> int:
        return self.rank[min(attempt, len(self.rank) - 1)] if self.rank else world_size - 1

    def killed_in(self, step: int, world_size: int) -> int | None:
        """The rank that ``--fail-at-step`` kills in ``step`` of this attempt (None: no kill planned there,
        or a lost machine, whose ranks depend on the agent)."""
        attempt = restart_count()
        if self.node or attempt >= len(self.fail_at_step) or self.fail_at_step[attempt] != step:
            return None
        return self._chosen_rank(attempt, world_size)

    def peer_killed_in(self, step: int, *, rank: int, world_size: int) -> bool:
        """Whether the demonstration kills another rank than ``rank`` in ``step`` of this attempt: then
        ``rank``'s failure in that step is the demonstration's, not a fault of its own."""
        killed = self.killed_in(step, world_size)
        return self.demo and killed is not None and killed != rank

    def before_step(self, step: int, *, rank: int, world_size: int, local_rank: int = 0,
                    out: str | os.PathLike | None = None) -> None:
        """At the start of ``step``: a preemption (SIGTERM to this process) if planned here; in the step in
        which the demonstration kills another rank, a SIGTERM (torchrun stopping the group) ends this
        rank at once and quietly (``_stop_quietly_on_sigterm``)."""
        if self.peer_killed_in(step, rank=rank, world_size=world_size):
            _stop_quietly_on_sigterm()
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
            elif self.demo:
                message = "the planned demo fault: the rank killed itself (SIGKILL) in the middle of the step"
                _say(rank, step, "demo fault, as planned: this rank kills itself (SIGKILL); torchrun logs "
                                 "the exit (-9) and restarts all ranks, which resume from the newest "
                                 "checkpoint on disk (from step 0 without one)", attempt=False)
                record_failure(out, rank=rank, step=step, kind="kill", message=message)
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


def is_planned(exc: BaseException) -> bool:
    """Whether ``exc`` ended a rank in the step in which the demonstration killed another rank (marked by
    ``mark_planned``): the demonstration, not a failure to report."""
    return bool(getattr(exc, _PLANNED, False))


def mark_planned(exc: BaseException) -> None:
    """Mark ``exc`` as the demonstration's (``is_planned``)."""
    setattr(exc, _PLANNED, True)


_PLANNED = "refimpl_planned_fault"


def _stop_quietly_on_sigterm() -> None:
    """From now on a SIGTERM ends this process at once with status 143, without a word and without the
    save that the trainer's own handler (``refimpl.checkpoint.SaveSchedule``) would promise: in the
    demonstration's step a peer is dead, so no collective save can happen, and the SIGTERM is torchrun
    stopping the group to restart it. Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(143)  # 128 + SIGTERM; nothing of this attempt is kept but its committed checkpoints

    signal.signal(signal.SIGTERM, stop)


def _say(rank: int, step: int, message: str, *, attempt: bool = True) -> None:
    # on a line of its own: rank 0's progress bar may be half-way through one
    suffix = f" (attempt {restart_count()})" if attempt else ""
    print(f"\n[rank {rank}] step {step}: {message}{suffix}", file=sys.stderr, flush=True)
