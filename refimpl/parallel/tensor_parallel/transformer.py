"""refimpl's GPT in its tensor-parallel form: :func:`apply_tensor_parallel` (chapter 06).

Shoeybi et al. 2019, "Megatron-LM" (section 3, figure 3); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (sequence parallelism, figure 5). On the ``t`` ranks of
``tp_group``, in place and from the model's full weights (every rank built the same model):

* **attention, heads split**: ``query_key_value`` becomes a :class:`ColumnParallelLinear`, ``dense`` a
  :class:`RowParallelLinear`, and the block keeps its forward with ``a/t`` heads. The fused weight is in
  Megatron's per-head layout (:class:`refimpl.models.CausalSelfAttention`: rows ``[3d i, 3d (i+1))`` are head
  ``i``'s q, k and v), so rank ``r``'s contiguous block of ``3h/t`` rows is q, k and v of heads
  ``[r a/t, (r+1) a/t)``: each of q, k, v is column-parallel. (In nanoGPT's ``[3, a, d]`` layout the same
  row block is all of q and part of k: the fused-qkv trap of the chapter.) Attention itself is local:
  each head only needs its own q, k and v.
* **MLP**: ``dense_h_to_4h`` column-parallel, GELU on the local ``4h/t`` features, ``dense_4h_to_h``
  row-parallel. Per block: one all-reduce forward after each row layer (``g``) and one backward before each
  column layer (``f``): 2 + 2. An MoE block's MLP (chapter 09) is left whole: every tp rank routes the same
  tokens to the same experts (:mod:`refimpl.parallel.expert_parallel_gpt`).
* **vocabulary**: ``word_embeddings`` a :class:`VocabParallelEmbedding`; the output layer (tied: the same
  shard, :class:`TiedVocabParallelHead`; untied: a column-parallel ``[V, h]``) returns the logits shard
  ``[b, s, V/t]``, and :func:`tp_lm_loss` is the loss on it (:func:`vocab_parallel_cross_entropy`): the
  full ``[b, s, V]`` logits are never built. Position embeddings and layer norms are replicated.
* **sequence parallelism** (``sequence_parallel=True``): between the blocks' parallel regions the
  activations are split along the sequence (``[b, s/t, h]``): the vocab-parallel embedding reduce-scatters
  its partial lookups into the sequence shard (Megatron-Core's ``reduce_scatter_embeddings``; backward an
  all-gather) and adds the shard's position embeddings, each
  ``f`` / ``g`` pair becomes an all-gather (in front of the column layer) and a reduce-scatter (after the
  row layer), and the final hidden states are all-gathered before the head. Layer norms and row biases
  then see ``s/t`` tokens: the layer norms become :class:`SequenceParallelLayerNorm` (same parameters),
  which with the row layers declare those parameters (``sequence_parallel_parameters()``, by name, so the
  declaration survives ZeRO-3's replaced parameters), and :func:`allreduce_sequence_parallel_grads` sums
  their gradients over the group after backward.

Sizes that do not divide by ``t`` (heads, ``ffn_hidden_size``) are a one-line ``ValueError``; a vocabulary
that does not divide is one too unless ``pad_vocab=True`` (tied embeddings: :mod:`.vocab_parallel`'s rule).
Every replaced module declares its box (``local_shards``) under the plain model's names, so a TP run's
checkpoint loads at any TP size or into the plain GPT; :func:`full_state_dict` assembles the plain state.
"""

from __future__ import annotations

import torch
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.placement import module_shards
from refimpl.models import GPT, MLP, Embedding, lm_loss
from refimpl.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
)
from refimpl.parallel.tensor_parallel.sequence_parallel_linear import linear_with_sequence_parallel_gather
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_size
from refimpl.parallel.tensor_parallel.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = ["TiedVocabParallelHead", "VocabParallelGPTEmbedding", "apply_tensor_parallel", "full_state_dict",
           "fused_qkv_per_head", "is_tensor_parallel", "tp_lm_loss"]


class VocabParallelGPTEmbedding(nn.Module):
    """Token (vocab-parallel) plus position (replicated) embedding, ``[b, s] -> [b, s, h]``; under sequence
    parallelism the token lookups are reduce-scattered along the sequence and the shard's positions added,
    ``[b, s] -> [b, s/t, h]`` (backward: one all-gather), as :class:`VocabParallelEmbedding` with
    ``reduce_scatter_embeddings`` does: the output is the shard itself, no view of a whole ``[b, s, h]``."""

    def __init__(self, word_embeddings: VocabParallelEmbedding, position_embeddings: nn.Embedding, *,
                 sequence_parallel: bool) -> None:
        super().__init__()
        if word_embeddings.reduce_scatter_embeddings != sequence_parallel:
            raise ValueError("the word embeddings reduce-scatter exactly under sequence parallelism: build "
                             "them with reduce_scatter_embeddings=sequence_parallel")
        self.word_embeddings, self.position_embeddings = word_embeddings, position_embeddings
        self.sequence_parallel = sequence_parallel

    position_ids = staticmethod(Embedding.position_ids)  # context parallelism replaces it (chapter 07)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h] (SP: [b, s/t, h])
        positions = self.position_ids(input_ids.shape[1], input_ids.device)  # [s]
        return self.word_embeddings(input_ids, self.position_embeddings(positions))


class TiedVocabParallelHead(nn.Module):
    """The output layer tied to the vocab-parallel embedding: ``[b, s, h] -> [b, s, V/t]`` on the same
    shard. Without SP the input goes through ``f`` (:meth:`VocabParallelEmbedding.lm_logits`); with SP it is
    all-gathered along the sequence instead (its backward, a reduce-scatter, already sums the ranks), saving
    only this rank's ``s/t`` tokens (:func:`linear_with_sequence_parallel_gather`)."""

    def __init__(self, embedding: VocabParallelEmbedding, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.embedding, self.sequence_parallel = embedding, sequence_parallel  # shared, saved once

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.embedding.lm_logits(hidden)
        # [b, s/t, h] gathered to [b, s, h] (saving only [b, s/t, h]) -> [b, s, V/t]
        emb = self.embedding
        return linear_with_sequence_parallel_gather(hidden, emb.weight, None, emb.tp_group)


def fused_qkv_per_head(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The rows of a fused qkv weight ``[3h, h]`` or bias ``[3h]`` from nanoGPT's order ``[3, a, d]`` (all q,
    all k, all v) to Megatron's per-head ``[a, 3, d]`` (:class:`refimpl.models.CausalSelfAttention`), a copy:
    after it a contiguous row block of ``3h/t`` rows is q, k and v of ``a/t`` whole heads, the shard a
    :class:`ColumnParallelLinear` takes (the fused-qkv trap of chapter 06)."""
    three_h = tensor.shape[0]
    if three_h % (3 * num_heads):
        raise ValueError(f"a fused qkv of {three_h} rows is not 3 x {num_heads} heads x head_dim")
    d = three_h // (3 * num_heads)
    rest = tensor.shape[1:]
    # [3h, ...] -> [3, a, d, ...] -> [a, 3, d, ...] -> [3h, ...]
    return tensor.reshape(3, num_heads, d, *rest).transpose(0, 1).reshape(three_h, *rest).clone()


def _check_divides(model: GPT, t: int, pad_vocab: bool) -> None:
    c = model.config
    for what, size in (("num_attention_heads", c.num_attention_heads),
                       ("ffn_hidden_size", c.ffn_hidden_size)):
        if size % t:
            raise ValueError(f"tensor parallelism: {what}={size} does not divide by the tensor-parallel size "
                             f"{t} (each rank holds {what} / {t})")
    if c.vocab_size % t and not (pad_vocab and c.tie_word_embeddings):
        fix = ("pass pad_vocab=True (pads to a multiple of the TP size)" if c.tie_word_embeddings
               else "padding needs tie_word_embeddings=True")
        raise ValueError(f"tensor parallelism: vocab_size={c.vocab_size} does not divide by the tensor-"
                         f"parallel size {t}; {fix}, or pick another size")


@torch.no_grad()
def apply_tensor_parallel(model: GPT, *, tp_group: Group, sequence_parallel: bool = False,
                          pad_vocab: bool = False) -> GPT:
    """Turn refimpl's GPT into its tensor- (and sequence-) parallel form over ``tp_group``, in place.

    Every rank of the group must hold the same full model (same seed or checkpoint): each keeps its block
    of every sharded weight (module docstring). ``forward(input_ids [b, s])`` then returns the logits shard
    ``[b, s, V/t]``: take the loss with :func:`tp_lm_loss`. Returns ``model``.
    """
    t = group_size(tp_group)
    _check_divides(model, t, pad_vocab)
    sp = sequence_parallel and t > 1
    kw = {"tp_group": tp_group, "sequence_parallel": sp}
    for block in model.layers:
        attn, mlp = block.self_attention, block.mlp
        attn.query_key_value = ColumnParallelLinear.from_linear(attn.query_key_value, **kw)
        attn.dense = RowParallelLinear.from_linear(attn.dense, **kw)
        attn.num_heads = model.config.num_attention_heads // t  # a/t heads, each with its own q, k, v
        if isinstance(mlp, MLP):  # an MoE block's experts stay whole: replicated over tp (chapter 09)
            mlp.dense_h_to_4h = ColumnParallelLinear.from_linear(mlp.dense_h_to_4h, **kw)
            mlp.dense_4h_to_h = RowParallelLinear.from_linear(mlp.dense_4h_to_h, **kw)
        if sp:  # replicated, applied to s/t tokens: their gradients are summed over tp after backward
            block.input_layernorm = SequenceParallelLayerNorm.from_layernorm(block.input_layernorm)
            block.post_attention_layernorm = SequenceParallelLayerNorm.from_layernorm(
                block.post_attention_layernorm)
    if sp:
        model.final_layernorm = SequenceParallelLayerNorm.from_layernorm(model.final_layernorm)
    emb = model.embedding
    word = VocabParallelEmbedding.from_embedding(emb.word_embeddings, tp_group=tp_group, pad_vocab=pad_vocab,
                                                 reduce_scatter_embeddings=sp)
    model.embedding = VocabParallelGPTEmbedding(word, emb.position_embeddings, sequence_parallel=sp)
    if "position_ids" in vars(emb):  # positions already set on the instance (context parallelism) carry over
        model.embedding.position_ids = emb.position_ids
    if model.config.tie_word_embeddings:
        model.output_layer = TiedVocabParallelHead(word, sequence_parallel=sp)
    else:
        model.output_layer = ColumnParallelLinear.from_linear(model.output_layer, **kw)
    model.tp_group, model.sequence_parallel = tp_group, sp
    return model


def is_tensor_parallel(model: nn.Module) -> bool:
    """True for a model :func:`apply_tensor_parallel` transformed (its output is a logits shard)."""
    return hasattr(model, "tp_group")


def tp_lm_loss(logits_shard: torch.Tensor, labels: torch.Tensor, *, tp_group: Group, vocab_size: int,
               num_tokens: int | None = None) -> torch.Tensor:
    """:func:`refimpl.models.lm_loss` on the logits shard ``[b, s, V/t]`` (padded columns masked): the sum
    of the per-token losses of :func:`vocab_parallel_cross_entropy`, divided by ``num_tokens``."""
    if group_size(tp_group) == 1 and logits_shard.shape[-1] == vocab_size:
        return lm_loss(logits_shard, labels, num_tokens=num_tokens)
    per_token = vocab_parallel_cross_entropy(logits_shard.float(), labels, tp_group=tp_group,
                                             vocab_size=vocab_size)  # [b, s]
    return per_token.sum() / (labels.numel() if num_tokens is None else num_tokens)


@torch.no_grad()
def full_state_dict(model: nn.Module, tp_group: Group) -> dict[str, torch.Tensor]:
    """The plain model's state (every tensor whole, the plain GPT's names) on every rank of ``tp_group``.

    Each rank writes the boxes it declares (:func:`refimpl.distributed.placement.module_shards`) into a
    zero tensor of the global shape; one all-reduce (sum) per sharded tensor assembles them (the boxes of
    a tensor are disjoint over the group), replicated tensors are taken as they are. Collective.
    """
    out: dict[str, torch.Tensor] = {}
    t = group_size(tp_group)
    for name, shard in module_shards(model).items():
        if shard.box.shape == shard.box.global_shape:
            out[name] = shard.tensor.detach().clone()
            continue
        full = torch.zeros(shard.box.global_shape, dtype=shard.tensor.dtype, device=shard.tensor.device)
        full[shard.box.slices()] = shard.tensor
        if t > 1:
            ops.all_reduce(full, group=tp_group)
        out[name] = full
    return out
