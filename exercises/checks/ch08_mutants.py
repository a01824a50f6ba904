"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 08's checks.

``exercises/checks/ch08.py`` re-exports both; tests/test_exercises.py grades every mutant (its task, and
only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole module
that takes refimpl's answers (``exercises/reference/ch08.py``) for the other tasks and replaces one name.
The right implementations are written here independently of refimpl (a learner's way: counters instead of
index arithmetic, the peer as ``stage % pp_size`` inline, a dictionary of finished actions and the rank
that ran each), and every mutant is that same code with one line changed (:func:`_mutate` insists that the
line is there).
"""

from __future__ import annotations

_HEADER = "from exercises.reference.ch08 import *  # noqa: F403\n"
_1F1B = _HEADER + """
def one_f_one_b(*, rank, pp_size, num_microbatches):
    m = num_microbatches
    warmup = min(pp_size - 1 - rank, m)
    out, f, b = [], 0, 0
    for _ in range(warmup):
        out.append(Action("F", rank, f)); f += 1
    while f < m:
        out.append(Action("F", rank, f)); f += 1
        out.append(Action("B", rank, b)); b += 1
    while b < m:
        out.append(Action("B", rank, b)); b += 1
    return out
"""
_P2P = _HEADER + """
def stage_p2p(action, *, num_stages, pp_size):
    s, i = action.stage, action.microbatch
    before, after = [], []
    if action.kind == "F":
        if s != 0:
            before.append(P2PAction("recv_activation", s - 1, i, (s - 1) % pp_size))
        if s != num_stages - 1:
            after.append(P2PAction("send_activation", s, i, (s + 1) % pp_size))
    elif action.kind == "B":
        if s != num_stages - 1:
            before.append(P2PAction("recv_grad", s + 1, i, (s + 1) % pp_size))
        if s != 0:
            after.append(P2PAction("send_grad", s, i, (s - 1) % pp_size))
    return before, after
"""
_SIM = _HEADER + """
def simulate_bubble(schedule, *, costs, p2p=0.0):
    p = len(schedule)
    stages = 1 + max(a.stage for ops in schedule for a in ops)
    end, rank_of = {}, {}
    pos, free = [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    remaining = sum(len(ops) for ops in schedule)
    while remaining:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                if a.kind == "F":
                    needs = [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
                elif a.kind == "B":
                    needs = [("F", a.stage, a.microbatch)]
                    if a.stage < stages - 1:
                        needs.append(("B", a.stage + 1, a.microbatch))
                else:
                    needs = [("B", a.stage, a.microbatch)]
                if not all(n in end for n in needs):
                    break
                start = free[r]
                for n in needs:
                    start = max(start, end[n] + (p2p if rank_of[n] != r else 0.0))
                stop = start + costs[a.kind]
                timeline[r].append((a, start, stop))
                key = (a.kind, a.stage, a.microbatch)
                end[key], rank_of[key], free[r] = stop, r, stop
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ValueError("the schedule deadlocks: " + ", ".join(
                f"rank {r} waits at {schedule[r][pos[r]]!r}" for r in range(p) if pos[r] < len(schedule[r])))
    makespan = max(free)
    busy = sum(e - s for ops in timeline for _, s, e in ops)
    return timeline, 1.0 - busy / (p * makespan)
"""


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


ONE_F_ONE_B, P2P, SIM = "1f1b: one rank's list", "stage_p2p: sends and receives", "simulate_bubble"
CORRECT = {ONE_F_ONE_B: _1F1B, P2P: _P2P, SIM: _SIM}
MUTANTS = {
    ONE_F_ONE_B: [
        _mutate(_1F1B, 'out.append(Action("F", rank, f)); f += 1\n        out.append(Action("B", rank, b)); '
                       'b += 1',
                'out.append(Action("B", rank, b)); b += 1\n        out.append(Action("F", rank, f)); '
                'f += 1'),  # the steady state backwards before it forwards
        _mutate(_1F1B, "warmup = min(pp_size - 1 - rank, m)", "warmup = min(pp_size - rank, m)"),  # one more
        _mutate(_1F1B, "warmup = min(pp_size - 1 - rank, m)", "warmup = pp_size - 1 - rank"),  # m < p breaks
        _mutate(_1F1B, "warmup = min(pp_size - 1 - rank, m)", "warmup = m"),  # GPipe: every forward first
    ],
    P2P: [
        _mutate(_P2P, 'P2PAction("send_activation", s, i, (s + 1) % pp_size)',
                'P2PAction("send_activation", s, i, s + 1)'),  # the next stage's index, not its rank
        _mutate(_P2P, 'P2PAction("send_grad", s, i, (s - 1) % pp_size)',
                'P2PAction("send_grad", s, i, (s + 1) % pp_size)'),  # the gradient sent downstream
        _mutate(_P2P, '            before.append(P2PAction("recv_grad", s + 1, i, (s + 1) % pp_size))\n',
                "            pass\n"),  # a backward that does not wait for its output gradient
        _mutate(_P2P, "        if s != 0:\n            before",
                "        if s % pp_size != 0:\n            before"),
        # ^ rank 0 never receives an activation: wrong once it holds later chunks (interleaved)
    ],
    SIM: [
        _mutate(_SIM, "start = max(start, end[n] + (p2p if rank_of[n] != r else 0.0))",
                "start = max(start, end[n]) if rank_of[n] == r else start"),  # ignores other ranks' times
        _mutate(_SIM, "(p2p if rank_of[n] != r else 0.0)", "p2p"),  # a transfer within a rank too
        _mutate(_SIM, "busy = sum(e - s for ops in timeline for _, s, e in ops)",
                "busy = sum(ops[-1][2] for ops in timeline)"),  # a rank's waits counted as busy
        _mutate(_SIM, "busy = sum(e - s for ops in timeline for _, s, e in ops)",
                "busy = sum(e - s for _, s, e in timeline[0])"),  # only one rank's work
    ],
}
