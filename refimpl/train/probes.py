"""The run's own probes, ``RunProbes``: hooks (``refimpl.train.hooks``) that the trainer composes
before the caller's, ``compose(RunProbes(options, ctx, out), hooks)``.

They are fault injection (``options.faults``, chapter 11: a preemption before the step; a kill, a lost
machine or a hang after the first forward, while the other ranks go on into the collectives), the tests'
sleep in a step (``--test-sleep-in-step``: a step too long for a SIGTERM to wait for) and the heartbeat
(``refimpl.elastic.Heartbeat``: this rank's position in the store at four places of a step, read back
on a failure to name the rank that stopped behind the others).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TypedDict

from refimpl import elastic
from refimpl.config import ConfigError
from refimpl.data import DataError
from refimpl.distributed import DistributedContext
from refimpl.elastic.faults import mark_planned
from refimpl.train.args import RunOptions

__all__ = ["RunProbes"]


class _Where(TypedDict):
    """Where this rank is, as ``refimpl.elastic.faults.FaultPlan``'s points take it (keywords)."""

    rank: int
    world_size: int
    local_rank: int
    out: Path


class RunProbes:
    """The run's probes as hooks. At each point (``step`` the step's index):

    - ``before_step``: heartbeat 0, "forward"; then a planned preemption (``faults.before_step``; in the
      step in which the demonstration kills another rank, a SIGTERM from then on ends this one quietly);
    - ``after_first_forward``: a planned kill, lost machine or hang (``faults.mid_step``), the test sleep,
      then heartbeat 1, "backward and gradient reduction";
    - ``after_gradient_probe``: heartbeat 2, "optimizer step";
    - ``before_checkpoint``: heartbeat 3, "checkpoint";
    - ``on_failure``: in a world of more than one, unless the error is the user's (a bad configuration or
      data): a line on stderr with the heartbeat's report (``refimpl.elastic.Heartbeat.explain``) and an
      ``error`` record in ``<out>/failures.jsonl``; in the step in which the demonstration (``--demo-fault``)
      killed another rank only the record, and the error is marked planned
      (``refimpl.elastic.faults.is_planned``: no traceback follows).
    """

    around_step = after_first_loss = before_optimizer_step = gradient_probe = clock = None  # not the run's

    def __init__(self, options: RunOptions, ctx: DistributedContext, out: Path) -> None:
        self.faults, self.sleep_s = options.faults, options.sleep_in_step_s
        self.rank, self.world_size, self.out = ctx.rank, ctx.world_size, out
        self.heartbeat = elastic.Heartbeat(ctx.rank, ctx.world_size)
        self._where: _Where = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
                       "out": out}  # what FaultPlan's points take

    def before_step(self, step: int, setup: Any) -> None:
        self.heartbeat.beat(step, 0, "forward")
        self.faults.before_step(step, **self._where)

    def after_first_forward(self, step: int, setup: Any) -> None:
        self.faults.mid_step(step, **self._where)  # the others go on into the collectives
        if self.sleep_s:  # tests: a step too long for a SIGTERM to wait for
            print(f"[test] step {step} sleeps {self.sleep_s:g} s", file=sys.stderr, flush=True)
            time.sleep(self.sleep_s)
        self.heartbeat.beat(step, 1, "backward and gradient reduction")

    def after_gradient_probe(self, step: int, setup: Any) -> None:
        self.heartbeat.beat(step, 2, "optimizer step")

    def before_checkpoint(self, step: int, setup: Any) -> None:
        self.heartbeat.beat(step, 3, "checkpoint")

    def on_failure(self, step: int, setup: Any, exc: BaseException) -> None:
        if self.world_size <= 1 or isinstance(exc, (ConfigError, DataError)):
            return
        if self.faults.peer_killed_in(step, rank=self.rank, world_size=self.world_size):
            # the demonstration killed a peer in this step, as the killed rank said: nothing to report
            # (refimpl.elastic.faults: marked planned, the command line ends this rank without a traceback)
            killed = self.faults.killed_in(step, self.world_size)
            elastic.record_failure(self.out, rank=self.rank, step=step, kind="error",
                                   message=f"{type(exc).__name__} (the planned demo fault: rank {killed} "
                                   "was killed in this step)")
            mark_planned(exc)
            return
        report = self.heartbeat.explain()
        first = (str(exc).splitlines() or [""])[0][:300]
        print(f"[rank {self.rank}] step {step} failed: {type(exc).__name__}: {first}\n  {report}",
              file=sys.stderr, flush=True)
        elastic.record_failure(self.out, rank=self.rank, step=step, kind="error",
                               message=f"{type(exc).__name__} ({report.splitlines()[-1].strip()})")
