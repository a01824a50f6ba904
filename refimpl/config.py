"""Typed, keyword-only configuration of the model, the data and the training run.

Every object the course builds takes one of these dataclasses, never loose keyword soup, and each
validates itself on construction so a bad configuration fails early with a message that says what to
change (chapter 01). Names follow Megatron-LM (``hidden_size``, ``num_attention_heads``,
``ffn_hidden_size``). The model's own configuration lives in ``refimpl.model_config`` and is
re-exported here, with ``ConfigError`` (``refimpl.errors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from refimpl.errors import ConfigError
from refimpl.model_config import (
    ACTIVATIONS,
    ARCHS,
    ATTENTION_TYPES,
    DEEPSEEK_V3,
    LLAMA,
    MODEL_CLASS,
    MOE_ACTIVATIONS,
    MOE_LOAD_BALANCE,
    MOE_SCORE_FUNCS,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    ROPE_TYPES,
    ModelConfig,
)

__all__ = ["ACTIVATIONS", "ARCHS", "ATTENTION_TYPES", "CP_LAYOUTS", "CP_METHODS", "DEEPSEEK_V3",
           "FP8_SCALINGS", "LLAMA", "MODEL_CLASS", "MOE_ACTIVATIONS", "MOE_LOAD_BALANCE", "MOE_SCORE_FUNCS",
           "NORMALIZATIONS", "POSITION_EMBEDDINGS", "PP_BALANCES", "PP_SCHEDULES", "PRECISIONS", "ROPE_TYPES",
           "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig",
           "flag_of", "micro_batches", "parse_block_selection"]

# The names each technique option takes, written once here (config imports nothing of refimpl but the
# model's configuration, so the techniques, the planner and the trainer's flags all read them from here).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")  # chapter 05 (fp8: bf16 + fp8 linears, 10)
FP8_SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")  # chapter 10: torchao's two dynamic recipes
CP_METHODS: tuple[str, ...] = ("ring", "ulysses")  # chapter 07: ring attention, DeepSpeed-Ulysses
CP_LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")  # chapter 07: how the ring splits the sequence
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")  # chapter 08
PP_BALANCES: tuple[str, ...] = ("layers", "parameters")  # chapter 08: how blocks are cut into stages


def parse_block_selection(spec: str) -> str | list[int] | Callable[[int], bool]:
    """A command-line selection of blocks for activation checkpointing (chapter 05): ``all``, ``none``,
    ``every-N`` (blocks 0, N, 2N, ...) or comma-separated indices such as ``0,2,-1``; the result goes to
    ``refimpl.parallel.activation_checkpoint.apply_activation_checkpointing``."""
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
    it); the planner (``refimpl.planner.predict_run``) counts with the same rule."""
    if pp > 1 and microbatches is not None:
        return microbatches
    if micro_batch_size is not None:
        return per_rank_batch // micro_batch_size
    return pp if pp > 1 else 1


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
        ``ModelConfig.to_dict`` gives it (a dense model without the MoE fields)."""
        return dataclasses.asdict(self) | {"model": self.model.to_dict()}


class Degrees(TypedDict):
    """``ParallelConfig.degrees``: the keyword arguments of ``refimpl.distributed.ParallelDims.from_world``
    (``dp`` None: derived from the world size)."""

    dp: int | None
    cp: int
    tp: int
    pp: int
    dp_replicate: int
    ep: int


def _flag(text: str, **argparse_keywords: object) -> dict:
    """A ``ParallelConfig`` field's command-line flag, ``--`` and the name with dashes: its help ``text``
    and argparse's keywords (``type``, ``choices``, ``metavar``, ...). ``refimpl.train.args`` adds one
    flag per field that has one, so the layout is described once, here."""
    return {"flag": {"help": text, **argparse_keywords}}


def flag_of(name: str) -> str:
    """The trainer's flag of the ``ParallelConfig`` field ``name`` (``pp_schedule`` -> ``--pp-schedule``)."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The layout and every technique option of a run, in one object (chapter 12 assembles them): what the
    trainer's options hold (``RunOptions.parallel``), ``refimpl.parallel.parallelize`` applies,
    ``refimpl.planner.predict_run`` predicts and the trainer's memory preflight plans.

    Degrees ``dp`` (None: the world size over ``cp x tp x pp``), ``cp``, ``tp``, ``pp``, and
    ``dp_replicate`` (HSDP: the ``dp`` ranks as ``dp_replicate x dp_shard``, ZeRO-3 sharding over a shard
    group and replicating across them; it must divide ``dp``); ``zero_stage``
    0 (data parallel), 1 (sharded optimizer state), 2 (and gradients), 3 (and parameters); ``precision``
    fp32/bf16/fp16, or fp8 (bf16 autocast with the linears' three GEMMs in fp8, chapter 10) with
    ``fp8_scaling`` tensorwise or rowwise (torchao's recipes); ``sequence_parallel`` (the activations
    between the tensor-parallel regions split along the sequence); ``cp_method`` ring/ulysses and
    ``cp_layout`` how the sequence is split for it (ring: ``zigzag``, the default, or ``contiguous``;
    Ulysses: contiguous) (chapter 07); ``tp_comm_overlap`` (Megatron's ``--tp-comm-overlap``) the
    sequence-parallel linears' all-gather and reduce-scatter as rings overlapped with their matmuls
    (collective matmul, chapter 06); the pipeline's
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

    Each field with a ``flag`` in its metadata is one of the trainer's flags (``--`` and its name with
    dashes; its help and argparse keywords there): ``python -m refimpl.train --help`` lists them in the
    group "parallelism and precision", in this order. The wrappers' tuning and ``cp_layout`` have none.

    Every value is checked here, once (its error names the flag); which combinations are refused, and why,
    is the support table's (``refimpl.support.check_supported``), not this class's.
    """

    dp: int | None = field(default=None, metadata=_flag(
        "data-parallel degree (default: world size / (tp x pp x cp)); dp x cp x tp x pp must be the world "
        "size", type=int))
    cp: int = field(default=1, metadata=_flag(
        "context-parallel degree (chapter 07): each sequence split over cp ranks, attention across them; "
        "--seq-len must divide by 2 x cp (ring) or cp (ulysses)", type=int))
    tp: int = field(default=1, metadata=_flag(
        "tensor-parallel degree (chapter 06): heads, MLP and vocabulary split over tp ranks that see the "
        "same batch; must divide --num-heads, 4 x --hidden-size and 256", type=int))
    pp: int = field(default=1, metadata=_flag(
        "pipeline-parallel degree (chapter 08): the blocks cut into pp stages, the batch run through them in "
        "micro-batches; composes with --dp, --tp, --cp and --zero-stage 0-3", type=int))
    dp_replicate: int = field(default=1, metadata=_flag(
        "with --zero-stage 3: hybrid sharding (HSDP), the dp ranks as R replicas of dp/R adjacent ranks that "
        "shard the model (inside a node); R must divide dp", type=int, metavar="R"))
    ep: int = field(default=1, metadata=_flag(
        "expert-parallel degree (chapter 09): each MoE block's experts split over ep consecutive ranks of "
        "the dp x cp ranks (torchtitan's dp2ep); must divide dp x cp and --moe-experts", type=int))
    zero_stage: int = field(default=0, metadata=_flag(
        "0: data parallel; 1/2: sharded optimizer state (and gradients); 3: fully sharded",
        type=int, choices=(0, 1, 2, 3)))
    precision: str = field(default="fp32", metadata=_flag(
        "compute dtype (autocast over fp32 weights; fp16 adds a dynamic loss scaler; fp8: bf16 autocast with "
        "the linears' GEMMs in fp8, the first and last linear kept in bf16)", choices=PRECISIONS))
    fp8_scaling: str = field(default="tensorwise", metadata=_flag(
        "with --precision fp8: torchao's recipe, one dynamic scale per tensor (tensorwise) or per row, "
        "power-of-two scales and e4m3 gradients (rowwise)", choices=FP8_SCALINGS))
    sequence_parallel: bool = field(default=False, metadata=_flag(
        "with --tp > 1: split the activations outside the tensor-parallel regions along the sequence "
        "(Korthikanti et al. 2022); --seq-len must divide by --tp", action="store_true"))
    tp_comm_overlap: bool = field(default=False, metadata=_flag(
        "with --sequence-parallel: each linear's all-gather / reduce-scatter as a ring whose transfers hide "
        "behind the matmul of a sequence chunk (collective matmul, Wang et al. 2023; Megatron's "
        "--tp-comm-overlap)", action="store_true"))
    cp_method: str = field(default="ring", metadata=_flag(
        "with --cp > 1: ring attention (K/V blocks round a ring, zig-zag split for causal balance) or "
        "Ulysses (all-to-alls to head shards; the heads per tp rank must divide by cp)", choices=CP_METHODS))
    cp_layout: str | None = None
    pp_schedule: str = field(default="1f1b", metadata=_flag(
        "with --pp > 1: the pipeline schedule (zbh1: the handcrafted zero-bubble schedule ZB-H1 of Qi et al. "
        "2023; zbv: its ZB-V, two chunks per rank in a V, with --virtual-stages 2)", choices=PP_SCHEDULES))
    virtual_stages: int = field(default=1, metadata=_flag(
        "with --pp-schedule interleaved: model chunks per pipeline rank (zbv: 2)", type=int, metavar="V"))
    pp_balance: str = field(default="layers", metadata=_flag(
        "with --pp > 1: cut the blocks into equal counts or equal parameters per stage", choices=PP_BALANCES))
    microbatches: int | None = field(default=None, metadata=_flag(
        "with --pp > 1: pipeline micro-batches per step and data-parallel rank (default: per-rank batch / "
        "--micro-batch-size, else pp)", type=int, metavar="M"))
    activation_checkpointing: str | None = field(default=None, metadata=_flag(
        "recompute blocks in backward: all (the default when given), every-N, or 0,2,-1",
        nargs="?", const="all", metavar="BLOCKS"))
    bucket_cap_mb: float = 25.0
    zero_bucket_numel: int = 2**20
    prefetch: bool = False
    reshard_after_forward: bool = True
    zero3_reshard_per_microbatch: bool = field(default=False, metadata=_flag(
        "with --pp > 1 and --zero-stage 3: gather each stage's weights and reduce its gradients per "
        "micro-batch (m times the collectives, less memory) instead of once per step", action="store_true"))

    def __post_init__(self) -> None:
        degrees = ("cp", "tp", "pp", "dp_replicate", "ep", "virtual_stages")
        for name in degrees + (("dp",) if self.dp is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag_of(name)}: {name} must be a positive integer, got {value!r}")
        if self.dp is not None and self.dp % self.dp_replicate:
            raise ConfigError(f"--dp-replicate: dp_replicate {self.dp_replicate} must divide dp {self.dp} "
                              "(HSDP: dp = dp_replicate x dp_shard)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name, known in (("precision", PRECISIONS), ("fp8_scaling", FP8_SCALINGS),
                            ("cp_method", CP_METHODS), ("pp_schedule", PP_SCHEDULES),
                            ("pp_balance", PP_BALANCES)):
            if (value := getattr(self, name)) not in known:
                raise ConfigError(f"{flag_of(name)}: {name} must be one of {known}, got {value!r}")
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
            try:
                parse_block_selection(self.activation_checkpointing)  # a bad selection fails here
            except ConfigError as exc:
                raise ConfigError(f"--activation-checkpointing: {exc}") from None

    def checkpointed_blocks(self, num_layers: int) -> list[int]:
        """The indices of the blocks ``activation_checkpointing`` recomputes in a model of ``num_layers``
        (negative indices count from the end; out of range: none), as the planner counts them."""
        if self.activation_checkpointing is None:
            return []
        n, sel = num_layers, parse_block_selection(self.activation_checkpointing)
        if isinstance(sel, str):  # "all" or "none"
            return list(range(n)) if sel == "all" else []
        if callable(sel):
            return [i for i in range(n) if sel(i)]
        return sorted({i % n for i in sel if -n <= i < n})

    @property
    def degrees(self) -> Degrees:
        """``{"dp": ..., "cp": ..., "tp": ..., "pp": ..., "dp_replicate": ..., "ep": ...}`` (dp None: derived
        from the world size)."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp, "dp_replicate": self.dp_replicate,
                "ep": self.ep}

    @property
    def fsdp_mixed_precision(self) -> bool:
        """ZeRO-3 in 16 bits as FSDP2: 16-bit gathered weights over fp32 master shards."""
        return self.zero_stage == 3 and self.precision != "fp32"
