"""The trainer's flags and what they become: ``build_parser``, ``config_from_args`` (a
``refimpl.config.TrainConfig``) and ``options_from_args`` (a ``RunOptions``: the layout and its
techniques as one ``refimpl.config.ParallelConfig``, whose fields give the parallelism flags, then
checkpoints and faults, chapters 03-05 and 09)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from refimpl import elastic
from refimpl.checkpoint import CheckpointConfig
from refimpl.config import (
    ARCHS,
    MOE_LOAD_BALANCE,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    flag_of,
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
    """The parallelism and precision flags: one per field of ``refimpl.config.ParallelConfig`` that
    declares one (its help, choices and metavar are the field's metadata), its default the field's."""
    par = p.add_argument_group("parallelism and precision")
    for f in _layout_fields():
        keywords = f.metadata["flag"] | ({"type": _schedule} if f.name == "pp_schedule" else {})
        par.add_argument(flag_of(f.name), dest=f.name, default=f.default, **keywords)


def _layout_fields() -> list[dataclasses.Field]:
    """The fields of ``refimpl.config.ParallelConfig`` that are flags, in its order."""
    return [f for f in dataclasses.fields(ParallelConfig) if "flag" in f.metadata]


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
    """What the trainer does beyond ``TrainConfig``: the layout and its techniques (``parallel``, one
    ``refimpl.config.ParallelConfig``, which checks its own values), checkpoints, faults, the report.

    The defaults (one data-parallel layout, no checkpoint folder, no fault) are those of ``train`` called
    from Python: ``RunOptions(parallel=ParallelConfig(tp=2, sequence_parallel=True))``.
    """

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig | None = None
    faults: elastic.FaultPlan = field(default_factory=elastic.FaultPlan)
    sigterm_grace_s: float | None = 60.0  # SaveSchedule: after a SIGTERM, exit at once past this
    sleep_in_step_s: float = 0.0  # tests only: each step sleeps this long after its first forward
    report: bool = True  # at the end, rank 0: loss.png, a text sample, summary.json (--no-report: none)

    def __post_init__(self) -> None:
        if self.sigterm_grace_s is not None and not self.sigterm_grace_s >= 0:
            raise ConfigError(f"--sigterm-grace must be >= 0 seconds, got {self.sigterm_grace_s}")
        check_supported(self.parallel)  # the combinations refused: refimpl/support.py, written once

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout of ``world_size`` ranks (checked: the degrees' product is the world size)."""
        return ParallelDims.from_world(world_size, **self.parallel.degrees)

    def to_dict(self) -> dict:
        """The layout and its techniques as config.json's ``run`` (every field of ``ParallelConfig``)."""
        return dataclasses.asdict(self.parallel)


def options_from_args(args: argparse.Namespace) -> RunOptions:
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
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
    parallel = ParallelConfig(**{f.name: getattr(args, f.name) for f in _layout_fields()})
    return RunOptions(parallel=parallel, checkpoint=checkpoint, faults=faults,
                      sigterm_grace_s=args.sigterm_grace, sleep_in_step_s=args.test_sleep_in_step,
                      report=args.report)
