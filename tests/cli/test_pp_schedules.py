"""Pipeline schedules as data (chapter 08): every schedule on a grid of ``p``, ``m``, ``v`` is valid, runs
without deadlock in the simulator, and its simulated bubble is the textbook formula; 1F1B holds at most
``p - r`` micro-batches on rank ``r`` where GPipe holds ``m``; our interleaved lists are torch's
``ScheduleInterleaved1F1B.pipeline_order``, action for action, and our ZB-V lists torch's
``ScheduleZBVZeroBubble.pipeline_order`` (its ``I``, the input gradient, is our ``B``). ZB-V's bubble is
``bubble_formula``'s closed form for ``m >= 2p`` with ``t_F, t_W <= t_B`` and never below it (a grid of
costs), its plan passes the strict NCCL rule, and it holds ``2p`` half-size chunk-micro-batches on every
rank (1F1B's rank 0: ``p`` whole ones). Negative controls: a backward before its
forward, a missing or misplaced action, and an order that deadlocks are each refused with one clear line.
The old name ``zb1p`` (the paper's ZB-1p is its searched schedule, not our handcrafted ZB-H1) is refused by
``build_schedule`` and by the trainer's command line, with the right name.

The bubble formulas are a separate computation from the simulator (closed forms vs an event-driven run of
the lists), so their agreement to 1e-12 is a check, not a restatement.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from refimpl.parallel.pipeline_parallel import (
    Action,
    Costs,
    ScheduleError,
    bubble_formula,
    build_schedule,
    p2p_actions,
    schedule_placement,
    simulate,
    stage_rank,
    validate,
)
from refimpl.parallel.pipeline_parallel.p2p_plan import p2p_plan, strict_deadlock
from refimpl.parallel.pipeline_parallel.schedules import ZB1P_HINT

ROOT = Path(__file__).resolve().parents[2]

GRID = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zbh1") for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]
GRID += [("interleaved", p, m, v) for p in (1, 2, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)]
GRID += [("zbv", p, m, 2) for p in (1, 2, 3, 4) for m in sorted({1, 3, p, 2 * p - 1, 2 * p, 3 * p})]


@pytest.mark.parametrize("name, p, m, v", GRID, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in GRID])
def test_every_schedule_is_valid_and_its_simulated_bubble_is_the_formula(name, p, m, v):
    schedule = build_schedule(name, pp_size=p, num_microbatches=m, virtual_stages=v)
    assert len(schedule) == p
    costs = Costs(forward=1.0, backward=1.3, weight=0.7)  # unequal F, B, W: the formulas must still hold
    if name in ("interleaved", "zbv"):  # v chunks per rank, each 1/v of the layers
        costs = Costs(forward=1.0 / v, backward=1.3 / v, weight=0.7 / v)
    sim = simulate(schedule, num_microbatches=m, virtual_stages=v, costs=costs,
                   placement=schedule_placement(name))
    formula = bubble_formula(name, pp_size=p, num_microbatches=m, virtual_stages=v,
                             costs=Costs(forward=1.0, backward=1.3, weight=0.7))
    steady = {"zbh1": m >= p, "zbv": m >= 2 * p}.get(name, True)  # the zero-bubble ones need a steady state
    if steady:
        assert sim.bubble == pytest.approx(formula, abs=1e-12), (sim.bubble, formula)
    else:  # ZB-H1 (ZB-V) with fewer micro-batches than stages (2p): no steady state to fill the drain
        assert sim.bubble >= formula - 1e-12
    if name == "1f1b":
        assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]
    if name == "gpipe":
        assert sim.peak_in_flight == [m] * p
    if name == "zbh1":
        assert max(sim.peak_in_flight) <= p  # 1F1B's memory bound (the deferred W s ride within it)
    if name == "zbv":  # 2p chunk-micro-batches of half a stage each: 1F1B's rank-0 bytes, on every rank
        assert max(sim.peak_in_flight) <= 2 * p
        assert m < 2 * p or sim.peak_in_flight == [2 * p] * p


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_zbv_bubble_is_the_closed_form_on_a_grid_of_costs_and_never_below_it(p):
    """``I = (p-1) max(t_B, 2 (t_B - t_W))`` idle per rank (chunk costs): equal for ``m >= 2p`` and
    ``t_F, t_W <= t_B``, a lower bound everywhere on the grid (``t_F > t_B``: the forwards, not the
    backwards, set the pace and the formula does not hold)."""
    values = (0.25, 0.5, 1.0, 2.0)
    grid = itertools.product(values, values, (0.0, *values))
    for (f, b, w), m in itertools.product(grid, (2, 2 * p, 3 * p)):
        chunk = Costs(forward=f, backward=b, weight=w)
        sim = simulate(build_schedule("zbv", pp_size=p, num_microbatches=m, virtual_stages=2),
                       num_microbatches=m, virtual_stages=2, costs=chunk, placement="v")
        formula = bubble_formula("zbv", pp_size=p, num_microbatches=m, virtual_stages=2,
                                 costs=Costs(forward=2 * f, backward=2 * b, weight=2 * w))  # whole stages
        if m >= 2 * p and f <= b and w <= b:
            assert sim.bubble == pytest.approx(formula, abs=1e-12), (f, b, w, m)
        else:
            assert sim.bubble >= formula - 1e-12, (f, b, w, m)
    assert bubble_formula("zbv", pp_size=p, num_microbatches=2 * p, virtual_stages=2) == pytest.approx(
        (p - 1) / (6 * 2 * p + p - 1))  # equal costs: (p-1)/(6m + p - 1), half of ZB-H1's (p-1)/(3m + p - 1)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 2), (2, 3), (2, 4), (3, 6), (4, 4), (4, 5), (4, 8)])
def test_zbv_is_torch_schedule_zbv_zero_bubble_action_for_action(p, m):
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    stages = [_fake_stage(0, p, 2, index) for index in (0, 2 * p - 1)]  # rank 0's V (the table: every rank's)
    table = ScheduleZBVZeroBubble(stages, m).pipeline_order
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "B",
             _ComputationType.BACKWARD_WEIGHT: "W"}
    ours = build_schedule("zbv", pp_size=p, num_microbatches=m, virtual_stages=2)
    for rank in range(p):
        theirs = [Action(kinds[a.computation_type], a.stage_index, a.microbatch_index)
                  for a in table[rank] if a is not None]
        assert ours[rank] == theirs, rank
        assert {a.stage for a in ours[rank]} == {rank, 2 * p - 1 - rank}  # the V


def test_the_v_placement_hands_the_turn_over_in_place_and_its_plan_cannot_deadlock():
    p = 4
    assert [stage_rank(s, pp_size=p, placement="v") for s in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_rank(s, pp_size=p) for s in range(2 * p)] == [0, 1, 2, 3, 0, 1, 2, 3]  # the loop, as before

    def moves(kind: str, stage: int) -> tuple[list, list]:
        before, after = p2p_actions(Action(kind, stage, 0), num_stages=2 * p, pp_size=p, placement="v")
        return [(t.kind, t.peer) for t in before], [(t.kind, t.peer) for t in after]

    assert moves("F", 3) == ([("recv_activation", 2)], [])  # in from rank 2, nothing out: the turn
    assert moves("F", 4) == ([], [("send_activation", 2)])  # stage 4 takes stage 3's output on rank 3
    assert moves("B", 4) == ([("recv_grad", 2)], [])  # its input gradient stays on rank 3 too
    assert moves("B", 3) == ([], [("send_grad", 2)])
    assert moves("F", 7) == ([("recv_activation", 1)], [])  # the last stage, on rank 0: the loss there
    for p, m in [(2, 2), (2, 5), (3, 6), (4, 8)]:
        table = build_schedule("zbv", pp_size=p, num_microbatches=m, virtual_stages=2)
        plans = [p2p_plan(table[r], num_stages=2 * p, pp_size=p, placement="v") for r in range(p)]
        assert strict_deadlock(plans) is None, (p, m)
    # negative controls: the V's table under the loop placement is refused, and so is zbv with 1 chunk
    with pytest.raises(ScheduleError, match="which rank"):
        validate(build_schedule("zbv", pp_size=2, num_microbatches=4, virtual_stages=2), num_microbatches=4,
                 virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages must be 2"):
        build_schedule("zbv", pp_size=2, num_microbatches=4)


def test_the_bubble_shrinks_as_the_papers_say():
    p, m = 4, 8
    one = simulate(build_schedule("1f1b", pp_size=p, num_microbatches=m), num_microbatches=m).bubble
    gpipe = simulate(build_schedule("gpipe", pp_size=p, num_microbatches=m), num_microbatches=m).bubble
    v = 2
    inter = simulate(build_schedule("interleaved", pp_size=p, num_microbatches=m, virtual_stages=v),
                     num_microbatches=m, virtual_stages=v,
                     costs=Costs(forward=0.5, backward=0.5, weight=0.5)).bubble
    zb = simulate(build_schedule("zbh1", pp_size=p, num_microbatches=m), num_microbatches=m).bubble
    assert gpipe == one == pytest.approx(3 / 11)
    assert inter == pytest.approx(3 / 19) and zb == pytest.approx(3 * 1 / (8 * 3 + 3 * 1))
    assert zb < inter < one


def _fake_stage(rank: int, p: int, v: int, index: int) -> SimpleNamespace:
    return SimpleNamespace(group_size=p, group_rank=rank, num_stages=p * v, stage_index=index,
                           is_first=index == 0, is_last=index == p * v - 1, stage_index_to_group_rank=None,
                           submod=torch.nn.Linear(1, 1))


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_is_torch_schedule_interleaved_1f1b_action_for_action(p, v, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    stages = [_fake_stage(0, p, v, chunk * p) for chunk in range(v)]  # the table is built for every rank
    table = ScheduleInterleaved1F1B(stages, m).pipeline_order
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    ours = build_schedule("interleaved", pp_size=p, num_microbatches=m, virtual_stages=v)
    for rank in range(p):
        theirs = [Action(kinds[a.computation_type], a.stage_index, a.microbatch_index)
                  for a in table[rank] if a is not None]
        assert ours[rank] == theirs, rank


def test_p2p_actions_are_derived_from_the_stage_graph():
    before, after = p2p_actions(Action("F", 2, 5), num_stages=4, pp_size=2)
    assert [(t.kind, t.stage, t.peer) for t in before] == [("recv_activation", 1, 1)]
    assert [(t.kind, t.stage, t.peer) for t in after] == [("send_activation", 2, 1)]
    before, after = p2p_actions(Action("B", 0, 1), num_stages=4, pp_size=2)
    assert [(t.kind, t.stage, t.peer) for t in before] == [("recv_grad", 1, 1)] and after == []
    assert p2p_actions(Action("W", 1, 0), num_stages=4, pp_size=2) == ([], [])
    assert p2p_actions(Action("F", 3, 0), num_stages=4, pp_size=2)[1] == []  # the last stage sends nothing


def test_negative_controls_invalid_and_deadlocking_schedules_are_refused_in_one_line():
    good = build_schedule("1f1b", pp_size=2, num_microbatches=2)
    bad = [[Action("B", 0, 0), Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1)], good[1]]
    cases = {
        "comes before F0.0": bad,
        "appears twice": [good[0] + [Action("F", 0, 0)], good[1]],
        "which rank 1 holds": [good[0] + [Action("F", 1, 0)], good[1][1:]],
        "actions are missing": [good[0][:-1], good[1]],
        # rank 1 forwards micro-batch 1 first: it would receive micro-batch 0's activation as 1's
        "in another order than they are sent": [
            [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)],
            [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)]],
        # rank 1 backwards micro-batch 1 first: the message order is fine, but rank 0 forwards micro-batch 1
        # only after a backward that waits for rank 1, which waits for that forward
        "deadlocks": [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
                      [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]],
    }
    for message, schedule in cases.items():
        with pytest.raises(ScheduleError, match=message) as info:
            simulate(schedule, num_microbatches=2)
        assert "\n" not in str(info.value)
    assert validate(good, num_microbatches=2) is False  # the unsplit backward


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="interleaved", pp_size=4, num_microbatches=6, virtual_stages=2), "does not divide by 4"),
    (dict(name="1f1b", pp_size=2, num_microbatches=4, virtual_stages=2), "virtual_stages must be 1"),
    (dict(name="pipedream", pp_size=2, num_microbatches=4), "unknown pipeline schedule"),
    (dict(name="gpipe", pp_size=0, num_microbatches=4), "pp_size must be a positive integer"),
])
def test_sizes_that_do_not_fit_are_one_line_errors(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        build_schedule(name, **kwargs)


def test_p2p_latency_adds_to_cross_rank_dependencies_only():
    p, m = 2, 4
    schedule = build_schedule("1f1b", pp_size=p, num_microbatches=m)
    base = simulate(schedule, num_microbatches=m)
    slow = simulate(schedule, num_microbatches=m, p2p=0.25)
    assert slow.makespan > base.makespan and slow.busy == base.busy
    one = simulate(build_schedule("1f1b", pp_size=1, num_microbatches=m), num_microbatches=m, p2p=10.0)
    assert one.bubble == 0.0  # one rank: no cross-rank dependency to wait for
    assert list(itertools.chain(*[[a for a, _, _ in ops] for ops in base.timeline])) == [
        a for ops in schedule for a in ops]  # the simulator ran each rank's list in its order


def test_the_old_name_zb1p_is_refused_with_the_right_name():
    with pytest.raises(ValueError) as info:
        build_schedule("zb1p", pp_size=2, num_microbatches=4)
    assert str(info.value) == ZB1P_HINT and "ZB-1p" in ZB1P_HINT and "use zbh1" in ZB1P_HINT
    assert build_schedule("zbh1", pp_size=2, num_microbatches=4)  # the right name builds


@pytest.mark.timeout(180)
def test_the_trainer_refuses_zb1p_in_one_line_before_making_a_run_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "refimpl.train", "--pp", "2", "--pp-schedule", "zb1p",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, report
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, report
    assert "ZB-1p" in errors[0] and "--pp-schedule zbh1" in errors[0], report
    assert not out.exists(), "a refused run must not create its run folder"
    ok = subprocess.run([sys.executable, "-m", "refimpl.train", "--pp-schedule", "zbh1", "--help"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert ok.returncode == 0, ok.stderr  # the control: the right name passes the same parser
