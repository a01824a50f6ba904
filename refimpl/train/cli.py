"""The command line: ``main`` (``python -m refimpl.train``), the self-launch under torchrun with
``--nproc-per-node`` (``_launch``, with the demonstration fault of the default run), and the report of a
failed launch (``failure_report``: the failures the ranks recorded, where a rerun resumes; chapter 11).

No process of a run outlives the one that started it: each rank dies with its torchrun agent
(``init_distributed`` under ``TORCHELASTIC_RUN_ID``: ``refimpl.distributed.env.exit_with_parent``), and
the torchrun of the self-launch dies with the trainer that started it (``preexec_exit_with_parent``, Linux),
so a self-launcher killed by a job's timeout takes torchrun and then the ranks with it.

The demonstration of the default run (``make train``: ``demo_fault_flags``) is said once before the
launch (``_demo_announcement``); the ranks get ``--demo-fault`` with its fault, so that the killed
rank says in one line that the fault was planned and the others, whose step fails with it, stop quietly
(``refimpl.elastic.faults``; ``main`` ends them with status 1 and no traceback).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from refimpl import elastic
from refimpl.checkpoint import CheckpointError, find_latest_valid
from refimpl.config import ConfigError, TrainConfig
from refimpl.data import DataError
from refimpl.distributed import init_distributed, teardown
from refimpl.distributed.device_lint import DeviceLint, device_lint_enabled
from refimpl.distributed.env import preexec_exit_with_parent
from refimpl.elastic.faults import is_planned
from refimpl.launch.shaped_exec import shaped_command
from refimpl.launch.shaped_link import check_link, shaped_link_unavailable
from refimpl.train.args import RunOptions, build_parser, config_from_args, options_from_args
from refimpl.train.layout import Layout, resolve
from refimpl.train.loop import SIGTERM_EXIT, Preempted, train
from refimpl.train.preflight import check_fits, preflight_memory, preflight_resume


def _demo_fault_step(config: TrainConfig, options: RunOptions) -> int:
    """Half-way between the first and the second checkpoint (or half-way through a short run)."""
    every = options.checkpoint.every_steps if options.checkpoint else None
    if every and every + every // 2 < config.steps:
        return every + every // 2
    return config.steps // 2


def demo_fault_flags(args: argparse.Namespace, rest: list[str], nproc: int, *,
                     start: int | None = None) -> list[str]:
    """The fault flags the self-launch adds for the demonstration (see the module docstring), or []: also
    [] when the run resumes (``start``: the step of the checkpoint it resumes from) at or past that step,
    where the fault would never happen, and under ``--max-restarts 0``, where no restart would follow it."""
    config, options = config_from_args(args), options_from_args(args)
    wanted = args.demo_fault if args.demo_fault is not None else not any(a.startswith("-") for a in rest)
    if not wanted or options.faults.any or options.checkpoint is None or args.max_restarts < 1:
        return []
    step = _demo_fault_step(config, options)
    if start is not None and start >= step:
        return []
    return ["--fail-at-step", str(step), "--fail-rank", str(nproc - 1)]


def _demo_announcement(demo: list[str], options: RunOptions, start: int | None) -> str:
    """The line the self-launch prints before a demonstration: what will happen, and where the restarted
    ranks will resume (the newest checkpoint saved before the fault, as far as the schedule tells)."""
    step, rank = int(demo[1]), demo[3]
    assert options.checkpoint is not None  # demo_fault_flags plans a demonstration only with checkpoints
    every = options.checkpoint.every_steps
    saved = max(start or 0, step // every * every if every else 0)
    if options.checkpoint.every_minutes is not None:
        where = "resume from the newest checkpoint on disk"
    elif saved:
        where = f"resume from the checkpoint of step {saved}"
    else:
        where = "start again from step 0 (no checkpoint is saved before it)"
    return (f"demo: rank {rank} will kill itself once, in step {step}, to show an elastic restart: torchrun "
            f"logs its exit (-9), stops the other ranks and restarts them all; they {where} and finish the "
            "run (--no-demo-fault turns this off)")


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag V`` or ``--flag=V``)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in flags)):
            rest.append(a)
    return rest


def _shaped_link(link: str | None) -> str | None:
    """``--link``'s rate as ``tc`` takes it, None without; a ConfigError for a bad rate or a machine that
    cannot shape a link (``refimpl.launch.shaped_link``), before anything starts."""
    if link is None:
        return None
    try:
        rate = check_link(link)
    except ValueError as exc:
        raise ConfigError(f"--link: {exc}") from None
    if (why := shaped_link_unavailable()) is not None:
        raise ConfigError(f"--link {rate}: {why}")
    return rate


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this command under torchrun with ``--nproc-per-node`` ranks (our flag removed)."""
    n = args.nproc_per_node
    if n == "auto":  # one rank per GPU; CPU ranks (2) without a GPU or under --backend gloo
        n = str((torch.cuda.device_count() if args.backend != "gloo" else 0) or 2)
    if not n.isdigit() or int(n) < 1:
        print(f"error: --nproc-per-node must be a positive integer or 'auto', got {n!r}", file=sys.stderr)
        return 2
    rest = _without(argv, "--nproc-per-node", "--link")  # the launcher's flags, not the ranks'
    link = _shaped_link(args.link)
    config, options = config_from_args(args), options_from_args(args)
    layout = resolve(config, options, int(n))  # a layout that cannot run is refused before torchrun
    preflight_memory(config, layout, ranks_per_node=int(n), force=args.force, launching=True,
                     backend=args.backend)
    check_fits(config)
    start = preflight_resume(config, options)  # another run's folder, or one without a valid checkpoint
    demo = demo_fault_flags(args, rest, int(n), start=start)
    # --demo-fault is the launcher's: the ranks get it only with the demonstration's fault, which it marks
    rest = [a for a in rest if a not in ("--demo-fault", "--no-demo-fault")]
    if demo:
        rest += ["--demo-fault", *demo]
        print(_demo_announcement(demo, options, start), flush=True)
    cmd = elastic.torchrun_command(rest, nproc_per_node=int(n), max_restarts=args.max_restarts)
    if link is not None:  # torchrun and its ranks inside a namespace behind the shaped loopback
        cmd = shaped_command(cmd, rate=link, caller=os.getpid())
    print("launching:", " ".join(cmd[1:]), flush=True)
    started = time.time()
    code = subprocess.call(cmd, env=elastic.elastic_env(), preexec_fn=preexec_exit_with_parent())
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


def _train(config: TrainConfig, ctx, layout: Layout) -> None:
    """``train``, under the device lint when ``REFIMPL_DEVICE_LINT=1`` (the whole run, setup included:
    a call CUDA or NCCL would refuse raises there; rank 0 prints the host syncs per step at the end)."""
    if not device_lint_enabled():
        train(config, ctx, layout=layout)
        return
    with DeviceLint() as lint:
        train(config, ctx, layout=layout, hooks=lint)
    if ctx.is_main:
        print(lint.report(), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # an unknown flag: usage + exit 2
    under_launcher = "RANK" in os.environ
    try:
        if args.nproc_per_node is not None and not under_launcher:
            return _launch(args, argv)
        if args.link is not None and not under_launcher:
            raise ConfigError("--link shapes the link between the ranks the trainer launches: give "
                              "--nproc-per-node N too")
        config, options = config_from_args(args), options_from_args(args)
        if args.demo_fault and options.faults.any:  # the self-launch's demonstration: told as planned
            options = replace(options, faults=replace(options.faults, demo=True))
        # refused before init_process_group; an elastic restart with fewer ranks keeps tp, pp and cp and
        # shrinks dp (train() says so)
        layout = resolve(config, options, int(os.environ.get("WORLD_SIZE", "1")),
                         restart_count=elastic.restart_count())
        preflight_memory(config, layout, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         force=args.force, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                         backend=args.backend)
        ctx = init_distributed(timeout_s=config.timeout_s, backend=args.backend)
        _train(config, ctx, layout)
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
    except Exception as exc:
        if not is_planned(exc):
            raise
        return 1  # this rank's step failed with the demonstration's killed peer: torchrun restarts the group
    return 0
