"""The memory of a training run per rank, before anything runs: model state and activations (chapters 01,
04, 05 and 10).

* :func:`state_memory`: weights, gradients and optimizer state of one unsharded replica (chapter 01;
  Kingma & Ba 2015 for Adam's two moments);
* :func:`state_memory_per_rank`: the same per rank of a layout, sharded by ZeRO stage over the
  data-parallel ranks (Rajbhandari et al. 2020, :mod:`refimpl.planner.zero_state`; chapter 04);
* :func:`run_memory_per_rank`: state plus one micro-batch's activations (Korthikanti et al. 2022,
  :mod:`refimpl.planner.activations`; chapter 05), term by term: what the trainer's preflight compares
  with the machine's memory before any process starts.

Every function that answers per rank takes the layout ``dims`` (:mod:`refimpl.planner.layout`), so the
terms of tensor, context and pipeline parallelism join here with chapters 06-08. The
:class:`~refimpl.measure.state.StateMemory` returned is the one :func:`refimpl.measure.state_bytes`
measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refimpl.config import ModelConfig
from refimpl.measure.state import StateMemory
from refimpl.planner.activations import activation_bytes
from refimpl.planner.layout import Layout, data_parallel_degree
from refimpl.planner.params_flops import num_param_tensors, param_count, param_shapes
from refimpl.planner.zero_state import zero3_peak_gathered_bytes, zero_memory

__all__ = ["RunMemory", "run_memory_per_rank", "state_memory", "state_memory_per_rank"]

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def state_memory(
    config: ModelConfig,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer: str = "adamw",
    state_bytes: int = 4,
) -> StateMemory:
    """Weights, gradients and optimizer state of a single, unsharded replica.

    Adam/AdamW (Kingma & Ba 2015): two moments of ``state_bytes`` per parameter plus PyTorch's ``step``
    counter, a float32 scalar tensor per parameter tensor. SGD without momentum keeps nothing.
    """
    n = param_count(config).total
    if optimizer in ("adam", "adamw"):
        opt = 2 * state_bytes * n + 4 * num_param_tensors(config)
    elif optimizer == "sgd":
        opt = 0
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adamw', 'adam' or 'sgd'")
    return StateMemory(weights=param_bytes * n, grads=grad_bytes * n, optimizer=opt)


def state_memory_per_rank(config: ModelConfig, dims: Layout, *, zero_stage: int = 0,
                          dp_rank: int = 0) -> StateMemory:
    """Weights, gradients and AdamW state held at rest by data-parallel rank ``dp_rank`` of layout ``dims``.

    fp32 weights and gradients, two fp32 moments and a ``step`` scalar per tensor, sharded over the
    ``dims.dp`` ranks by ZeRO ``zero_stage`` with the runtime's shard rule
    (:func:`~refimpl.planner.zero_state.zero_memory` on :func:`~refimpl.planner.params_flops.param_shapes`).
    Stage 0 is :func:`state_memory`, the full replica. Tensor, context and pipeline degrees above 1 are
    refused with the chapter that brings them (:func:`~refimpl.planner.layout.data_parallel_degree`).
    """
    return zero_memory(param_shapes(config), data_parallel_degree(dims), zero_stage, rank=dp_rank)


@dataclass(frozen=True, kw_only=True)
class RunMemory:
    """A run's bytes per rank, term by term: ``state`` (model state) and ``activations`` (one micro-batch)."""

    state: dict[str, int]
    activations: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.state.values()) + sum(self.activations.values())

    def describe(self) -> str:
        """One line: the total and every non-zero term, in MiB."""
        terms = [f"{k} {v / 2**20:,.1f}" for k, v in {**self.state, **self.activations}.items() if v]
        return f"{self.total / 2**20:,.1f} MiB = " + " + ".join(terms)


def run_memory_per_rank(
    config: ModelConfig,
    dims: Layout,
    *,
    micro_batch: int,
    seq_len: int,
    zero_stage: int = 0,
    precision: str = "fp32",
    checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
    sequence_parallel: bool = False,
) -> RunMemory:
    """The peak bytes one rank of a training run laid out as ``dims`` needs, before anything runs (chapters
    01, 04 and 05; the trainer's preflight).

    ``dims``: the layout (:class:`refimpl.distributed.ParallelDims` or any object with ``dp, cp, tp, pp``);
    data parallelism only today, tensor/context/pipeline degrees above 1 are refused
    (:func:`~refimpl.planner.layout.data_parallel_degree`). Model state (:func:`state_memory_per_rank`,
    Rajbhandari et al. 2020): fp32 weights, fp32 gradients and AdamW's two fp32 moments, each full or
    sharded over the ``dims.dp`` data-parallel ranks by ZeRO ``zero_stage``; ZeRO-3 adds the gathered root
    unit and the largest block (its forward/backward peak,
    :func:`~refimpl.planner.zero_state.zero3_peak_gathered_bytes`). ``precision`` bf16/fp16 computes under
    autocast over fp32 weights and so adds autocast's cached 16-bit copies of the matmul weights.

    Activations of one micro-batch ``b`` of ``s`` tokens (Korthikanti et al. 2022, as
    :func:`refimpl.planner.activations.activation_bytes` counts our block exactly): the saved tensors of every
    block (a checkpointed block keeps only its input and recomputes the largest block's tensors in backward),
    plus what the model saves outside the blocks: the final LayerNorm's input ``r s b h`` and statistics
    ``2 r s b``, the output layer's input ``p s b h``, the float32 log-softmax ``4 s b V`` of the loss, the
    int64 token ids, labels and positions, and the loss scalar (what
    :class:`refimpl.measure.activations.SavedTensorMeter` measures, to the byte). The logits and their
    float32 gradient, ``(p + 4) s b V``, are transient buffers on top (not saved tensors: an estimate of
    the loss's peak, not a measured figure).
    """
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {tuple(_DTYPE_BYTES)}")
    world_size = data_parallel_degree(dims)
    p = _DTYPE_BYTES[precision]
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    s, b, h, v = seq_len, micro_batch, config.hidden_size, config.vocab_size
    shapes = param_shapes(config)
    zero = state_memory_per_rank(config, dims, zero_stage=zero_stage)
    state = {"weights": zero.weights, "grads": zero.grads, "AdamW state": zero.optimizer}
    if zero_stage == 3:
        per_block = 12
        blocks = [shapes[2 + i * per_block: 2 + (i + 1) * per_block] for i in range(config.num_layers)]
        root = shapes[:2] + shapes[2 + config.num_layers * per_block:]
        state["ZeRO-3 gathered units"] = zero3_peak_gathered_bytes([root, *blocks], world_size).weights
    if p != 4:
        state["autocast weight copies"] = p * param_count(config).matmul
    chosen = set(checkpointed_blocks)
    saved = activation_bytes(config, micro_batch=b, seq_len=s, compute_dtype=compute,
                             checkpointed_blocks=chosen)
    full = activation_bytes(config, micro_batch=b, seq_len=s, compute_dtype=compute)
    activations = {
        "block activations": sum(saved),
        "recomputed block (backward)": max(full) if chosen and full else 0,
        "final layernorm + output layer inputs": 4 * s * b * h + 2 * 4 * s * b + p * s * b * h,
        "log-softmax (fp32)": 4 * s * b * v,
        "token ids, labels, positions": 8 * (2 * s * b + s) + 4,
        "logits + their gradient (transient)": (p + 4) * s * b * v,
    }
    return RunMemory(state=state, activations=activations)
