"""Where a run starts (chapter 11): ``resume`` loads the newest valid checkpoint into the built setup
and keeps the records of the earlier attempts; the trainer (``refimpl.train.train``) then runs the
steps from ``Resumed.start``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from refimpl import elastic
from refimpl.checkpoint import (
    Checkpointer,
    CheckpointInfo,
    SaveSchedule,
    expected_shapes,
    load_training_state,
)
from refimpl.config import TrainConfig
from refimpl.distributed import DistributedContext, log0
from refimpl.train.args import RunOptions
from refimpl.train.preflight import check_same_run

__all__ = ["Resumed", "resume"]


def _read_records(path: Path, before: int) -> list[dict]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before]



@dataclasses.dataclass(kw_only=True)
class Resumed:
    """Where the run starts: ``start`` (the first step to run), the checkpoint it resumed from (``info``,
    None for a fresh start), the checkpointer and save schedule (None without ``options.checkpoint``), the
    records of earlier attempts (rank 0) and this attempt's ``attempt`` and ``job`` ids."""

    start: int
    info: CheckpointInfo | None
    checkpointer: Checkpointer | None
    schedule: SaveSchedule | None
    earlier: list[dict]
    attempt: int
    job: str | None



def resume(config: TrainConfig, ctx: DistributedContext, options: RunOptions, setup, out: Path) -> Resumed:
    """Load the newest valid checkpoint of ``options.checkpoint`` into ``setup`` (chapter 11), write
    config.json and keep the earlier attempts' records in metrics.jsonl (rank 0)."""
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
    return Resumed(start=start, info=info, checkpointer=checkpointer, schedule=schedule, earlier=earlier,
                    attempt=attempt, job=job)


