"""When a pipeline rank posts its sends and receives, so that the schedule cannot deadlock on NCCL
(chapter 08): ``p2p_plan``, and ``strict_deadlock``, which checks a plan without processes.

NCCL runs a pair's point-to-point calls in order, and a send completes only once the peer has posted the
matching receive (strict mode of ``refimpl.comm.ops`` shows it on gloo). So a rank that sends an
activation, unbatched, while its peer sends it a gradient, both waiting for the other to receive, hangs:
1F1B at ``p = 2`` does exactly that in its steady state. The cure is to post transfers in **groups**
(``batch_isend_irecv``, one fused NCCL launch whose sends and receives progress together) at points both
ranks' programs agree on. The executor posts one group at each *boundary* of its action list (before the
first action, between two actions, after the last) and waits for it before its next action computes (with
``overlap``, only when an action needs what it receives: the same groups in the same order).
``plan[b]`` is the group of boundary ``b``: the sends of action ``b - 1`` and the receives posted there.

* **Rounds** (when the whole table is known: passed in, or inferred for interleaved 1F1B by
  ``find_table``; ``torch.distributed.pipelining``'s rule): the table is run in simulated time with
  every action lasting one unit (``.simulator.simulate``), so each action ends at an integer round
  ``T``. A message is sent in the round its producer ends, at the producer's boundary, and received **in
  the same round**, at the boundary the receiver stands at then (after its actions that end by ``T``; the
  consumer starts at ``T`` or later). Every op of a round-``T`` group has its partner in a round-``T``
  group, so by induction over ``T`` every group is posted and completes: no deadlock, for any valid table.
* **Local rule** (one stage per rank and no table: only this rank's list is known): the sends of each
  action with the receives of the next action (Megatron-LM's ``send_forward_recv_backward`` /
  ``send_backward_recv_forward``). Deadlock-free for GPipe, 1F1B, ZB-H1 and one-chunk interleaving
  (checked by ``strict_deadlock`` in tests/ranks/cli/serial/test_p2p_strict.py), **not** for interleaved 1F1B
  with several chunks: there a rank sends a gradient in the same group as it receives an activation while its
  peer first needs to send it something else, hence the rounds for multi-stage lists.

Messages between two ranks in one direction are posted in the order they are sent and awaited in the
order they are posted, as the simulator's validator requires of the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from refimpl.parallel.pipeline_parallel.schedules import (
    Action,
    P2PAction,
    Placement,
    build_schedule,
    p2p_actions,
    stage_rank,
)
from refimpl.parallel.pipeline_parallel.simulator import Costs, simulate

__all__ = ["find_table", "p2p_plan", "strict_deadlock"]

Plan = list[list[P2PAction]]


def find_table(actions: Sequence[Action], *, pp_size: int,
               placement: Placement = "loop") -> list[list[Action]] | None:
    """The table whose list for this rank is ``actions`` when the list holds several stages: interleaved
    1F1B's under the ``"loop"`` placement, ZB-V's under ``"v"`` (only these build such lists, so every
    rank of the pipeline infers the same table), else None. One-stage lists are not looked up: GPipe and
    1F1B give rank 0 the same list at ``m = 2`` while rank 1's differ, so two ranks could infer two
    tables."""
    if not actions:
        return None
    rank = stage_rank(actions[0].stage, pp_size=pp_size, placement=placement)
    v = len({a.stage for a in actions})
    forwards = sum(a.kind == "F" for a in actions)
    if v == 1 or forwards % v:
        return None
    try:
        table = build_schedule("zbv" if placement == "v" else "interleaved", pp_size=pp_size,
                               num_microbatches=forwards // v, virtual_stages=v)
    except ValueError:
        return None
    return table if table[rank] == list(actions) else None


def _receive(send: P2PAction, *, sender: int) -> P2PAction:
    """The receiver's side of ``send`` (the consumer's ``before`` entry of ``p2p_actions``)."""
    return P2PAction("recv_" + send.kind.split("_")[1], send.stage, send.microbatch, sender)


def _round_plan(table: list[list[Action]], rank: int, *, num_stages: int, placement: Placement) -> Plan:
    p = len(table)
    split = any(a.kind == "W" for ops in table for a in ops)
    m = sum(a.kind == "F" for a in table[0]) * p // num_stages
    unit = Costs(forward=1.0, backward=1.0, weight=1.0 if split else 0.0)  # every action one round long
    sim = simulate(table, num_microbatches=m, virtual_stages=num_stages // p, costs=unit, placement=placement)
    ends = [[end for _, _, end in ops] for ops in sim.timeline]
    mine = table[rank]
    plan: Plan = [[] for _ in range(len(mine) + 1)]
    for k, a in enumerate(mine):
        plan[k + 1] += p2p_actions(a, num_stages=num_stages, pp_size=p, placement=placement)[1]
    arriving: list[list[tuple[float, P2PAction]]] = [[] for _ in range(len(mine) + 1)]
    for q in range(p):
        for a, end in zip(table[q], ends[q], strict=True):
            for s in p2p_actions(a, num_stages=num_stages, pp_size=p, placement=placement)[1]:
                if s.peer == rank:  # sent in round `end`: received at my boundary of that round
                    boundary = sum(e <= end for e in ends[rank])
                    arriving[boundary].append((end, _receive(s, sender=q)))
    for b, got in enumerate(arriving):
        plan[b] += [r for _, r in sorted(got, key=lambda x: (x[0], x[1].peer))]
    return plan


def _local_plan(actions: Sequence[Action], *, num_stages: int, pp_size: int) -> Plan:
    pa = [p2p_actions(a, num_stages=num_stages, pp_size=pp_size) for a in actions]  # one stage per rank
    plan: Plan = [list(pa[0][0]) if pa else []]
    for k in range(len(actions)):
        plan.append(list(pa[k][1]) + (list(pa[k + 1][0]) if k + 1 < len(actions) else []))
    return plan


def p2p_plan(actions: Sequence[Action], *, num_stages: int, pp_size: int,
             table: Sequence[Sequence[Action]] | None = None, placement: Placement = "loop") -> Plan:
    """The group this rank posts at each boundary of ``actions`` (module docstring): ``plan[b]``, ``b`` in
    ``0 .. len(actions)``, its sends (of action ``b - 1``) first. ``table``: every rank's list (default:
    ``find_table``); with it the rounds, without it the local rule. Every rank of a pipeline must
    decide alike: pass the table to all of them or to none. ``placement``: where the stages live
    (``.schedules.stage_rank``; ``"v"``: ZB-V, whose lists of two stages always find their table)."""
    table = ([list(t) for t in table] if table is not None
             else find_table(actions, pp_size=pp_size, placement=placement))
    if table is None:
        return _local_plan(actions, num_stages=num_stages, pp_size=pp_size)
    rank = stage_rank(actions[0].stage, pp_size=pp_size, placement=placement) if actions else 0
    if table[rank] != list(actions):
        raise ValueError("the table's list for this rank is not the actions run")
    return _round_plan(table, rank, num_stages=num_stages, placement=placement)


def strict_deadlock(plans: Sequence[Plan]) -> str | None:
    """Run every rank's plan under NCCL's rule (strict mode): a rank posts its next group once its last one
    completed, and a group completes once every op's partner (the ``k``-th send from ``a`` to ``b`` is the
    ``k``-th receive of ``b`` from ``a``) has been posted. None if every group completes; else which group
    each stuck rank waits at. Also refuses a plan whose ``k``-th send of a pair is not the ``k``-th
    receive's message."""
    where: dict[tuple[str, int, int, int], tuple[int, tuple]] = {}
    for r, plan in enumerate(plans):
        seen: dict[tuple[str, int], int] = {}
        for b, group in enumerate(plan):
            for t in group:
                d = t.kind.split("_")[0]
                k = seen.get((d, t.peer), 0)
                seen[(d, t.peer)] = k + 1
                where[(d, r, t.peer, k)] = (b, (t.kind.split("_")[1], t.stage, t.microbatch))
    needs: list[list[list[tuple[int, int]]]] = []
    for (d, r, peer, k), (_, msg) in where.items():
        other = where.get(("recv" if d == "send" else "send", peer, r, k))
        if other is None or other[1] != msg:
            return f"rank {r}'s {d} #{k} with rank {peer} ({msg}) has no matching op (found {other})"
    for r, plan in enumerate(plans):
        seen = {}
        needs.append([])
        for group in plan:
            deps = []
            for t in group:
                d = t.kind.split("_")[0]
                k = seen.get((d, t.peer), 0)
                seen[(d, t.peer)] = k + 1
                deps.append((t.peer, where[("recv" if d == "send" else "send", t.peer, r, k)][0]))
            needs[-1].append(deps)
    pos = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan) and all(pos[q] >= b for q, b in needs[r][pos[r]]):
                pos[r], moved = pos[r] + 1, True
    stuck = [f"rank {r} at group {pos[r]} {plans[r][pos[r]]}" for r in range(len(plans))
             if pos[r] < len(plans[r])]
    return "; ".join(stuck) if stuck else None
