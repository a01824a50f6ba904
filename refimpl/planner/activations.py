"""Activation memory before anything runs: Korthikanti et al.'s formula, and the same count for our model,
per rank under tensor and sequence parallelism (chapters 05 and 06).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sections 4.1-4.2)
count the bytes one Megatron GPT layer keeps for backward in 16-bit training, per rank of ``t``
tensor-parallel ranks (Shoeybi et al. 2019)::

    s b h (34 + 5 a s / h)                   one device (eq. 1)
    s b h (10 + 24 / t + 5 a s / (h t))      tensor parallel (eq. 2)
    s b h (34 / t + 5 a s / (h t))           tensor + sequence parallel (eq. 4)

s = sequence, b = micro-batch, h = hidden, a = heads. 34 s b h: attention 11 (QKV input 2, Q and K 4, V 2,
projection input 2, dropout mask 1), MLP 19 (input 2, GELU input 8, GELU output 8, dropout mask 1), two
LayerNorm inputs 4; 5 a s^2 b: the softmax output (2), its dropout mask (1) and the dropout output (2).
Tensor parallelism splits the 24 (and the a s^2 terms) by ``t``; the 10 (LayerNorm inputs, the inputs of
QKV and of the first MLP linear, the two dropout masks) sits outside the parallel regions, and sequence
parallelism splits it along the sequence: Megatron's column layers save their ``s/t`` input shard and
all-gather it again in backward.

Our block (:class:`refimpl.model.TransformerBlock`, :func:`refimpl.parallel.tensor_parallel.
apply_tensor_parallel`) differs, and :func:`activation_bytes_per_layer` counts it exactly, term by term,
for a compute dtype (``p`` bytes), the residual stream's dtype (``r``), ``t`` ranks and ``u = t`` under
sequence parallelism (else ``u = 1``):

* no dropout: the two s b h masks and the attention dropout go;
* fused (flash) attention, as ``scaled_dot_product_attention`` runs on the CPU: no a s^2 b tensors; it
  keeps its output and a float32 log-sum-exp of ``a b s / t`` values instead;
* under autocast the residual stream and the LayerNorms stay in float32 (r = 4): the two LayerNorm
  inputs cost ``2 r s b h / u``, plus each LayerNorm's mean and reciprocal std ``2 x 2 r s b / u``;
* the FFN width f is a config field (4h by default);
* sequence parallelism as Megatron's: a column layer's input arrives as ``[b, s/t, h]``, is all-gathered for
  the matmul, and only the ``s/t`` shard is saved (gathered again in backward,
  :mod:`refimpl.parallel.tensor_parallel.sequence_parallel_linear`): the QKV and MLP inputs cost
  ``2 p s b h / u`` (autograd's default would keep the gathered ``[b, s, h]``, ``2 p s b h`` at every ``t``).

Per layer and rank::

    2 r sbh/u + 4 r sb/u                     LayerNorm inputs, mean + rstd (replicated; SP: s/t tokens)
    + 2 p sbh/u                              QKV and MLP inputs (SP: the s/t shard)
    + (4 p + 2 p f/h) sbh/t + 4 a sb/t       Q, K, V, attention output; GELU input and output; lse

So in 16-bit (p = 2, r = 4, f = 4h): ``sbh (12 + 24/t) + 16 sb + 4 a sb/t`` without and
``36 sbh/t + 16 sb/t + 4 a sb/t`` with sequence parallelism (``t = 1``: ``36 sbh + 16 sb + 4 a sb``), where
Korthikanti et al. have ``10 + 24/t`` and ``34/t``: fp32 LayerNorm inputs (+4), no dropout masks (-2),
flash attention (no ``5 a s/h`` term);
a checkpointed layer keeps only its input, ``r s b h / u``. :func:`outside_block_bytes` counts what the
model saves outside the blocks. :class:`refimpl.measure.activations.SavedTensorMeter` measures the same
numbers (tests/test_activations.py, tests/test_planner_tp.py at tp 2 and 4);
:func:`refimpl.planner.memory.run_memory_per_rank` adds them up per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refimpl.config import ModelConfig

__all__ = ["ActivationBreakdown", "activation_bytes", "activation_bytes_per_layer",
           "korthikanti_bytes_per_layer", "outside_block_bytes"]


def _check_tp(config: ModelConfig, *, tp: int, sequence_parallel: bool, seq_len: int) -> int:
    """``u``, the split of the sequence-parallel regions (``tp`` under SP, else 1), after the sizes check."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    for what, size in (("num_attention_heads", config.num_attention_heads),
                       ("ffn_hidden_size", config.ffn_hidden_size)):
        if size % tp:
            raise ValueError(f"tensor parallelism: {what}={size} does not divide by tp={tp}")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism: seq_len={seq_len} does not divide by tp={tp}")
    return tp if sequence_parallel else 1


def korthikanti_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden_size: int, num_heads: int,
                                tp: int = 1, sequence_parallel: bool = False) -> int:
    """A Megatron GPT layer in 16 bits per rank (Korthikanti et al. 2022, eqs. 1, 2 and 4):
    ``s b h (10 + 24/t + 5 a s/(h t))``, with sequence parallelism ``s b h (34/t + 5 a s/(h t))``.
    Exact integers when ``t`` divides ``a`` (and so ``h``)."""
    s, b, h, a, t = seq_len, micro_batch, hidden_size, num_heads, tp
    if a % t or h % t:
        raise ValueError(f"tp={t} must divide num_heads={a} and hidden_size={h}")
    outside = 10 * s * b * h // (t if sequence_parallel else 1)
    return outside + 24 * s * b * h // t + 5 * (a // t) * s * s * b


@dataclass(frozen=True, kw_only=True)
class ActivationBreakdown:
    """Bytes one layer saves for backward, term by term (``terms[name] = bytes``)."""

    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def activation_bytes_per_layer(
    config: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int,
    compute_dtype: torch.dtype = torch.float32,
    residual_dtype: torch.dtype = torch.float32,
    checkpointed: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> ActivationBreakdown:
    """Saved-for-backward bytes of one :class:`refimpl.model.TransformerBlock` on one rank of ``tp``
    tensor-parallel ranks (with ``sequence_parallel``: Korthikanti et al.'s sequence parallelism); see the
    module docstring for the terms.

    ``compute_dtype``: what the matmuls run in (autocast's dtype, or the weights' dtype);
    ``residual_dtype``: the dtype of the residual stream and the LayerNorm inputs (float32 under autocast;
    the weights' dtype when the model itself is 16-bit). LayerNorm keeps its mean and reciprocal std in
    the residual dtype (measured on the CPU); the attention log-sum-exp is float32 in every case.
    ``sequence_parallel`` at ``tp = 1`` is the plain block (as :func:`apply_tensor_parallel` does).
    """
    s, b, h, a = seq_len, micro_batch, config.hidden_size, config.num_attention_heads
    f, t = config.ffn_hidden_size, tp
    u = _check_tp(config, tp=tp, sequence_parallel=sequence_parallel, seq_len=s)
    p, r = _nbytes(compute_dtype), _nbytes(residual_dtype)
    if checkpointed:
        return ActivationBreakdown(terms={"block input (checkpoint)": r * s * b * h // u})
    terms = {
        "layernorm inputs (2)": 2 * r * s * b * h // u,
        "layernorm mean + rstd (2 x 2)": 2 * 2 * r * s * b // u,
        "QKV input": p * s * b * h // u,
        "Q, K, V": 3 * p * s * b * h // t,
        "attention log-sum-exp (fp32)": 4 * (a // t) * s * b,
        "attention output = projection input": p * s * b * h // t,
        "MLP input": p * s * b * h // u,
        "GELU input": p * s * b * (f // t),
        "GELU output = second linear input": p * s * b * (f // t),
    }
    return ActivationBreakdown(terms=terms)


def activation_bytes(
    config: ModelConfig, *, checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (), **per_layer: Any
) -> list[int]:
    """Saved bytes of every block of the model on one rank, in order (checkpointed ones keep only their
    input).

    ``per_layer``: the keyword arguments of :func:`activation_bytes_per_layer` (``micro_batch``,
    ``seq_len``, ``compute_dtype``, ``residual_dtype``, ``tp``, ``sequence_parallel``), the same for every
    block.
    """
    if "checkpointed" in per_layer:
        raise TypeError("activation_bytes takes checkpointed_blocks (block indices), not checkpointed")
    chosen = set(checkpointed_blocks)
    return [activation_bytes_per_layer(config, checkpointed=i in chosen, **per_layer).total
            for i in range(config.num_layers)]


def outside_block_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int,
                        compute_dtype: torch.dtype = torch.float32, tp: int = 1,
                        sequence_parallel: bool = False) -> dict[str, int]:
    """What one rank saves for backward outside the blocks (embedding, final LayerNorm, output layer,
    loss), with the residual stream in float32, term by term.

    One device (``tp = 1``, :func:`refimpl.model.lm_loss`): the final LayerNorm's input ``4 s b h`` and
    statistics ``2 x 4 s b``, the output layer's input ``p s b h``, the float32 log-softmax ``4 s b V``, the
    int64 token ids, labels and positions ``8 (2 s b + s)`` and ``cross_entropy``'s float32 total weight.

    Tensor parallel (``t > 1``, :func:`refimpl.parallel.tensor_parallel.tp_lm_loss`): the final LayerNorm
    sees ``s/u`` tokens and the head saves its ``p s b h / u`` input (under SP the shard, gathered again in
    backward, as the blocks' column layers); the
    vocab-parallel loss saves its float32 softmax shard ``4 s b V_t`` (``V_t = ceil(V/t)`` columns, the
    padding rule of :mod:`refimpl.parallel.tensor_parallel.vocab_parallel`), its int64 target index and two
    bool masks (owned, valid); the vocab-parallel embedding its int64 local ids and bool mask; int64
    positions. The full ``[b, s, V]`` logits are never built.
    """
    s, b, h, v, t = seq_len, micro_batch, config.hidden_size, config.vocab_size, tp
    u = _check_tp(config, tp=tp, sequence_parallel=sequence_parallel, seq_len=s)
    p = _nbytes(compute_dtype)
    if t == 1:
        return {"final layernorm + output layer inputs": 4 * s * b * h + 2 * 4 * s * b + p * s * b * h,
                "log-softmax (fp32)": 4 * s * b * v,
                "token ids, labels, positions": 8 * (2 * s * b + s) + 4}
    return {"final layernorm + output layer inputs": (4 * s * b * h + 2 * 4 * s * b + p * s * b * h) // u,
            "vocab-parallel softmax shard (fp32)": 4 * s * b * -(-v // t),
            "token ids, labels, positions": 8 * (2 * s * b + s),
            "embedding + loss masks (bool)": 3 * s * b}
