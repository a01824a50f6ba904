"""What is refused before any process starts, beside the layout's rules (``refimpl.train.layout``):
the data (``check_fits``), the device (``run_device``: too few GPUs for the ranks; ``check_fp8_device``:
fp8 on a GPU without fp8 tensor cores), the planned memory per rank against the machine's
(``preflight_memory``, the planner of chapter 12; on a GPU less the headroom of ``usable_cuda_bytes``),
and a checkpoint folder that the ranks could not resume: another run's, or one whose checkpoints are all
damaged (``preflight_resume``, chapter 11)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from refimpl.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from refimpl.config import ConfigError, TrainConfig
from refimpl.data import ShardedBatches, prepare_corpus
from refimpl.measure import format_bytes
from refimpl.train.args import RunOptions
from refimpl.train.layout import Layout


def check_fits(config: TrainConfig) -> ShardedBatches:
    """The data: a corpus that exists, is not empty and can feed the global batch (``DataError``
    otherwise); the batch split over the ranks is the layout's (``refimpl.train.layout.resolve``)."""
    corpus = prepare_corpus(config.data.data, config.data.cache_dir)
    return ShardedBatches(corpus.tokens, seq_len=config.data.seq_len,
                          global_batch_size=config.data.global_batch_size, seed=config.data.seed)


MEMORY_ENV = "REFIMPL_MEMORY_BYTES"  # tests: this node's memory in bytes, instead of the measured figure
CUDA_USABLE_SHARE = 0.9  # of a GPU's free (or, launching, total) memory: the caching allocator's rounding
CUDA_ALLOWANCE_BYTES = 2**30  # what a GPU rank holds outside the planned tensors: see usable_cuda_bytes
FP8_MIN_CAPABILITY = (8, 9)  # the first CUDA compute capability with fp8 tensor cores (Ada; Hopper is 9.0)


def run_device(ranks_per_node: int, *, local_rank: int = 0, backend: str | None = None,
               launching: bool = False) -> torch.device:
    """A rank's device by ``refimpl.distributed.choose_device``'s rule, its refusal a
    ``ConfigError`` (exit status 2). ``launching``: the self-launcher, whose ranks see its GPUs."""
    from refimpl.distributed import choose_device

    try:
        return choose_device(local_rank, max(ranks_per_node, 1), backend=backend, shared_view=launching)[0]
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None


def check_fp8_device(precision: str, device: torch.device) -> None:
    """Refuse ``--precision fp8`` on a GPU below compute capability 8.9 (``FP8_MIN_CAPABILITY``): the
    fp8 kernels of ``torch._scaled_mm`` need fp8 tensor cores (Ada 8.9, Hopper 9.0 and later); on an A100
    the first fp8 GEMM would fail inside step 0, once every rank has set up. A CPU keeps fp8 (dequantized)."""
    if precision != "fp8" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise ConfigError(f"--precision fp8 needs a GPU of compute capability 8.9 or newer (fp8 tensor cores "
                          f"for torch._scaled_mm: Ada, Hopper and later); {device} is a "
                          f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}); use "
                          "--precision bf16")


def usable_cuda_bytes(measured: int) -> int:
    """What a GPU rank may plan for out of ``measured`` bytes (free; the self-launcher's: total):
    ``0.9 x measured - 1 GiB`` (``CUDA_USABLE_SHARE``, ``CUDA_ALLOWANCE_BYTES``), at least 0.

    The planner counts the step's tensors. The 10%: the caching allocator rounds blocks up (512 bytes, large
    ones cut from 2 or 20 MiB segments) and cannot always reuse a freed segment for a larger block, so it
    reserves more than the tensors take. The 1 GiB, whatever the model: NCCL's communicators (one per group
    of the layout, ``NCCL_BUFFSIZE`` 4 MiB per channel and peer: tens to hundreds of MiB each), cuBLAS's and
    cuBLASLt's workspaces (32 MiB per handle and stream on Hopper) and, where the figure is the total, the
    rank's CUDA context (about half a GiB). Too little shows as an out-of-memory error in step 0 on every
    rank; too much refuses a run that ``--force`` still starts."""
    return max(int(CUDA_USABLE_SHARE * measured) - CUDA_ALLOWANCE_BYTES, 0)


def _cuda_memory(device: torch.device, *, launching: bool) -> tuple[int, str]:
    """``usable_cuda_bytes`` of the GPU's free memory (launching: total), and how (the refusal says)."""
    name = torch.cuda.get_device_name(device)
    if launching:
        measured, what = torch.cuda.get_device_properties(device).total_memory, f"total memory of the {name}"
    else:
        measured, what = torch.cuda.mem_get_info(device)[0], f"free memory of the {name} (mem_get_info)"
    return usable_cuda_bytes(measured), (f"usable: {CUDA_USABLE_SHARE:g} x {format_bytes(measured)} {what} - "
                                         f"{format_bytes(CUDA_ALLOWANCE_BYTES)} for the CUDA context, NCCL "
                                         "and cuBLAS")


def machine_memory_per_rank(ranks_per_node: int, *, local_rank: int = 0, launching: bool = False,
                            backend: str | None = None) -> tuple[int, str]:
    """The bytes one rank may use and where the figure comes from: on a GPU ``usable_cuda_bytes`` of
    its free memory (``torch.cuda.mem_get_info``; the self-launcher reads the total instead, to create no
    CUDA context in itself), on a CPU the node's available memory (psutil, else /proc/meminfo) over its
    ranks; ``REFIMPL_MEMORY_BYTES`` (tests) replaces the measured node's figure."""
    per = max(ranks_per_node, 1)
    if os.environ.get(MEMORY_ENV):
        try:
            node = int(os.environ[MEMORY_ENV])
        except ValueError:
            raise ConfigError(f"{MEMORY_ENV} must be a number of bytes, got "
                              f"{os.environ[MEMORY_ENV]!r}") from None
        return node // per, f"{MEMORY_ENV} {format_bytes(node)} / {per} rank(s) on this node"
    device = run_device(per, local_rank=local_rank, backend=backend, launching=launching)
    if device.type == "cuda":
        return _cuda_memory(device, launching=launching)
    try:
        import psutil

        node = psutil.virtual_memory().available
    except ImportError:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        node = int(fields["MemAvailable"].split()[0]) * 1024
    return node // per, f"available memory {format_bytes(node)} / {per} rank(s) on this node"


def preflight_memory(config: TrainConfig, layout: Layout, *, ranks_per_node: int, force: bool = False,
                     local_rank: int = 0, launching: bool = False, backend: str | None = None):
    """Refuse, before any process starts, a run whose planned bytes per rank exceed the machine's:
    ``refimpl.planner.run_memory_of`` the resolved ``layout`` (``refimpl.train.layout.resolve``: model
    state by ZeRO stage and precision + one micro-batch's activations) against
    ``machine_memory_per_rank``. ``force``: warn and go on. Returns the estimate (None where the planner
    does not model the run: an MoE model with fp8 or a layout ``refimpl.planner.experts.unmodelled_moe``
    names, multi-head latent attention; not checked, said on stderr). An MoE model is planned at pp = 1
    for uniform routing (chapter 09). First the device (``backend``: ``--backend``): ``run_device`` and
    ``check_fp8_device``, which ``force`` does not override."""
    from refimpl.planner import run_memory_of
    from refimpl.planner.experts import unmodelled_moe
    from refimpl.planner.memory import unmodelled_attention

    dims, par, micro = layout.dims, layout.parallel, layout.micro_batch
    check_fp8_device(par.precision, run_device(ranks_per_node, local_rank=local_rank, backend=backend,
                                               launching=launching))
    moe = unmodelled_moe(config.model, pp=dims.pp, cp=dims.cp, zero_stage=par.zero_stage,
                         sequence_parallel=par.sequence_parallel, precision=par.precision)
    unmodelled = [f"MoE blocks with {', '.join(moe)}"] * bool(moe) + unmodelled_attention(config.model)
    if unmodelled:  # refimpl/planner/experts.py, refimpl/planner/memory.py
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: no memory preflight for {' and '.join(unmodelled)} (the planner does not model "
                  "them yet)", file=sys.stderr, flush=True)
        return None
    need = run_memory_of(config.model, par, world_size=dims.world_size, micro_batch=micro,
                         seq_len=config.data.seq_len, num_microbatches=layout.accumulation)
    have, source = machine_memory_per_rank(ranks_per_node, local_rank=local_rank, launching=launching,
                                           backend=backend)
    if need.total > have:
        tokens = (f"{config.data.seq_len} tokens" if dims.cp == 1
                  else f"{config.data.seq_len // dims.cp} tokens of {config.data.seq_len} (cp {dims.cp})")
        what = (f"the run needs about {format_bytes(need.total)} per rank (planner: {need.describe()}; "
                f"micro-batch {micro} x {tokens}) but this machine has "
                f"{format_bytes(have)} per rank ({source})")
        if not force:
            raise ConfigError(f"{what}; use a shorter --seq-len, a smaller --micro-batch-size, "
                              "--activation-checkpointing, a higher --zero-stage, a higher --cp or more "
                              "ranks, or --force")
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


def _shown(key: str, value: object) -> str:
    if key == "data.data" and value is None:
        return "None (the default corpus, Python's standard library)"
    return repr(value)


def check_same_run(saved: dict | None, config: TrainConfig, where: object) -> None:
    """Refuse to resume a checkpoint written with other model/data/optimizer settings or step count, in
    one line: what differs, why a run cannot change it (``--steps``: the learning-rate schedule), and the
    fix (another run folder)."""
    if not saved or "train" not in saved:
        return
    before, now = _run_signature(saved["train"]), _run_signature(config.to_dict())
    changed = [k for k, v in now.items() if before.get(k) != v]
    if not changed:
        return
    diffs = "; ".join(f"{k}: {_shown(k, before.get(k))} in the checkpoint, {_shown(k, now[k])} now"
                      for k in changed)
    steps = ("; --steps too: the learning rate of every step follows from the total steps (warm-up, then a "
             "cosine decay that reaches its floor at the last step: refimpl/optim.py lr_at), so a run, "
             "finished or not, cannot be extended with more --steps" if "steps" in changed else "")
    raise ConfigError(f"{where} belongs to a run with other settings ({diffs}): a run resumes only with the "
                      f"settings it started with{steps}; to train with these flags use another run folder "
                      "(e.g. --out runs/other, or --checkpoint-dir), or give that run's flags to resume it")


def _relative(reason: str, folder: Path) -> str:
    return reason.replace(f"{folder}{os.sep}", "")


def preflight_resume(config: TrainConfig, options: RunOptions) -> int | None:
    """Before launching, what the ranks would refuse (exit status 2, in one line, before torchrun would
    restart them to refuse again): a folder that holds checkpoints under ``--resume never``; one whose
    checkpoints are all damaged (each verified as the ranks do, newest first, down to the first valid one:
    its manifest, files, sizes and sha256, ``refimpl.checkpoint.verify_checkpoint``); a valid checkpoint
    of another run configuration (``check_same_run``). Returns the step the run resumes from (None:
    a fresh start). Nothing in the folder is changed."""
    if options.checkpoint is None:
        return None
    folder = Path(options.checkpoint.folder)
    found = list_checkpoints(folder)
    if not found:
        return None
    if options.checkpoint.resume == "never":
        raise CheckpointError(f"{folder} already holds checkpoints (newest {found[0].name}) and --resume "
                              "never refuses to overwrite them; use --resume auto to continue that run, or "
                              "another run folder (e.g. --out runs/other, or --checkpoint-dir)")
    rejected = []
    for path in found:
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as exc:
            rejected.append(_relative(str(exc), folder) if str(exc).startswith(str(folder)) else
                            f"{path.name}: {exc}")
            continue
        check_same_run(manifest.get("config"), config, path)
        return int(manifest["step"])
    raise CheckpointError(f"no valid checkpoint in {folder}, so the run cannot resume: every one of its "
                          f"{len(found)} checkpoint(s) is damaged ({'; '.join(rejected)}); to start over, "
                          f"move that folder away (e.g. mv {folder} {folder}.damaged), or use another run "
                          "folder (e.g. --out runs/other, or --checkpoint-dir)")
