"""Pipeline parallelism: the model cut into stages across ranks, micro-batches flowing through (chapter 08).

Huang et al. 2019 (GPipe); Narayanan et al. 2021 (1F1B and interleaved 1F1B, Megatron-LM); Qi et al. 2023
(zero-bubble ZB-H1, and ZB-V: two chunks per rank in a V). One concept per file:

* ``refimpl.parallel.pipeline_parallel.schedules``: schedules as data, one ordered action list per
  rank (``F``, ``B``, ``W`` of a stage and a micro-batch); the sends and receives derived from them;
* ``refimpl.parallel.pipeline_parallel.simulator``: a schedule checked (every action once, forward
  before backward, no deadlock) and timed without processes: bubble, in-flight micro-batches;
* ``refimpl.parallel.pipeline_parallel.stage``: blocks cut into stages (by layers or parameters,
  ``split_blocks``), a tied embedding's copy (``with_own_parameters``) and what a stage module
  carries; the model builds its stages (``pipeline_stages``: the GPT's in ``refimpl/models/gpt_stages.py``);
* ``refimpl.parallel.pipeline_parallel.pipeline_communications``: activations and gradients between
  stages over ``isend`` / ``irecv``, shapes agreed up front; the tied-embedding gradient exchange;
* ``refimpl.parallel.pipeline_parallel.weight_grad``: the weight gradient split off the backward
  (zero-bubble's ``W``);
* ``refimpl.parallel.pipeline_parallel.executor``: one rank's action list run, each action timed;
* ``refimpl.parallel.pipeline_parallel.pipeline_parallel``: ``PipelineModule``, a rank's stages
  as one module (``parallelize``'s step 3): a whole step per call, checkpoints under the GPT's names.

The trainer's ``--pp`` composes the pipeline with data, tensor and context parallelism and ZeRO 0-2
(``refimpl.parallel.parallelize``, chapter 12).
"""

from __future__ import annotations

from refimpl.parallel.pipeline_parallel.executor import PipelineEvent, run_schedule
from refimpl.parallel.pipeline_parallel.pipeline_communications import sync_tied_embeddings
from refimpl.parallel.pipeline_parallel.pipeline_parallel import PipelineModule
from refimpl.parallel.pipeline_parallel.schedules import (
    KINDS,
    PLACEMENTS,
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    P2PAction,
    Placement,
    build_schedule,
    p2p_actions,
    schedule_placement,
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
from refimpl.parallel.pipeline_parallel.stage import Balance, split_blocks, with_own_parameters
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients

__all__ = [
    "KINDS",
    "PLACEMENTS",
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Action",
    "Costs",
    "Balance",
    "P2PAction",
    "Placement",
    "PipelineEvent",
    "PipelineModule",
    "ScheduleError",
    "Simulation",
    "WeightGradStore",
    "bubble_formula",
    "build_schedule",
    "defer_weight_gradients",
    "p2p_actions",
    "run_schedule",
    "schedule_placement",
    "simulate",
    "split_blocks",
    "stage_rank",
    "sync_tied_embeddings",
    "validate",
    "with_own_parameters",
]
