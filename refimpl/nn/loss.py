"""The language-modelling loss every model and technique shares (chapter 01; ``num_tokens``: chapter 03)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["lm_loss"]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, num_tokens: int | None = None) -> torch.Tensor:
    """Next-token cross entropy, summed over tokens and divided by ``num_tokens``.

    ``num_tokens`` defaults to the tokens in this call (a plain mean). Under data parallelism and gradient
    accumulation pass the token count of the whole global batch, so that the sum of every rank's and
    every micro-batch's loss is exactly the mean over the global batch (chapter 03's trap).
    """
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")  # [b*s, v]
    return total / (labels.numel() if num_tokens is None else num_tokens)
