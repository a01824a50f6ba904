"""refimpl's GPT cut into pipeline stages (chapter 08).

Stage ``s`` of ``S = pp x v`` holds a contiguous run of blocks; the first also the embedding, the last also
the final LayerNorm and the output layer, so that stage ``s`` computes ``[b, s_len, h] -> [b, s_len, h]``
(the first takes token ids, the last returns logits). :func:`split_layers` cuts the blocks either into equal
counts (``balance="layers"``, the earlier stages taking the remainder) or so that the largest stage holds
the fewest parameters (``balance="parameters"``: the embedding and the head count towards the first and the
last stage; an exact min-max partition over contiguous runs).

Tied embeddings (the input embedding is the output layer's weight): with the first and the last stage on
different ranks each holds its own copy, equal at the start; after every backward the two ranks add their
gradients (:func:`~refimpl.parallel.pipeline_parallel.pipeline_communications.sync_tied_embeddings`), so
the copies take the same optimizer step and stay equal (Megatron's embedding group; Shoeybi et al. 2019).
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn

from refimpl.models import GPT
from refimpl.parallel.pipeline_parallel.schedules import stage_rank

__all__ = ["GPTStage", "build_stages", "split_layers"]

Balance = Literal["layers", "parameters"]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_layers(model: GPT, num_stages: int, *, balance: Balance = "layers") -> list[range]:
    """The blocks of each of ``num_stages`` stages, as contiguous ranges covering ``0 .. num_layers - 1``."""
    n = len(model.layers)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if n < num_stages:
        raise ValueError(f"{n} transformer blocks cannot fill {num_stages} pipeline stages (each stage needs "
                         "at least one block): use fewer stages or more --num-layers")
    if balance == "layers":
        base, extra = divmod(n, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    elif balance == "parameters":
        sizes = _min_max_partition(model, num_stages)
    else:
        raise ValueError(f"balance must be 'layers' or 'parameters', got {balance!r}")
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + k) for a, k in zip(starts, sizes, strict=True)]


def _min_max_partition(model: GPT, num_stages: int) -> list[int]:
    """Block counts per stage minimising the largest stage's parameters (dynamic programming)."""
    block = [_numel(layer) for layer in model.layers]
    head = _numel(model.final_layernorm) + model.output_layer.weight.numel()  # a tied copy counts too
    first, n, inf = _numel(model.embedding), len(block), float("inf")

    def cost(s: int, a: int, b: int) -> float:  # stage s holding blocks a .. b-1
        return sum(block[a:b]) + (first if s == 0 else 0) + (head if s == num_stages - 1 else 0)

    best = {(0, 0): (0.0, [])}  # (stages filled, blocks used) -> (max so far, sizes)
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


class GPTStage(nn.Module):
    """Stage ``stage`` of ``num_stages``: the blocks ``layers`` of ``model`` (shared, not copied), with the
    embedding on the first stage and the final LayerNorm and output layer on the last. ``tied_copy``: the
    last stage's own copy of a tied embedding (another rank holds the first stage)."""

    def __init__(self, model: GPT, *, stage: int, num_stages: int, layers: range, copy_tied: bool) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.block_ids = layers
        self.embedding = model.embedding if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.final_layernorm = model.final_layernorm if self.is_last else None
        self.output_layer = None
        self.tied_copy = False
        if self.is_last:
            self.output_layer = model.output_layer
            if model.config.tie_word_embeddings and copy_tied:
                self.output_layer = _with_own_parameters(model.output_layer)
                self.tied_copy = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)  # [b, s] -> [b, s, h]
        for layer in self.layers:
            x = layer(x)  # [b, s, h]
        if self.is_last:
            x = self.output_layer(self.final_layernorm(x))  # [b, s, v]
        return x

    def full_name(self, name: str) -> str:
        """A tensor's name in this stage -> in the plain GPT (``layers.0`` of stage 2 is ``layers.k``; the
        last stage's copy of a tied embedding, ``output_layer.weight`` or under tensor parallelism
        ``output_layer.embedding.weight``, is ``embedding.word_embeddings.weight``)."""
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            return f"layers.{self.block_ids[int(i)]}.{rest}"
        if self.tied_copy and name in ("output_layer.weight", "output_layer.embedding.weight"):
            return "embedding.word_embeddings.weight"  # the tied weight's one name in the GPT
        return name

    def full_names(self) -> dict[str, str]:
        """This stage's parameter names -> the plain GPT's (:meth:`full_name`)."""
        return {name: self.full_name(name) for name, _ in self.named_parameters()}


def _with_own_parameters(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (and of its submodules) holding clones of its parameters: the last
    stage's own copy of a tied output layer (``nn.Linear``, or under tensor parallelism the tied
    vocab-parallel head and its embedding shard), equal to the original at the start."""
    new = copy.copy(module)
    new._parameters = {n: None if p is None else nn.Parameter(p.detach().clone(), p.requires_grad)
                       for n, p in module._parameters.items()}
    new._buffers = dict(module._buffers)
    new._modules = {n: None if m is None else _with_own_parameters(m) for n, m in module._modules.items()}
    return new


def build_stages(model: GPT, *, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                 balance: Balance = "layers") -> dict[int, GPTStage]:
    """The stages pipeline rank ``pp_rank`` holds (stage ``s`` lives on rank ``s % pp_size``), by index."""
    num_stages = pp_size * virtual_stages
    ranges = split_layers(model, num_stages, balance=balance)
    last_elsewhere = stage_rank(num_stages - 1, pp_size=pp_size) != stage_rank(0, pp_size=pp_size)
    return {s: GPTStage(model, stage=s, num_stages=num_stages, layers=ranges[s], copy_tied=last_elsewhere)
            for s in range(num_stages) if stage_rank(s, pp_size=pp_size) == pp_rank}
