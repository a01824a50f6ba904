"""Exercises of chapter 08: pipeline parallelism, a schedule as data, then run over real stages.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=08`` (or
``python -m exercises.grade 08``) to see your score per task:

1. ``one_f_one_b``: the action list of one rank under 1F1B (Narayanan et al. 2021, PipeDream-Flush);
2. ``stage_p2p``: the transfers one action implies: which receive it waits for before it runs and which
   send it makes after it, with the peer rank;
3. ``simulate_bubble``: run the ranks' lists in simulated time (an action starts when its rank is free and
   what it needs is done) and return the timeline and the bubble, the idle share of the ranks' time
   (Huang et al. 2019, GPipe; Qi et al. 2023 for the split backward);
4. ``run_pipeline_rank``: the executor: one rank runs its action list over its real ``GPTStage``,
   exchanging activations and gradients with the other rank (graded on 2 processes against one device);
5. ``linear_split_backward``: a linear layer whose backward is split as zero-bubble schedules need it, the
   input gradient (``B``) at once and the weight gradient (``W``) deferred to later (Qi et al. 2023).

Tasks 1-3 run in one process, without tensors: a schedule is ``schedule[rank] = [Action, ...]`` with
``Action(kind, stage, microbatch)`` (``repr`` ``F2.3``): ``kind`` ``"F"`` (forward), ``"B"`` (backward;
the input gradient only when the schedule also has ``"W"`` actions) or ``"W"`` (the weight gradient of a
split backward). The model is cut into ``S = pp x v`` stages (``v`` model chunks per rank); stage ``s``
lives on rank ``s % pp``. Dependencies: ``F`` of stage ``s`` needs ``F`` of ``s - 1`` (same micro-batch),
``B`` of ``s`` needs ``F`` of ``s`` and ``B`` of ``s + 1``, ``W`` needs ``B`` of its stage.

You may use ``Action`` and ``P2PAction`` (the data types), ``GPTStage`` (a stage of refimpl's GPT, built
for you), ``WeightGradStore`` (the queue of deferred weight gradients), ``refimpl.models.lm_loss``,
``refimpl.comm.ops`` and ``torch.distributed``; do not import the rest of
``refimpl.parallel.pipeline_parallel`` (that is the answer). Chapter 08 explains each piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.models.gpt_stages import GPTStage
from refimpl.parallel.pipeline_parallel.schedules import Action, P2PAction
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore

# ---- 1: 1F1B, one rank's list ------------------------------------------------------------------------------


def one_f_one_b(*, rank: int, pp_size: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s actions of a step of ``num_microbatches`` (``m``) micro-batches under 1F1B, one
    stage per rank (stage = ``rank``), in the order the rank runs them.

    Contract: each ``F`` and ``B`` of the rank's stage exactly once, micro-batches in the order ``0 .. m-1``
    in both directions, a micro-batch's ``F`` before its ``B``; at most ``p - rank`` micro-batches in
    flight (forwarded, not yet backwarded) at any time, ``m`` smaller than ``p`` included. It is 1F1B's
    order as the chapter draws it: the rank's first backward comes as early as the stages after it can
    have returned that micro-batch's gradient, then forwards and backwards alternate until the forwards run
    out, then the remaining backwards.
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


# ---- 4: the executor, one rank over its real stage ---------------------------------------------------------


def run_pipeline_rank(actions: list[Action], *, stage: GPTStage, inputs: list[torch.Tensor],
                      labels: list[torch.Tensor], num_tokens: int, activation_shape: tuple[int, ...],
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Run this rank's action list (``F`` and ``B`` of one stage per rank) over ``stage``; return the sum
    of the micro-batch losses this rank computed, a detached scalar tensor (zero on every rank but the
    last stage's).

    ``stage.stage`` is this rank's index in ``group`` (``None``: the default group) and
    ``stage.num_stages`` the number of ranks; the first stage takes token ids ``[b, s]``, every other stage
    a float32 activation of ``activation_shape`` (``[b, s, h]``); the last returns logits ``[b, s, V]``.
    ``inputs[i]``, ``labels[i]``: micro-batch ``i``'s token ids and labels, on the stage's device (given to
    every rank). ``actions``: a valid list of any schedule without ``W`` (1F1B's, GPipe's, fewer
    micro-batches than ranks included), as ``one_f_one_b`` returns it.

    Contract, checked against one device running the same micro-batches through the whole model:

    * afterwards every parameter of ``stage`` holds in ``.grad`` the gradient of the step's loss, summed
      over the micro-batches, as one device's (within the spread that the order of summation makes);
    * the step's loss is the mean over all its tokens: micro-batch ``i`` contributes the sum of its token
      losses divided by ``num_tokens``, the tokens of the whole step (``lm_loss(logits, labels,
      num_tokens=...)``), so that the ``m`` contributions add up to it;
    * ranks exchange tensors point to point only (``torch.distributed`` or ``refimpl.comm.ops``), each of
      ``activation_shape`` in float32. Messages between two ranks are matched in the order they are
      posted, and a tensor handed to a non-blocking send must stay alive until that send completes;
    * the call returns when this rank's work is done, no send left pending.

    Trap: on GPUs (NCCL) a plain send may not return before its receiver posts the receive, so two ranks
    that both send before they receive wait for each other (``torch.distributed.batch_isend_irecv``
    posts a send and a receive together); the grader runs your code on CPU (gloo), where sends return.
    """
    raise NotImplementedError("run_pipeline_rank: walk the actions; what crosses a stage boundary, and when")


# ---- 5: the backward split into B and W --------------------------------------------------------------------


def linear_split_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          store: WeightGradStore) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``y = x W^T + b``) whose backward is split in two, as zero-bubble
    schedules run it: ``B``, the gradient the previous stage waits for, and ``W``, deferred.

    ``x``: ``[..., in]`` with any number of leading dims; ``weight``: ``[out, in]``; ``bias``: ``[out]`` or
    ``None``. Contract:

    * forward: the value of ``F.linear(x, weight, bias)``, differentiable with respect to ``x`` and
      ``bias``;
    * backward (the ``B``): ``x`` and ``bias`` get their gradients at once, as autograd's full backward of
      ``F.linear`` gives them; ``weight.grad`` is left untouched, and exactly one callable without
      arguments is handed to ``store.push`` (which queues it under the key of the backward running, see
      ``WeightGradStore.capture``);
    * that callable (the ``W``, run by ``store.flush(key)``) adds this call's weight gradient to
      ``weight.grad`` (creating it when it is ``None``). It may run any time later: after other
      micro-batches have gone forward and backward through the same layer, and in another order than
      theirs. Once every ``W`` of a step has run, ``weight.grad`` is the full backward's sum over the
      micro-batches (within float32 rounding: the grader measures autograd's own distance to float64).
    """
    raise NotImplementedError("linear_split_backward: dX and db in backward, dW queued for later")


__all__ = ["Action", "P2PAction", "linear_split_backward", "one_f_one_b", "run_pipeline_rank",
           "simulate_bubble", "stage_p2p"]
