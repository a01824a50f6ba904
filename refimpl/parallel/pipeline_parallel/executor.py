"""Run one rank's action list of a pipeline schedule (chapter 08): :func:`run_schedule`.

The rank walks its list (:func:`~refimpl.parallel.pipeline_parallel.schedules.build_schedule`) in order:

* ``F`` (stage ``s``, micro-batch ``i``): the input is the micro-batch's token ids on the first stage, else
  the activation received from stage ``s - 1``; the output is sent to stage ``s + 1``, or on the last stage
  turned into the micro-batch's loss ``sum of token losses / num_tokens`` (``num_tokens`` = the tokens of
  the whole step, so that the losses of the ``m`` micro-batches add up to the step's mean: chapter 03's
  rule). The stage's input and output are kept for the backward.
* ``B``: backward from the received output gradient (or from the loss), then the input's gradient is sent
  to stage ``s - 1``. Parameter gradients accumulate over the micro-batches, as one device's would.
  When the schedule has ``W`` actions the linear layers' weight gradients are queued instead
  (:mod:`.weight_grad`), and ``W`` computes them.

Every action is timed (:class:`PipelineEvent`, ``time.perf_counter`` seconds, the clock of
:class:`refimpl.comm.CommTracer`), including the wait for its input: the chapter's Gantt chart and the
measured bubble come from these events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.comm.tracer import now
from refimpl.parallel.pipeline_parallel.pipeline_communications import PendingSends, recv_tensor, send_tensor
from refimpl.parallel.pipeline_parallel.schedules import Action, p2p_actions
from refimpl.parallel.pipeline_parallel.stage import GPTStage
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore

__all__ = ["PipelineEvent", "run_schedule"]


@dataclass(frozen=True, kw_only=True)
class PipelineEvent:
    """One action of one rank: ``kind`` ``F``/``B``/``W``; ``ready`` when its input had arrived (after the
    receive), ``start`` when it was called, ``end`` when it finished."""

    kind: str
    stage: int
    microbatch: int
    start: float
    ready: float
    end: float


def run_schedule(actions: Sequence[Action], *, stages: dict[int, GPTStage],
                 pp_group: dist.ProcessGroup | None, pp_size: int,
                 inputs: Sequence[torch.Tensor] | None, labels: Sequence[torch.Tensor] | None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 activation_shape: tuple[int, ...], activation_dtype: torch.dtype,
                 store: WeightGradStore | None = None,
                 scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 events: list[PipelineEvent] | None = None) -> torch.Tensor:
    """Run ``actions`` (this rank's list) over ``stages`` (this rank's, by index); returns the sum of the
    micro-batch losses this rank computed (the last stage's rank; zero elsewhere), detached.

    ``inputs`` / ``labels``: the ``m`` micro-batches' token ids and labels (needed on the ranks of the first
    and the last stage); ``loss_fn(logits, labels)`` the micro-batch's share of the step loss;
    ``activation_shape``/``dtype`` what crosses a stage boundary (``[b, s, h]``); ``store``: the queue of
    deferred weight gradients when ``actions`` has ``W`` s; ``scale_loss``: applied to a micro-batch's loss
    before its backward (the fp16 loss scaler; the returned sum is unscaled); ``events``: appended one per
    action.
    """
    num_stages = next(iter(stages.values())).num_stages
    device = next(next(iter(stages.values())).parameters()).device
    if any(a.kind == "W" for a in actions) and store is None:
        raise ValueError("a schedule with W actions needs the WeightGradStore its stages defer into")
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    sends = PendingSends()
    total = torch.zeros((), device=device)
    for a in actions:
        start = now()
        before, after = p2p_actions(a, num_stages=num_stages, pp_size=pp_size)
        received = None
        for r in before:  # at most one: the activation (F) or the output gradient (B)
            received = recv_tensor(activation_shape, dtype=activation_dtype, device=device, peer=r.peer,
                                   group=pp_group, what=f"{r.kind} for {a!r} from pipeline rank {r.peer}")
        ready = now()
        stage, key = stages[a.stage], (a.stage, a.microbatch)
        if a.kind == "F":
            x = inputs[a.microbatch].to(device) if stage.is_first else received.requires_grad_()
            y = stage(x)
            if stage.is_last:
                y = loss_fn(y, labels[a.microbatch].to(device))
                total += y.detach()
                y = y if scale_loss is None else scale_loss(y)
            saved[key] = (x, y)
            for s in after:
                send_tensor(y, peer=s.peer, group=pp_group, pending=sends, what=f"{s.kind} of {a!r}",
                            key=key)
        elif a.kind == "B":
            x, y = saved.pop(key)
            if not stage.is_last:  # its gradient came back: stage s + 1 received the output long ago
                sends.release(key)
            with store.capture(key) if store is not None else contextlib.nullcontext():
                torch.autograd.backward(y, None if stage.is_last else received)
            for s in after:
                send_tensor(x.grad, peer=s.peer, group=pp_group, pending=sends, what=f"{s.kind} of {a!r}")
        else:
            store.flush(key)
        if events is not None:
            events.append(PipelineEvent(kind=a.kind, stage=a.stage, microbatch=a.microbatch, start=start,
                                        ready=ready, end=now()))
    sends.wait()
    if saved:
        raise RuntimeError(f"the schedule left {len(saved)} forwards without their backward: "
                           f"{sorted(saved)[:4]}")
    return total

