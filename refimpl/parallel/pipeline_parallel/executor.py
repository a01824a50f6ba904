"""Run one rank's action list of a pipeline schedule (chapter 08): ``run_schedule``.

The rank walks its list (``refimpl.parallel.pipeline_parallel.schedules.build_schedule``) in order:

* ``F`` (stage ``s``, micro-batch ``i``): the input is the micro-batch's token ids on the first stage, else
  the activation received from stage ``s - 1``; the output is sent to stage ``s + 1``, or on the last stage
  turned into the micro-batch's loss ``sum of token losses / num_tokens`` (``num_tokens`` = the tokens of
  the whole step, so that the losses of the ``m`` micro-batches add up to the step's mean: chapter 03's
  rule). The stage's input and output are kept for the backward.
* ``B``: backward from the received output gradient (or from the loss), then the input's gradient is sent
  to stage ``s - 1``. Two neighbouring stages on one rank (ZB-V's turn, stages ``p - 1`` and ``p`` on rank
  ``p - 1``) send nothing: the output (or the input's gradient) is handed over in place, the next stage's
  input a detached leaf as a received one is, so that each stage's ``B`` stops at its own input.
  Parameter gradients accumulate over the micro-batches, as one device's would.
  When the schedule has ``W`` actions the linear layers' weight gradients are queued instead
  (``.weight_grad``), and ``W`` computes them.
* An MoE stage (chapter 09) also has a loss of its own, its blocks' balance losses (``aux_loss(stage)``
  after each ``F``, scaled like the micro-batch's loss): the last stage adds it to the loss; any other
  stage backpropagates it in its ``B`` together with the received gradient, one
  ``autograd.backward([output, aux], [grad, None])`` (Megatron-LM attaches it to the activation with its
  ``MoEAuxLossAutoScaler`` instead: the same gradient). It counts in the returned loss sum.

Transfers (``.p2p_plan``, ``.pipeline_communications``): at each boundary of the list (before the
first action, after each) the rank posts one group, the sends of the action just done with the receives
the plan puts there, and waits for it at the start of its next action (at the end of the step after the
last). No schedule deadlocks on NCCL this way (the plan's rounds), and a sent tensor is released one action
after its send, wherever its receiver is: an input gradient is held from the end of its ``B`` to the start
of the next action; a stage output lives until its backward anyway (``autograd.backward`` needs it), so
1F1B's rank ``r`` holds ``min(p - r, m)`` micro-batches' activations and outputs whatever ``m``
(tests/planner/ranks/test_planner_pp.py measures it).

``overlap=True`` waits later (Megatron-LM's ``overlap_p2p_comm``, which it offers for the interleaved
schedule): a group is waited for when an action needs what it receives, and a group that only sends once
the next action has computed (PyTorch's ``Schedule1F1B`` waits for its warm-up sends so). The plan does
not change, so neither does the order in which NCCL runs the groups (in posting order, on its stream):
only the host waits later, and on CUDA a ``wait()`` issued after the compute was queued lets the stream
run that compute beside the transfer. Where the rounds post a receive ahead of the action that needs it
(interleaved 1F1B: another chunk's work comes between a message's send and its use), two things change:
the transfer travels while that work computes, and the rank no longer stands idle at a boundary until its
peer has computed a message it does not need yet (the rounds count every action one unit long, a
backward takes about two). In plain 1F1B and GPipe each input is needed by the very next action, and
nothing moves (bench/RESULTS.md). Measured on a shaped link against ``overlap=False`` (its serialized
control) in tests/ranks/cli/test_overlap.py and chapter 08. What it costs: a sent input gradient is held
until its group is waited for, and the planner's held bytes (``refimpl.planner.pipeline_memory``) count
the default, so the trainer runs the default.

Every action is timed (``PipelineEvent``), including the wait for its input: the chapter's Gantt
chart and the measured bubble come from these events. The stamps are the stages' device's
(``refimpl.comm.device_clock.DeviceClock``): ``time.perf_counter`` on CPU; on CUDA events on the
current stream, since a launch returns before its kernels ran and NCCL's ``work.wait()`` only makes the
stream wait for the transfer: ``ready`` completes when the input has arrived, ``end`` when the action's
kernels are done. The events read them as seconds (on CUDA after one synchronize, at the first read, after
the step), on the ``perf_counter`` axis of ``refimpl.comm.CommTracer``'s events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm.device_clock import DeviceClock, Stamp, StampField
from refimpl.parallel.pipeline_parallel.p2p_plan import p2p_plan
from refimpl.parallel.pipeline_parallel.pipeline_communications import (
    Message,
    PostedGroup,
    message,
    post_group,
)
from refimpl.parallel.pipeline_parallel.schedules import Action, P2PAction, Placement, p2p_actions
from refimpl.parallel.pipeline_parallel.stage import as_stage
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore

__all__ = ["PipelineEvent", "run_schedule"]


@dataclass(frozen=True, kw_only=True)
class PipelineEvent:
    """One action of one rank: ``kind`` ``F``/``B``/``W``; ``ready`` when its input had arrived (after the
    receive), ``start`` when it was called, ``end`` when it finished: stamps of the executor's clock, read
    as seconds (``refimpl.comm.device_clock.StampField``: device time on CUDA)."""

    kind: str
    stage: int
    microbatch: int
    start: StampField[float] = StampField()
    ready: StampField[float] = StampField()
    end: StampField[float] = StampField()


def run_schedule(actions: Sequence[Action], *, stages: dict[int, nn.Module],
                 pp_group: dist.ProcessGroup | None, pp_size: int,
                 inputs: Sequence[torch.Tensor] | None, labels: Sequence[torch.Tensor] | None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 activation_shape: tuple[int, ...], activation_dtype: torch.dtype,
                 store: WeightGradStore | None = None,
                 scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 events: list[PipelineEvent] | None = None,
                 table: Sequence[Sequence[Action]] | None = None,
                 clock: Callable[[], Stamp] | None = None,
                 aux_loss: Callable[[nn.Module], torch.Tensor | None] | None = None,
                 num_stages: int | None = None, placement: Placement = "loop",
                 overlap: bool = False) -> torch.Tensor:
    """Run ``actions`` (this rank's list) over ``stages`` (this rank's, by index); returns the sum of the
    micro-batch losses this rank computed (the last stage's rank; zero elsewhere), detached.

    ``inputs`` / ``labels``: the ``m`` micro-batches' token ids and labels (needed on the ranks of the first
    and the last stage); ``loss_fn(logits, labels)`` the micro-batch's share of the step loss;
    ``activation_shape``/``dtype`` what crosses a stage boundary (``[b, s, h]``); ``store``: the queue of
    deferred weight gradients when ``actions`` has ``W`` s; ``scale_loss``: applied to a micro-batch's loss
    before its backward (the fp16 loss scaler; the returned sum is unscaled); ``events``: appended one per
    action; ``table``: every rank's list, for the transfer plan (default: the named schedule whose list
    ``actions`` is, else the plan from ``actions`` alone; ``.p2p_plan.p2p_plan``); ``clock``: the clock
    the events read (default: the stages' device's, ``refimpl.comm.device_clock.DeviceClock``; a
    measurement samples at its reads and returns a stamp, e.g. ``refimpl.comm.tracer.now``'s);
    ``aux_loss(stage)``: the stage's own loss of the forward just run, in the graph (None: none; an MoE
    stage's balance losses, module docstring); ``placement``: where the stages live
    (``.schedules.stage_rank``: ``"v"`` for ZB-V); ``overlap``: wait for a group only when its transfers
    must be done (module docstring).
    """
    if num_stages is None:  # the stages' own count (the course GPT's stages carry it)
        num_stages = cast(int, next(iter(stages.values())).num_stages)  # a stage's attribute, not declared
    device = next(next(iter(stages.values())).parameters()).device
    now = clock if clock is not None else DeviceClock(device).mark
    if any(a.kind == "W" for a in actions) and store is None:
        raise ValueError("a schedule with W actions needs the WeightGradStore its stages defer into")
    run = _Run(stages=stages, inputs=inputs, labels=labels, loss_fn=loss_fn, store=store,
               scale_loss=scale_loss, aux_loss=aux_loss, device=device, total=torch.zeros((), device=device))
    plan = p2p_plan(actions, num_stages=num_stages, pp_size=pp_size, table=table, placement=placement)

    def post(b: int) -> PostedGroup | None:
        return post_group(plan[b], outgoing=run.outbox.pop, shape=activation_shape, dtype=activation_dtype,
                          device=device, group=pp_group,
                          what=f"transfers {plan[b]} after {actions[b - 1]!r}" if b else "first receives")

    transfers = _Transfers(overlap=overlap)
    transfers.post(post(0))
    for k, a in enumerate(actions):
        start = now()
        before, after = p2p_actions(a, num_stages=num_stages, pp_size=pp_size, placement=placement)
        needed = message(before[0]) if before else None
        received = transfers.take(needed)  # the activation (F) or output grad (B) received, or ...
        if needed is None:  # ... handed over by this rank's neighbouring stage (or none: the first stage)
            received = run.handed.pop((a.kind, a.stage, a.microbatch), None)
        posted_before = len(transfers.pending)
        ready = now()
        if a.kind == "F":
            run.forward(a, received, after)
        elif a.kind == "B":
            run.backward(a, received, after)
        else:
            run.weights(a)
        received = None  # drop this action's tensors: what stays alive is saved, sent or queued
        transfers.release_sends(posted_before)
        transfers.post(post(k + 1))
        if events is not None:
            events.append(PipelineEvent(kind=a.kind, stage=a.stage, microbatch=a.microbatch, start=start,
                                        ready=ready, end=now()))
    transfers.finish()
    if run.saved or run.handed:
        raise RuntimeError(f"the schedule left {len(run.saved)} forwards without their backward: "
                           f"{sorted(run.saved)[:4]} (and {sorted(run.handed)[:4]} handed over, not taken)")
    return run.total


@dataclass(eq=False)
class _Transfers:
    """The groups this rank posted and has not waited for yet, in posting order, and what they received
    (module docstring, "Transfers")."""

    overlap: bool
    pending: list[PostedGroup] = field(default_factory=list)
    inbox: dict[Message, torch.Tensor] = field(default_factory=dict)

    def post(self, group: PostedGroup | None) -> None:
        if group is not None:
            self.pending.append(group)

    def take(self, needed: Message | None) -> torch.Tensor | None:
        """Before an action: wait for every posted group, or with ``overlap`` only up to the one that
        receives ``needed``; the received tensor (None: nothing needed)."""
        while self.pending and (not self.overlap or (needed is not None and needed not in self.inbox)):
            self.inbox |= self.pending.pop(0).wait()
        return None if needed is None else self.inbox.pop(needed)

    def release_sends(self, posted_before: int) -> None:
        """After an action computed: wait for the groups posted before it that only send."""
        for group in [g for g in self.pending[:posted_before] if not g.received]:
            self.pending.remove(group)
            group.wait()

    def finish(self) -> None:
        """At the end of the step: wait for every group left."""
        while self.pending:
            self.pending.pop(0).wait()


@dataclass(kw_only=True, eq=False)
class _Run:
    """One ``run_schedule`` call: what its actions read, and what it keeps between them: ``saved``, each
    (stage, micro-batch)'s input, output (or loss) and own loss (or None) until its ``B``; ``outbox``, what
    the action just done sends, by message; ``handed``, what a stage hands the neighbouring stage on this
    rank (ZB-V's turn), by the consuming action ``(kind, stage, microbatch)``; ``total``, the sum of the
    losses (module docstring)."""

    stages: dict[int, nn.Module]
    inputs: Sequence[torch.Tensor] | None
    labels: Sequence[torch.Tensor] | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    store: WeightGradStore | None
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None
    aux_loss: Callable[[nn.Module], torch.Tensor | None] | None
    device: torch.device
    total: torch.Tensor
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict)
    outbox: dict[Message, torch.Tensor] = field(default_factory=dict)
    handed: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)

    def forward(self, a: Action, received: torch.Tensor | None, after: list[P2PAction]) -> None:
        """``F``: the stage on the micro-batch's tokens or the received activation; its output (on the last
        stage the loss) is kept for the ``B`` and sent on; the stage's own loss kept or added."""
        stage = self.stages[a.stage]
        if as_stage(stage).is_first:
            assert self.inputs is not None, "the first stage's rank needs the micro-batches' inputs"
            x = self.inputs[a.microbatch].to(self.device)
        else:
            assert received is not None  # p2p_actions: every stage but the first receives its input
            x = received.requires_grad_()
        y = stage(x)
        aux = None if self.aux_loss is None else self.aux_loss(stage)
        if as_stage(stage).is_last:
            assert self.labels is not None, "the last stage's rank needs the micro-batches' labels"
            y = self.loss_fn(y, self.labels[a.microbatch].to(self.device))
            y = y if aux is None else y + aux
            aux = None
            self.total += y.detach()
            y = y if self.scale_loss is None else self.scale_loss(y)
        elif aux is not None:  # backpropagated in this stage's B, beside the received gradient
            self.total += aux.detach()
            aux = aux if self.scale_loss is None else self.scale_loss(aux)
        self.saved[(a.stage, a.microbatch)] = (x, y, aux)
        for t in after:
            self.outbox[message(t)] = y
        if not as_stage(stage).is_last and a.stage + 1 in self.stages:  # a leaf, as a received one is
            self.handed[("F", a.stage + 1, a.microbatch)] = y.detach()

    def backward(self, a: Action, received: torch.Tensor | None, after: list[P2PAction]) -> None:
        """``B``: backward from the received output gradient (the last stage: from the loss), with the
        stage's own loss; the input's gradient is sent on. The tensors it held go with its return."""
        key = (a.stage, a.microbatch)
        x, y, aux = self.saved.pop(key)
        roots, grads = [y], [None if as_stage(self.stages[a.stage]).is_last else received]
        if aux is not None:
            roots, grads = [y, aux], [received, None]
        with self.store.capture(key) if self.store is not None else contextlib.nullcontext():
            torch.autograd.backward(roots, grads)
        for t in after:
            assert x.grad is not None  # the input of a stage that sends a gradient is a received activation
            self.outbox[message(t)] = x.grad
        if a.stage > 0 and a.stage - 1 in self.stages:
            assert x.grad is not None  # the input of a stage after the first is a leaf requiring grad
            self.handed[("B", a.stage - 1, a.microbatch)] = x.grad

    def weights(self, a: Action) -> None:
        """``W``: the weight gradients queued under the action's (stage, micro-batch)."""
        assert self.store is not None  # run_schedule refuses W actions without a store
        self.store.flush((a.stage, a.microbatch))
