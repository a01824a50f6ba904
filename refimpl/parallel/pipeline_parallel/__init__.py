"""Pipeline parallelism: the model cut into stages across ranks, micro-batches flowing through (chapter 08).

Huang et al. 2019 (GPipe); Narayanan et al. 2021 (1F1B and interleaved 1F1B, Megatron-LM); Qi et al. 2023
(zero-bubble ZB-H1). One concept per file:

* :mod:`~refimpl.parallel.pipeline_parallel.schedules`: schedules as data, one ordered action list per
  rank (``F``, ``B``, ``W`` of a stage and a micro-batch); the sends and receives derived from them;
* :mod:`~refimpl.parallel.pipeline_parallel.simulator`: a schedule checked (every action once, forward
  before backward, no deadlock) and timed without processes: bubble, in-flight micro-batches.

Still to come for chapter 08 (issue 14): the GPT split into stages, the point-to-point executor, the
trainer's ``--pp``, the chapter, exercises and benchmark.
"""

from __future__ import annotations

from refimpl.parallel.pipeline_parallel.schedules import (
    KINDS,
    SCHEDULES,
    Action,
    P2PAction,
    build_schedule,
    p2p_actions,
    stage_rank,
)
from refimpl.parallel.pipeline_parallel.simulator import (
    Costs,
    ScheduleError,
    Simulation,
    bubble_formula,
    simulate,
    validate,
)

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Costs",
    "P2PAction",
    "ScheduleError",
    "Simulation",
    "bubble_formula",
    "build_schedule",
    "p2p_actions",
    "simulate",
    "stage_rank",
    "validate",
]
