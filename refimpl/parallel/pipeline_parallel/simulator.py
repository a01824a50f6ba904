"""A pipeline schedule checked and timed without processes (chapter 08).

``validate`` checks a schedule (``refimpl.parallel.pipeline_parallel.schedules.build_schedule`` or
anyone's lists): every ``(kind, stage, microbatch)`` exactly once, on the rank that holds the stage, each
micro-batch forwarded on a stage before it is backwarded there (and ``B`` before ``W``), and, for one stage
per rank, between any two ranks the messages awaited in the order they are sent (sends match receives,
first in, first out: ``.p2p_plan``'s local rule posts a receive just before the action that needs it).
Lists of several stages per rank are run with ``.p2p_plan``'s rounds, which post each receive in the round
of its send, in the order of the sends, whatever order the receiver's actions take them in: ZB-V's rank
``1`` takes stage ``2p-1``'s gradient of micro-batch 0 before the activation rank 0 sent it earlier.
``simulate`` then runs the lists as the ranks would: each rank takes its actions in order, an action
starts when its rank is free and what it needs is done (``F`` of stage ``s`` needs ``F`` of ``s - 1``; ``B``
of ``s`` needs ``F`` of ``s`` and ``B`` of ``s + 1``; ``W`` needs ``B`` of the same stage), plus ``p2p``
seconds for a dependency on another rank. If no rank can go on before all are done the schedule deadlocks, and
``ScheduleError`` names the action each rank waits at.

Bubble: the idle share of the ranks' time, ``1 - sum(busy) / (p x makespan)``. With equal stages and
``p2p = 0`` it is ``(p-1)/(m+p-1)`` for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021),
``(p-1)/(v m + p - 1)`` for interleaved 1F1B with stages ``v`` times smaller, and for ZB-H1 (Qi et al. 2023)
``(p-1)(t_F + t_B - t_W) / (m (t_F + t_B + t_W) + (p-1)(t_F + t_B - t_W))``: ``bubble_formula``. ZB-V
(Qi et al. 2023, section 6) with chunk costs ``t_F``, ``t_B``, ``t_W`` (half a stage's) idles each rank
``I = (p-1) max(t_B, 2 (t_B - t_W))``: bubble ``I / (2 m (t_F + t_B + t_W) + I)``, exactly for ``m >= 2p``
with ``t_F <= t_B`` and ``t_W <= t_B`` (the regime the paper's V is built for), a lower bound otherwise
(tests/cli/test_pp_schedules.py checks both on a grid); at equal costs ``(p-1)/(6m + p - 1)`` against ZB-H1's
``(p-1)/(3m + p - 1)``, half its idle time (found with this simulator, chapter 08).
In flight: a micro-batch is in flight on a rank from the start of its forward to the end of its backward
(of its ``W`` when split); ``Simulation.peak_in_flight`` is the most at once per rank, the micro-batches
whose activations the rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refimpl.parallel.pipeline_parallel.schedules import Action, Placement, p2p_actions, stage_rank

__all__ = ["Costs", "ScheduleError", "Simulation", "bubble_formula", "simulate", "validate"]


class ScheduleError(ValueError):
    """A schedule that is not valid or deadlocks; the message names the first problem."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds (or any unit) of one action on one stage: forward, input-gradient and weight-gradient
    backward; a ``B`` of a schedule without ``W`` s is the whole backward, ``backward + weight``."""

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0

    def of(self, action: Action, *, split: bool) -> float:
        if action.kind == "F":
            return self.forward
        if action.kind == "W":
            return self.weight
        return self.backward if split else self.backward + self.weight


@dataclass
class Simulation:
    """What ``simulate`` found: per rank the ``(action, start, end)`` it ran, the makespan, the busy
    time per rank and the peak number of micro-batches in flight per rank."""

    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]
    peak_in_flight: list[int] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (p x makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def validate(schedule: list[list[Action]], *, num_microbatches: int, virtual_stages: int = 1,
             placement: Placement = "loop") -> bool:
    """Raise ``ScheduleError`` unless every action is on its stage's rank (``placement``:
    ``schedules.stage_rank``), present once, and in an order its rank can run (F before B before W of the
    same stage and micro-batch); returns whether ``B`` is split (the schedule has ``W`` s)."""
    p = len(schedule)

    def stage_rank_(s: int) -> int:
        return stage_rank(s, pp_size=p, placement=placement)

    stages, m = p * virtual_stages, num_microbatches
    split = any(a.kind == "W" for ops in schedule for a in ops)
    kinds = ("F", "B", "W") if split else ("F", "B")
    want = {(k, s, i) for k in kinds for s in range(stages) for i in range(m)}
    seen: set[tuple[str, int, int]] = set()
    for rank, ops in enumerate(schedule):
        for a in ops:
            key = (a.kind, a.stage, a.microbatch)
            if key not in want:
                raise ScheduleError(f"rank {rank}: {a!r} is not an action of {stages} stages x {m} "
                                    f"micro-batches{' with split backward' if split else ''}")
            if stage_rank_(a.stage) != rank:
                raise ScheduleError(f"rank {rank}: {a!r} is on stage {a.stage}, which rank "
                                    f"{stage_rank_(a.stage)} holds")
            if key in seen:
                raise ScheduleError(f"rank {rank}: {a!r} appears twice")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before is not None and (before, a.stage, a.microbatch) not in seen:
                raise ScheduleError(f"rank {rank}: {a!r} comes before {before}{a.stage}.{a.microbatch} on "
                                    "its stage (a backward needs its forward's activations)")
            seen.add(key)
    missing = sorted(want - seen)
    if missing:
        k, s, i = missing[0]
        raise ScheduleError(f"{len(missing)} actions are missing, e.g. {k}{s}.{i} (rank "
                            f"{stage_rank_(s)})")
    if virtual_stages == 1:  # several stages per rank run with the rounds, which receive in send order
        _check_message_order(schedule, num_stages=stages, placement=placement)
    return split


def _check_message_order(schedule: list[list[Action]], *, num_stages: int, placement: Placement) -> None:
    """Sends match receives: between two ranks, messages arrive in the order they were sent (gloo and NCCL
    match them first in, first out), so the receiver's list must wait for them in the sender's order."""
    p = len(schedule)
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    awaited: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank, ops in enumerate(schedule):
        for a in ops:
            before, after = p2p_actions(a, num_stages=num_stages, pp_size=p, placement=placement)
            for r in before:  # what this message carries: (activation|grad, producing stage, micro-batch)
                awaited.setdefault((r.peer, rank), []).append((r.kind.split("_")[1], r.stage, r.microbatch))
            for t in after:
                sent.setdefault((rank, t.peer), []).append((t.kind.split("_")[1], t.stage, t.microbatch))
    for pair in sorted(set(sent) | set(awaited)):
        out, into = sent.get(pair, []), awaited.get(pair, [])
        if out != into:
            k = next((i for i, (x, y) in enumerate(zip(out, into, strict=False)) if x != y),
                     min(len(out), len(into)))  # the first message that differs
            raise ScheduleError(f"rank {pair[1]} waits for its messages from rank {pair[0]} in another order "
                                f"than they are sent (message {k}: sent {out[k:k + 1]}, awaited "
                                f"{into[k:k + 1]}): the pair would receive the wrong tensor")


def _needs(a: Action, *, stages: int) -> list[tuple[str, int, int]]:
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if a.kind == "B":
        return [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
    return [("B", s, i)]


def simulate(schedule: list[list[Action]], *, num_microbatches: int, virtual_stages: int = 1,
             costs: Costs | None = None, p2p: float = 0.0, placement: Placement = "loop") -> Simulation:
    """Run ``schedule`` in simulated time (see the module docstring; ``placement``: where the stages live,
    ``schedules.stage_rank``); raises ``ScheduleError`` if it is not valid or deadlocks."""
    split = validate(schedule, num_microbatches=num_microbatches, virtual_stages=virtual_stages,
                     placement=placement)
    costs = costs or Costs()
    p, stages = len(schedule), len(schedule) * virtual_stages
    done: dict[tuple[str, int, int], float] = {}
    position, free = [0] * p, [0.0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    while any(position[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(schedule[r]):
                a = schedule[r][position[r]]
                needs = _needs(a, stages=stages)
                if any(n not in done for n in needs):
                    break  # this rank waits; another rank must move first
                ready = max([free[r]] + [done[n] + (p2p if stage_rank(n[1], pp_size=p, placement=placement)
                                                     != r else 0.0) for n in needs])
                end = ready + costs.of(a, split=split)
                timeline[r].append((a, ready, end))
                done[(a.kind, a.stage, a.microbatch)] = end
                free[r], position[r], progressed = end, position[r] + 1, True
        if not progressed:
            waits = ", ".join(f"rank {r} at {schedule[r][position[r]]!r}" for r in range(p)
                              if position[r] < len(schedule[r]))
            raise ScheduleError(f"the schedule deadlocks: {waits} (each waits for an action that waits too)")
    makespan = max(free)
    busy = [sum(e - s for _, s, e in ops) for ops in timeline]
    return Simulation(timeline=timeline, makespan=makespan, busy=busy,
                      peak_in_flight=[_peak_in_flight(ops, split=split) for ops in timeline])


def _peak_in_flight(ops: list[tuple[Action, float, float]], *, split: bool) -> int:
    """Most micro-batches (per stage) between the start of their forward and the end of their last backward
    action on this rank, counted at the action boundaries."""
    last = "W" if split else "B"
    starts = [(s, 1) for a, s, _ in ops if a.kind == "F"]
    ends = [(e, -1) for a, _, e in ops if a.kind == last]
    events = sorted(starts + ends)  # at one instant the release (-1) sorts before the acquire
    held = peak = 0
    for _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


def bubble_formula(name: str, *, pp_size: int, num_microbatches: int, virtual_stages: int = 1,
                   costs: Costs | None = None) -> float:
    """The textbook bubble of ``name`` for equal stages (module docstring); ``costs`` of one stage of a
    non-interleaved split (interleaved and ZB-V stages cost ``1/v`` of it: ``v`` chunks per rank). For
    ``zbv`` a lower bound, reached for ``m >= 2p`` with ``t_F <= t_B`` and ``t_W <= t_B``."""
    p, m, v = pp_size, num_microbatches, virtual_stages
    c = costs or Costs()
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        idle = (p - 1) * (c.forward + c.backward - c.weight)
        return idle / (m * (c.forward + c.backward + c.weight) + idle)
    if name == "zbv":  # chunks of half a stage: I = (p-1) max(t_B, 2 (t_B - t_W)) / 2, busy m (t_F+t_B+t_W)
        idle = (p - 1) * max(c.backward, 2 * (c.backward - c.weight)) / 2
        return idle / (m * (c.forward + c.backward + c.weight) + idle)
    raise ValueError(f"no bubble formula for schedule {name!r}")
