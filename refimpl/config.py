"""Typed, keyword-only configuration of the model, the data and the training run.

Every object the course builds takes one of these dataclasses, never loose keyword soup, and each
validates itself on construction so a bad configuration fails early with a message that says what to
change (chapter 01). Names follow Megatron-LM (``hidden_size``, ``num_attention_heads``,
``ffn_hidden_size``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which field and why."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    """

    vocab_size: int = 256
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    max_seq_len: int = 128
    tie_word_embeddings: bool = True
    layernorm_eps: float = 1e-5

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

    @property
    def head_dim(self) -> int:
        """Q in the PaLM FLOPs formula: the width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The layout and every technique option of a run, in one object (chapter 10 assembles them).

    Degrees ``dp`` (None: the world size over ``cp x tp x pp``), ``cp``, ``tp``, ``pp``; ``zero_stage``
    0-3; ``precision`` fp32/bf16/fp16; ``sequence_parallel``; ``cp_method`` ring/ulysses; the pipeline's
    ``pp_schedule``, ``virtual_stages``, ``pp_balance`` and ``microbatches`` (None: the trainer's
    default); ``activation_checkpointing`` a block selection or None. Which combinations are refused, and
    why, is the support table's (:func:`refimpl.support.check_supported`), not this class's: it checks
    only that each value is one it knows. The trainer's options give it (``RunOptions.parallel``).
    """

    dp: int | None = None
    cp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    sequence_parallel: bool = False
    cp_method: str = "ring"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_balance: str = "layers"
    microbatches: int | None = None
    activation_checkpointing: str | None = None

    def __post_init__(self) -> None:
        for name in ("cp", "tp", "pp", "virtual_stages") + (("dp",) if self.dp is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.microbatches}")
