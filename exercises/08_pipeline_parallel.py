"""Exercises of chapter 08: pipeline parallelism, a schedule as data.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=08`` (or
``python -m exercises.grade 08``) to see your score per task:

1. ``one_f_one_b``: the action list of one rank under 1F1B (Narayanan et al. 2021, PipeDream-Flush);
2. ``stage_p2p``: the transfers one action implies: which receive it waits for before it runs and which
   send it makes after it, with the peer rank;
3. ``simulate_bubble``: run the ranks' lists in simulated time (an action starts when its rank is free and
   what it needs is done) and return the timeline and the bubble, the idle share of the ranks' time
   (Huang et al. 2019, GPipe; Qi et al. 2023 for the split backward).

Everything runs in one process, without tensors: a schedule is ``schedule[rank] = [Action, ...]`` with
``Action(kind, stage, microbatch)`` (``repr`` ``F2.3``): ``kind`` ``"F"`` (forward), ``"B"`` (backward;
the input gradient only when the schedule also has ``"W"`` actions) or ``"W"`` (the weight gradient of a
split backward). The model is cut into ``S = pp x v`` stages (``v`` model chunks per rank); stage ``s``
lives on rank ``s % pp``. Dependencies: ``F`` of stage ``s`` needs ``F`` of ``s - 1`` (same micro-batch),
``B`` of ``s`` needs ``F`` of ``s`` and ``B`` of ``s + 1``, ``W`` needs ``B`` of its stage.

You may use ``Action`` and ``P2PAction`` (the data types, below); do not import the rest of
``refimpl.parallel.pipeline_parallel`` (that is the answer). Chapter 08 explains each piece.
"""

from __future__ import annotations

from refimpl.parallel.pipeline_parallel.schedules import Action, P2PAction

# ---- 1: 1F1B, one rank's list ------------------------------------------------------------------------------


def one_f_one_b(*, rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s actions of a step of ``num_microbatches`` (``m``) micro-batches under 1F1B, one
    stage per rank (stage = ``rank``), in the order the rank runs them.

    Warm-up: ``min(p - 1 - rank, m)`` forwards (the later the stage, the fewer); steady state: one forward,
    then the backward of the oldest micro-batch still held; cool-down: the remaining backwards. Micro-batches
    go in order ``0 .. m-1`` in both directions. Contract: each ``F`` and ``B`` of the rank's stage exactly
    once, a micro-batch's ``F`` before its ``B``, at most ``p - rank`` micro-batches in flight (forwarded,
    not yet backwarded) at any time, for ``m`` smaller than ``p`` too.
    """
    raise NotImplementedError("one_f_one_b: warm-up forwards, then one forward / one backward, then drain")


# ---- 2: a stage's sends and receives -----------------------------------------------------------------------


def stage_p2p(action: Action, *, num_stages: int,
              pp_size: int) -> tuple[list[P2PAction], list[P2PAction]]:
    """``(before, after)``: the receives ``action`` waits for before it runs, and the sends it makes after.

    ``P2PAction(kind, stage, microbatch, peer)``: ``kind`` one of ``"recv_activation"``,
    ``"send_activation"``, ``"recv_grad"``, ``"send_grad"``; ``stage``: the stage that *produced* the
    tensor (a forward output of stage ``s`` travels to ``s + 1``, an input gradient of stage ``s`` to
    ``s - 1``); ``microbatch``: the action's; ``peer``: the rank at the other end (stage ``t`` lives on
    rank ``t % pp_size``). Contract: a forward receives its input from the stage before (none on the first
    stage) and sends its output to the stage after (none on the last, which makes the loss); a backward
    receives the output gradient from the stage after (none on the last) and sends its input gradient to
    the stage before (none on the first); a ``"W"`` moves nothing. Every send of a schedule then meets
    exactly one receive on its peer.
    """
    raise NotImplementedError("stage_p2p: forward activations go to s + 1, input gradients to s - 1")


# ---- 3: the bubble simulator -------------------------------------------------------------------------------


def simulate_bubble(schedule: list[list[Action]], *, costs: dict[str, float],
                    p2p: float = 0.0) -> tuple[list[list[tuple[Action, float, float]]], float]:
    """Run ``schedule`` (``schedule[rank]``, each rank's list in order) in simulated time; return
    ``(timeline, bubble)``.

    ``costs[kind]``: the duration of one action of that kind (``"F"``, ``"B"`` and, if the schedule has
    them, ``"W"``). Each rank runs its actions one at a time, in its list's order; an action starts at

        start = max(end of the rank's previous action (0 for its first),
                    end of each action it needs + p2p if that action ran on another rank)

    and ends at ``start + costs[kind]``. ``timeline[rank]`` = ``[(action, start, end), ...]`` in the rank's
    order; ``bubble = 1 - sum over ranks of busy time / (p x makespan)``, busy = the summed durations of
    the rank's actions, makespan = the latest end. If no rank can go on before every action has run (each
    waits for an action that waits too) the schedule deadlocks: raise ``ValueError`` saying so. The
    schedule is not modified.
    """
    raise NotImplementedError("simulate_bubble: start when the rank is free and its inputs are done")


__all__ = ["Action", "P2PAction", "one_f_one_b", "simulate_bubble", "stage_p2p"]
