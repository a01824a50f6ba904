"""Pipeline schedules as data: one ordered list of actions per pipeline rank (chapter 08).

The model is cut into ``S = pp x v`` stages (``v`` = ``virtual_stages`` model chunks per rank). Stage ``s``
lives on rank ``s % pp`` (Megatron's interleaved placement, ``"loop"``), but under ZB-V on rank ``s`` for
``s < pp`` and ``2 pp - 1 - s`` after (the ``"v"`` placement: rank ``r`` holds stages ``r`` and
``2 pp - 1 - r``, so rank 0 holds the first and the last): ``stage_rank``, with ``schedule_placement(name)``.
A step runs ``m`` micro-batches through them.
A schedule says, per rank, in which order that rank runs its stages' work; ``build_schedule`` returns it
as ``schedule[rank] = [Action, ...]`` with ``Action(kind, stage, microbatch)``:

* ``"F"``: forward of ``microbatch`` through ``stage``;
* ``"B"``: its backward (the whole backward, or under ``zbh1`` and ``zbv`` only the input gradient);
* ``"W"``: the weight gradient of a ``B`` split in two (``zbh1`` and ``zbv``: ``SPLIT_BACKWARD``).

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
* ``zbv`` (ZB-V: Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6, as
  ``ScheduleZBVZeroBubble`` cites it; the V shapes generalised in Qi et al. 2024, "Pipeline Parallelism with
  Controllable Memory"; DeepSeek-V3's DualPipe keeps the V): two chunks per rank in the ``"v"`` placement,
  ``B`` and ``W`` split. Rank ``r`` runs ``2(p-r)-1`` forwards of its first chunk, then ``r`` pairs of
  forwards (second chunk, first chunk), then ``p-r`` times ``F B W`` of its second chunk; in the steady state
  ``F B W`` of the first chunk, then of the second; the drain interleaves the ``B`` s of both chunks and runs
  the ``W`` s last. The forward turns around on rank ``p - 1`` (stage ``p - 1`` hands its output to stage
  ``p`` on the same rank, no send) and the loss is computed on rank 0. With chunk costs ``t_F``, ``t_B``,
  ``t_W`` (half a stage's) each rank idles ``(p-1) max(t_B, 2 (t_B - t_W))``, exactly for ``m >= 2p`` and
  ``t_F, t_W <= t_B``, at least that otherwise (``.simulator``, ``bubble_formula``), at 1F1B's rank-0
  activation memory on every rank: ``2p`` chunk-micro-batches, each half a stage's. Any ``m`` (with fewer
  than ``2p - 1``, the list of ``2p - 1`` micro-batches without the ones past ``m``, as PyTorch builds it).

The orders match ``torch.distributed.pipelining``'s ``pipeline_order`` tables (``ScheduleGPipe``,
``ScheduleInterleaved1F1B``; ``Schedule1F1B``'s but for its last rank's forwards, numbered one too high,
chapter 08; ZB-H1 as ``ScheduleInterleavedZeroBubble``'s table at one stage per rank, whose docstring calls
it ZB1P; ZB-V as ``ScheduleZBVZeroBubble``'s, its ``I`` our ``B``). The paper's ZB-1p is another
schedule, searched for from measured ``t_F``, ``t_B``, ``t_W`` and a memory limit: not built here, and the
name ``zb1p`` is refused.

The sends and receives are not part of the data: ``p2p_actions`` derives them from the compute actions
(a forward of stage ``s < S-1`` sends its output to stage ``s+1``, a backward of stage ``s > 0`` sends the
input gradient to stage ``s-1``; two stages on one rank hand the tensor over in place, ZB-V's turn).
``.simulator`` checks and times a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refimpl.config import PP_SCHEDULES

__all__ = ["KINDS", "PLACEMENTS", "SCHEDULES", "SPLIT_BACKWARD", "Action", "P2PAction", "Placement",
           "build_schedule", "p2p_actions", "schedule_placement", "stage_rank"]

Kind = Literal["F", "B", "W"]
Placement = Literal["loop", "v"]
PLACEMENTS = ("loop", "v")
SPLIT_BACKWARD = ("zbh1", "zbv")  # the schedules whose backward is split into B and W
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


def stage_rank(stage: int, *, pp_size: int, placement: Placement = "loop") -> int:
    """The rank that holds ``stage``: ``stage % pp_size`` (``"loop"``, Megatron's interleaved placement)
    or, of ``2 pp_size`` stages in a V (``"v"``, ZB-V), ``stage`` going down and ``2 pp_size - 1 - stage``
    back."""
    if placement == "loop":
        return stage % pp_size
    if placement != "v" or not 0 <= stage < 2 * pp_size:
        raise ValueError(f"placement {placement!r} of stage {stage} over {pp_size} ranks: expected 'loop', "
                         f"or 'v' for 2 x {pp_size} stages")
    return stage if stage < pp_size else 2 * pp_size - 1 - stage


def schedule_placement(name: str) -> Placement:
    """Where schedule ``name`` puts its stages: ``"v"`` for ``zbv``, else ``"loop"``."""
    return "v" if name == "zbv" else "loop"


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
    if name == "zbv" and virtual_stages != 2:
        raise ValueError(f"zbv runs two model chunks per rank, in a V: virtual_stages must be 2, got "
                         f"{virtual_stages}")
    if name not in ("interleaved", "zbv") and virtual_stages != 1:
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


def _zero_bubble_v(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V's list of rank ``rank`` (module docstring; ``ScheduleZBVZeroBubble``'s construction, with
    ``max(m, 2p - 1)`` micro-batches and the ones past ``m`` left out)."""
    n, down, up = max(m, 2 * p - 1), rank, 2 * p - 1 - rank
    ops: list[Action] = []
    count = {(kind, s): 0 for kind in KINDS for s in (down, up)}

    def act(*steps: tuple[Kind, int]) -> None:  # each (kind, stage) on its next micro-batch
        for kind, stage in steps:
            ops.append(Action(kind, stage, count[(kind, stage)]))
            count[(kind, stage)] += 1

    for _ in range(2 * (p - rank) - 1):  # warm-up: down the V
        act(("F", down))
    for _ in range(rank):
        act(("F", up), ("F", down))
    for _ in range(p - rank):  # the turn: the second chunk's first backwards
        act(("F", up), ("B", up), ("W", up))
    while count[("F", up)] < count[("F", down)] or count[("F", down)] < n:  # steady state
        if count[("F", down)] < n:
            act(("F", down))
        act(("B", down), ("W", down), ("F", up), ("B", up), ("W", up))
    for _ in range(rank):  # drain: the input gradients first, the weight gradients fill the gaps
        act(("B", down), ("B", up))
    for _ in range(p - rank):
        act(("B", down), ("W", down))
    for stage in (up, down):
        while count[("W", stage)] < count[("B", stage)]:
            act(("W", stage))
    return [a for a in ops if a.microbatch < m]


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
    if name == "zbv":
        return [_zero_bubble_v(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, v) for r in range(p)]


def p2p_actions(action: Action, *, num_stages: int, pp_size: int,
                placement: Placement = "loop") -> tuple[list[P2PAction], list[P2PAction]]:
    """``(before, after)``: the receive a compute action waits for and the send it makes, derived from the
    stage graph under ``placement`` (a ``W`` moves nothing; the first stage receives no activation, the
    last no gradient; two neighbouring stages on one rank, ZB-V's turn, exchange nothing over the network:
    the executor hands the tensor over in place)."""
    s, mb = action.stage, action.microbatch
    before: list[P2PAction] = []
    after: list[P2PAction] = []

    def rank(stage: int) -> int:
        return stage_rank(stage, pp_size=pp_size, placement=placement)

    if action.kind == "F":
        if s > 0 and rank(s - 1) != rank(s):
            before.append(P2PAction("recv_activation", s - 1, mb, rank(s - 1)))
        if s < num_stages - 1 and rank(s + 1) != rank(s):
            after.append(P2PAction("send_activation", s, mb, rank(s + 1)))
    elif action.kind == "B":
        if s < num_stages - 1 and rank(s + 1) != rank(s):
            before.append(P2PAction("recv_grad", s + 1, mb, rank(s + 1)))
        if s > 0 and rank(s - 1) != rank(s):
            after.append(P2PAction("send_grad", s, mb, rank(s - 1)))
    return before, after
