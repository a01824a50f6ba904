"""The analytic model of a training run: parameters, FLOPs and memory before anything runs (chapters 00-01).

Every figure here is a formula that a chapter checks against a measurement:

* parameters: counted from the architecture, equal to ``sum(p.numel())`` of :class:`refimpl.model.GPT`;
* FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): ``6 N + 12 L H Q T`` with N parameters,
  L layers, H heads, Q head dim, T sequence length. The ``6 N`` counts forward (2N) and backward (4N)
  matrix multiplies; ``12 L H Q T`` the attention scores and the weighted sum. Only weights that sit in a
  matrix multiply cost FLOPs, so :func:`flops_per_token` can count exactly those (``matmul_only=True``)
  and then equals what ``torch.utils.flop_counter.FlopCounterMode`` measures;
* memory of the model state per device: weights, gradients and the optimizer's state (Adam keeps two
  moments per parameter and one ``step`` scalar per tensor in PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass

from refimpl.config import ModelConfig

# Dense (not 2:4 sparse) peak throughput in FLOP/s, by device name fragment and the dtype the matrix
# multiplies compute in. Sources: NVIDIA's H100 Tensor Core GPU architecture white paper (SXM5: BF16/FP16
# 989 dense, TF32 494.7 dense, FP32 67 on the CUDA cores; the H200 has the same SMs and clocks) and the
# A100 data sheet (BF16/FP16 312, TF32 156, FP32 19.5). The H100 PCIe card is slower (H100 data sheet:
# BF16 756, TF32 378, FP32 51) and is matched first. See :func:`peak_flops` for which key a run uses.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIE": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
PEAK_DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    """Parameters of a GPT by role; ``total`` counts a tied embedding once."""

    embedding: int  # word + position embeddings
    layers: int  # all transformer blocks
    final_layernorm: int
    output_layer: int  # 0 when tied to the word embedding
    matmul: int  # weights that enter a matrix multiply (what costs FLOPs)

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_layernorm + self.output_layer


def param_count(config: ModelConfig) -> ParamCount:
    """Count the parameters of :class:`refimpl.model.GPT` for ``config`` without building it."""
    h, f, v, n = config.hidden_size, config.ffn_hidden_size, config.vocab_size, config.num_layers
    attention = (h * 3 * h + 3 * h) + (h * h + h)  # query_key_value and dense, with biases
    mlp = (h * f + f) + (f * h + h)  # dense_h_to_4h and dense_4h_to_h
    layernorms = 2 * 2 * h  # two LayerNorms of weight + bias
    per_layer = attention + mlp + layernorms
    return ParamCount(
        embedding=v * h + config.max_seq_len * h,
        layers=n * per_layer,
        final_layernorm=2 * h,
        output_layer=0 if config.tie_word_embeddings else h * v,
        matmul=n * (4 * h * h + 2 * h * f) + h * v,  # the output layer multiplies, tied or not
    )


def num_param_tensors(config: ModelConfig) -> int:
    """How many parameter tensors the model has (Adam keeps one ``step`` scalar per tensor)."""
    per_layer = 2 + 2 + 2 + 2 + 2 + 2  # 2 LayerNorms, qkv, dense, two MLP linears; weight + bias each
    return 2 + config.num_layers * per_layer + 2 + (0 if config.tie_word_embeddings else 1)


def flops_per_token(config: ModelConfig, seq_len: int, *, matmul_only: bool = False) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L H Q T`` (PaLM appendix B).

    With ``matmul_only`` N counts only weights inside matrix multiplies (no position embedding,
    LayerNorm or bias); that is the number a FLOP counter measures. The attention term counts the full
    T x T score matrix, as PaLM and ``FlopCounterMode`` do, although a causal mask could skip half.
    """
    counts = param_count(config)
    n = counts.matmul if matmul_only else counts.total
    attention = 12 * config.num_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6.0 * n + attention


@dataclass(frozen=True, kw_only=True)
class StateMemory:
    """Bytes of model state held by one device."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


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


def model_flops_utilization(
    tokens_per_s: float, flops_per_tok: float, num_devices: int, peak_flops_per_device: float
) -> float:
    """MFU = tokens/s x FLOPs per token / (devices x peak) (PaLM appendix B)."""
    return tokens_per_s * flops_per_tok / (num_devices * peak_flops_per_device)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a device for the dtype its matrix multiplies compute in (:data:`PEAK_FLOPS`).

    ``dtype`` is one of :data:`PEAK_DTYPES` and has no default: the MFU of an fp32 run divided by the
    bf16 peak would be 989 / 67 = 14.8 times too small on an H100. ``"fp32"`` is the peak of true float32
    arithmetic on the CUDA cores (67 TFLOP/s on an H100), because that is what PyTorch computes by default
    (``torch.get_float32_matmul_precision() == "highest"``: no TF32). ``"tf32"`` is the tensor-core peak
    that a float32 run reaches only after opting in to TF32 (precision ``"high"`` or ``"medium"``);
    :func:`refimpl.metrics.peak_dtype` picks between the two. Returns None for a device not in the table
    (a CPU, an unknown GPU): no made-up peak. An unknown ``dtype`` is a ValueError, not a silent None.
    """
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r} for a peak; expected one of {PEAK_DTYPES}")
    for fragment, table in PEAK_FLOPS.items():
        if fragment in device_name.upper():
            return table[dtype]
    return None


# -- the memory of a whole run, per rank (the trainer's preflight) ---------------------------------------

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def param_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """The shapes of :class:`refimpl.model.GPT`'s parameters in ``named_parameters()`` order (no model
    built)."""
    h, f, v = config.hidden_size, config.ffn_hidden_size, config.vocab_size
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
    shapes = [(v, h), (config.max_seq_len, h)] + block * config.num_layers + [(h,), (h,)]
    return shapes + ([] if config.tie_word_embeddings else [(v, h)])


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
    *,
    micro_batch: int,
    seq_len: int,
    world_size: int = 1,
    zero_stage: int = 0,
    precision: str = "fp32",
    checkpointed_blocks: set[int] | list[int] | tuple[int, ...] = (),
) -> RunMemory:
    """The peak bytes one rank of a training run needs, before anything runs (chapters 01, 04 and 05).

    Model state (:func:`refimpl.parallel.zero_planner.zero_memory`, Rajbhandari et al. 2020): fp32 weights,
    fp32 gradients and AdamW's two fp32 moments, each full or sharded over ``world_size`` ranks by ZeRO
    ``zero_stage``; ZeRO-3 adds the gathered root unit and the largest block (its forward/backward peak,
    :func:`~refimpl.parallel.zero_planner.zero3_peak_gathered_bytes`). ``precision`` bf16/fp16 computes under
    autocast over fp32 weights and so adds autocast's cached 16-bit copies of the matmul weights.

    Activations of one micro-batch ``b`` of ``s`` tokens (Korthikanti et al. 2022, as
    :func:`refimpl.activation_planner.activation_bytes` counts our block exactly): the saved tensors of every
    block (a checkpointed block keeps only its input and recomputes the largest block's tensors in backward),
    plus what the model saves outside the blocks: the final LayerNorm's input ``r s b h`` and statistics
    ``2 r s b``, the output layer's input ``p s b h``, the float32 log-softmax ``4 s b V`` of the loss, the
    int64 token ids, labels and positions, and the loss scalar (what :class:`refimpl.activations.
    SavedTensorMeter` measures, to the byte). The logits and their float32 gradient, ``(p + 4) s b V``, are
    transient buffers on top (not saved tensors: an estimate of the loss's peak, not a measured figure).
    """
    from refimpl.activation_planner import activation_bytes
    from refimpl.parallel.zero_planner import zero3_peak_gathered_bytes, zero_memory

    if precision not in _DTYPE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {tuple(_DTYPE_BYTES)}")
    import torch

    p = _DTYPE_BYTES[precision]
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    s, b, h, v = seq_len, micro_batch, config.hidden_size, config.vocab_size
    shapes = param_shapes(config)
    zero = zero_memory(shapes, world_size, zero_stage)
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
