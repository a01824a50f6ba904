"""The course GPT's tensor-parallel plan: what ``refimpl.models.GPT.tensor_parallel_plan`` declares
(chapter 06; torchtitan's ``models/llama3/sharding.py`` is the pattern).

Shoeybi et al. 2019, "Megatron-LM" (section 3, figure 3); Korthikanti et al. 2022 (sequence parallelism,
figure 5). On ``t`` ranks:

* **attention, heads split**: ``query_key_value`` column-parallel, ``dense`` row-parallel; the block keeps its
  forward and sees ``a/t`` heads (it infers them from the width). The fused weight is in Megatron's per-head
  layout (``refimpl.models.CausalSelfAttention``: rows ``[3d i, 3d (i+1))`` are head ``i``'s q, k and v),
  so rank ``r``'s contiguous block of ``3h/t`` rows is q, k and v of heads ``[r a/t, (r+1) a/t)``: one chunk.
  With grouped-query attention the rows are grouped by key/value head (its ``a/g`` query heads, its k, its v),
  so the block is ``g/t`` whole groups when ``t`` divides ``g``. With fewer key/value heads than ranks
  (``g < t``, ``t`` a multiple of ``g``: MQA at any ``t``) the ``r = t/g`` ranks of each group share its
  k/v head: ``SharedKeyValueAttentionParallel`` keeps the contiguous split (rank ``p`` holds
  ``1/r`` of group ``p // r``'s rows: disjoint shards, so ZeRO, clipping and checkpoints see one copy of
  every weight), all-gathers the projections and gives rank ``p`` its ``a/t`` query heads with its group's
  k and v (Megatron's QKV sub-sharding of the activations). The backward of that gather is a
  reduce-scatter: each k/v row's gradient is the sum of what the ``r`` ranks that read it send back (a
  replica that keeps only its own is the bug of bigcode-project/Megatron-LM#35). (In nanoGPT's
  ``[3, a, d]`` layout the same rows are all of q and part of k: the fused-qkv trap of the chapter;
  ``ColwiseParallel(chunks=3)`` is that layout's plan.)
* **MLP**: ``dense_h_to_4h`` column-parallel, GELU on the local ``4h/t`` features (SwiGLU: its rows
  interleave gate and up, so the block holds both halves of ``f/t`` features), ``dense_4h_to_h``
  row-parallel. An MoE block's MLP is left whole: every tp rank routes the same tokens to the same
  experts (chapter 09).
* **vocabulary**: the word embedding vocab-parallel inside ``VocabParallelGPTEmbedding`` (which adds
  the replicated position embeddings); the output layer tied to it (the same shard) or, untied,
  column-parallel ``[V/t, h]``; both return the logits shard ``[b, s, V/t]``.
* **sequence parallelism**: the column layers all-gather their ``[b, s/t, h]`` input, the row layers
  reduce-scatter their output, the embedding reduce-scatters its lookups into the sequence shard and the
  LayerNorms run on ``s/t`` tokens (``refimpl.parallel.tensor_parallel.SequenceParallel``: their
  gradients summed over tp).

Sizes that do not divide by ``t`` (heads, ``ffn_hidden_size``) are a one-line ``ValueError`` naming the
size; a vocabulary that does not divide is one too unless ``pad_vocab=True`` with tied embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from refimpl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    ParamSplit,
    RowwiseParallel,
    SequenceParallel,
    TiedVocabParallelOutput,
    VocabParallelEmbedding,
)
from refimpl.parallel.tensor_parallel.tp_communications import (
    Group,
    gather_from_tensor_parallel_region,
    group_size,
)

if TYPE_CHECKING:
    from refimpl.models.gpt import GPT, CausalSelfAttention, Embedding

__all__ = ["GPTEmbeddingParallel", "SharedKeyValueAttentionParallel", "SharedKeyValueQKV",
           "VocabParallelGPTEmbedding", "gpt_tensor_parallel_plan"]


class VocabParallelGPTEmbedding(nn.Module):
    """Token (vocab-parallel) plus position (replicated) embedding, ``[b, s] -> [b, s, h]``; under sequence
    parallelism the token lookups are reduce-scattered along the sequence and the shard's positions added,
    ``[b, s] -> [b, s/t, h]`` (backward: one all-gather), as ``VocabParallelEmbedding`` with
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
    and added to the (sequence-parallel: reduce-scattered) lookups (``VocabParallelGPTEmbedding``)."""

    sequence_parallel: bool = False
    pad_vocab: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        embedding = cast("Embedding", module)  # the plan names the GPT's embedding
        sp = self.sequence_parallel and group_size(tp_group) > 1
        word = VocabParallelEmbedding.from_embedding(embedding.word_embeddings, tp_group=tp_group,
                                                     pad_vocab=self.pad_vocab, reduce_scatter_embeddings=sp)
        new = VocabParallelGPTEmbedding(word, embedding.position_embeddings, sequence_parallel=sp)
        if "position_ids" in vars(module):  # positions already set on the instance (context parallelism)
            new.position_ids = embedding.position_ids  # type: ignore[method-assign]  # replaced on the instance
        return new

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0, padded=True) if name == "word_embeddings.weight" else ParamSplit()


class SharedKeyValueQKV(ColumnParallelLinear):
    """The fused qkv of ``g`` query groups over ``t = r g`` ranks (module docstring): this rank's contiguous
    ``1/t`` of the rows (a ``ColumnParallelLinear``, its box and gradient as any), then the whole
    projection gathered and cut to one group: this rank's ``a/t`` query heads and its group's k and v.

    ``[b, s, h] -> [b, s, (a/t + 2) d]``, the layout by query group with one group. ``gather``: the
    all-gather whose backward sums the ranks' gradients (chapter 06 swaps in one that does not, the negative
    control)."""

    held_query_groups = 1  # the groups its output holds (CausalSelfAttention.held_query_heads reads it)

    def __init__(self, in_features: int, out_features: int, *, query_groups: int, head_dim: int,
                 **kw) -> None:
        super().__init__(in_features, out_features, **kw)
        t, g = self.tp_size, query_groups
        if t % g or out_features % (g * head_dim):
            raise ValueError(f"{type(self).__name__}: {g} query groups over {t} ranks need t a multiple of g")
        self.query_groups, self.head_dim = g, head_dim
        self.q_per_group = out_features // (g * head_dim) - 2  # a/g
        self.q_per_rank = self.q_per_group * g // t  # a/t
        self.group, self.index = divmod(self.tp_rank, t // g)  # my group j and my place u among its r ranks

    @staticmethod
    def gather(y: torch.Tensor, group: Group) -> torch.Tensor:
        return gather_from_tensor_parallel_region(y, group, sum_grads=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gather(super().forward(x), self.tp_group)  # [b, s, R/t] -> [b, s, R], R = g (a/g + 2) d
        b, s = y.shape[:2]
        grp = y.view(b, s, self.query_groups, self.q_per_group + 2, self.head_dim)[:, :, self.group]
        n, u = self.q_per_rank, self.index  # grp: [b, s, a/g + 2, d]
        q, kv = grp[:, :, u * n:(u + 1) * n], grp[:, :, self.q_per_group:]  # [b, s, a/t, d], [b, s, 2, d]
        return torch.cat([q, kv], dim=2).reshape(b, s, (n + 2) * self.head_dim)  # [b, s, (a/t + 2) d]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedKeyValueAttentionParallel:
    """The GPT's own style for a ``refimpl.models.CausalSelfAttention`` with fewer key/value heads
    than ranks (module docstring): its ``query_key_value`` becomes a ``SharedKeyValueQKV`` and the
    attention reads ``a/t`` query heads per group. ``dense`` takes its own ``RowwiseParallel``."""

    sequence_parallel: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        attention = cast("CausalSelfAttention", module)  # the plan names the GPT's multi-head attention
        linear = attention.query_key_value
        qkv = cast(SharedKeyValueQKV, SharedKeyValueQKV.from_linear(  # from_linear builds its cls
            linear, tp_group=tp_group, query_groups=attention.query_groups, head_dim=attention.head_dim,
            sequence_parallel=self.sequence_parallel and group_size(tp_group) > 1))
        module.query_key_value = qkv  # a module of another type in place of the Linear
        attention.q_per_group = qkv.q_per_rank
        return module

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0) if name.startswith("query_key_value.") else ParamSplit()


def _check_divides(model: GPT, t: int, pad_vocab: bool) -> None:
    c = model.config
    for what, size in (("num_attention_heads", c.num_attention_heads),
                       ("ffn_hidden_size", c.ffn_size)):
        if size % t:
            raise ValueError(f"tensor parallelism: {what}={size} does not divide by the tensor-parallel size "
                             f"{t} (each rank holds {what} / {t})")
    g = c.query_groups
    if g % t and t % g:
        raise ValueError(f"tensor parallelism: num_key_value_heads={g} and the tensor-parallel size {t}: one "
                         "must divide the other (each rank holds whole query groups, or t/g ranks share one)")
    if g < t and (c.num_attention_heads + 2 * g) * c.head_dim % t:
        rows = (c.num_attention_heads + 2 * g) * c.head_dim
        raise ValueError(f"tensor parallelism: the fused qkv's {rows} "
                         f"rows do not divide by the tensor-parallel size {t}")
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
    if model.config.query_groups < tp_size:  # t/g ranks share each key/value head
        plan["layers.*.self_attention"] = SharedKeyValueAttentionParallel(sequence_parallel=sp)
    else:
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
