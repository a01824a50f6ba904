"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 07's checks.

``exercises/checks/ch07.py`` re-exports both; tests/course/cli/test_exercises.py grades every mutant (its
task, and only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole
module that takes refimpl's answers (``exercises/reference/ch07.py``) for the other tasks and replaces one
name. The right implementations are written here independently of refimpl (a learner's way: the weights
``e^(lse_i - max)`` rather than refimpl's sigmoid, ``torch.softmax`` and ``torch.logsumexp`` for a block),
and every mutant is that same code with one line changed (``_mutate`` insists that the line is there).
"""

from __future__ import annotations

_HEADER = "from exercises.reference.ch07 import *  # noqa: F403\nimport torch\n"
_MERGE = _HEADER + """
def merge_partial_attention(out1, lse1, out2, lse2):
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    out = (w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2) / total.unsqueeze(-1)
    return out, m + torch.log(total)
"""
_SPLIT = _HEADER + """
def zigzag_split(x, *, dim, cp_rank, cp_size):
    n = 2 * cp_size
    if x.shape[dim] % n:
        raise ValueError(f"length {x.shape[dim]} does not divide into {n} chunks")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[n - 1 - cp_rank]], dim=dim)
"""
_STEP = _HEADER + """
def ring_attention_step(q, k, v, out, lse, *, position, scale):
    if position not in ("diagonal", "past", "future"):
        raise ValueError(f"unknown position {position!r}")
    if position == "future":
        return out, lse
    s = q @ k.transpose(-2, -1) * scale
    if position == "diagonal":
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1), float("-inf"))
    block_lse = torch.logsumexp(s, dim=-1)
    block_out = torch.softmax(s, dim=-1) @ v
    m = torch.maximum(lse, block_lse)
    w1, w2 = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w1 + w2
    new = (w1.unsqueeze(-1) * out + w2.unsqueeze(-1) * block_out) / total.unsqueeze(-1)
    return new, m + torch.log(total)
"""

_EXCHANGE = _HEADER + """import torch.distributed as dist
from refimpl.comm import ops


def _exchange(tensors, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    right, left = (dist.get_global_rank(group, (r + i) % n) for i in (1, -1))
    got = [torch.empty_like(t) for t in tensors]
    works = [ops.isend(t.contiguous(), dst=right, group=group) for t in tensors]
    works += [ops.irecv(g, src=left, group=group) for g in got]
    for w in works:
        w.wait()
    return got


def _masked_scores(q, k, diagonal):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s
"""
_RING = _EXCHANGE + """

def ring_attention_forward(q, k, v, *, group, causal):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))
    for step in range(n):
        src = (r - step) % n
        if not causal or src <= r:
            s = _masked_scores(q, k, causal and src == r)
            block_lse = torch.logsumexp(s, dim=-1)
            m = torch.maximum(lse, block_lse)
            w1, w2 = torch.exp(lse - m).unsqueeze(-1), torch.exp(block_lse - m).unsqueeze(-1)
            out = (w1 * out + w2 * (torch.softmax(s, dim=-1) @ v)) / (w1 + w2)
            lse = m + torch.log(w1 + w2).squeeze(-1)
        if step < n - 1:
            k, v = _exchange([k, v], group)
    return out
"""
_RING_BACKWARD = _EXCHANGE + """

def ring_attention_backward(do, q, k, v, out, lse, *, group, causal):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5
    delta = (do * out).sum(-1, keepdim=True)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for step in range(n):
        src = (r - step) % n
        if not causal or src <= r:
            p = torch.exp(_masked_scores(q, k, causal and src == r) - lse.unsqueeze(-1))
            ds = p * (do @ v.transpose(-2, -1) - delta)
            dq = dq + ds @ k * scale
            dk = dk + ds.transpose(-2, -1) @ q * scale
            dv = dv + p.transpose(-2, -1) @ do
        if n > 1:
            k, v, dk, dv = _exchange([k, v, dk, dv], group)
    return dq, dk, dv
"""
_ULYSSES = _HEADER + """import torch.distributed as dist
from refimpl.comm import ops


def sequence_to_heads(x, group):
    n = dist.get_world_size(group)
    b, a, c, d = x.shape
    if a % n:
        raise ValueError(f"{a} heads do not divide by {n} ranks")
    send = x.reshape(b, n, a // n, c, d).transpose(0, 1).contiguous()
    got = torch.empty_like(send)
    ops.all_to_all_single(got, send, group=group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, a // n, n * c, d)


def heads_to_sequence(x, group):
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    if s % n:
        raise ValueError(f"{s} tokens do not divide by {n} ranks")
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    ops.all_to_all_single(got, send, group=group)
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)
"""


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


MERGE, SPLIT, STEP = "merge: the log-sum-exp rule", "zigzag_split: causal balance", "ring_attention_step"
RING, RING_BACKWARD, ULYSSES = ("ring forward on ranks", "ring backward on ranks",
                                "Ulysses: sequence <-> heads")
CORRECT = {MERGE: _MERGE, SPLIT: _SPLIT, STEP: _STEP, RING: _RING, RING_BACKWARD: _RING_BACKWARD,
           ULYSSES: _ULYSSES}
MUTANTS = {
    MERGE: [
        _mutate(_MERGE, "out = (w1.unsqueeze(-1) * out1 + w2.unsqueeze(-1) * out2) / total.unsqueeze(-1)",
                "out = (out1 + out2) / 2"),  # averages the outputs (the lse right)
        _mutate(_MERGE, "m = torch.maximum(lse1, lse2)", "m = torch.zeros_like(lse1)"),  # e^lse overflows
        _mutate(_MERGE, "return out, m + torch.log(total)", "return out, m"),  # keeps the larger lse
    ],
    SPLIT: [
        _mutate(_SPLIT, "    chunks = x.chunk(n, dim=dim)\n    return torch.cat([chunks[cp_rank], "
                        "chunks[n - 1 - cp_rank]], dim=dim)\n",
                "    return x.chunk(cp_size, dim=dim)[cp_rank]\n"),  # the contiguous split
        _mutate(_SPLIT, "chunks[n - 1 - cp_rank]", "chunks[cp_size + cp_rank]"),  # i and cp + i: unbalanced
        _mutate(_SPLIT, "if x.shape[dim] % n:", "if x.shape[dim] % cp_size:"),  # misses 2 cp
    ],
    STEP: [
        _mutate(_STEP, "s = s.masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1), float(\"-inf\"))",
                "pass"),  # forgets the diagonal block's mask
        _mutate(_STEP, ".triu(1)", ".tril(-1)"),  # masks the past instead of the future
        _mutate(_STEP, "    if position == \"future\":\n        return out, lse\n", ""),  # future as past
        _mutate(_STEP, "new = (w1.unsqueeze(-1) * out + w2.unsqueeze(-1) * block_out) / total.unsqueeze(-1)",
                "new = torch.where(torch.isinf(lse).unsqueeze(-1), block_out, (out + block_out) / 2)"),
        # ^ merges without the lse: every block weighs the same
        _mutate(_STEP, "    block_lse = torch.logsumexp(s, dim=-1)\n"
                       "    block_out = torch.softmax(s, dim=-1) @ v\n",
                "    e = torch.exp(s)\n    block_lse = torch.log(e.sum(-1))\n"
                "    block_out = e @ v / e.sum(-1, keepdim=True)\n"),  # no max subtracted: e^S overflows
    ],
    RING: [
        _mutate(_RING, "src = (r - step) % n", "src = (r + step) % n"),  # the wrong block's positions
        _mutate(_RING, "if step < n - 1:\n            k, v", "if step < n - 2:\n            k, v"),
        # ^ stops a hop early: one rank's keys never arrive
    ],
    RING_BACKWARD: [
        _mutate(_RING_BACKWARD, "delta = (do * out).sum(-1, keepdim=True)",
                "delta = torch.zeros_like(lse).unsqueeze(-1)"),  # forgets the softmax's rowsum(dO * O)
        _mutate(_RING_BACKWARD, "k, v, dk, dv = _exchange([k, v, dk, dv], group)",
                "k, v = _exchange([k, v], group)"),  # dK/dV stay put: every block's share summed together
    ],
    ULYSSES: [
        _mutate(_ULYSSES, "send = x.reshape(b, n, a // n, c, d).transpose(0, 1).contiguous()",
                "send = x.reshape(b, a // n, n, c, d).permute(2, 0, 1, 3, 4).contiguous()"),
        # ^ heads dealt round-robin (head h to rank h mod n), not in blocks
        _mutate(_ULYSSES, "return got.transpose(0, 1).reshape(b, n * h, s // n, d)",
                "return got.permute(1, 2, 0, 3, 4).reshape(b, n * h, s // n, d)"),  # heads interleaved back
    ],
}
