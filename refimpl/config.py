"""Typed, keyword-only configuration of the model, the data and the training run.

Every object the course builds takes one of these dataclasses, never loose keyword soup, and each
validates itself on construction so a bad configuration fails early with a message that says what to
change (chapter 01). Names follow Megatron-LM (``hidden_size``, ``num_attention_heads``,
``ffn_hidden_size``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which field and why."""


# The names each technique option takes, written once here (config imports nothing of refimpl, so the
# techniques, the planner and the trainer's flags all read them from here).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")  # chapter 05 (fp8: bf16 + fp8 linears, 10)
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")  # chapter 10: torchao's two dynamic recipes
CP_METHODS: tuple[str, ...] = ("ring", "ulysses")  # chapter 07: ring attention, DeepSpeed-Ulysses
CP_LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")  # chapter 07: how the ring splits the sequence
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zbh1")  # chapter 08
PP_BALANCES: tuple[str, ...] = ("layers", "parameters")  # chapter 08: how blocks are cut into stages
MOE_SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")  # chapter 09: Switch / Mixtral, DeepSeek-V3
MOE_LOAD_BALANCE: tuple[str, ...] = ("aux", "bias")  # chapter 09: the balance loss, or DeepSeek-V3's bias
MOE_ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")  # chapter 09: the experts' MLP
POSITION_EMBEDDINGS: tuple[str, ...] = ("learned", "rope")  # chapter 01: GPT-2's table, Llama's rotation
ROPE_TYPES: tuple[str, ...] = ("default", "llama3")  # RoFormer's frequencies, Llama 3.1's scaled ones
NORMALIZATIONS: tuple[str, ...] = ("layernorm", "rmsnorm")
ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")  # the dense MLP's


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_block_selection(spec: str) -> str | list[int] | Callable[[int], bool]:
    """A command-line selection of blocks for activation checkpointing (chapter 05): ``all``, ``none``,
    ``every-N`` (blocks 0, N, 2N, ...) or comma-separated indices such as ``0,2,-1``; the result goes to
    :func:`refimpl.parallel.activation_checkpoint.apply_activation_checkpointing`."""
    spec = spec.strip().lower()
    if spec in ("all", "none"):
        return spec
    if spec.startswith("every-"):
        step = spec.removeprefix("every-")
        if not step.isdigit() or int(step) < 1:
            raise ConfigError(f"bad block selection {spec!r}: every-N needs a positive N, e.g. every-2")
        return lambda i: i % int(step) == 0
    try:
        return [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(
            f"bad block selection {spec!r}: use all, none, every-N, or indices like 0,2,-1") from None


def micro_batches(*, per_rank_batch: int, micro_batch_size: int | None, pp: int = 1,
                  microbatches: int | None = None) -> int:
    """The forwards one data-parallel rank runs per optimizer step, the rule written once (chapters 03, 08).

    Without a pipeline (``pp = 1``) gradient accumulation: the per-rank batch over ``micro_batch_size``
    (None: one forward of the whole batch). With one, the pipeline's micro-batches: ``microbatches`` if
    given, else the per-rank batch over ``micro_batch_size``, else ``pp`` (one per stage, the least that
    fills the pipeline). The callers check that the batch splits (the trainer's preflight says how to fix
    it); the planner (:func:`refimpl.planner.predict_run`) counts with the same rule."""
    if pp > 1 and microbatches is not None:
        return microbatches
    if micro_batch_size is not None:
        return per_rank_batch // micro_batch_size
    return pp if pp > 1 else 1


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the small GPT that runs through the whole course (chapter 01).

    A decoder-only transformer with pre-LayerNorm blocks (GPT-2, Radford et al. 2019), learned position
    embeddings and a byte vocabulary of 256.

    **The Llama form** (one config-driven model, as Megatron-Core's ``GPTModel``): ``num_key_value_heads``
    (grouped-query attention, Ainslie et al. 2023; 1: multi-query), ``position_embedding="rope"`` (Su et al.
    2021, with ``rope_theta`` and ``rope_type="llama3"``'s frequency scaling), ``normalization="rmsnorm"``,
    ``activation="swiglu"`` (Shazeer 2020), ``add_bias=False`` and an untied output layer:
    ``ModelConfig(**LLAMA, ...)``. At their defaults these fields are GPT-2's and left out of
    :meth:`to_dict`.

    **Mixture of experts** (chapter 09; Shazeer et al. 2017, GShard, Switch, DeepSeek-V3): with ``num_experts
    = E > 0`` the MLP of every ``moe_every``-th block (blocks ``0, N, 2N, ...``, the rule of Megatron-LM's
    ``moe_layer_freq``; 1: all) is an ``MoEMLP`` (``refimpl.models.moe``): a top-``top_k`` router over ``E``
    experts with ``score_func`` scores, each expert an MLP of ``moe_ffn_hidden_size`` (None: the dense MLP's
    ``ffn_hidden_size``) with ``moe_activation`` (``gelu``: two matrices like the dense MLP; ``swiglu``:
    three). ``moe_normalize_topk``: divide each token's ``k`` combine weights by their sum (GShard, Mixtral,
    DeepSeek-V3) or keep the raw scores (Switch's top-1); None (the default) renormalises when ``top_k > 1``
    (at ``k = 1`` a renormalised weight is 1 and the router would learn nothing from the task).
    ``capacity_factor`` None is dropless, else each expert takes ``ceil(k T / E cf)`` of the ``T`` tokens of
    one forward on one rank. ``moe_load_balance``: ``aux`` adds the sequence-wise balance loss
    ``aux_loss_coeff x E sum_i f_i P_i`` (DeepSeek-V3 eq. 17-20) to the loss; ``bias`` also adds it (0 for
    none) and steers the choice with DeepSeek-V3's expert bias, moved by ``moe_bias_update_rate`` before each
    optimizer step. With ``num_experts = 0`` (dense, the default) the MoE fields are unused and left out of
    :meth:`to_dict`, so a dense configuration reads as before. """

    vocab_size: int = 256
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    max_seq_len: int = 128
    tie_word_embeddings: bool = True
    layernorm_eps: float = 1e-5
    num_key_value_heads: int | None = None  # GQA; None: num_attention_heads (multi-head), 1: MQA
    position_embedding: str = "learned"  # "learned" (GPT-2) or "rope" (Llama)
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "llama3": Llama 3.1's frequency scaling, with the four rope_* below
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    normalization: str = "layernorm"  # or "rmsnorm"
    activation: str = "gelu"  # the dense MLP's: "gelu" (GPT-2) or "swiglu" (Llama)
    add_bias: bool = True  # the linear layers' (and LayerNorms') biases
    num_experts: int = 0  # 0: dense; E > 0: MoE blocks (chapter 09)
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coeff: float = 0.01
    score_func: str = "softmax"
    moe_load_balance: str = "aux"
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_activation: str = "gelu"
    moe_bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma
    moe_normalize_topk: bool | None = None  # None: renormalise the top-k weights when top_k > 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"ModelConfig: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; each head needs hidden_size / heads "
                f"dimensions; head counts that divide it: {_divisors(self.hidden_size)[:8]}"
            )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        elif self.ffn_hidden_size <= 0:
            raise ConfigError(f"ModelConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self._check_architecture()
        self._check_moe()

    def _check_architecture(self) -> None:
        kv, a = self.num_key_value_heads, self.num_attention_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or a % kv:
            raise ConfigError(f"ModelConfig.num_key_value_heads must divide num_attention_heads = {a} (each "
                              f"key/value head serves a group of query heads), got {kv!r}")
        for name, known in (("position_embedding", POSITION_EMBEDDINGS), ("rope_type", ROPE_TYPES),
                            ("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"ModelConfig.{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig: RoPE rotates pairs of dimensions: head_dim = {self.head_dim} "
                              "must be even")

    def _check_moe(self) -> None:
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ConfigError(f"ModelConfig.num_experts must be 0 (dense) or a positive integer, got "
                              f"{self.num_experts!r}")
        if self.num_experts == 0:
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"ModelConfig.top_k must be in [1, num_experts = {self.num_experts}], got "
                              f"{self.top_k}")
        if self.moe_every < 1:
            raise ConfigError(f"ModelConfig.moe_every must be >= 1 (1: every block), got {self.moe_every}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"ModelConfig.capacity_factor must be > 0 or None (dropless), got "
                              f"{self.capacity_factor}")
        if not self.aux_loss_coeff >= 0 or not self.moe_bias_update_rate >= 0:
            raise ConfigError(f"ModelConfig.aux_loss_coeff and moe_bias_update_rate must be >= 0, got "
                              f"{self.aux_loss_coeff} and {self.moe_bias_update_rate}")
        for name, known in (("score_func", MOE_SCORE_FUNCS), ("moe_load_balance", MOE_LOAD_BALANCE),
                            ("moe_activation", MOE_ACTIVATIONS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"ModelConfig.{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.moe_normalize_topk not in (None, True, False):
            raise ConfigError(f"ModelConfig.moe_normalize_topk must be None (when top_k > 1), True or False, "
                              f"got {self.moe_normalize_topk!r}")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size <= 0:
            raise ConfigError(f"ModelConfig.moe_ffn_hidden_size must be positive, got "
                              f"{self.moe_ffn_hidden_size}")

    @property
    def head_dim(self) -> int:
        """Q in the PaLM FLOPs formula: the width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_hidden_size(self) -> int:
        """The width of one expert's MLP: ``moe_ffn_hidden_size``, else the dense MLP's."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads, each serving ``num_attention_heads / num_key_value_heads`` query heads."""
        return self.num_key_value_heads  # type: ignore[return-value]

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has an MoE MLP: ``num_experts > 0`` and ``index % moe_every == 0``."""
        return self.num_experts > 0 and index % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the blocks whose MLP is an MoE."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def build(self, *, seed: int = 0) -> nn.Module:
        """The model this configuration describes (the course GPT, :data:`MODEL_CLASS`), built on the
        current default device (``with torch.device("meta"):`` for shapes only). The planner reads the
        model's declarations through it (its parameters and its tensor-parallel plan) without importing a
        model. The configuration names the class it builds and it is resolved when called (Hugging Face's
        ``config.architectures`` and ``AutoModel.from_config``): nothing here imports ``refimpl.models``,
        which imports this file."""
        module, _, name = MODEL_CLASS.rpartition(".")
        return getattr(importlib.import_module(module), name)(self, seed=seed)

    def to_dict(self) -> dict:
        """The fields as a dict; a dense configuration (``num_experts = 0``) without its unused MoE fields."""
        out = dataclasses.asdict(self)
        if self.num_experts == 0:
            for name in _MOE_FIELDS:
                out.pop(name)
        for name, default in _ARCHITECTURE_DEFAULTS.items():  # GPT-2's form reads as it always did
            if out[name] == default:
                out.pop(name)
        if out.get("num_key_value_heads") == self.num_attention_heads:
            out.pop("num_key_value_heads")
        return out


MODEL_CLASS = "refimpl.models.gpt.GPT"
"""The class a :class:`ModelConfig` describes (``ModelConfig.build``), by name."""

_ARCHITECTURE_DEFAULTS = {"position_embedding": "learned", "rope_theta": 10000.0, "rope_type": "default",
                          "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                          "rope_original_max_position": 8192, "normalization": "layernorm",
                          "activation": "gelu", "add_bias": True}
"""The architecture fields at GPT-2's values: left out of ``ModelConfig.to_dict`` (the GPT-2 form's dict is
the one it always was; ``ModelConfig(**d)`` restores them)."""

LLAMA = {"position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu", "add_bias": False,
         "tie_word_embeddings": False, "layernorm_eps": 1e-6}
"""The Llama form (Touvron et al. 2023; Llama 3, Dubey et al. 2024): RoPE, RMSNorm, SwiGLU, no biases, an
untied output layer: ``ModelConfig(**LLAMA, num_key_value_heads=..., ...)``. ``ARCHS`` names the forms."""

ARCHS: dict[str, dict] = {"gpt2": {}, "llama": LLAMA}

_MOE_FIELDS = ("num_experts", "top_k", "moe_every", "capacity_factor", "aux_loss_coeff", "score_func",
               "moe_load_balance", "moe_ffn_hidden_size", "moe_activation", "moe_bias_update_rate",
               "moe_normalize_topk")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the tokens come from and how a step's batch is cut (chapter 01, sharding in chapter 03).

    ``global_batch_size`` sequences of ``seq_len`` tokens are trained per optimizer step, summed over all
    data-parallel ranks and accumulation micro-steps, so a run means the same thing at every world size.
    """

    data: str | None = None  # a text file or folder; None = the default corpus from Python's stdlib
    cache_dir: str | None = None  # where prepared token files live; None = ~/.cache/refimpl
    seq_len: int = 128
    global_batch_size: int = 16
    micro_batch_size: int | None = None  # per rank; None = global_batch_size / dp_size (no accumulation)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ConfigError(f"DataConfig.seq_len must be positive, got {self.seq_len}")
        if self.global_batch_size <= 0:
            raise ConfigError(f"DataConfig.global_batch_size must be positive, got {self.global_batch_size}")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError(f"DataConfig.micro_batch_size must be positive, got {self.micro_batch_size}")

    def per_rank_batch(self, dp_size: int) -> int:
        """Sequences each data-parallel rank trains per optimizer step (all micro-batches together)."""
        if self.global_batch_size % dp_size != 0:
            raise ConfigError(
                f"global batch size {self.global_batch_size} does not divide among {dp_size} data-parallel "
                f"ranks; use a multiple of {dp_size}"
            )
        return self.global_batch_size // dp_size

    def accumulation_steps(self, dp_size: int) -> int:
        """global batch = micro batch x accumulation steps x data-parallel size (chapter 03)."""
        per_rank = self.per_rank_batch(dp_size)
        micro = self.micro_batch_size or per_rank
        if per_rank % micro != 0:
            raise ConfigError(
                f"per-rank batch {per_rank} (= {self.global_batch_size} / {dp_size} ranks) is not a multiple "
                f"of micro_batch_size={micro}"
            )
        return per_rank // micro


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"OptimConfig.lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"OptimConfig.grad_clip must be positive or None, got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A whole training run: what ``python -m refimpl.train`` builds from its flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 200
    out: str = "runs/default"
    log_every: int = 10
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"TrainConfig.steps must be positive, got {self.steps}")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"seq_len={self.data.seq_len} is longer than the model's max_seq_len={self.model.max_seq_len}"
            )
        if self.log_every <= 0:
            raise ConfigError(f"TrainConfig.log_every must be positive, got {self.log_every}")

    def to_dict(self) -> dict:
        """The run as a dict (config.json, the checkpoint's signature); the model's as
        :meth:`ModelConfig.to_dict` gives it (a dense model without the MoE fields)."""
        return dataclasses.asdict(self) | {"model": self.model.to_dict()}


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The layout and every technique option of a run, in one object (chapter 12 assembles them): what the
    trainer's options give (``RunOptions.parallel``), :func:`refimpl.parallel.parallelize` applies,
    :func:`refimpl.planner.predict_run` predicts and the trainer's memory preflight plans.

    Degrees ``dp`` (None: the world size over ``cp x tp x pp``), ``cp``, ``tp``, ``pp``, and
    ``dp_replicate`` (HSDP: the ``dp`` ranks as ``dp_replicate x dp_shard``, ZeRO-3 sharding over a shard
    group and replicating across them; it must divide ``dp``); ``zero_stage``
    0 (data parallel), 1 (sharded optimizer state), 2 (and gradients), 3 (and parameters); ``precision``
    fp32/bf16/fp16, or fp8 (bf16 autocast with the linears' three GEMMs in fp8, chapter 10) with
    ``fp8_scaling`` tensorwise or rowwise (torchao's recipes); ``sequence_parallel`` (the activations
    between the tensor-parallel regions split along the sequence); ``cp_method`` ring/ulysses and
    ``cp_layout`` how the sequence is split for it (ring: ``zigzag``, the default, or ``contiguous``;
    Ulysses: contiguous) (chapter 07); the pipeline's
    ``pp_schedule``, ``virtual_stages`` (model chunks per rank), ``pp_balance`` (``layers`` or
    ``parameters``) and ``microbatches`` (None: the trainer's default) (chapter 08);
    ``ep`` the expert-parallel degree (chapter 09): the experts of each MoE block split over ``ep``
    consecutive ranks of the ``dp x cp`` ranks (torchtitan's dp2ep), so it must divide ``dp x cp``;
    ``activation_checkpointing`` a block selection (``all``, ``every-N``, ``0,2,-1``; None: off).
    The wrappers' tuning: ``bucket_cap_mb`` ZeRO-0's gradient buckets (DDP's 25 MB), ``zero_bucket_numel``
    the elements per reduce-scatter bucket of ZeRO-2, ``prefetch`` and ``reshard_after_forward`` ZeRO-3's
    all-gather schedule; under pipeline parallelism ZeRO-3 gathers each stage once per step and reduces its
    gradients once after the last backward (torchtitan's default), or with ``zero3_reshard_per_microbatch``
    gathers and reduces per micro-batch (m times the collectives, the parameters never kept).

    Which combinations are refused, and why, is the support table's
    (:func:`refimpl.support.check_supported`), not this class's: it checks only that each value is one it
    knows.
    """

    dp: int | None = None
    cp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    fp8_scaling: str = "tensorwise"
    sequence_parallel: bool = False
    cp_method: str = "ring"
    cp_layout: str | None = None
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_balance: str = "layers"
    microbatches: int | None = None
    activation_checkpointing: str | None = None
    bucket_cap_mb: float = 25.0
    zero_bucket_numel: int = 2**20
    prefetch: bool = False
    reshard_after_forward: bool = True
    zero3_reshard_per_microbatch: bool = False

    def __post_init__(self) -> None:
        degrees = ("cp", "tp", "pp", "dp_replicate", "ep", "virtual_stages")
        for name in degrees + (("dp",) if self.dp is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name, known in (("precision", PRECISIONS), ("fp8_scaling", FP8_SCALINGS),
                            ("cp_method", CP_METHODS), ("pp_schedule", PP_SCHEDULES),
                            ("pp_balance", PP_BALANCES)):
            if getattr(self, name) not in known:
                raise ConfigError(f"{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.cp_layout not in (None, *CP_LAYOUTS) or (self.cp_method == "ulysses"
                                                         and self.cp_layout not in (None, "contiguous")):
            raise ConfigError(f"cp_layout must be None or one of {CP_LAYOUTS} (Ulysses: contiguous), got "
                              f"{self.cp_layout!r} with cp_method {self.cp_method!r}")
        if not self.bucket_cap_mb > 0 or self.zero_bucket_numel < 1:
            raise ConfigError(f"bucket sizes must be positive, got bucket_cap_mb={self.bucket_cap_mb}, "
                              f"zero_bucket_numel={self.zero_bucket_numel}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.activation_checkpointing is not None:
            parse_block_selection(self.activation_checkpointing)  # a bad selection fails here

    def checkpointed_blocks(self, num_layers: int) -> list[int]:
        """The indices of the blocks ``activation_checkpointing`` recomputes in a model of ``num_layers``
        (negative indices count from the end; out of range: none), as the planner counts them."""
        if self.activation_checkpointing is None:
            return []
        n, sel = num_layers, parse_block_selection(self.activation_checkpointing)
        if sel in ("all", "none"):
            return list(range(n)) if sel == "all" else []
        if callable(sel):
            return [i for i in range(n) if sel(i)]
        return sorted({i % n for i in sel if -n <= i < n})

    @property
    def degrees(self) -> dict[str, int | None]:
        """``{"dp": ..., "cp": ..., "tp": ..., "pp": ..., "dp_replicate": ..., "ep": ...}`` (dp None: derived
        from the world size)."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp, "dp_replicate": self.dp_replicate,
                "ep": self.ep}

    @property
    def fsdp_mixed_precision(self) -> bool:
        """ZeRO-3 in 16 bits as FSDP2: 16-bit gathered weights over fp32 master shards."""
        return self.zero_stage == 3 and self.precision != "fp32"
