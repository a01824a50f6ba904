"""The vocabulary split across the tensor-parallel ranks: embedding, tied output layer and loss (chapter 06).

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (section 3, "the input embedding weight matrix ... is parallelized along the vocabulary
dimension"). With ``t`` ranks and a vocabulary of ``V`` rows, rank ``r`` holds the contiguous row block
``[r V/t, (r+1) V/t)`` of the ``[V, h]`` table (Megatron's ``vocab_start_index`` / ``vocab_end_index``):

* ``VocabParallelEmbedding``: ``y = sum_r E_r[x]``, where ``E_r[x]`` is row ``x - r V/t`` of my block
  when I own token ``x`` and zeros otherwise; the sum is ``g`` =
  ``refimpl.parallel.tensor_parallel.tp_communications.reduce_from_tensor_parallel_region`` (one
  all-reduce of ``[..., h]`` forward, none backward). Exactly one term is non-zero, so the output equals
  the one-device lookup bitwise.
  Under sequence parallelism (``reduce_scatter_embeddings=True``, Megatron-Core's name and switch) the
  sum is **reduce-scattered** along the sequence instead: rank ``r`` receives only its ``s/t`` positions of
  ``y``, ``[b, s/t, h]``, the shard the first block's sequence-parallel region needs, for half the
  all-reduce's bytes (a ring sends ``(t-1)/t`` of ``[b, s, h]`` instead of ``2 (t-1)/t``); backward is the
  conjugate all-gather of ``dy`` along the sequence. An optional replicated ``[s, h]`` term (the GPT's
  learned position embeddings) is added to the shard, its gradient the gathered ``dy`` summed over the
  batch (the same ``sum_to_size`` as one device's broadcast): Megatron-Core reduce-scatters only without
  learned absolute positions (it all-reduces, adds them, then scatters); added after the collective, the
  sum ``E[x] + P`` is the same element by element, bitwise.
* ``VocabParallelEmbedding.lm_logits``: the tied output layer, ``z_r = f(h) E_r^T`` of shape
  ``[..., V/t]`` on the **same** Parameter (``f`` = copy-to-region: identity forward, all-reduce of
  ``dh`` backward), so the embedding's and the head's gradients accumulate into one shard.
* ``vocab_parallel_cross_entropy``: ``loss = log sum_v exp(z_v - m) - (z_y - m)`` with
  ``m = max_v z_v``, from the shards without ever building ``[..., V]``: three all-reduces of ``[...]``
  (``m`` with MAX; the target logit ``z_y - m``, picked by the one rank that owns ``y``, with SUM; the
  local ``sum exp(z - m)`` with SUM), none backward. Backward is ``dz_r = (softmax_r - onehot_r) dloss``
  on the local shard (Megatron-LM ``tensor_parallel/cross_entropy.py``).

**Padding rule** (a vocabulary that does not divide by ``t``): off by default (a one-line ``ValueError``);
with ``pad_vocab=True`` the table is padded to ``V_pad = t ceil(V/t)`` rows, rank ``r`` holds rows
``[r V_pad/t, (r+1) V_pad/t)`` of the padded table, the padded rows (``>= V``, on the last ranks) are zeros,
never looked up (a token's owner is decided against ``V``, not ``V_pad``) and never saved: the real rows
of rank ``r`` are exactly ``refimpl.distributed.placement.chunk_range`` ``(V, r, t)``, the box
``local_shards()`` declares. Their logits are masked to ``-inf`` in the loss (``vocab_size=V``), so their
softmax and gradient are exactly 0.

A group of size 1 (or ``None`` with no process group) is the plain ``nn.Embedding`` / ``F.cross_entropy``
arithmetic with no collective. Every collective goes through ``refimpl.comm.ops`` (a
``refimpl.comm.CommTracer`` sees them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.placement import Box, LocalShard
from refimpl.nn.linear import linear_with_grad
from refimpl.parallel.tensor_parallel.sequence_parallel_linear import linear_with_sequence_parallel_gather
from refimpl.parallel.tensor_parallel.tp_communications import (
    SEQUENCE_DIM,
    Group,
    _all_gather,
    _reduce_scatter,
    copy_to_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
)

__all__ = ["TiedVocabParallelHead", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _partition(vocab_size: int, t: int, *, pad_vocab: bool) -> int:
    """Rows per rank, ``ceil(V/t)``; a ``V`` that does not divide is an error unless ``pad_vocab``."""
    if vocab_size % t and not pad_vocab:
        raise ValueError(f"vocabulary size {vocab_size} does not divide by the tensor-parallel size {t}: "
                         f"pass pad_vocab=True (pads to {-(-vocab_size // t) * t} rows) or pick another size")
    return -(-vocab_size // t)


class VocabParallelEmbedding(nn.Module):
    """Megatron-LM's ``VocabParallelEmbedding`` (Shoeybi et al. 2019; chapter 06): rows of ``[V, h]`` split.

    ``weight`` is ``[ceil(V/t), h]``: rows ``[vocab_start_index, vocab_start_index + ceil(V/t))`` of the
    (padded) table; the real ones end at ``vocab_end_index`` (``<= V``), the rest is padding (module
    docstring). ``forward(x)`` is ``nn.Embedding``'s lookup, bitwise, after one all-reduce of ``[..., h]``;
    with ``reduce_scatter_embeddings`` (sequence parallelism) ``x`` is ``[b, s]`` and the output this rank's
    ``[b, s/t, h]`` of the lookup, after one reduce-scatter along the sequence (dim 1).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group, pad_vocab: bool = False,
                 reduce_scatter_embeddings: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_group, self.reduce_scatter_embeddings = tp_group, reduce_scatter_embeddings
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = _partition(num_embeddings, self.tp_size, pad_vocab=pad_vocab)
        self.padded_num_embeddings = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        per = self.num_embeddings_per_partition
        self.vocab_end_index = max(self.vocab_start_index, min(self.vocab_start_index + per, num_embeddings))
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def num_real_rows(self) -> int:
        """Rows of my block that are vocabulary, not padding."""
        return self.vocab_end_index - self.vocab_start_index

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s N(0, 1) on my rows (not the one-device draw: use ``from_embedding``),
        padding rows zero."""
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight[self.num_real_rows:].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, tp_group: Group, pad_vocab: bool = False,
                       reduce_scatter_embeddings: bool = False) -> VocabParallelEmbedding:
        """My row block of a full ``nn.Embedding`` (copied; padding rows zero)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("from_embedding shards a plain nn.Embedding: padding_idx, max_norm and sparse "
                             "are not supported")
        w = embedding.weight
        out = cls(embedding.num_embeddings, embedding.embedding_dim, tp_group=tp_group, pad_vocab=pad_vocab,
                  reduce_scatter_embeddings=reduce_scatter_embeddings, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            out.weight.zero_()
            out.weight[: out.num_real_rows].copy_(w[out.vocab_start_index : out.vocab_end_index])
        return out

    def forward(self, input: torch.Tensor, added: torch.Tensor | None = None) -> torch.Tensor:
        """``[...]`` token ids -> ``[..., h]`` (``reduce_scatter_embeddings``: ``[b, s]`` -> ``[b, s/t, h]``,
        my positions), plus ``added`` (``[s, h]``, replicated: the position embeddings) when given. Tokens
        outside ``[0, V)`` look up zeros on every rank."""
        if self.tp_size == 1:
            out = F.embedding(input, self.weight)
            return out if added is None else out + added
        outside = (input < self.vocab_start_index) | (input >= self.vocab_end_index)  # [...]
        local = (input - self.vocab_start_index).masked_fill(outside, 0)             # [...] my row index
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [..., h]
        if self.reduce_scatter_embeddings:
            if input.dim() != 2:
                raise ValueError(f"reduce_scatter_embeddings needs [batch, seq] token ids (the sequence is "
                                 f"dim 1), got shape {tuple(input.shape)}")
            return _ReduceScatterEmbeddings.apply(partial, added, self.tp_group)  # [b, s/t, h]
        out = reduce_from_tensor_parallel_region(partial, self.tp_group)
        return out if added is None else out + added

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output layer on my shard: ``[..., h] -> [..., V/t]``, ``f(hidden) @ weight.T``.

        Padded rows give logits 0: pass ``vocab_size=num_embeddings`` to the loss to mask them.
        """
        return linear_with_grad(copy_to_tensor_parallel_region(hidden, self.tp_group), self.weight)

    def local_shards(self) -> dict[str, LocalShard]:
        """My real rows as a box of the ``[V, h]`` table (padding is not part of it)."""
        box = Box.chunk((self.num_embeddings, self.embedding_dim), 0, self.tp_rank, self.tp_size)
        if self.num_real_rows == self.num_embeddings_per_partition:  # no padding: the Parameter itself
            return {"weight": LocalShard(self.weight, box)}  # (the optimizer's state is found by it)
        return {"weight": LocalShard(self.weight.detach()[: self.num_real_rows], box)}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start_index}, "
                f"{self.vocab_end_index}) of tp {self.tp_size}, {self.num_embeddings_per_partition} per rank")


class _ReduceScatterEmbeddings(torch.autograd.Function):
    """Forward: my ``s/t`` positions of ``sum_r partial_r`` (one reduce-scatter along the sequence) plus my
    rows of the replicated ``added``; backward: the all-gather of ``dy`` along the sequence, the gradient of
    every partial, and of ``added`` its sum over the batch."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, added: torch.Tensor | None, group: Group) -> torch.Tensor:
        ctx.group, ctx.added_shape = group, None if added is None else added.shape
        out = _reduce_scatter(partial, SEQUENCE_DIM, group)                   # [b, s/t, h]
        if added is None:
            return out
        chunk = out.shape[SEQUENCE_DIM]
        return out + added.narrow(0, group_rank(group) * chunk, chunk)         # + my [s/t, h] rows

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        d = _all_gather(dy, SEQUENCE_DIM, ctx.group)                           # [b, s, h]
        return d, None if ctx.added_shape is None else d.sum_to_size(ctx.added_shape), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: the loss from the shards (three all-reduces of ``[...]``); backward: softmax - onehot."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int,
                vocab_size: int | None) -> torch.Tensor:
        t, r = group_size(group), group_rank(group)
        part = logits.shape[-1]
        start = r * part
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # [..., V/t]
        if vocab_size is not None and start + part > vocab_size:  # padded columns -> -inf
            padded = torch.arange(start, start + part, device=z.device) >= vocab_size      # [V/t]
            z = z.masked_fill(padded, float("-inf"))
        logits_max = z.amax(dim=-1)                                                           # [...]
        if t > 1:
            ops.all_reduce(logits_max, op=ops.ReduceOp.MAX, group=group)
        shifted = z - logits_max.unsqueeze(-1)                                                # [..., V/t]
        valid = target != ignore_index                                                        # [...]
        local = target - start
        owned = valid & (local >= 0) & (local < part)                                         # [...]
        index = local.masked_fill(~owned, 0)                                                  # [...]
        predicted = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)  # [...]
        exp = shifted.exp_()                                                                  # [..., V/t]
        sum_exp = exp.sum(dim=-1)                                                             # [...]
        if t > 1:
            ops.all_reduce(predicted, group=group)
            ops.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - predicted).masked_fill(~valid, 0.0)                           # [...]
        softmax = exp.div_(sum_exp.unsqueeze(-1))                                             # [..., V/t]
        ctx.save_for_backward(softmax, index, owned, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, index, owned, valid = ctx.saved_tensors
        g = grad_loss.to(softmax.dtype)
        grad = softmax * (g * valid).unsqueeze(-1)                                            # [..., V/t]
        grad.scatter_add_(-1, index.unsqueeze(-1), -(g * owned).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, tp_group: Group,
                                 ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross entropy from vocabulary-sharded logits (Megatron-LM, Shoeybi et al. 2019; chapter 06).

    ``logits_shard`` ``[..., V/t]`` holds columns ``[r V/t, (r+1) V/t)`` of the logits, ``target`` ``[...]``
    (any leading dims). Returns ``[...]``, equal to ``F.cross_entropy(full_logits, target,
    reduction="none", ignore_index=ignore_index)`` (ignored tokens: loss 0, gradient 0) without building
    the full logits: per rank the largest tensor is ``[..., V/t]`` (the softmax shard kept for backward).
    Collectives at ``t > 1``: three all-reduces of ``[...]`` in the compute dtype forward (MAX of the
    max, SUM of the target logit, SUM of the sum-exp), none backward. float16 / bfloat16 logits are
    computed in float32 (as Megatron), the loss is float32. ``vocab_size`` (the padding rule): columns
    ``>= vocab_size`` are padding, masked to ``-inf``. A target outside the vocabulary that is not
    ``ignore_index`` is owned by no rank (not checked, to avoid a device sync).
    """
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"target of shape {tuple(target.shape)} does not match logits of shape "
                         f"{tuple(logits_shard.shape)} (expected the logits' shape without its last dim)")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, ignore_index, vocab_size)


class TiedVocabParallelHead(nn.Module):
    """The output layer tied to the vocab-parallel embedding: ``[b, s, h] -> [b, s, V/t]`` on the same
    shard. Without SP the input goes through ``f`` (``VocabParallelEmbedding.lm_logits``); with SP it is
    all-gathered along the sequence instead (its backward, a reduce-scatter, already sums the ranks), saving
    only this rank's ``s/t`` tokens (``linear_with_sequence_parallel_gather``)."""

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
