"""Pipeline stages, generically (chapter 08): how blocks are cut into stages, and what a stage declares.

Stage ``s`` of ``S = pp x v`` holds a contiguous run of blocks (the first also what comes before them, the
last also what comes after). ``split_blocks`` cuts ``n`` blocks either into equal counts
(``balance="layers"``, the earlier stages taking the remainder) or so that the largest stage holds the
fewest parameters (``balance="parameters"``: ``first_extra`` and ``last_extra``, e.g. the embedding and the
head, count towards the first and the last stage; an exact min-max partition over contiguous runs, by
dynamic programming). A model declares its stages (``pipeline_stages``,
``refimpl.parallel.declarations``); each stage module is ``[b, s, h] -> [b, s, h]`` (the first takes
token ids, the last returns logits) and carries:

* ``is_first`` / ``is_last``, and ``hidden_size``, the ``h`` of the activations it sends and receives;
* ``full_name(name)``: a tensor's name in the stage -> in the whole model (checkpoints and placements see
  the whole model's names, so a checkpoint written at one ``pp`` loads at another);
* ``tied_weight()``: its end of a weight another stage also holds (a tied embedding: the first stage's
  table and the last stage's own copy, ``with_own_parameters``, equal at the start; after every
  backward the two ranks add their gradients, Megatron's embedding group), None when it holds none, and
  ``tied_copy``: whether that end is the copy (the first stage's counts the tensor once).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal, Protocol, cast

import torch
from torch import nn

__all__ = ["Balance", "PipelineStage", "as_stage", "split_blocks", "with_own_parameters"]

Balance = Literal["layers", "parameters"]


class PipelineStage(Protocol):
    """What a stage module carries besides being an ``nn.Module`` (module docstring)."""

    is_first: bool
    is_last: bool
    hidden_size: int
    tied_copy: bool

    def tied_weight(self) -> torch.Tensor | None: ...

    def full_name(self, name: str) -> str: ...


def as_stage(module: nn.Module) -> PipelineStage:
    """``module``, a stage, read through what a stage carries (not checked: a stage without a member fails
    where the member is read)."""
    return cast(PipelineStage, module)


def split_blocks(block_numels: Sequence[int], num_stages: int, *, balance: Balance = "layers",
                 first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """The blocks of each of ``num_stages`` stages, as contiguous ranges covering ``0 .. n - 1``
    (``block_numels``: each block's parameter count; module docstring)."""
    n = len(block_numels)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if n < num_stages:
        raise ValueError(f"{n} transformer blocks cannot fill {num_stages} pipeline stages (each stage needs "
                         "at least one block): use fewer stages or more --num-layers")
    if balance == "layers":
        base, extra = divmod(n, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    elif balance == "parameters":
        sizes = _min_max_partition(list(block_numels), num_stages, first_extra, last_extra)
    else:
        raise ValueError(f"balance must be 'layers' or 'parameters', got {balance!r}")
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + k) for a, k in zip(starts, sizes, strict=True)]


def _min_max_partition(block: list[int], num_stages: int, first: int, head: int) -> list[int]:
    """Block counts per stage minimising the largest stage's parameters (dynamic programming)."""
    n, inf = len(block), float("inf")

    def cost(s: int, a: int, b: int) -> float:  # stage s holding blocks a .. b-1
        return sum(block[a:b]) + (first if s == 0 else 0) + (head if s == num_stages - 1 else 0)

    # (stages filled, blocks used) -> (max so far, sizes)
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0.0, [])}
    for s in range(num_stages):
        nxt: dict[tuple[int, int], tuple[float, list[int]]] = {}
        for (_, used), (worst, sizes) in best.items():
            left = num_stages - s - 1
            for b in range(used + 1, n - left + 1):
                cand = (max(worst, cost(s, used, b)), [*sizes, b - used])
                if cand[0] < nxt.get((s + 1, b), (inf, []))[0]:
                    nxt[(s + 1, b)] = cand
        best = nxt
    return best[(num_stages, n)][1]


def with_own_parameters(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (and of its submodules) holding clones of its parameters: the last
    stage's own copy of a tied output layer (``nn.Linear``, or under tensor parallelism the tied
    vocab-parallel head and its embedding shard), equal to the original at the start."""
    new = copy.copy(module)
    new._parameters = {n: None if p is None else nn.Parameter(p.detach().clone(), p.requires_grad)
                       for n, p in module._parameters.items()}
    new._buffers = dict(module._buffers)
    new._modules = {n: None if m is None else with_own_parameters(m) for n, m in module._modules.items()}
    return new
