"""Fault injection for teaching and tests (chapter 11): a rank that dies, hangs or is preempted mid-step.

A rank kills itself with SIGKILL in the middle of a step (after its forward pass, while the others already
wait in the gradient all-reduce), stalls there (a hang: only the collective timeout ends it), sends itself
SIGTERM (a preemption), or kills its own torchrun agent (a machine lost). Each takes one step per attempt:
``--fail-at-step 3`` fails the first attempt only, ``--fail-at-step 1,2,2`` the first three.
"""

from __future__ import annotations

import os
import signal
import sys
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
