"""fp32 master weights for a model held in 16 bits (Micikevicius et al. 2018, section 3.1; chapter 05)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn


class MasterWeights:
    """An fp32 master copy of a model whose own weights are cast to ``dtype`` (Micikevicius et al. 2018).

    The model computes forward and backward in 16 bits; build the optimizer on ``master`` (an fp32
    twin of the model, tied weights kept tied); per step call ``copy_grads_to_master`` after backward
    and ``copy_master_to_model`` after the optimizer step. Updates too small for 16 bits (lr x grad
    below half a unit in the last place of the weight) accumulate in the master copy instead of vanishing.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.master = copy.deepcopy(model).float()
        model.to(dtype)
        self.dtype = dtype

    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """(fp32 master, 16-bit model) parameter pairs, tied parameters once."""
        return zip(self.master.parameters(), self.model.parameters(), strict=True)

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """master.grad = fp32(model.grad); the 16-bit gradients are freed."""
        for master, p in self.pairs():
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        for master, p in self.pairs():
            p.copy_(master)
