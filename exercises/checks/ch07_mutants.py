"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 07's checks.

``exercises/checks/ch07.py`` re-exports both; tests/test_exercises.py grades every mutant (its task, and
only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole module
that takes refimpl's answers (``exercises/reference/ch07.py``) for the other tasks and replaces one name.
The right implementations are written here independently of refimpl (a learner's way: the weights
``e^(lse_i - max)`` rather than refimpl's sigmoid, ``torch.softmax`` and ``torch.logsumexp`` for a block),
and every mutant is that same code with one line changed (:func:`_mutate` insists that the line is there).
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


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


MERGE, SPLIT, STEP = "merge: the log-sum-exp rule", "zigzag_split: causal balance", "ring_attention_step"
CORRECT = {MERGE: _MERGE, SPLIT: _SPLIT, STEP: _STEP}
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
    ],
}
