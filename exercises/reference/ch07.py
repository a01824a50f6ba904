"""refimpl's answers to the exercises of chapter 07, under the exercise's names and signatures.

The merge and the split are refimpl's own functions; one ring step is refimpl's block attention and merge,
as ``refimpl.parallel.context_parallel.ring_attention.ring_attention`` composes them for each (query
chunk, key chunk) pair it does not skip. The ring forward and backward are refimpl's ``ring_attention``
(contiguous layout) and its autograd backward ring; Ulysses' all-to-alls are refimpl's. The grader's
self-test grades this module and expects full marks (tests/course/cli/test_exercises.py).
"""

from __future__ import annotations

import torch

from refimpl.parallel.context_parallel.ring_attention import (
    block_attention,
    merge_partial_attention,
    ring_attention,
)
from refimpl.parallel.context_parallel.sequence_layout import zigzag_split
from refimpl.parallel.context_parallel.ulysses import heads_to_sequence, sequence_to_heads

POSITIONS = ("diagonal", "past", "future")


def ring_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, *, position: str,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's attention (masked on the diagonal, skipped in the future) merged into ``(out, lse)``."""
    if position not in POSITIONS:
        raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
    if position == "future":
        return out, lse
    block_out, block_lse = block_attention(q, k, v, scale=scale, diagonal=position == "diagonal")
    return merge_partial_attention(out, lse, block_out, block_lse)


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                           causal: bool) -> torch.Tensor:
    """refimpl's ring attention on the contiguous split (rank ``r`` holds chunk ``r``)."""
    return ring_attention(q, k, v, cp_group=group, causal=causal, layout="contiguous")


def ring_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, *, group,
                            causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """refimpl's backward ring, reached through autograd (its forward ring run again for the saved state)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mine = ring_attention(q, k, v, cp_group=group, causal=causal, layout="contiguous")
    dq, dk, dv = torch.autograd.grad(mine, (q, k, v), do)
    return dq, dk, dv


__all__ = ["heads_to_sequence", "merge_partial_attention", "ring_attention_backward",
           "ring_attention_forward", "ring_attention_step", "sequence_to_heads", "zigzag_split"]
