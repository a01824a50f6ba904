"""Checks of chapter 08's exercises (``exercises/08_pipeline_parallel.py``); see exercises/grading.py.

Tasks 1-3 in one process, without tensors (a schedule is data):

* ``one_f_one_b``: at p = 1..5 and m = 1..8 (m < p included), every rank's list is checked for what a
  schedule must be (refimpl's ``validate``: each ``F`` and ``B`` of the rank's stage once, ``F`` before
  ``B``), for 1F1B's memory bound (at most ``p - rank`` micro-batches in flight), for running without a
  deadlock together with the other ranks' lists (refimpl's ``simulate``), and then against refimpl's
  1F1B action for action.
* ``stage_p2p``: over every action of gpipe, 1f1b, zbh1 (p = 2, 3, 4) and interleaved (v = 2, 3), each
  send must meet exactly one receive of the same tensor on its peer (the pairing, from the answer alone),
  then every ``(before, after)`` must equal refimpl's ``p2p_actions``.
* ``simulate_bubble``: two cases worked out by hand (GPipe at p = 2, m = 2, with and without a transfer
  cost); then the four schedules on a grid of p, m, v with p2p = 0 and 0.25, against refimpl's
  ``simulate``. The costs are dyadic fractions (1, 2, 1.5, 0.5, 0.25), so every start and end time is
  exact in float64 whatever the order of the additions: times must be equal, the bubble within 1e-12 (one
  rounding of the final division). A deadlocking schedule must raise ``ValueError`` within 10 s.

Tasks 4 and 5 (the executor on 2 ranks over real stages, the split backward) are checked in
``ch08_stages``.

``MUTANTS`` (in ``ch08_mutants``) holds plausible wrong implementations, several per task
(tests/course/cli/test_exercises.py grades each and expects its task alone to fail).
"""

from __future__ import annotations

import copy
import threading

# several plausible wrong implementations per task, and an independent right one (not refimpl's)
from exercises.checks.ch08_mutants import CORRECT, EXECUTOR, MUTANTS, ONE_F_ONE_B, P2P, SIM, SPLIT
from exercises.checks.ch08_stages import check_executor, check_split_backward
from exercises.grading import Task, load_module
from refimpl.parallel.pipeline_parallel.schedules import Action, build_schedule, p2p_actions
from refimpl.parallel.pipeline_parallel.simulator import Costs, ScheduleError, simulate, validate

# ---- task 1: 1F1B ------------------------------------------------------------------------------------------


def _in_flight(ops: list[Action]) -> int:
    held = peak = 0
    for a in ops:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def check_one_f_one_b(path: str) -> None:
    fn = load_module(path).one_f_one_b
    for p in range(1, 6):
        for m in range(1, 9):
            schedule = []
            for rank in range(p):
                ops = fn(rank=rank, pp_size=p, num_microbatches=m)
                where = f"rank {rank} of pp_size={p}, num_microbatches={m}"
                assert isinstance(ops, list) and all(isinstance(a, Action) for a in ops), (
                    f"{where}: return a list of Action, got {type(ops).__name__}")
                schedule.append(ops)
                one_rank = [ops if r == rank else [] for r in range(p)]
                try:
                    validate(one_rank, num_microbatches=m)
                except ScheduleError as exc:
                    if "missing" not in str(exc):  # the other ranks' lists are empty here
                        raise AssertionError(f"{where}: {exc}") from None
                peak = _in_flight(ops)
                assert peak <= p - rank, (
                    f"{where}: {peak} micro-batches in flight at once; 1F1B holds at most p - rank = "
                    f"{p - rank} (warm-up min(p - 1 - rank, m) forwards, then one forward, one backward)")
            try:
                simulate(schedule, num_microbatches=m)
            except ScheduleError as exc:
                raise AssertionError(f"pp_size={p}, num_microbatches={m}: {exc}") from None
            want = build_schedule("1f1b", pp_size=p, num_microbatches=m)
            for rank, (got, ref) in enumerate(zip(schedule, want, strict=True)):
                if got != ref:
                    k = next((j for j, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y),
                             min(len(got), len(ref)))
                    raise AssertionError(
                        f"rank {rank} of pp_size={p}, num_microbatches={m}: action {k} is "
                        f"{got[k] if k < len(got) else 'missing'!r}, 1F1B's is "
                        f"{ref[k] if k < len(ref) else 'none'!r} (got {got}, want {ref})")


# ---- task 2: the transfers of an action --------------------------------------------------------------------


def _grid() -> list[tuple[str, int, int, int]]:
    cases = [(name, p, 2 * p, 1) for name in ("gpipe", "1f1b", "zbh1") for p in (2, 3, 4)]
    return cases + [("interleaved", p, 2 * p, v) for p in (2, 3, 4) for v in (2, 3)]


def check_p2p(path: str) -> None:
    fn = load_module(path).stage_p2p
    for name, p, m, v in _grid():
        schedule = build_schedule(name, pp_size=p, num_microbatches=m, virtual_stages=v)
        stages, what = p * v, f"{name} at pp_size={p}, virtual_stages={v}"
        sends, recvs = [], []
        answers = {}
        for rank, ops in enumerate(schedule):
            for a in ops:
                got = fn(a, num_stages=stages, pp_size=p)
                assert isinstance(got, tuple) and len(got) == 2, (
                    f"{what}: stage_p2p({a!r}) must return (before, after), got {type(got).__name__}")
                answers[a] = got
                for t in got[0]:
                    recvs.append((rank, t.peer, t.kind.split("_", 1)[1], t.stage, t.microbatch))
                for t in got[1]:
                    sends.append((t.peer, rank, t.kind.split("_", 1)[1], t.stage, t.microbatch))
        # a send (to, from, tensor, stage, mb) must meet the receive (at, from, tensor, stage, mb)
        unmatched_s, unmatched_r = sorted(set(sends) - set(recvs)), sorted(set(recvs) - set(sends))
        if unmatched_s or len(sends) != len(set(sends)):
            to, frm, kind, s, i = unmatched_s[0] if unmatched_s else sends[0]
            raise AssertionError(f"{what}: rank {frm} sends the {kind} of stage {s}, micro-batch {i} to rank "
                                 f"{to}, which never receives it (stage t lives on rank t % pp_size)")
        if unmatched_r:
            at, frm, kind, s, i = unmatched_r[0]
            raise AssertionError(f"{what}: rank {at} waits for the {kind} of stage {s}, micro-batch {i} from "
                                 f"rank {frm}, which never sends it")
        for a, got in answers.items():
            want = p2p_actions(a, num_stages=stages, pp_size=p)
            if (list(got[0]), list(got[1])) != want:
                raise AssertionError(f"{what}: stage_p2p({a!r}) = {got}, want {want} (receives before the "
                                     f"action, sends after it)")


# ---- task 3: the simulator ---------------------------------------------------------------------------------


def _by_hand() -> list[tuple[float, list[list[tuple[Action, float, float]]], float]]:
    """GPipe at p = 2, m = 2, F = B = 1: worked out on paper (makespan 6, then 7 with p2p = 0.5)."""
    F, B = (lambda s, i: Action("F", s, i)), (lambda s, i: Action("B", s, i))  # noqa: E731
    plain = [[(F(0, 0), 0, 1), (F(0, 1), 1, 2), (B(0, 0), 4, 5), (B(0, 1), 5, 6)],
             [(F(1, 0), 1, 2), (F(1, 1), 2, 3), (B(1, 0), 3, 4), (B(1, 1), 4, 5)]]
    slow = [[(F(0, 0), 0, 1), (F(0, 1), 1, 2), (B(0, 0), 5, 6), (B(0, 1), 6, 7)],
            [(F(1, 0), 1.5, 2.5), (F(1, 1), 2.5, 3.5), (B(1, 0), 3.5, 4.5), (B(1, 1), 4.5, 5.5)]]
    return [(0.0, plain, 1 - 8 / 12), (0.5, slow, 1 - 8 / 14)]


def _compare(got: object, timeline: list, bubble: float, where: str) -> None:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"{where}: return (timeline, bubble), got {type(got).__name__}")
    got_timeline, got_bubble = got
    for rank, (ops, want) in enumerate(zip(got_timeline, timeline, strict=True)):
        ops = [(a, float(s), float(e)) for a, s, e in ops]
        if ops != [(a, float(s), float(e)) for a, s, e in want]:
            k = next((j for j, (x, y) in enumerate(zip(ops, want, strict=False)) if x != y),
                     min(len(ops), len(want)))
            g = ops[k] if k < len(ops) else "nothing"
            w = want[k] if k < len(want) else "nothing"
            raise AssertionError(f"{where}: rank {rank}'s entry {k} is {g}, want {w} (an action starts when "
                                 "its rank is free and what it needs has ended, + p2p from another rank)")
    assert abs(float(got_bubble) - bubble) <= 1e-12, (
        f"{where}: the timeline is right but the bubble is {float(got_bubble):.6f}, want {bubble:.6f} "
        "(1 - the ranks' summed action durations / (p x makespan))")


def _within(fn, seconds: float):
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the grading thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"simulate_bubble did not return within {seconds:g} s on a deadlocking "
                             "schedule: when no rank can go on, raise ValueError")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def check_simulator(path: str) -> None:
    fn = load_module(path).simulate_bubble
    schedule = build_schedule("gpipe", pp_size=2, num_microbatches=2)
    for p2p, timeline, bubble in _by_hand():
        _compare(fn(schedule, costs={"F": 1.0, "B": 1.0}, p2p=p2p), timeline, bubble,
                 f"GPipe at pp=2, m=2, F = B = 1, p2p = {p2p}")
    for name, p, m, v in [("gpipe", 3, 4, 1), ("1f1b", 4, 3, 1), ("1f1b", 2, 6, 1), ("zbh1", 3, 5, 1),
                          ("zbh1", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
                          ("interleaved", 3, 6, 3)]:
        sched = build_schedule(name, pp_size=p, num_microbatches=m, virtual_stages=v)
        split = name == "zbh1"
        costs = {"F": 1.0, "B": 1.5, "W": 0.5} if split else {"F": 1.0, "B": 2.0}
        ref_costs = Costs(forward=1.0, backward=costs["B"], weight=costs.get("W", 0.0))
        for p2p in (0.0, 0.25):
            before = copy.deepcopy(sched)
            got = fn(sched, costs=dict(costs), p2p=p2p)
            assert sched == before, f"{name}: simulate_bubble modified the schedule"
            sim = simulate(sched, num_microbatches=m, virtual_stages=v, costs=ref_costs, p2p=p2p)
            _compare(got, sim.timeline, sim.bubble,
                     f"{name} at pp={p}, m={m}, v={v}, costs {costs}, p2p={p2p}")
    F, B = (lambda s, i: Action("F", s, i)), (lambda s, i: Action("B", s, i))  # noqa: E731
    stuck = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), F(1, 0), B(1, 0), B(1, 1)]]  # rank 1 waits F0.1
    try:
        _within(lambda: fn(stuck, costs={"F": 1.0, "B": 1.0}), 10.0)
    except ValueError:
        return
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"a deadlocking schedule raised {type(exc).__name__}: {exc}; "
                             "want ValueError") from None
    raise AssertionError("a deadlocking schedule (rank 0: F0.0 B0.0 F0.1 B0.1; rank 1: F1.1 F1.0 B1.0 B1.1) "
                         "returned; raise ValueError when no rank can go on")


TASKS = [
    Task(name=ONE_F_ONE_B, points=3, check=check_one_f_one_b),
    Task(name=P2P, points=3, check=check_p2p),
    Task(name=SIM, points=4, check=check_simulator),
    Task(name=EXECUTOR, points=4, check=check_executor),
    Task(name=SPLIT, points=3, check=check_split_backward),
]

__all__ = ["CORRECT", "MUTANTS", "TASKS"]
