"""The course GPT's tensor-parallel plan: what :meth:`refimpl.models.GPT.tensor_parallel_plan` declares
(chapter 06; torchtitan's ``models/llama3/sharding.py`` is the pattern).

Shoeybi et al. 2019, "Megatron-LM" (section 3, figure 3); Korthikanti et al. 2022 (sequence parallelism,
figure 5). On ``t`` ranks:

* **attention, heads split**: ``query_key_value`` column-parallel, ``dense`` row-parallel; the block keeps its
  forward and sees ``a/t`` heads (it infers them from the width). The fused weight is in Megatron's per-head
  layout (:class:`refimpl.models.CausalSelfAttention`: rows ``[3d i, 3d (i+1))`` are head ``i``'s q, k and v),
  so rank ``r``'s contiguous block of ``3h/t`` rows is q, k and v of heads ``[r a/t, (r+1) a/t)``: one chunk.
  With grouped-query attention the rows are grouped by key/value head (its ``a/g`` query heads, its k, its v),
  so the block is ``g/t`` whole groups: ``t`` must divide ``g`` (fewer key/value heads than ranks is refused:
  the support table says why). (In nanoGPT's ``[3, a, d]`` layout the same rows are all of q and part of k:
  the fused-qkv trap of the chapter; ``ColwiseParallel(chunks=3)`` is that layout's plan.)
* **MLP**: ``dense_h_to_4h`` column-parallel, GELU on the local ``4h/t`` features (SwiGLU: its rows
  interleave gate and up, so the block holds both halves of ``f/t`` features), ``dense_4h_to_h``
  row-parallel. An MoE block's MLP is left whole: every tp rank routes the same tokens to the same
  experts (chapter 09).
* **vocabulary**: the word embedding vocab-parallel inside :class:`VocabParallelGPTEmbedding` (which adds
  the replicated position embeddings); the output layer tied to it (the same shard) or, untied,
  column-parallel ``[V/t, h]``; both return the logits shard ``[b, s, V/t]``.
* **sequence parallelism**: the column layers all-gather their ``[b, s/t, h]`` input, the row layers
  reduce-scatter their output, the embedding reduce-scatters its lookups into the sequence shard and the
  LayerNorms run on ``s/t`` tokens (:class:`~refimpl.parallel.tensor_parallel.SequenceParallel`: their
  gradients summed over tp).

Sizes that do not divide by ``t`` (heads, ``ffn_hidden_size``) are a one-line ``ValueError`` naming the
size; a vocabulary that does not divide is one too unless ``pad_vocab=True`` with tied embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from refimpl.parallel.tensor_parallel import (
    ColwiseParallel,
    ParamSplit,
    RowwiseParallel,
    SequenceParallel,
    TiedVocabParallelOutput,
    VocabParallelEmbedding,
)
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_size

if TYPE_CHECKING:
    from refimpl.models.gpt import GPT

__all__ = ["GPTEmbeddingParallel", "VocabParallelGPTEmbedding", "gpt_tensor_parallel_plan"]


class VocabParallelGPTEmbedding(nn.Module):
    """Token (vocab-parallel) plus position (replicated) embedding, ``[b, s] -> [b, s, h]``; under sequence
    parallelism the token lookups are reduce-scattered along the sequence and the shard's positions added,
    ``[b, s] -> [b, s/t, h]`` (backward: one all-gather), as :class:`VocabParallelEmbedding` with
    ``reduce_scatter_embeddings`` does: the output is the shard itself, no view of a whole ``[b, s, h]``."""

    def __init__(self, word_embeddings: VocabParallelEmbedding, position_embeddings: nn.Embedding | None, *,
                 sequence_parallel: bool) -> None:
        super().__init__()
        if word_embeddings.reduce_scatter_embeddings != sequence_parallel:
            raise ValueError("the word embeddings reduce-scatter exactly under sequence parallelism: build "
                             "them with reduce_scatter_embeddings=sequence_parallel")
        self.word_embeddings, self.position_embeddings = word_embeddings, position_embeddings
        self.sequence_parallel = sequence_parallel

    @staticmethod
    def position_ids(seq_len: int, device: torch.device) -> torch.Tensor:
        """``[0, seq_len)``; context parallelism (chapter 07) replaces it on the instance."""
        return torch.arange(seq_len, device=device)  # [s]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h] (SP: [b, s/t, h])
        if self.position_embeddings is None:  # RoPE: the attention rotates q and k instead
            return self.word_embeddings(input_ids)
        positions = self.position_ids(input_ids.shape[1], input_ids.device)  # [s]
        return self.word_embeddings(input_ids, self.position_embeddings(positions))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTEmbeddingParallel:
    """The GPT's own style for its ``Embedding``: the word table vocab-parallel, the positions replicated
    and added to the (sequence-parallel: reduce-scattered) lookups (:class:`VocabParallelGPTEmbedding`)."""

    sequence_parallel: bool = False
    pad_vocab: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        sp = self.sequence_parallel and group_size(tp_group) > 1
        word = VocabParallelEmbedding.from_embedding(module.word_embeddings, tp_group=tp_group,
                                                     pad_vocab=self.pad_vocab, reduce_scatter_embeddings=sp)
        new = VocabParallelGPTEmbedding(word, module.position_embeddings, sequence_parallel=sp)
        if "position_ids" in vars(module):  # positions already set on the instance (context parallelism)
            new.position_ids = module.position_ids
        return new

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0, padded=True) if name == "word_embeddings.weight" else ParamSplit()


def _check_divides(model: GPT, t: int, pad_vocab: bool) -> None:
    c = model.config
    for what, size in (("num_attention_heads", c.num_attention_heads),
                       ("num_key_value_heads", c.num_key_value_heads),
                       ("ffn_hidden_size", c.ffn_hidden_size)):
        if size % t:
            raise ValueError(f"tensor parallelism: {what}={size} does not divide by the tensor-parallel size "
                             f"{t} (each rank holds {what} / {t})")
    if c.vocab_size % t and not (pad_vocab and c.tie_word_embeddings):
        fix = ("pass pad_vocab=True (pads to a multiple of the TP size)" if c.tie_word_embeddings
               else "padding needs tie_word_embeddings=True")
        raise ValueError(f"tensor parallelism: vocab_size={c.vocab_size} does not divide by the tensor-"
                         f"parallel size {t}; {fix}, or pick another size")


def gpt_tensor_parallel_plan(model: GPT, *, tp_size: int, sequence_parallel: bool = False,
                             pad_vocab: bool = False) -> dict[str, object]:
    """The plan of the module docstring, ``{module-name pattern: style}``, for ``model``'s blocks (an MoE
    block's MLP left out); ``ValueError`` for sizes that do not divide by ``tp_size``."""
    _check_divides(model, tp_size, pad_vocab)
    sp = sequence_parallel and tp_size > 1
    plan: dict[str, object] = {"embedding": GPTEmbeddingParallel(sequence_parallel=sp, pad_vocab=pad_vocab)}
    plan["layers.*.self_attention.query_key_value"] = ColwiseParallel(sequence_parallel=sp)
    plan["layers.*.self_attention.dense"] = RowwiseParallel(sequence_parallel=sp)
    dense = [i for i, block in enumerate(model.layers) if hasattr(block.mlp, "dense_h_to_4h")]
    mlps = ["layers.*.mlp"] if len(dense) == len(model.layers) else [f"layers.{i}.mlp" for i in dense]
    for mlp in mlps:
        plan[f"{mlp}.dense_h_to_4h"] = ColwiseParallel(sequence_parallel=sp)
        plan[f"{mlp}.dense_4h_to_h"] = RowwiseParallel(sequence_parallel=sp)
    if sp:  # replicated, applied to s/t tokens: their gradients are summed over tp after backward
        plan["layers.*.input_layernorm"] = SequenceParallel()
        plan["layers.*.post_attention_layernorm"] = SequenceParallel()
        plan["final_layernorm"] = SequenceParallel()
    tied = TiedVocabParallelOutput(embedding="embedding.word_embeddings", sequence_parallel=sp)
    plan["output_layer"] = tied if model.config.tie_word_embeddings else ColwiseParallel(sequence_parallel=sp)
    return plan
