"""Activation memory before anything runs: Korthikanti et al.'s formula, and the same count for our model.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1)
count the bytes one Megatron GPT layer keeps for backward in 16-bit training without tensor or sequence
parallelism::

    s b h (34 + 5 a s / h)      s = sequence, b = micro-batch, h = hidden, a = heads

34 s b h: attention 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1), MLP 19 (input 2,
GELU input 8, GELU output 8, dropout mask 1), two LayerNorm inputs 4. 5 a s^2 b: the softmax output (2),
its dropout mask (1) and the dropout output (2), all a x s x s per sequence.

Our block (:class:`refimpl.model.TransformerBlock`) differs, and :func:`activation_bytes_per_layer` counts
it exactly, term by term, for a compute dtype (``p`` bytes) and the residual stream's dtype (``r``):

* no dropout: the two s b h masks and the attention dropout go;
* fused (flash) attention, as ``scaled_dot_product_attention`` runs on the CPU: no a s^2 b tensors at
  all; it keeps its output and a float32 log-sum-exp of a b s values instead;
* under autocast the residual stream and the LayerNorms stay in float32 (r = 4): the two LayerNorm
  inputs cost 2 r s b h, plus each LayerNorm's mean and reciprocal std (2 x 2 x r s b);
* the FFN width f is a config field (4h by default).

So in 16-bit (p = 2, r = 4, f = 4h): ``s b h (36) + 16 s b + 4 a s b`` per layer; a checkpointed layer
keeps only its input, ``r s b h``. :class:`refimpl.measure.activations.SavedTensorMeter` measures the
same numbers; :func:`refimpl.planner.memory.run_memory_per_rank` adds what the model saves outside the
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refimpl.config import ModelConfig

__all__ = ["ActivationBreakdown", "activation_bytes", "activation_bytes_per_layer",
           "korthikanti_bytes_per_layer"]


def korthikanti_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden_size: int, num_heads: int) -> int:
    """``s b h (34 + 5 a s / h)``: a Megatron GPT layer in 16 bits, no parallelism (Korthikanti eq. 1)."""
    s, b, h, a = seq_len, micro_batch, hidden_size, num_heads
    return 34 * s * b * h + 5 * a * s * s * b


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
) -> ActivationBreakdown:
    """Saved-for-backward bytes of one :class:`refimpl.model.TransformerBlock` (see the module docstring).

    ``compute_dtype``: what the matmuls run in (autocast's dtype, or the weights' dtype);
    ``residual_dtype``: the dtype of the residual stream and the LayerNorm inputs (float32 under autocast;
    the weights' dtype when the model itself is 16-bit). LayerNorm keeps its mean and reciprocal std in
    the residual dtype (measured on the CPU); the attention log-sum-exp is float32 in every case.
    """
    s, b, h, a = seq_len, micro_batch, config.hidden_size, config.num_attention_heads
    f = config.ffn_hidden_size
    p, r = _nbytes(compute_dtype), _nbytes(residual_dtype)
    if checkpointed:
        return ActivationBreakdown(terms={"block input (checkpoint)": r * s * b * h})
    terms = {
        "layernorm inputs (2)": 2 * r * s * b * h,
        "layernorm mean + rstd (2 x 2)": 2 * 2 * r * s * b,
        "QKV input": p * s * b * h,
        "Q, K, V": 3 * p * s * b * h,
        "attention log-sum-exp (fp32)": 4 * a * s * b,
        "attention output = projection input": p * s * b * h,
        "MLP input": p * s * b * h,
        "GELU input": p * s * b * f,
        "GELU output = second linear input": p * s * b * f,
    }
    return ActivationBreakdown(terms=terms)


def activation_bytes(
    config: ModelConfig, *, checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (), **per_layer: Any
) -> list[int]:
    """Saved bytes of every block of the model, in order (checkpointed ones keep only their input).

    ``per_layer``: the keyword arguments of :func:`activation_bytes_per_layer` (``micro_batch``,
    ``seq_len``, ``compute_dtype``, ``residual_dtype``), the same for every block.
    """
    if "checkpointed" in per_layer:
        raise TypeError("activation_bytes takes checkpointed_blocks (block indices), not checkpointed")
    chosen = set(checkpointed_blocks)
    return [activation_bytes_per_layer(config, checkpointed=i in chosen, **per_layer).total
            for i in range(config.num_layers)]
