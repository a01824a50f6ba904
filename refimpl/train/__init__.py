"""The trainer's command line: ``python -m refimpl.train`` (under torchrun for several ranks).

One process per device. Every rank builds the same model from the same seed, reads its own shard of each
global batch (``refimpl.data.ShardedBatches``), and the gradients are averaged across ranks before
the AdamW step: by data parallelism (``refimpl.parallel.data_parallel.DataParallelBucket``, chapter
03: bucketed all-reduces overlapped with backward), or by ZeRO (``--zero-stage 1/2``: a sharded optimizer;
``3``: a fully sharded module; chapter 04). ``--precision bf16/fp16`` computes under autocast (fp16 with a
dynamic loss scaler; with ``--zero-stage 3`` as FSDP2 instead: 16-bit all-gathered weights over fp32 master
shards, gradients reduced in fp32) and ``--activation-checkpointing`` recomputes blocks in backward
(chapter 05).

**Checkpoints and restarts** (chapter 11). The run saves its whole training state into
``--checkpoint-dir`` (default ``<out>/checkpoints``) every ``--checkpoint-every`` steps and/or
``--checkpoint-minutes`` minutes, on SIGTERM (then it stops: exit status 143) and at the end. A run
pointed at a folder that holds checkpoints resumes from the newest one that verifies (``--resume auto``)
and gives, bit for bit, the losses of an uninterrupted run; ``--resume never`` refuses such a folder
(except the checkpoints of its own job after an elastic restart: ``refimpl.elastic.resume_mode``).
Under ``torchrun --max-restarts R`` a failed rank restarts the whole group, which resumes from the disk
(never from the restart counter, which is per agent and read for the report only); at a smaller world
size the checkpoint is resharded. ``--fail-at-step``, ``--hang-at-step`` and ``--preempt-at-step``
inject faults (``refimpl.elastic.FaultPlan``). Each step appends a JSON line to
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

The package, one concept a file, imports one way: ``args`` (flags, ``RunOptions``) -> ``layout``
(``resolve``: every rule of the layout, checked once, into a ``Layout``) -> ``preflight`` (the data, the
device, the memory and the checkpoint folder, refused before any process starts) -> ``setup`` (the model
through ``refimpl.parallel.parallelize.parallelize`` on the layout's groups, then the optimizer) ->
``step`` (one optimizer step) -> ``loop`` (``train``: builds the groups once) -> ``cli`` (``main``, the
self-launch, the failure report).
"""

from refimpl.train.args import RunOptions, build_parser, config_from_args, options_from_args
from refimpl.train.cli import demo_fault_flags, failure_report, main
from refimpl.train.layout import Layout, check_shapes, resolve
from refimpl.train.loop import SIGTERM_EXIT, Preempted, train
from refimpl.train.preflight import (
    MEMORY_ENV,
    check_fits,
    check_same_run,
    machine_memory_per_rank,
    preflight_memory,
    preflight_resume,
)
from refimpl.train.setup import build_setup
from refimpl.train.step import train_step

__all__ = [
    "MEMORY_ENV",
    "SIGTERM_EXIT",
    "Layout",
    "Preempted",
    "RunOptions",
    "build_parser",
    "build_setup",
    "check_fits",
    "check_same_run",
    "check_shapes",
    "config_from_args",
    "demo_fault_flags",
    "failure_report",
    "machine_memory_per_rank",
    "main",
    "options_from_args",
    "preflight_memory",
    "preflight_resume",
    "resolve",
    "train",
    "train_step",
]
