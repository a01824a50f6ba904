"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 09's checks.

``exercises/checks/ch09.py`` re-exports both; tests/course/cli/test_exercises.py grades every mutant (its
task, and only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole
module that takes refimpl's answers (``exercises/reference/ch09.py``) for the other tasks and replaces its
task's names. The right implementations are written here independently of refimpl (a learner's way: loops over
experts and over ``k``, ``nonzero`` and ``argsort`` instead of refimpl's scatter and ``bincount`` tricks),
and every mutant is that same code with one line changed (``_mutate`` insists that the line is there).
"""

from __future__ import annotations

_HEADER = "from exercises.reference.ch09 import *  # noqa: F403\nimport math\nimport torch\n"
_BALANCE = _HEADER + """
def load_balancing_loss(scores, expert_ids, coeff, score_func):
    t, e = scores.shape
    if coeff == 0 or t == 0:
        return scores.new_zeros(())
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = torch.stack([(expert_ids == i).sum() for i in range(e)]).to(scores.dtype) / expert_ids.numel()
    p = probs.mean(0)
    return coeff * e * (f * p).sum()
"""
_CAPACITY = _HEADER + """
def expert_capacity(num_tokens, top_k, num_experts, capacity_factor):
    if capacity_factor is None:
        return None
    return math.ceil(top_k * num_tokens / num_experts * capacity_factor)


def capacity_keep(expert_ids, scores, capacity):
    keep = torch.ones_like(expert_ids, dtype=torch.bool)
    if capacity is None:
        return keep
    for i in range(scores.shape[1]):
        tokens, slots = torch.nonzero(expert_ids == i, as_tuple=True)   # in token order
        if tokens.numel() <= capacity:
            continue
        ranked = torch.argsort(scores[tokens, i].detach(), descending=True, stable=True)
        dropped = ranked[capacity:]
        keep[tokens[dropped], slots[dropped]] = False
    return keep
"""
_DISPATCH = _HEADER + """
def sort_by_expert(expert_ids, num_experts):
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    if bool((flat >= num_experts).any()):
        raise ValueError(f"an expert id is >= num_experts = {num_experts}")
    kept = torch.nonzero(flat >= 0).flatten()                 # assignment ids, increasing
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.stack([(flat == i).sum() for i in range(num_experts)]) if num_experts else flat[:0]
    return SortPlan(order=order, counts=counts.long(), top_k=k, num_tokens=t)


def combine(y, weights, plan):
    dt = torch.promote_types(y.dtype, torch.float32)
    rows = torch.zeros(plan.num_tokens * plan.top_k, y.shape[-1], dtype=dt, device=y.device)
    rows = rows.index_copy(0, plan.order, y.to(dt)).view(plan.num_tokens, plan.top_k, -1)
    out = torch.zeros(plan.num_tokens, y.shape[-1], dtype=dt, device=y.device)
    for j in range(plan.top_k):
        out = out + weights[:, j:j + 1].to(dt) * rows[:, j]
    return out
"""
_ALLTOALL = _HEADER + """
def rank_splits(counts, num_ranks):
    e = counts.numel()
    if e % num_ranks:
        raise ValueError(f"{e} experts do not divide over {num_ranks} ranks")
    per = e // num_ranks
    return [int(counts[r * per:(r + 1) * per].sum()) for r in range(num_ranks)]


def expert_major_order(recv):
    n, local = recv.shape
    sizes = recv.flatten().tolist()                           # block (q, j) is number q * local + j
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    idx = []
    for j in range(local):
        for q in range(n):
            s = starts[q * local + j]
            idx.extend(range(s, s + sizes[q * local + j]))
    return torch.tensor(idx, dtype=torch.long)
"""
_ROUTER = _HEADER + """
def route(x, gate, top_k, *, score_func, normalize_topk=None, expert_bias=None):
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x.to(dt) @ gate.weight.to(dt).t()
    if gate.bias is not None:
        logits = logits + gate.bias.to(dt)
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    select = scores.detach()
    if expert_bias is not None:
        select = select + expert_bias
    expert_ids = torch.argsort(select, dim=-1, descending=True)[:, :top_k]
    weights = torch.gather(scores, 1, expert_ids)
    renormalise = top_k > 1 if normalize_topk is None else normalize_topk
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights, scores


def update_expert_bias(bias, load, rate):
    load = load.to(torch.float32)
    return bias - rate * torch.sign(load - load.mean())
"""
_EXCHANGE = _HEADER + """import torch.distributed as dist
from refimpl.comm import ops


def exchange_counts(counts, group):
    n = dist.get_world_size(group)
    if counts.numel() % n:
        raise ValueError(f"{counts.numel()} experts do not divide over {n} ranks")
    send = counts.reshape(n, -1).contiguous()     # row q: the counts of rank q's experts
    if n == 1:
        return send.clone()
    recv = torch.empty_like(send)
    ops.all_to_all_single(recv, send, group=group)
    return recv


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    ops.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, dy):
        dx = _all_to_all(dy, ctx.input_splits, ctx.output_splits, ctx.group)
        return dx, None, None, None


def all_to_all_tokens(x, output_splits, input_splits, group):
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)
"""
_EXPERT_GRADS = _HEADER + """import torch.distributed as dist
from refimpl.comm import ops


def reduce_expert_gradients(grads, *, edp_group, ep_group):
    edp = dist.get_world_size(edp_group)
    n = edp * dist.get_world_size(ep_group)       # dp x cp
    for g in grads:
        if edp > 1:
            ops.all_reduce(g, group=edp_group)
        g.div_(n)
"""


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


BALANCE = "load_balancing_loss: alpha E sum f P"
CAPACITY = "capacity: C slots, lowest scores dropped"
DISPATCH = "sort_by_expert and combine"
ALLTOALL = "all-to-all: splits, expert-major order"
ROUTER = "router: top-k, renormalisation, bias"
EXCHANGE = "count exchange, uneven all-to-all"
EXPERT_GRADS = "expert gradients: sum over edp / dp cp"
CORRECT = {BALANCE: _BALANCE, CAPACITY: _CAPACITY, DISPATCH: _DISPATCH, ALLTOALL: _ALLTOALL, ROUTER: _ROUTER,
           EXCHANGE: _EXCHANGE, EXPERT_GRADS: _EXPERT_GRADS}
MUTANTS = {
    BALANCE: [
        _mutate(_BALANCE, "return coeff * e * (f * p).sum()", "return coeff * (f * p).sum()"),  # no factor E
        _mutate(_BALANCE, "/ expert_ids.numel()", "/ t"),  # f counts tokens: k times too large
        _mutate(_BALANCE, 'probs = scores if score_func == "softmax" else scores / scores.sum(-1, '
                          'keepdim=True)',
                "probs = scores"),  # sigmoid scores used as probabilities
    ],
    CAPACITY: [
        _mutate(_CAPACITY, "return math.ceil(", "return math.floor("),  # too few slots
        _mutate(_CAPACITY, "ranked = torch.argsort(scores[tokens, i].detach(), descending=True, stable=True)",
                "ranked = torch.arange(tokens.numel())"),  # first come, first served
        _mutate(_CAPACITY, "descending=True, stable=True)", "descending=True)"),  # ties in any order
    ],
    DISPATCH: [
        _mutate(_DISPATCH, "order = kept[torch.argsort(flat[kept], stable=True)]",
                "order = torch.argsort(flat, stable=True)"),  # the dropped (-1) assignments sorted first
        _mutate(_DISPATCH, "rows = rows.index_copy(0, plan.order, y.to(dt))",
                "rows = rows.index_copy(0, torch.arange(plan.order.numel()), y.to(dt)[plan.order])"),
        # ^ reads plan.order as "which row comes here" (a gather), not "where this row goes"
        _mutate(_DISPATCH, "out = out + weights[:, j:j + 1].to(dt) * rows[:, j]",
                "out = out + (weights[:, j:j + 1].to(y.dtype) * rows[:, j].to(y.dtype)).to(dt)"),
        # ^ weighs in the experts' dtype (bf16), only the sum in fp32
    ],
    ALLTOALL: [
        _mutate(_ALLTOALL, "return [int(counts[r * per:(r + 1) * per].sum()) for r in range(num_ranks)]",
                "return [int(counts[r::num_ranks].sum()) for r in "
                "range(num_ranks)]"),  # experts dealt round-robin
        _mutate(_ALLTOALL, "    for j in range(local):\n        for q in range(n):\n",
                "    for q in range(n):\n        for j in range(local):\n"),  # keeps the rank-major order
    ],
    ROUTER: [
        _mutate(_ROUTER, "renormalise = top_k > 1 if normalize_topk is None",
                "renormalise = True if normalize_topk is None"),  # always: k = 1 weights all 1, no gradient
        _mutate(_ROUTER, "weights = torch.gather(scores, 1, expert_ids)",
                "weights = torch.gather(scores if expert_bias is None else scores + expert_bias, 1, "
                "expert_ids)"),  # the bias added to the combine weights
        _mutate(_ROUTER, "        select = select + expert_bias\n", "        pass\n"),  # the bias ignored
        _mutate(_ROUTER, "dt = torch.float64 if x.dtype == torch.float64 else torch.float32",
                "dt = x.dtype"),  # bf16 logits for bf16 tokens
        _mutate(_ROUTER, "return bias - rate * torch.sign(load - load.mean())",
                "return bias + rate * torch.sign(load - load.mean())"),  # the wrong sign: busier still
    ],
    EXCHANGE: [
        _mutate(_EXCHANGE, "    recv = torch.empty_like(send)\n"
                           "    ops.all_to_all_single(recv, send, group=group)\n    return recv\n",
                "    return send.clone()\n"),  # counts not exchanged: assumes every rank routes alike
        _mutate(_EXCHANGE, "dx = _all_to_all(dy, ctx.input_splits, ctx.output_splits, ctx.group)",
                "dx = _all_to_all(dy, ctx.output_splits, ctx.input_splits, ctx.group)"),  # forward's splits
        _mutate(_EXCHANGE, "dx = _all_to_all(dy, ctx.input_splits, ctx.output_splits, ctx.group)",
                "dx = dy"),  # the gradient not routed back (kept where it arrived)
        _mutate(_EXCHANGE, "return _AllToAll.apply(x, list(output_splits), list(input_splits), group)",
                "return _all_to_all(x, output_splits, input_splits, group)"),  # no autograd: the graph cut
    ],
    EXPERT_GRADS: [
        _mutate(_EXPERT_GRADS, "n = edp * dist.get_world_size(ep_group)", "n = edp"),  # the mean over edp
        _mutate(_EXPERT_GRADS, "        g.div_(n)\n", ""),  # summed, not divided
        _mutate(_EXPERT_GRADS, "n = edp * dist.get_world_size(ep_group)",
                "n = dist.get_world_size()"),  # the world size: tp ranks counted as token shards
    ],
}
