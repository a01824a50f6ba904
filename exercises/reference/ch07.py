"""refimpl's answers to the exercises of chapter 07, under the exercise's names and signatures.

The merge and the split are refimpl's own functions; one ring step is refimpl's block attention and merge,
as :func:`refimpl.parallel.context_parallel.ring_attention.ring_attention` composes them for each (query
chunk, key chunk) pair it does not skip. The grader's self-test grades this module and expects full marks
(tests/test_exercises.py).
"""

from __future__ import annotations

import torch

from refimpl.parallel.context_parallel.ring_attention import (
    block_attention,
    merge_partial_attention,
    zigzag_split,
)

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


__all__ = ["merge_partial_attention", "ring_attention_step", "zigzag_split"]
