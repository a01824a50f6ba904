"""The optimizer of the course's runs: AdamW with decoupled weight decay and a warm-up + cosine schedule.

AdamW (Loshchilov & Hutter 2019) decays only matrices (2-D weights); biases, LayerNorm parameters and the
embeddings are left undecayed, as in GPT-2/nanoGPT. The learning rate is a pure function of the step
(linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``), so
a resumed run needs only the step to continue the schedule exactly (chapter 01, chapter 11).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from refimpl.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float,
                 named: Iterable[tuple[str, nn.Parameter]] | None = None) -> list[dict]:
    """Two groups: 2-D weights outside the embeddings decay, everything else does not. An embedding is a
    parameter of a module whose type is an embedding (``nn.Embedding``, a vocab-parallel one, Hugging
    Face's; any model) or one named so (``named``: the ``(name, parameter)`` pairs to sort, when the model's
    own names are not the plain GPT's: a pipeline stage's copy of a tied embedding is named
    ``output_layer.weight`` but is the embedding)."""
    tables = {id(p) for m in model.modules() if type(m).__name__.endswith("Embedding")
              for p in m.parameters(recurse=False)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in (model.named_parameters() if named is None else named):
        if not p.requires_grad:
            continue
        embedding = id(p) in tables or "embedding" in name
        (decay if p.ndim >= 2 and not embedding else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw_foreach(device: torch.device | str) -> bool:
    """AdamW's ``foreach`` for parameters on ``device``: True on CUDA, False elsewhere.

    On a GPU the per-tensor loop launches a dozen small kernels per parameter tensor and step (hundreds per
    step for the GPT), each a few microseconds of host time; ``foreach`` does the same element-wise
    arithmetic for a list of tensors per launch. On a CPU the per-tensor loop stays: it is what every
    one-device reference and equivalence test of the course compares with bitwise. Within a device every
    layout steps alike (an element's update reads only that element), so runs on one kind of device stay
    comparable with each other."""
    return torch.device(device).type == "cuda"


def _device_of(groups: list[dict]) -> torch.device:
    """The device of the first parameter in ``groups`` (the CPU when there is none)."""
    return next((p.device for g in groups for p in g["params"]), torch.device("cpu"))


def build_optimizer(model: nn.Module, config: OptimConfig,
                    named: Iterable[tuple[str, nn.Parameter]] | None = None) -> torch.optim.AdamW:
    """AdamW over ``param_groups``, ``foreach`` by the parameters' device (``adamw_foreach``)."""
    groups = param_groups(model, config.weight_decay, named)
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        foreach=adamw_foreach(_device_of(groups)),
    )


def lr_at(step: int, config: OptimConfig, total_steps: int) -> float:
    """lr(step): ``lr * (step + 1) / warmup`` in warm-up, then cosine from ``lr`` to ``min_lr_ratio * lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.min_lr_ratio * config.lr
    return floor + 0.5 * (config.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
