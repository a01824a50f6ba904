"""The course GPT cut into pipeline stages: what ``refimpl.models.GPT.pipeline_stages`` declares
(chapter 08).

Stage ``s`` of ``S = pp x v`` holds a contiguous run of blocks (``split_layers``, by
``refimpl.parallel.pipeline_parallel.split_blocks``); the first also the embedding, the last also the
final LayerNorm and the output layer, so that stage ``s`` computes ``[b, s_len, h] -> [b, s_len, h]`` (the
first takes token ids, the last returns logits). The embedding and the head count towards the first and
the last stage under ``balance="parameters"``.

Tied embeddings (the input embedding is the output layer's weight): with the first and the last stage on
different ranks each holds its own copy, equal at the start; after every backward the two ranks add their
gradients (``refimpl.parallel.pipeline_parallel.pipeline_communications.sync_tied_embeddings``), so
the copies take the same optimizer step and stay equal (Megatron's embedding group; Shoeybi et al. 2019).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from refimpl.parallel.pipeline_parallel import Balance, split_blocks, stage_rank, with_own_parameters
from refimpl.parallel.pipeline_parallel.schedules import Placement

if TYPE_CHECKING:
    from refimpl.models.gpt import GPT

__all__ = ["GPTStage", "build_stages", "split_layers"]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_layers(model: GPT, num_stages: int, *, balance: Balance = "layers") -> list[range]:
    """The blocks of each of ``num_stages`` stages, as contiguous ranges covering ``0 .. num_layers - 1``."""
    head = _numel(model.final_layernorm) + model.output_layer.weight.numel()  # a tied copy counts too
    return split_blocks([_numel(layer) for layer in model.layers], num_stages, balance=balance,
                        first_extra=_numel(model.embedding), last_extra=head)


class GPTStage(nn.Module):
    """Stage ``stage`` of ``num_stages``: the blocks ``layers`` of ``model`` (shared, not copied), with the
    embedding on the first stage and the final LayerNorm and output layer on the last. ``tied_copy``: the
    last stage's own copy of a tied embedding (another rank holds the first stage)."""

    def __init__(self, model: GPT, *, stage: int, num_stages: int, layers: range, copy_tied: bool) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.hidden_size = model.config.hidden_size  # the boundary activations' h
        # a tied embedding whose two ends live on different ranks: this stage holds one of them
        self.tied = model.config.tie_word_embeddings and copy_tied and (self.is_first or self.is_last)
        self.block_ids = layers
        self.embedding = model.embedding if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.final_layernorm = model.final_layernorm if self.is_last else None
        self.output_layer: nn.Module | None = None  # the model's Linear, or the last stage's copy of it
        self.tied_copy = False
        if self.is_last:
            self.output_layer = model.output_layer
            if model.config.tie_word_embeddings and copy_tied:
                self.output_layer = with_own_parameters(model.output_layer)
                self.tied_copy = True

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's end of a tied embedding another rank also holds (None otherwise): the first stage's
        word table, the last stage's copy of it."""
        if not self.tied:
            return None
        if self.is_first:
            assert self.embedding is not None  # the first stage holds the embedding
            return self.embedding.word_embeddings.weight
        assert self.output_layer is not None  # a tied stage that is not the first is the last
        return cast(torch.Tensor, self.output_layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)  # [b, s] -> [b, s, h]
        for layer in self.layers:
            x = layer(x)  # [b, s, h]
        if self.is_last:
            assert self.output_layer is not None and self.final_layernorm is not None  # the last stage's
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
        """This stage's parameter names -> the plain GPT's (``full_name``)."""
        return {name: self.full_name(name) for name, _ in self.named_parameters()}


def build_stages(model: GPT, *, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                 balance: Balance = "layers", placement: Placement = "loop") -> dict[int, GPTStage]:
    """The stages pipeline rank ``pp_rank`` holds (stage ``s`` lives on rank ``s % pp_size``, or under
    ZB-V's ``placement="v"`` on ``stage_rank(s, pp_size=pp_size, placement="v")``), by index. A tied
    embedding whose two ends share a rank (the V's rank 0) is the model's one tensor, no copy."""
    num_stages = pp_size * virtual_stages

    def rank(s: int) -> int:
        return stage_rank(s, pp_size=pp_size, placement=placement)

    ranges = split_layers(model, num_stages, balance=balance)
    last_elsewhere = rank(num_stages - 1) != rank(0)
    return {s: GPTStage(model, stage=s, num_stages=num_stages, layers=ranges[s], copy_tied=last_elsewhere)
            for s in range(num_stages) if rank(s) == pp_rank}
