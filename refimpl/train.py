"""The trainer's command line: ``python -m refimpl.train`` (under torchrun for several ranks).

One process per device. Every rank builds the same model from the same seed, reads its own shard of each
global batch (:class:`refimpl.data.ShardedBatches`), and the gradients are averaged across ranks before
the AdamW step: by data parallelism (:class:`refimpl.parallel.data_parallel.DataParallelBucket`, chapter
03: bucketed all-reduces overlapped with backward), or by ZeRO (``--zero-stage 1/2``: a sharded optimizer;
``3``: a fully sharded module; chapter 04). ``--precision bf16/fp16`` computes under autocast (fp16 with a
dynamic loss scaler; with ``--zero-stage 3`` as FSDP2 instead: 16-bit all-gathered weights over fp32 master
shards, gradients reduced in fp32) and ``--activation-checkpointing`` recomputes blocks in backward
(chapter 05).

**Checkpoints and restarts** (chapter 09). The run saves its whole training state into
``--checkpoint-dir`` (default ``<out>/checkpoints``) every ``--checkpoint-every`` steps and/or
``--checkpoint-minutes`` minutes, on SIGTERM (then it stops: exit status 143) and at the end. A run
pointed at a folder that holds checkpoints resumes from the newest one that verifies (``--resume auto``)
and gives, bit for bit, the losses of an uninterrupted run; ``--resume never`` refuses such a folder
(except the checkpoints of its own job after an elastic restart: :func:`refimpl.elastic.resume_mode`).
Under ``torchrun --max-restarts R`` a failed rank restarts the whole group, which resumes from the disk
(never from the restart counter, which is per agent and read for the report only); at a smaller world
size the checkpoint is resharded. ``--fail-at-step``, ``--hang-at-step`` and ``--preempt-at-step``
inject faults (:class:`refimpl.elastic.FaultPlan`). Each step appends a JSON line to
``<out>/metrics.jsonl`` (a resumed run first drops the lines of the steps it replays); the end of the run
writes ``loss.png``, ``config.json``, ``summary.json`` (restarts, resume point) and a text sample.

    python -m refimpl.train --steps 200                       # one process
    python -m refimpl.train --nproc-per-node 2                # launches torchrun for you (CPU: gloo)
    torchrun --nproc-per-node=8 --max-restarts=3 -m refimpl.train --batch-size 64 --out runs/gpu

**The default self-launched run is a demonstration** (``make train``, i.e. ``--nproc-per-node auto`` and no
other flag): the trainer starts ``torchrun --max-restarts 3`` and kills its last rank once, half-way
between the first and the second checkpoint, so that the run shows the restart and the resume and still
finishes. Any other self-launched command line runs without a fault unless ``--demo-fault`` is given
(``--no-demo-fault`` turns the demonstration off in the default run); a trainer started by your own
``torchrun`` never injects a fault unasked.

Bad input (an unknown flag, a missing data path, an empty corpus, heads that do not divide the width, more
ranks than the data can feed, a checkpoint folder of another run) stops with one line on stderr and exit
status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from refimpl import elastic
from refimpl.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    SaveSchedule,
    expected_shapes,
    find_latest_valid,
    list_checkpoints,
    load_training_state,
    save_training_state,
)
from refimpl.comm import ops
from refimpl.config import ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from refimpl.data import DataError, ShardedBatches, decode, encode, prepare_corpus
from refimpl.distributed import (
    DistributedContext,
    ParallelDims,
    init_distributed,
    log0,
    seed_everything,
    teardown,
)
from refimpl.metrics import Throughput, format_bytes, format_mfu, peak_dtype, peak_memory_bytes, progress
from refimpl.model import GPT, generate, lm_loss
from refimpl.optim import build_optimizer, lr_at, param_groups, set_lr
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.planner import flops_per_token, param_count
from refimpl.precision import PRECISIONS, MixedPrecision, MixedPrecisionPolicy

SIGTERM_EXIT = 143  # 128 + SIGTERM: "stopped, not finished" for schedulers and torchrun


class Preempted(Exception):
    """The run saved its state on SIGTERM and stopped after ``step`` completed steps."""

    def __init__(self, step: int, path: Path | None) -> None:
        super().__init__(f"stopped on SIGTERM after saving step {step} in {path}; run the same command "
                         "again to resume")
        self.step, self.path = step, path


def _steps(text: str) -> tuple[int, ...]:
    try:
        return elastic.parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refimpl.train",
        description="Train the course's byte-level GPT with data parallelism or ZeRO (run under torchrun, "
        "or pass --nproc-per-node to launch it). Writes metrics.jsonl, loss.png, config.json and "
        "checkpoints into --out, and resumes from them.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    run.add_argument("--force", action="store_true",
                     help="start even when the planner's memory per rank exceeds the machine's memory")
    run.add_argument("--nproc-per-node", default=None,
                     help="launch this many ranks with torchrun ('auto' = one per GPU, else 2 CPU ranks)")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="with --nproc-per-node: torchrun restarts the ranks this often after a failure")
    run.add_argument("--demo-fault", action=argparse.BooleanOptionalAction, default=None,
                     help="with --nproc-per-node: kill the last rank once after the first checkpoint, to "
                     "demonstrate the restart and the resume (default: only when no other flag is given, "
                     "as in `make train`)")
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-heads", type=int, default=4, help="attention heads; must divide --hidden-size")
    model.add_argument("--no-tie-embeddings", action="store_true", help="untie input and output embeddings")
    par = p.add_argument_group("parallelism and precision")
    par.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                     help="0: data parallel; 1/2: sharded optimizer state (and gradients); 3: fully sharded")
    par.add_argument("--precision", choices=PRECISIONS, default="fp32",
                     help="compute dtype (autocast over fp32 weights; fp16 adds a dynamic loss scaler)")
    par.add_argument("--activation-checkpointing", nargs="?", const="all", default=None, metavar="BLOCKS",
                     help="recompute blocks in backward: all (the default when given), every-N, or 0,2,-1")
    par.add_argument("--dp", type=int, default=None,
                     help="data-parallel degree (default: world size / (tp x pp x cp)); dp x cp x tp x pp "
                     "must be the world size")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (chapter 06; not built yet)")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (chapter 08; not built yet)")
    par.add_argument("--cp", type=int, default=1, help="context-parallel degree (chapter 07; not built yet)")
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
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_heads,
            max_seq_len=args.seq_len,
            tie_word_embeddings=not args.no_tie_embeddings,
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
    """What the trainer does beyond :class:`TrainConfig`: parallelism, precision, checkpoints, faults.

    The defaults (no checkpoint folder, no fault) are those of :func:`train` called from Python.
    """

    zero_stage: int = 0
    precision: str = "fp32"
    activation_checkpointing: str | None = None
    checkpoint: CheckpointConfig | None = None
    faults: elastic.FaultPlan = field(default_factory=elastic.FaultPlan)
    sigterm_grace_s: float | None = 60.0  # SaveSchedule: after a SIGTERM, exit at once past this
    sleep_in_step_s: float = 0.0  # tests only: each step sleeps this long after its first forward
    dp: int | None = None  # the layout (refimpl.distributed.ParallelDims); None: world / (tp x pp x cp)
    cp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        ParallelDims(dp=1 if self.dp is None else self.dp, cp=self.cp, tp=self.tp, pp=self.pp)  # degrees >= 1
        for flag, degree, chapter in (("--tp", self.tp, "06 tensor parallelism"),
                                      ("--pp", self.pp, "08 pipeline parallelism"),
                                      ("--cp", self.cp, "07 context parallelism")):
            if degree > 1:
                raise ConfigError(f"{flag} {degree}: not built yet (chapter {chapter} builds it); "
                                  "today the trainer runs --dp only")
        if self.sigterm_grace_s is not None and not self.sigterm_grace_s >= 0:
            raise ConfigError(f"--sigterm-grace must be >= 0 seconds, got {self.sigterm_grace_s}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.zero_stage == 3 and self.activation_checkpointing not in (None, "none"):
            # FullyShardedDataParallel registers the gathered parameters in the modules only around the
            # unit's forward; the recomputation in backward would run on the shards.
            raise ConfigError("--activation-checkpointing does not work with --zero-stage 3 yet (the "
                              "recomputed forward would see the parameter shards); use --zero-stage 1 or 2")

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout of ``world_size`` ranks (checked: the degrees' product is the world size)."""
        return ParallelDims.from_world(world_size, dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp)

    def to_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "precision": self.precision,
                "activation_checkpointing": self.activation_checkpointing}


def options_from_args(args: argparse.Namespace) -> RunOptions:
    if args.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.activation_checkpointing is not None:
        from refimpl.activations import parse_block_selection

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
    return RunOptions(zero_stage=args.zero_stage, precision=args.precision,
                      activation_checkpointing=args.activation_checkpointing, checkpoint=checkpoint,
                      faults=faults, sigterm_grace_s=args.sigterm_grace,
                      sleep_in_step_s=args.test_sleep_in_step,
                      dp=args.dp, cp=args.cp, tp=args.tp, pp=args.pp)


def check_fits(config: TrainConfig, world_size: int) -> ShardedBatches:
    """Everything that can be refused before a process group exists: batch split and data size."""
    config.data.accumulation_steps(world_size)
    corpus = prepare_corpus(config.data.data, config.data.cache_dir)
    return ShardedBatches(corpus.tokens, seq_len=config.data.seq_len,
                          global_batch_size=config.data.global_batch_size, seed=config.data.seed)


MEMORY_ENV = "REFIMPL_MEMORY_BYTES"  # tests: this node's memory in bytes, instead of the measured figure


def machine_memory_per_rank(ranks_per_node: int, *, local_rank: int = 0,
                            launching: bool = False) -> tuple[int, str]:
    """The bytes one rank may use and where the figure comes from: on a GPU its free memory
    (``torch.cuda.mem_get_info``; the self-launcher reads the total instead, to create no CUDA context in
    itself), on a CPU the node's available memory (psutil, else /proc/meminfo) over its ranks."""
    per = max(ranks_per_node, 1)
    if os.environ.get(MEMORY_ENV):
        try:
            node = int(os.environ[MEMORY_ENV])
        except ValueError:
            raise ConfigError(f"{MEMORY_ENV} must be a number of bytes, got "
                              f"{os.environ[MEMORY_ENV]!r}") from None
        return node // per, f"{MEMORY_ENV} {format_bytes(node)} / {per} rank(s) on this node"
    from refimpl.distributed import choose_device

    device, _ = choose_device(local_rank, per)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if launching:
            return torch.cuda.get_device_properties(device).total_memory, f"the total memory of the {name}"
        return torch.cuda.mem_get_info(device)[0], f"the free memory of the {name} (torch.cuda.mem_get_info)"
    try:
        import psutil

        node = psutil.virtual_memory().available
    except ImportError:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        node = int(fields["MemAvailable"].split()[0]) * 1024
    return node // per, f"available memory {format_bytes(node)} / {per} rank(s) on this node"


def preflight_memory(config: TrainConfig, options: RunOptions, *, world_size: int, ranks_per_node: int,
                     force: bool = False, local_rank: int = 0, launching: bool = False):
    """Refuse, before any process starts, a run whose planned bytes per rank exceed the machine's:
    :func:`refimpl.planner.run_memory_per_rank` (model state by ZeRO stage and precision + one micro-batch's
    activations) against :func:`machine_memory_per_rank`. ``force``: warn and go on. Returns the estimate."""
    from refimpl.planner import run_memory_per_rank

    accumulation = config.data.accumulation_steps(world_size)  # a bad split is refused here too
    micro = config.data.per_rank_batch(world_size) // accumulation
    n, chosen = config.model.num_layers, []
    if options.activation_checkpointing is not None:
        from refimpl.activations import parse_block_selection

        sel = parse_block_selection(options.activation_checkpointing)
        chosen = (list(range(n)) if sel == "all" else [] if sel == "none" else
                  [i for i in range(n) if sel(i)] if callable(sel) else [i % n for i in sel if -n <= i < n])
    need = run_memory_per_rank(config.model, micro_batch=micro, seq_len=config.data.seq_len,
                               world_size=world_size, zero_stage=options.zero_stage,
                               precision=options.precision, checkpointed_blocks=chosen)
    have, source = machine_memory_per_rank(ranks_per_node, local_rank=local_rank, launching=launching)
    if need.total > have:
        what = (f"the run needs about {format_bytes(need.total)} per rank (planner: {need.describe()}; "
                f"micro-batch {micro} x {config.data.seq_len} tokens) but this machine has "
                f"{format_bytes(have)} per rank ({source})")
        if not force:
            raise ConfigError(f"{what}; use a shorter --seq-len, a smaller --micro-batch-size, "
                              "--activation-checkpointing, a higher --zero-stage or more ranks, or --force")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: {what}; starting anyway (--force)", file=sys.stderr, flush=True)
    return need


# -- resuming the same run -------------------------------------------------------------------------------

def _run_signature(train_config: dict) -> dict:
    """The settings a checkpoint must share with the run that resumes it (the arithmetic depends on them);
    the world size, ZeRO stage, precision and logging may change."""
    data = train_config.get("data", {})
    sig = {f"model.{k}": v for k, v in train_config.get("model", {}).items()}
    sig |= {f"optim.{k}": v for k, v in train_config.get("optim", {}).items()}
    sig |= {f"data.{k}": data.get(k) for k in ("data", "seq_len", "global_batch_size", "seed")}
    sig["steps"] = train_config.get("steps")
    return json.loads(json.dumps(sig))


def check_same_run(saved: dict | None, config: TrainConfig, where: object) -> None:
    """Refuse to resume a checkpoint written with other model/data/optimizer settings or step count."""
    if not saved or "train" not in saved:
        return
    before, now = _run_signature(saved["train"]), _run_signature(config.to_dict())
    diffs = [f"{k}: {before.get(k)!r} in the checkpoint, {v!r} now" for k, v in now.items()
             if before.get(k) != v]
    if diffs:
        raise ConfigError(f"{where} was written by another run configuration ({'; '.join(diffs)}); resume "
                          "with the same flags, or use another --out / --checkpoint-dir")


def preflight_resume(config: TrainConfig, options: RunOptions) -> None:
    """Before launching: refuse a folder that ``--resume never`` or the run's settings would refuse."""
    if options.checkpoint is None:
        return
    found = list_checkpoints(options.checkpoint.folder)
    if not found:
        return
    if options.checkpoint.resume == "never":
        raise CheckpointError(f"{options.checkpoint.folder} already holds checkpoints (newest "
                              f"{found[0].name}) and --resume never refuses to overwrite them; use "
                              "--resume auto or another folder")
    from refimpl.checkpoint import read_manifest

    try:
        manifest = read_manifest(found[0])
    except CheckpointError:
        return  # the ranks will verify, skip it and say why
    check_same_run(manifest.get("config"), config, found[0])


# -- the model, its parallel wrapper, the optimizer ------------------------------------------------------

@dataclass(kw_only=True)
class _Setup:
    model: torch.nn.Module  # the plain GPT (ZeRO-3: its parameters are shards)
    forward: torch.nn.Module  # what the batch goes through
    state_module: torch.nn.Module  # what checkpoints save (FSDP for ZeRO-3)
    optimizer: torch.optim.Optimizer
    mp: MixedPrecision
    dp: DataParallelBucket | None = None
    grad_params: list = field(default_factory=list)
    clip_fn: object = None


def build_setup(config: TrainConfig, ctx: DistributedContext, options: RunOptions) -> _Setup:
    """Model, data-parallel or ZeRO wrapper, optimizer and mixed-precision policy of a run."""
    model = GPT(config.model, seed=config.data.seed).to(ctx.device)
    if options.activation_checkpointing is not None:
        from refimpl.activations import apply_activation_checkpointing, parse_block_selection

        apply_activation_checkpointing(model, parse_block_selection(options.activation_checkpointing))
    # ZeRO-3 in 16 bits as FSDP2: 16-bit gathered weights, fp32 master shards, gradients reduced in fp32
    fsdp_mp = options.zero_stage == 3 and options.precision != "fp32"
    mp = MixedPrecision(MixedPrecisionPolicy.from_name(options.precision, master_weights=fsdp_mp), model,
                        device=ctx.device, wrapper_keeps_master=fsdp_mp)
    clip = config.optim.grad_clip
    stage = options.zero_stage
    if stage == 0:
        dp = DataParallelBucket(model) if ctx.world_size > 1 else None  # broadcasts rank 0's weights
        return _Setup(model=model, forward=dp or model, state_module=model, mp=mp, dp=dp,
                      optimizer=build_optimizer(model, config.optim), grad_params=list(model.parameters()))
    from refimpl.parallel.zero import FullyShardedDataParallel, ShardedOptimizer

    if stage in (1, 2):  # every rank built the same weights from the seed: no broadcast needed
        o = config.optim
        optimizer = ShardedOptimizer(param_groups(model, o.weight_decay), torch.optim.AdamW, stage=stage,
                                     lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
        # stage 1 checks the full local gradients (reduced in step), stage 2 the shards it kept
        grads = optimizer.params if stage == 1 else [optimizer.shard(p) for p in optimizer.params]
        return _Setup(model=model, forward=model, state_module=model, mp=mp, optimizer=optimizer,
                      grad_params=list(grads),
                      clip_fn=None if clip is None else (lambda _: optimizer.clip_grad_norm_(clip)))
    fsdp = FullyShardedDataParallel(model, mp_policy=mp.policy if fsdp_mp else None)
    return _Setup(model=model, forward=fsdp, state_module=fsdp, mp=mp,
                  optimizer=build_optimizer(fsdp, config.optim), grad_params=fsdp.sharded_parameters(),
                  clip_fn=None if clip is None else (lambda _: fsdp.clip_grad_norm_(clip)))


def _sampling_model(setup: _Setup, config: TrainConfig, options: RunOptions,
                    ctx: DistributedContext) -> torch.nn.Module | None:
    """A full model to sample from on rank 0 (ZeRO-3 gathers it: collective); None on other ranks."""
    if options.zero_stage != 3:
        return setup.model if ctx.is_main else None
    full = setup.state_module.full_state_dict()
    if not ctx.is_main:
        return None
    model = GPT(config.model, seed=config.data.seed).to(next(iter(full.values())).device)
    model.load_state_dict(full, strict=False)  # a tied output weight is the embedding's
    return model


# -- the loop --------------------------------------------------------------------------------------------

def _read_records(path: Path, before: int) -> list[dict]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before]


def train(config: TrainConfig, ctx: DistributedContext, options: RunOptions | None = None) -> list[dict]:
    """Run the optimizer steps of ``config`` (resuming from ``options.checkpoint`` when it holds a valid
    checkpoint); return the per-step records (also in metrics.jsonl; on rank 0 they include the steps of
    earlier attempts). Raises :class:`Preempted` after the save that follows a SIGTERM."""
    options = options or RunOptions()
    dims = options.parallel_dims(ctx.world_size)  # pp x dp x cp x tp, tp innermost (refimpl.distributed.mesh)
    coords = dims.coordinates(ctx.rank)
    batches = check_fits(config, dims.dp)  # the global batch is split over the data-parallel axis
    seed_everything(config.data.seed, rank=ctx.rank)
    out = Path(config.out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)

    setup = build_setup(config, ctx, options)
    attempt = elastic.restart_count()  # for the report only: the resume decision reads the disk
    job = elastic.run_id()
    start, info, checkpointer, schedule = 0, None, None, None
    if options.checkpoint is not None:
        folder = options.checkpoint.folder
        mode = elastic.resume_mode(options.checkpoint.resume, folder, job)
        checkpointer = Checkpointer(dataclasses.replace(options.checkpoint, resume=mode))
        info = checkpointer.resume_point(expected=expected_shapes(setup.state_module))
        if info is not None:
            check_same_run(info.manifest.get("config"), config, info.path)
            state = load_training_state(checkpointer, info, model=setup.state_module,
                                        optimizer=setup.optimizer, scaler=setup.mp.scaler)
            start = state["step"]
        for reason in info.skipped if info is not None else ():
            log0(ctx, f"checkpoint rejected: {reason}")
        saved_world = info.manifest["world_size"] if info is not None else None
        log0(ctx, f"attempt {attempt} (TORCHELASTIC_RESTART_COUNT of this agent) | "
                  + (f"resuming from {info.path} (step {start}, saved at world size {saved_world}"
                     + (", resharded)" if saved_world != ctx.world_size else ")")
                     if info is not None else f"no checkpoint in {folder}: starting at step 0"))
        if start >= config.steps:
            log0(ctx, f"the run in {folder} is complete (step {start} of {config.steps}): nothing to train; "
                      "use another --out (or --checkpoint-dir) to train again")
        schedule = SaveSchedule(options.checkpoint, device=ctx.device, grace_s=options.sigterm_grace_s)
    if ctx.is_main:
        (out / "config.json").write_text(json.dumps(config.to_dict() | {"run": options.to_dict()}, indent=1))
        earlier = _read_records(out / "metrics.jsonl", start) if start else []
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    else:
        earlier = []

    accumulation = config.data.accumulation_steps(dims.dp)  # per data-parallel rank (TP ranks share a batch)
    micro = config.data.per_rank_batch(dims.dp) // accumulation
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    # MFU divides by every device of the run (all of them compute), not by the data-parallel ranks
    meter = Throughput(tokens_per_step=tokens_per_step, num_devices=dims.world_size, device=ctx.device,
                       flops_per_token=flops_per_token(config.model, config.data.seq_len),
                       dtype=peak_dtype(setup.mp.policy.compute_dtype))  # MFU against this dtype's peak
    log0(ctx, f"model: {param_count(config.model).total:,} parameters | world size {ctx.world_size} on "
              f"{ctx.device.type} ({ctx.backend}) | ZeRO stage {options.zero_stage} | {options.precision} | "
              f"global batch {config.data.global_batch_size} x {config.data.seq_len} tokens = {micro} per "
              f"micro-batch x {accumulation} accumulation x {dims.dp} data-parallel ranks | layout "
              f"{dims.describe()}")

    heartbeat = elastic.Heartbeat(ctx.rank, ctx.world_size)
    faults, mp, dp = options.faults, setup.mp, setup.dp
    fault_args = {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "out": out}
    records: list[dict] = []
    begin = time.perf_counter()
    bar = progress(config.steps, enabled=ctx.is_main, initial=start)
    step = start
    try:
        for step in range(start, config.steps):
            heartbeat.beat(step, 0, "forward")
            faults.before_step(step, **fault_args)
            lr = lr_at(step, config.optim, config.steps)
            set_lr(setup.optimizer, lr)
            inputs, labels = batches.batch(step, coords.dp, dims.dp)  # [B/dp, s] each: this dp rank's shard
            loss_sum = torch.zeros((), device=ctx.device)
            for i in range(accumulation):
                x = inputs[i * micro : (i + 1) * micro].to(ctx.device)
                y = labels[i * micro : (i + 1) * micro].to(ctx.device)
                last = i == accumulation - 1
                # no_sync must wrap the forward too: the wrapper (like DDP) reads the flag in forward
                # (chapter 03's trap). The last micro-batch's backward launches the bucket all-reduces.
                sync = contextlib.nullcontext() if dp is None or last else dp.no_sync()
                with sync:
                    with mp.autocast():
                        logits = setup.forward(x)
                    if i == 0:
                        faults.mid_step(step, **fault_args)  # the others go on into the collectives
                        if options.sleep_in_step_s:  # tests: a step too long for a SIGTERM to wait for
                            print(f"[test] step {step} sleeps {options.sleep_in_step_s:g} s", file=sys.stderr,
                                  flush=True)
                            time.sleep(options.sleep_in_step_s)
                        heartbeat.beat(step, 1, "backward and gradient reduction")
                    # The per-rank mean over the rank's micro-batch, / accumulation; the gradients are then
                    # averaged over equal-sized ranks, which gives the mean over the global batch.
                    loss = lm_loss(logits, y) / accumulation
                    mp.backward(loss)
                loss_sum += loss.detach()
            if dp is not None:
                dp.finish_gradient_synchronization()  # wait for the buckets before clipping and stepping
            heartbeat.beat(step, 2, "optimizer step")
            mp.step(setup.optimizer, grad_clip=config.optim.grad_clip, params=setup.grad_params,
                    clip_fn=setup.clip_fn)
            setup.optimizer.zero_grad(set_to_none=True)

            if ctx.world_size > 1:
                # The mean over the dp x cp ranks (equal token counts). While tp = pp = 1 (the only layouts
                # options allow) WORLD is the dp x cp group; a TP/PP trainer reduces over that group.
                ops.all_reduce(loss_sum)
                loss_sum /= dims.dp * dims.cp
            loss_value = loss_sum.item()
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step}; try a lower --lr")
            tokens_per_s, mfu = meter.step()
            record = {"step": step, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_s,
                      "mfu": mfu, "peak_memory_bytes": peak_memory_bytes(ctx.device),
                      "elapsed_s": time.perf_counter() - begin, "attempt": attempt,
                      "world_size": ctx.world_size}
            if mp.scaler is not None:
                record["loss_scale"] = mp.scale
            records.append(record)
            if ctx.is_main:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}")
                if step % config.log_every == 0 or step == config.steps - 1:
                    bar.write(f"step {step:5d} | loss {loss_value:.4f} | lr {lr:.2e} | "
                              f"{tokens_per_s:,.0f} tok/s | MFU {format_mfu(mfu)} | "
                              f"peak mem {format_bytes(record['peak_memory_bytes'])}")

            if schedule is not None:
                done = step + 1
                if schedule.due(done) or done == config.steps:  # due() is collective: always call it
                    heartbeat.beat(step, 3, "checkpoint")
                    save_training_state(checkpointer, done, model=setup.state_module,
                                        optimizer=setup.optimizer, scaler=mp.scaler,
                                        extra={"run_id": job, "attempt": attempt},
                                        config={"train": config.to_dict(), "run": options.to_dict()})
                    if schedule.stop_requested:
                        path = checkpointer.wait()
                        bar.close()
                        log0(ctx, f"SIGTERM: saved step {done} in {path}; stopping")
                        raise Preempted(done, path)
    except Exception as exc:
        if ctx.world_size > 1 and not isinstance(exc, (Preempted, ConfigError, DataError)):
            report = heartbeat.explain()
            first = (str(exc).splitlines() or [""])[0][:300]
            print(f"[rank {ctx.rank}] step {step} failed: {type(exc).__name__}: {first}\n  {report}",
                  file=sys.stderr, flush=True)
            elastic.record_failure(out, rank=ctx.rank, step=step, kind="error",
                                   message=f"{type(exc).__name__} ({report.splitlines()[-1].strip()})")
        raise
    finally:
        if schedule is not None:
            schedule.close()
    bar.close()
    if checkpointer is not None:
        checkpointer.close()  # an asynchronous save commits before the run ends

    sampler = _sampling_model(setup, config, options, ctx)
    all_records = earlier + records
    if ctx.is_main and all_records:
        from refimpl.viz import plot_loss

        title = f"{out.name}: loss over {config.steps} steps"
        title += f" (resumed at step {start})" if start else ""
        plot_loss({"train": ([r["step"] for r in all_records], [r["loss"] for r in all_records])},
                  path=out / "loss.png", title=title)
        sampler.eval()
        sample = decode(generate(sampler, encode("def ").to(ctx.device), max_new_tokens=120,
                                 seed=config.data.seed))
        (out / "sample.txt").write_text(sample)
        summary = {"restart_count": attempt, "resumed_from_step": start if info is not None else None,
                   "resumed_from": str(info.path) if info is not None else None,
                   "checkpoint_world_size": info.manifest["world_size"] if info is not None else None,
                   "world_size": ctx.world_size, "steps": config.steps,
                   "first_loss": all_records[0]["loss"], "final_loss": all_records[-1]["loss"]}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        restarts = (f"restarts: {attempt} (this agent's TORCHELASTIC_RESTART_COUNT); "
                    + (f"resumed from step {start} ({info.path}) at world size {ctx.world_size}"
                       if info is not None else "started from step 0"))
        log0(ctx, f"done: loss {all_records[0]['loss']:.3f} -> {all_records[-1]['loss']:.3f} in "
                  f"{time.perf_counter() - begin:.1f} s; {restarts}; wrote {out}/metrics.jsonl, loss.png\n"
                  f"sample:\n{sample}")
    return all_records


# -- the command line ------------------------------------------------------------------------------------

def _demo_fault_step(config: TrainConfig, options: RunOptions) -> int:
    """Half-way between the first and the second checkpoint (or half-way through a short run)."""
    every = options.checkpoint.every_steps if options.checkpoint else None
    if every and every + every // 2 < config.steps:
        return every + every // 2
    return config.steps // 2


def demo_fault_flags(args: argparse.Namespace, rest: list[str], nproc: int) -> list[str]:
    """The fault flags the self-launch adds for the demonstration (see the module docstring), or []."""
    config, options = config_from_args(args), options_from_args(args)
    wanted = args.demo_fault if args.demo_fault is not None else not any(a.startswith("-") for a in rest)
    if not wanted or options.faults.any or options.checkpoint is None:
        return []
    return ["--fail-at-step", str(_demo_fault_step(config, options)), "--fail-rank", str(nproc - 1)]


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this command under torchrun with ``--nproc-per-node`` ranks (our flag removed)."""
    n = args.nproc_per_node
    if n == "auto":
        n = str(torch.cuda.device_count() or 2)
    if not n.isdigit() or int(n) < 1:
        print(f"error: --nproc-per-node must be a positive integer or 'auto', got {n!r}", file=sys.stderr)
        return 2
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            rest.append(a)
    config, options = config_from_args(args), options_from_args(args)
    dims = options.parallel_dims(int(n))  # a layout that does not fit the ranks is refused before torchrun
    preflight_memory(config, options, world_size=int(n), ranks_per_node=int(n), force=args.force,
                     launching=True)
    check_fits(config, dims.dp)
    preflight_resume(config, options)
    demo = demo_fault_flags(args, rest, int(n))
    if demo:
        rest += demo
        print(f"demo: rank {demo[3]} will be killed once in step {demo[1]} to show the elastic restart and "
              "the resume (--no-demo-fault turns this off)", flush=True)
    cmd = elastic.torchrun_command(rest, nproc_per_node=int(n), max_restarts=args.max_restarts)
    print("launching:", " ".join(cmd[1:]), flush=True)
    started = time.time()
    code = subprocess.call(cmd, env=elastic.elastic_env())
    if code != 0:
        print(failure_report(config, options, code, args.max_restarts, since=started), file=sys.stderr)
    return code


def failure_report(config: TrainConfig, options: RunOptions, code: int, max_restarts: int, *,
                   since: float = 0.0) -> str:
    """What a failed launch prints: the failures the ranks recorded, and where a rerun would resume."""
    lines = [f"error: training failed: torchrun exited with {code} (it restarts the ranks at most "
             f"--max-restarts {max_restarts} times); failures recorded in "
             f"{Path(config.out) / elastic.FAILURES}:",
             elastic.summarize_failures(elastic.read_failures(config.out, since=since))]
    if options.checkpoint is not None:
        try:
            info = find_latest_valid(options.checkpoint.folder)
        except CheckpointError as exc:
            info, lines = None, [*lines, f"no usable checkpoint: {exc}"]
        if info is not None:
            lines.append(f"newest valid checkpoint: {info.path} (step {info.step}); run the same command "
                         "again to resume from it")
        elif len(lines) == 2:
            lines.append(f"no checkpoint in {options.checkpoint.folder}: a rerun starts at step 0")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # an unknown flag: usage + exit 2
    under_launcher = "RANK" in os.environ
    try:
        if args.nproc_per_node is not None and not under_launcher:
            return _launch(args, argv)
        config, options = config_from_args(args), options_from_args(args)
        options.parallel_dims(int(os.environ.get("WORLD_SIZE", "1")))  # refused before init_process_group
        preflight_memory(config, options, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                         ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), force=args.force,
                         local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        ctx = init_distributed(timeout_s=config.timeout_s)
        train(config, ctx, options)
        # Only after success: after a failure a peer may be gone or stuck, and teardown's barrier would
        # wait for it a whole --timeout more before the agent learns of the failure. Exiting frees all.
        teardown()
    except Preempted as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(exc), file=sys.stderr)
        return SIGTERM_EXIT
    except (ConfigError, DataError, FloatingPointError, CheckpointError) as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
