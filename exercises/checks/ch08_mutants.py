"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 08's checks.

``exercises/checks/ch08.py`` re-exports both; tests/course/cli/test_exercises.py grades every mutant (its
task, and only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole
module that takes refimpl's answers (``exercises/reference/ch08.py``) for the other tasks and replaces one
name. The right implementations are written here independently of refimpl (a learner's way: counters instead
of index arithmetic, the peer as ``stage % pp_size`` inline, a dictionary of finished actions and the rank
that ran each, blocking receives with ``torch.distributed``, a closure per deferred weight gradient), and
every mutant is that same code with a line or two changed (``_mutate`` insists that each is there).
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
_EXECUTOR = _HEADER + """
import torch
import torch.distributed as dist
from refimpl.models import lm_loss


def run_pipeline_rank(actions, *, stage, inputs, labels, num_tokens, activation_shape, group=None):
    me, device = stage.stage, next(stage.parameters()).device
    saved, pending = {}, []
    total = torch.zeros((), device=device)
    for a in actions:
        i = a.microbatch
        if a.kind == "F":
            if stage.is_first:
                x = inputs[i]
            else:
                x = torch.empty(activation_shape, device=device)
                dist.recv(x, src=me - 1, group=group)
                x.requires_grad_()
            out = stage(x)
            if stage.is_last:
                out = lm_loss(out, labels[i], num_tokens=num_tokens)
                total += out.detach()
            else:
                sent = out.detach().contiguous()
                pending.append((dist.isend(sent, dst=me + 1, group=group), sent))
            saved[i] = (x, out)
        elif a.kind == "B":
            x, out = saved.pop(i)
            if stage.is_last:
                torch.autograd.backward(out)
            else:
                grad = torch.empty(activation_shape, device=device)
                dist.recv(grad, src=me + 1, group=group)
                torch.autograd.backward(out, grad)
            if not stage.is_first:
                sent = x.grad.contiguous()
                pending.append((dist.isend(sent, dst=me - 1, group=group), sent))
    for work, _ in pending:
        work.wait()
    return total
"""
_SPLIT = _HEADER + """
import torch
import torch.nn.functional as F


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None

        def w(dy=dy, x=x):
            g = dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
            weight.grad = g if weight.grad is None else weight.grad + g

        ctx.store.push(w)
        return dx, None, db, None


def linear_split_backward(x, weight, bias, store):
    return _Split.apply(x, weight, bias, store)
"""


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


ONE_F_ONE_B, P2P, SIM = "1f1b: one rank's list", "stage_p2p: sends and receives", "simulate_bubble"
EXECUTOR, SPLIT = "run_pipeline_rank: the executor", "linear_split_backward: B and W"
CORRECT = {ONE_F_ONE_B: _1F1B, P2P: _P2P, SIM: _SIM, EXECUTOR: _EXECUTOR, SPLIT: _SPLIT}
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
    EXECUTOR: [
        _mutate(_EXECUTOR, "num_tokens=num_tokens)", "num_tokens=labels[i].numel())"),  # per micro-batch
        _mutate(_EXECUTOR, "    for a in actions:", "    for a in actions[:-1]:"),  # drops the last backward
        _mutate(_EXECUTOR, "                x.requires_grad_()\n", ""),  # the chain cut at the stage's input
    ],
    SPLIT: [
        _mutate(_mutate(_SPLIT, "        ctx.save_for_backward(x, weight)\n",
                        "        ctx.save_for_backward(x, weight)\n        weight.last_input = x\n"),
                "def w(dy=dy, x=x):", "def w(dy=dy, x=weight.last_input):"),  # the latest forward's input
        _mutate(_SPLIT, "        ctx.store.push(w)", "        w()"),  # dW computed in B: nothing deferred
        _mutate(_SPLIT, "weight.grad = g if weight.grad is None else weight.grad + g",
                "weight.grad = g"),  # each W overwrites the previous micro-batch's
    ],
}
