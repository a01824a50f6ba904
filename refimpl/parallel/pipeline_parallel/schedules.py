"""Pipeline schedules as data: one ordered list of actions per pipeline rank (chapter 08).

The model is cut into ``S = pp x v`` stages (``v`` = ``virtual_stages`` model chunks per rank; stage ``s``
lives on rank ``s % pp``, Megatron's interleaved placement). A step runs ``m`` micro-batches through them.
A schedule says, per rank, in which order that rank runs its stages' work; ``build_schedule`` returns it
as ``schedule[rank] = [Action, ...]`` with ``Action(kind, stage, microbatch)``:

* ``"F"``: forward of ``microbatch`` through ``stage``;
* ``"B"``: its backward (the whole backward, or under ``zbh1`` only the input gradient);
* ``"W"``: the weight gradient of a ``B`` split in two (``zbh1`` only).

Schedules (``p`` ranks, ``m`` micro-batches; bubble = idle share of ``p x`` step time for equal stage costs
``t_F``, ``t_B``, ``t_W``):

* ``gpipe`` (Huang et al. 2019): all forwards, then all backwards. Bubble ``(p-1)/(m+p-1)``; every rank
  holds the activations of all ``m`` micro-batches at the turn.
* ``1f1b`` (Narayanan et al. 2021, PipeDream-Flush): rank ``r`` runs ``min(p-1-r, m)`` warm-up forwards,
  then alternates one forward and one backward, then drains the backwards. Same bubble as GPipe, but rank
  ``r`` holds at most ``p - r`` micro-batches.
* ``interleaved`` (Narayanan et al. 2021, section 2.2; Megatron's interleaved 1F1B): ``v`` chunks per rank,
  micro-batches in rounds of ``p`` per chunk (``m`` must divide by ``p``), ``(v-1) p + 2 (p-1-r)`` warm-up
  forwards. Bubble ``(p-1)/(v m + p - 1)``: about ``1/v`` of 1F1B's for ``m >> p``, for ``v x`` the sends.
* ``zbh1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): 1F1B with each backward split into
  ``B`` (input gradient, on the critical path to the previous stage) and ``W`` (weight gradient, needed by
  no one until the optimizer step); rank ``r`` runs each ``W`` ``r`` backwards late, so the ``W`` s fill
  the drain where rank ``r`` would wait ``r t_B``. Bubble ``(p-1)(t_F + t_B - t_W)`` per rank instead of
  ``(p-1)(t_F + t_B + t_W)``, at 1F1B's memory (at most ``p`` micro-batches in flight).

The orders match ``torch.distributed.pipelining``'s ``pipeline_order`` tables (``ScheduleGPipe``,
``ScheduleInterleaved1F1B``; ``Schedule1F1B``'s but for its last rank's forwards, numbered one too high,
chapter 08; ZB-H1 as ``ScheduleInterleavedZeroBubble``'s table at one stage per rank, whose docstring calls
it ZB1P). The paper's ZB-1p is another schedule, searched for from measured ``t_F``, ``t_B``, ``t_W`` and a
memory limit: not built here, and the name ``zb1p`` is refused.

The sends and receives are not part of the data: ``p2p_actions`` derives them from the compute actions
(a forward of stage ``s < S-1`` sends its output to stage ``s+1``, a backward of stage ``s > 0`` sends the
input gradient to stage ``s-1``). ``.simulator`` checks and times a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refimpl.config import PP_SCHEDULES

__all__ = ["KINDS", "SCHEDULES", "Action", "P2PAction", "build_schedule", "p2p_actions", "stage_rank"]

Kind = Literal["F", "B", "W"]
KINDS = ("F", "B", "W")
SCHEDULES = PP_SCHEDULES


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` (``F``, ``B``, ``W``) of ``microbatch`` on the global (virtual) ``stage``."""

    kind: Kind
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class P2PAction:
    """A transfer a compute action implies: ``kind`` ``send_activation`` / ``recv_activation`` (forward,
    stage ``stage`` to ``stage + 1``) or ``send_grad`` / ``recv_grad`` (backward, ``stage`` to ``stage - 1``)
    of ``microbatch``, with the ``peer`` rank."""

    kind: str
    stage: int
    microbatch: int
    peer: int


def stage_rank(stage: int, *, pp_size: int) -> int:
    """The rank that holds ``stage``: ``stage % pp_size`` (Megatron's interleaved placement)."""
    return stage % pp_size


ZB1P_HINT = ("zb1p is the paper's searched ZB-1p schedule, which is not built here; the handcrafted "
             "zero-bubble schedule is ZB-H1: use zbh1")


def _check(name: str, pp_size: int, num_microbatches: int, virtual_stages: int) -> None:
    if name == "zb1p":  # the old name of zbh1
        raise ValueError(ZB1P_HINT)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {SCHEDULES}")
    for what, value in (("pp_size", pp_size), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(f"{name} runs one stage per rank: virtual_stages must be 1, got {virtual_stages} "
                         "(use 'interleaved' for several model chunks per rank)")
    if name == "interleaved" and num_microbatches % pp_size:
        raise ValueError(f"interleaved 1F1B sends micro-batches in rounds of pp_size = {pp_size} per model "
                         f"chunk: num_microbatches = {num_microbatches} does not divide by {pp_size}")


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - 1 - rank, m)
    ops = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Action("F", rank, warmup + i), Action("B", rank, i)]
    return ops + [Action("B", rank, i) for i in range(m - warmup, m)]


def _zero_bubble_h1(rank: int, p: int, m: int) -> list[Action]:
    """1F1B with ``W`` of the ``j``-th backward run after backward ``j + rank`` (the rest at the end)."""
    ops, done = [], 0
    for action in _one_f_one_b(rank, p, m):
        ops.append(action)
        if action.kind == "B" and action.microbatch >= rank:
            ops.append(Action("W", rank, done))
            done += 1
    return ops + [Action("W", rank, i) for i in range(done, m)]


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v  # forward (and backward) actions of this rank

    def chunk_and_microbatch(k: int, *, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v                       # rounds of p micro-batches per chunk
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    def act(kind: Kind, k: int) -> Action:
        chunk, mb = chunk_and_microbatch(k, backward=kind == "B")
        return Action(kind, chunk * p + rank, mb)

    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    ops = [act("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [act("F", warmup + i), act("B", i)]
    return ops + [act("B", k) for k in range(total - warmup, total)]


def build_schedule(name: str, *, pp_size: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """The action list of every pipeline rank for schedule ``name`` (see the module docstring):
    ``schedule[rank]`` in the order that rank runs them. Pure: no process, no tensor."""
    _check(name, pp_size, num_microbatches, virtual_stages)
    p, m, v = pp_size, num_microbatches, virtual_stages
    if name == "gpipe":
        return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
                for r in range(p)]
    if name == "1f1b":
        return [_one_f_one_b(r, p, m) for r in range(p)]
    if name == "zbh1":
        return [_zero_bubble_h1(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, v) for r in range(p)]


def p2p_actions(action: Action, *, num_stages: int, pp_size: int) -> tuple[list[P2PAction], list[P2PAction]]:
    """``(before, after)``: the receive a compute action waits for and the send it makes, derived from the
    stage graph (a ``W`` moves nothing; the first stage receives no activation, the last no gradient)."""
    s, mb = action.stage, action.microbatch
    before: list[P2PAction] = []
    after: list[P2PAction] = []
    if action.kind == "F":
        if s > 0:
            before.append(P2PAction("recv_activation", s - 1, mb, stage_rank(s - 1, pp_size=pp_size)))
        if s < num_stages - 1:
            after.append(P2PAction("send_activation", s, mb, stage_rank(s + 1, pp_size=pp_size)))
    elif action.kind == "B":
        if s < num_stages - 1:
            before.append(P2PAction("recv_grad", s + 1, mb, stage_rank(s + 1, pp_size=pp_size)))
        if s > 0:
            after.append(P2PAction("send_grad", s, mb, stage_rank(s - 1, pp_size=pp_size)))
    return before, after
