"""refimpl's answers to the exercises of chapter 08, under the exercise's names and signatures.

1F1B's list is refimpl's ``build_schedule``'s, the transfers its ``p2p_actions``, the simulator its
``simulate`` (the micro-batch and stage counts read off the schedule; ``costs`` per kind mapped onto
``Costs``, where a ``B`` without ``W`` s costs ``backward + weight``), the executor its
``run_schedule`` over the rank's one stage, the split linear ``linear_deferred_weight``, which
``defer_weight_gradients`` puts into every ``nn.Linear`` of a stage. The grader's self-test grades
this module and expects full marks (tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.models import lm_loss
from refimpl.models.gpt_stages import GPTStage
from refimpl.parallel.pipeline_parallel.executor import run_schedule
from refimpl.parallel.pipeline_parallel.schedules import Action, P2PAction, build_schedule, p2p_actions
from refimpl.parallel.pipeline_parallel.simulator import Costs, simulate
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, linear_deferred_weight


def one_f_one_b(*, rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s list of refimpl's 1F1B."""
    return build_schedule("1f1b", pp_size=pp_size, num_microbatches=num_microbatches)[rank]


def stage_p2p(action: Action, *, num_stages: int,
              pp_size: int) -> tuple[list[P2PAction], list[P2PAction]]:
    """refimpl's receives before and sends after ``action``."""
    return p2p_actions(action, num_stages=num_stages, pp_size=pp_size)


def simulate_bubble(schedule: list[list[Action]], *, costs: dict[str, float],
                    p2p: float = 0.0) -> tuple[list[list[tuple[Action, float, float]]], float]:
    """refimpl's simulator on ``schedule``: its timeline and bubble."""
    actions = [a for ops in schedule for a in ops]
    m = 1 + max(a.microbatch for a in actions)
    stages = 1 + max(a.stage for a in actions)
    split = any(a.kind == "W" for a in actions)
    c = (Costs(forward=costs["F"], backward=costs["B"], weight=costs["W"]) if split
         else Costs(forward=costs["F"], backward=costs["B"], weight=0.0))
    sim = simulate(schedule, num_microbatches=m, virtual_stages=stages // len(schedule), costs=c, p2p=p2p)
    return sim.timeline, sim.bubble


def run_pipeline_rank(actions: list[Action], *, stage: GPTStage, inputs: list[torch.Tensor],
                      labels: list[torch.Tensor], num_tokens: int, activation_shape: tuple[int, ...],
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """refimpl's executor on this rank's one stage."""
    return run_schedule(actions, stages={stage.stage: stage}, pp_group=group, pp_size=stage.num_stages,
                        inputs=inputs, labels=labels,
                        loss_fn=lambda logits, y: lm_loss(logits, y, num_tokens=num_tokens),
                        activation_shape=activation_shape, activation_dtype=torch.float32)


def linear_split_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          store: WeightGradStore) -> torch.Tensor:
    """refimpl's linear with the deferred weight gradient."""
    return linear_deferred_weight(x, weight, bias, store)


__all__ = ["Action", "P2PAction", "linear_split_backward", "one_f_one_b", "run_pipeline_rank",
           "simulate_bubble", "stage_p2p"]
