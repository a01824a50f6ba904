"""The trainer's flags and what they become: ``build_parser``, ``config_from_args`` (a
``refimpl.config.TrainConfig``) and ``options_from_args`` (a ``RunOptions``: parallelism,
precision, checkpoints and faults, chapters 03-05 and 09)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from refimpl import elastic
from refimpl.checkpoint import CheckpointConfig
from refimpl.config import (
    ARCHS,
    CP_METHODS,
    FP8_SCALINGS,
    MOE_LOAD_BALANCE,
    PP_BALANCES,
    PP_SCHEDULES,
    PRECISIONS,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from refimpl.distributed import ParallelDims
from refimpl.support import check_supported, describe_support_table


def _schedule(text: str) -> str:
    """A ``--pp-schedule`` value; ``zb1p`` (the old name of ``zbh1``) is refused with the right name."""
    if text == "zb1p":
        raise argparse.ArgumentTypeError(
            "zb1p is the paper's searched ZB-1p schedule, which is not built here; the handcrafted "
            "zero-bubble schedule is ZB-H1: use --pp-schedule zbh1")
    return text


def _steps(text: str) -> tuple[int, ...]:
    try:
        return elastic.parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _ListLayouts(argparse.Action):
    """``--list-layouts``: print the support table (refimpl/support.py) and exit 0, as ``--help`` does."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe_support_table())
        parser.exit()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: X)`` after a flag's help, once: not where the help gives its default itself
    in words (``default: <out>/checkpoints``), nor where there is none to give (an empty list of steps)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or (isinstance(action.default, tuple) and not action.default):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's command line, its flags in ``--help``'s groups (one helper per group, in that order)."""
    p = argparse.ArgumentParser(
        prog="python -m refimpl.train",
        description="Train the course's byte-level GPT with data parallelism or ZeRO, tensor, context and "
        "pipeline parallelism (run under torchrun, or pass --nproc-per-node to launch it). Writes "
        "metrics.jsonl, loss.png, config.json and checkpoints into --out, and resumes from them.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--list-layouts", action=_ListLayouts,
                   help="print the combinations of techniques that are refused, with the reasons, and exit")
    _add_run_flags(p)
    _add_model_flags(p)
    _add_moe_flags(p)
    _add_parallel_flags(p)
    _add_checkpoint_flags(p)
    _add_fault_flags(p)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The ``run`` flags: steps, batch, learning rate, data, the run folder, the launch."""
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=200, help="optimizer steps")
    run.add_argument("--batch-size", type=int, default=16, help="global batch in sequences (all ranks)")
    run.add_argument("--micro-batch-size", type=int, default=None,
                     help="sequences per rank per forward; fewer than batch/ranks means gradient "
                     "accumulation")
    run.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    run.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    run.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and sampling")
    run.add_argument("--data", default=None,
                     help="a text file or a folder of text files (default: Python's standard library source)")
    run.add_argument("--cache-dir", default=None, help="where prepared token files are kept")
    run.add_argument("--out", default="runs/default", help="the run folder")
    run.add_argument("--log-every", type=int, default=10, help="print a line every N steps")
    run.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                     help="at the end, rank 0 writes loss.png, a text sample and summary.json (--no-report: "
                     "not, for sweeps and tests)")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    run.add_argument("--force", action="store_true",
                     help="start even when the planner's memory per rank exceeds the machine's memory")
    run.add_argument("--nproc-per-node", default=None,
                     help="launch this many ranks with torchrun ('auto' = one per GPU, else 2 CPU ranks)")
    run.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                     help="gloo: CPU ranks, also on a GPU box; nccl: a GPU per rank (default: nccl when each "
                     "rank gets a GPU, gloo without CUDA; too few GPUs for the ranks is refused)")
    run.add_argument("--link", default=None, metavar="RATE",
                     help="with --nproc-per-node: the ranks' traffic crosses a loopback shaped to RATE (e.g. "
                     "400mbit, 1gbit) in a private network namespace (Linux: unshare and tc, iproute2), so "
                     "communication sets the pace as on a cluster's network")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="with --nproc-per-node: torchrun restarts the ranks this often after a failure")
    run.add_argument("--demo-fault", action=argparse.BooleanOptionalAction, default=None,
                     help="with --nproc-per-node: kill the last rank once after the first checkpoint, to "
                     "demonstrate the restart and the resume (default: only when no other flag is given, "
                     "as in `make train`)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The ``model`` flags and those of multi-head latent attention (``--arch deepseek``)."""
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-heads", type=int, default=4, help="attention heads; must divide --hidden-size")
    model.add_argument("--no-tie-embeddings", action="store_true", help="untie input and output embeddings")
    model.add_argument("--arch", choices=tuple(ARCHS), default="gpt2",
                       help="gpt2: LayerNorm, learned positions, GELU, biases, tied embeddings; llama: "
                       "RMSNorm, RoPE, SwiGLU, no biases, an untied output layer (chapter 01); deepseek: the "
                       "llama form with multi-head latent attention (give --kv-lora-rank, "
                       "--qk-nope-head-dim, --qk-rope-head-dim, --v-head-dim) and, with --moe-experts, "
                       "DeepSeek-V3's router: "
                       "sigmoid scores, renormalised top-k, the expert bias, SwiGLU experts (chapter 09)")
    model.add_argument("--num-kv-heads", type=int, default=None, metavar="G",
                       help="key/value heads (grouped-query attention; 1: multi-query); must divide "
                       "--num-heads (default: --num-heads, multi-head attention)")
    model.add_argument("--ffn-hidden-size", type=int, default=None, metavar="F",
                       help="the MLP's width (default 4 x --hidden-size)")
    mla = p.add_argument_group("multi-head latent attention (--arch deepseek; DeepSeek-V2 and V3)")
    mla.add_argument("--kv-lora-rank", type=int, default=None, metavar="C",
                     help="the per-token latent the keys and values are projected up from (what the KV "
                     "cache keeps, with the rotated key); required with --arch deepseek")
    mla.add_argument("--q-lora-rank", type=int, default=None, metavar="C",
                     help="the queries' latent (default: none, the queries projected straight from the "
                     "hidden state, as DeepSeek-V2-Lite)")
    mla.add_argument("--qk-nope-head-dim", type=int, default=None, metavar="N",
                     help="each head's query and key dims without position; required with --arch deepseek")
    mla.add_argument("--qk-rope-head-dim", type=int, default=None, metavar="R",
                     help="each head's rotated query dims and the one rotated key all heads share (even); "
                     "required with --arch deepseek")
    mla.add_argument("--v-head-dim", type=int, default=None, metavar="V",
                     help="each head's value dims; required with --arch deepseek")


def _add_moe_flags(p: argparse.ArgumentParser) -> None:
    """The mixture-of-experts flags (chapter 09)."""
    moe = p.add_argument_group("mixture of experts (chapter 09)")
    moe.add_argument("--moe-experts", type=int, default=0, metavar="E",
                     help="experts per MoE block (0: a dense model); each an MLP of the dense MLP's width")
    moe.add_argument("--moe-top-k", type=int, default=2, metavar="K", help="experts each token is routed to")
    moe.add_argument("--moe-normalize-topk", action=argparse.BooleanOptionalAction, default=None,
                     help="divide each token's K combine weights by their sum (GShard, Mixtral, DeepSeek-V3) "
                     "or keep the raw router scores (Switch); default: renormalise when K > 1 (at K = 1 a "
                     "renormalised weight is 1 and the router learns nothing from the task), always with "
                     "--arch deepseek")
    moe.add_argument("--moe-every", type=int, default=1, metavar="N",
                     help="blocks 0, N, 2N, ... have an MoE MLP (1: every block)")
    moe.add_argument("--moe-capacity-factor", type=float, default=None, metavar="C",
                     help="each expert takes ceil(K T / E x C) of the T tokens of a forward on a rank; the "
                     "rest are dropped (default: dropless)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.01, metavar="A",
                     help="the sequence-wise balance loss's coefficient (DeepSeek-V3's complementary loss "
                     "with --moe-load-balance bias; 0: none)")
    moe.add_argument("--moe-load-balance", choices=MOE_LOAD_BALANCE, default=None,
                     help="aux: the balance loss; bias: also DeepSeek-V3's expert bias, updated before each "
                     "optimizer step from the load summed over the batch's ranks (default: bias with --arch "
                     "deepseek, else aux)")
    moe.add_argument("--moe-shared-experts", type=int, default=0, metavar="S",
                     help="DeepSeekMoE's shared experts: an always-on MLP of S x the expert width in each "
                     "MoE block, added to the routed output (DeepSeek-V3: 1)")
    moe.add_argument("--moe-first-dense", type=int, default=0, metavar="D",
                     help="the first D blocks keep the dense MLP (DeepSeek-V3's first_k_dense_replace: 3)")


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """The parallelism and precision flags: ZeRO, the layout's degrees, pipeline and context
    parallelism."""
    par = p.add_argument_group("parallelism and precision")
    par.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                     help="0: data parallel; 1/2: sharded optimizer state (and gradients); 3: fully sharded")
    par.add_argument("--precision", choices=PRECISIONS, default="fp32",
                     help="compute dtype (autocast over fp32 weights; fp16 adds a dynamic loss scaler; fp8: "
                     "bf16 autocast with the linears' GEMMs in fp8, the first and last linear kept in bf16)")
    par.add_argument("--fp8-scaling", choices=FP8_SCALINGS, default="tensorwise",
                     help="with --precision fp8: torchao's recipe, one dynamic scale per tensor (tensorwise) "
                     "or per row, power-of-two scales and e4m3 gradients (rowwise)")
    par.add_argument("--activation-checkpointing", nargs="?", const="all", default=None, metavar="BLOCKS",
                     help="recompute blocks in backward: all (the default when given), every-N, or 0,2,-1")
    par.add_argument("--dp", type=int, default=None,
                     help="data-parallel degree (default: world size / (tp x pp x cp)); dp x cp x tp x pp "
                     "must be the world size")
    par.add_argument("--dp-replicate", type=int, default=1, metavar="R",
                     help="with --zero-stage 3: hybrid sharding (HSDP), the dp ranks as R replicas of dp/R "
                     "adjacent ranks that shard the model (inside a node); R must divide dp")
    par.add_argument("--ep", type=int, default=1,
                     help="expert-parallel degree (chapter 09): each MoE block's experts split over ep "
                     "consecutive ranks of the dp x cp ranks (torchtitan's dp2ep); must divide dp x cp and "
                     "--moe-experts")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel degree (chapter 06): heads, MLP and vocabulary split over tp "
                     "ranks that see the same batch; must divide --num-heads, 4 x --hidden-size and 256")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="with --tp > 1: split the activations outside the tensor-parallel regions along "
                     "the sequence (Korthikanti et al. 2022); --seq-len must divide by --tp")
    par.add_argument("--tp-comm-overlap", action="store_true",
                     help="with --sequence-parallel: each linear's all-gather / reduce-scatter as a ring "
                     "whose transfers hide behind the matmul of a sequence chunk (collective matmul, Wang "
                     "et al. 2023; Megatron's --tp-comm-overlap)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline-parallel degree (chapter 08): the blocks cut into pp stages, the batch "
                     "run through them in micro-batches; composes with --dp, --tp, --cp and --zero-stage 0-3")
    par.add_argument("--microbatches", type=int, default=None, metavar="M",
                     help="with --pp > 1: pipeline micro-batches per step and data-parallel rank (default: "
                     "per-rank batch / --micro-batch-size, else pp)")
    par.add_argument("--pp-schedule", type=_schedule, choices=PP_SCHEDULES,
                     default="1f1b", help="with --pp > 1: the pipeline schedule (zbh1: the handcrafted "
                     "zero-bubble schedule ZB-H1 of Qi et al. 2023; zbv: its ZB-V, two chunks per rank in a "
                     "V, with --virtual-stages 2)")
    par.add_argument("--zero3-reshard-per-microbatch", action="store_true",
                     help="with --pp > 1 and --zero-stage 3: gather each stage's weights and reduce its "
                     "gradients per micro-batch (m times the collectives, less memory) instead of once per "
                     "step")
    par.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                     help="with --pp-schedule interleaved: model chunks per pipeline rank (zbv: 2)")
    par.add_argument("--pp-balance", choices=PP_BALANCES, default="layers",
                     help="with --pp > 1: cut the blocks into equal counts or equal parameters per stage")
    par.add_argument("--cp", type=int, default=1,
                     help="context-parallel degree (chapter 07): each sequence split over cp ranks, "
                     "attention across them; --seq-len must divide by 2 x cp (ring) or cp (ulysses)")
    par.add_argument("--cp-method", choices=CP_METHODS, default="ring",
                     help="with --cp > 1: ring attention (K/V blocks round a ring, zig-zag split for "
                     "causal balance) or Ulysses (all-to-alls to head shards; the heads per tp rank must "
                     "divide by cp)")


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The checkpoint flags: folder, schedule, SIGTERM grace, resume."""
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint-dir", default=None, help="default: <out>/checkpoints")
    ck.add_argument("--checkpoint-every", type=int, default=50, help="save every N steps (0: only at the "
                    "end and on SIGTERM)")
    ck.add_argument("--checkpoint-minutes", type=float, default=None, help="also save every T minutes")
    ck.add_argument("--keep-last", type=int, default=3, help="checkpoints kept")
    ck.add_argument("--sigterm-grace", type=float, default=60.0, metavar="S",
                    help="after a SIGTERM, wait this long for the step to end and save; then (or at a second "
                    "SIGTERM) exit at once with status 143, without saving")
    ck.add_argument("--resume", choices=("auto", "never"), default="auto",
                    help="auto: continue from the newest valid checkpoint in the folder; never: refuse a "
                    "folder that holds checkpoints")
    ck.add_argument("--async-checkpoint", action="store_true",
                    help="write checkpoints in a background thread (training goes on after the snapshot)")


def _add_fault_flags(p: argparse.ArgumentParser) -> None:
    """The fault-injection flags (teaching and tests)."""
    fault = p.add_argument_group("fault injection (teaching and tests); STEPS: one step per attempt, "
                                 "e.g. 3 (the first attempt only) or 1,2,2 (the first three)")
    fault.add_argument("--fail-at-step", type=_steps, default=(), metavar="STEPS",
                       help="--fail-rank kills itself (SIGKILL) in the middle of this step")
    fault.add_argument("--hang-at-step", type=_steps, default=(), metavar="STEPS",
                       help="--fail-rank stalls in the middle of this step (the collective timeout ends it)")
    fault.add_argument("--preempt-at-step", type=_steps, default=(), metavar="STEPS",
                       help="--fail-rank receives SIGTERM at the start of this step (save and stop)")
    fault.add_argument("--fail-rank", type=_steps, default=(), metavar="RANKS",
                       help="the rank that fails, per attempt (default: the last rank)")
    fault.add_argument("--test-sleep-in-step", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    fault.add_argument("--fail-node", action="store_true",
                       help="--fail-at-step kills this machine's torchrun agent and its rank (a lost node; "
                       "give it to one agent's command only)")


def _moe_fields(args: argparse.Namespace) -> dict:
    """The MoE fields of ``refimpl.config.ModelConfig`` from the ``--moe-*`` flags (none: dense; the
    form's own where a flag is left at its default: ``--arch deepseek``'s bias balancing, its renormalised
    top-k)."""
    if not args.moe_experts:
        given = [flag for flag, value in (("--moe-shared-experts", args.moe_shared_experts),
                                          ("--moe-first-dense", args.moe_first_dense)) if value]
        if given:
            raise ConfigError(f"{' and '.join(given)}: shared experts and dense first blocks shape the MoE "
                              "blocks: give --moe-experts")
        return {}
    form = ARCHS[args.arch]
    load_balance = args.moe_load_balance or form.get("moe_load_balance", "aux")
    normalize = form.get("moe_normalize_topk") if args.moe_normalize_topk is None else args.moe_normalize_topk
    return {"num_experts": args.moe_experts, "top_k": args.moe_top_k, "moe_every": args.moe_every,
            # the experts as the dense MLP
            "moe_activation": form.get("moe_activation", "swiglu" if args.arch == "llama" else "gelu"),
            "capacity_factor": args.moe_capacity_factor, "aux_loss_coeff": args.moe_aux_loss_coeff,
            "moe_load_balance": load_balance, "moe_normalize_topk": normalize,
            "moe_shared_experts": args.moe_shared_experts, "moe_first_dense": args.moe_first_dense}


def _mla_fields(args: argparse.Namespace) -> dict:
    """Multi-head latent attention's dimensions from their flags, those given (a missing one with ``--arch
    deepseek``, or one given to another form, is ``ConfigError``'s to name)."""
    flags = {"kv_lora_rank": args.kv_lora_rank, "q_lora_rank": args.q_lora_rank,
             "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
             "v_head_dim": args.v_head_dim}
    return {name: value for name, value in flags.items() if value is not None}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {**ARCHS[args.arch], **({"tie_word_embeddings": False} if args.no_tie_embeddings else {}),
              **_mla_fields(args), **_moe_fields(args)}
    return TrainConfig(
        model=ModelConfig(
            **fields,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads,
            ffn_hidden_size=args.ffn_hidden_size,
            max_seq_len=args.seq_len,
        ),
        data=DataConfig(
            data=args.data,
            cache_dir=args.cache_dir,
            seq_len=args.seq_len,
            global_batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            seed=args.seed,
        ),
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps),
        steps=args.steps,
        out=args.out,
        log_every=args.log_every,
        timeout_s=args.timeout,
    )


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What the trainer does beyond ``TrainConfig``: parallelism, precision, checkpoints, faults.

    The defaults (no checkpoint folder, no fault) are those of ``train`` called from Python.
    """

    zero_stage: int = 0
    precision: str = "fp32"
    fp8_scaling: str = "tensorwise"  # with precision fp8: torchao's tensorwise or rowwise recipe
    activation_checkpointing: str | None = None
    checkpoint: CheckpointConfig | None = None
    faults: elastic.FaultPlan = field(default_factory=elastic.FaultPlan)
    sigterm_grace_s: float | None = 60.0  # SaveSchedule: after a SIGTERM, exit at once past this
    sleep_in_step_s: float = 0.0  # tests only: each step sleeps this long after its first forward
    dp: int | None = None  # the layout (refimpl.distributed.ParallelDims); None: world / (tp x pp x cp)
    cp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1  # HSDP: the dp ranks as dp_replicate x dp_shard (ZeRO-3 within a shard group)
    ep: int = 1  # expert parallelism: each MoE block's experts over ep ranks of dp x cp (chapter 09)
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False  # the sequence-parallel linears' collectives as rings (collective matmul)
    cp_method: str = "ring"
    microbatches: int | None = None  # pipeline micro-batches per step and dp rank (None: see --microbatches)
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    pp_balance: str = "layers"
    zero3_reshard_per_microbatch: bool = False  # ZeRO-3 with pp: gather and reduce per micro-batch
    report: bool = True  # at the end, rank 0: loss.png, a text sample, summary.json (--no-report: none)

    def __post_init__(self) -> None:
        ParallelDims(dp=self.dp_replicate if self.dp is None else self.dp, cp=self.cp, tp=self.tp, pp=self.pp,
                     dp_replicate=self.dp_replicate)  # degrees >= 1, dp_replicate divides dp
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"--ep must be a positive integer, got {self.ep!r}")
        if self.virtual_stages < 1:
            raise ConfigError(f"--virtual-stages {self.virtual_stages}: a positive number, above 1 only with "
                              "--pp-schedule interleaved (or 2 with zbv)")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.cp_method not in ("ring", "ulysses"):
            raise ConfigError(f"--cp-method must be ring or ulysses, got {self.cp_method!r}")
        if self.sigterm_grace_s is not None and not self.sigterm_grace_s >= 0:
            raise ConfigError(f"--sigterm-grace must be >= 0 seconds, got {self.sigterm_grace_s}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        check_supported(self.parallel)  # the combinations refused: refimpl/support.py, written once

    @property
    def parallel(self) -> ParallelConfig:
        """The layout and the technique options as one ``refimpl.config.ParallelConfig``."""
        return ParallelConfig(dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp, dp_replicate=self.dp_replicate,
                              ep=self.ep, zero_stage=self.zero_stage,
                              precision=self.precision, fp8_scaling=self.fp8_scaling,
                              sequence_parallel=self.sequence_parallel, tp_comm_overlap=self.tp_comm_overlap,
                              cp_method=self.cp_method, pp_schedule=self.pp_schedule,
                              virtual_stages=self.virtual_stages, pp_balance=self.pp_balance,
                              microbatches=self.microbatches,
                              activation_checkpointing=self.activation_checkpointing,
                              zero3_reshard_per_microbatch=self.zero3_reshard_per_microbatch)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout of ``world_size`` ranks (checked: the degrees' product is the world size)."""
        return ParallelDims.from_world(world_size, dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp,
                                       dp_replicate=self.dp_replicate, ep=self.ep)

    def to_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "precision": self.precision,
                "activation_checkpointing": self.activation_checkpointing, "dp": self.dp, "cp": self.cp,
                "cp_method": self.cp_method, "tp": self.tp, "sequence_parallel": self.sequence_parallel,
                "pp": self.pp, "pp_schedule": self.pp_schedule, "virtual_stages": self.virtual_stages,
                "microbatches": self.microbatches, "dp_replicate": self.dp_replicate,
                "zero3_reshard_per_microbatch": self.zero3_reshard_per_microbatch} | (
                    {"ep": self.ep} if self.ep > 1 else {}) | (
                    {"tp_comm_overlap": True} if self.tp_comm_overlap else {}) | (
                    {"fp8_scaling": self.fp8_scaling} if self.precision == "fp8" else {})


def options_from_args(args: argparse.Namespace) -> RunOptions:
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.activation_checkpointing is not None:
        from refimpl.parallel.activation_checkpoint import parse_block_selection

        try:
            parse_block_selection(args.activation_checkpointing)
        except ValueError as exc:
            raise ConfigError(f"--activation-checkpointing: {exc}") from None
    checkpoint = CheckpointConfig(
        folder=args.checkpoint_dir or str(Path(args.out) / "checkpoints"),
        keep_last=args.keep_last,
        async_save=args.async_checkpoint,
        every_steps=args.checkpoint_every or None,
        every_minutes=args.checkpoint_minutes,
        resume=args.resume,
    )
    faults = elastic.FaultPlan(fail_at_step=args.fail_at_step, hang_at_step=args.hang_at_step,
                               preempt_at_step=args.preempt_at_step, rank=args.fail_rank, node=args.fail_node)
    return RunOptions(zero_stage=args.zero_stage, precision=args.precision, fp8_scaling=args.fp8_scaling,
                      activation_checkpointing=args.activation_checkpointing, checkpoint=checkpoint,
                      faults=faults, sigterm_grace_s=args.sigterm_grace,
                      sleep_in_step_s=args.test_sleep_in_step,
                      dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp, dp_replicate=args.dp_replicate,
                      ep=args.ep,
                      sequence_parallel=args.sequence_parallel, tp_comm_overlap=args.tp_comm_overlap,
                      cp_method=args.cp_method,
                      microbatches=args.microbatches, pp_schedule=args.pp_schedule,
                      virtual_stages=args.virtual_stages, pp_balance=args.pp_balance,
                      zero3_reshard_per_microbatch=args.zero3_reshard_per_microbatch, report=args.report)
