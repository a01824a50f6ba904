"""The ``Checkpointer``: the collective save (synchronous or asynchronous), find and load (chapter 11).

The commit protocol, every rank and then rank 0, is in the package docstring (``refimpl.checkpoint``);
an asynchronous save returns after the CPU snapshot and a background thread writes, hashes and commits,
talking to the other ranks on its own gloo group so its collectives never interleave with the training's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refimpl.checkpoint.files import CheckpointReader, write_rank_file
from refimpl.checkpoint.folder import (
    TMP_MARK,
    CheckpointInfo,
    clean_leftovers,
    commit,
    find_latest_valid,
    list_checkpoints,
    step_dir_name,
)
from refimpl.checkpoint.format import (
    SPLIT_MIN_NUMEL,
    CheckpointError,
    as_local_shard,
    check_plain,
    rank_file_name,
    shard_metadata,
)
from refimpl.checkpoint.manifest import build_manifest, library_versions
from refimpl.checkpoint.plan import plan_pieces, snapshot_pieces
from refimpl.config import ConfigError
from refimpl.distributed.device_lint import private_group
from refimpl.distributed.placement import LocalShard


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how to checkpoint. ``every_steps``/``every_minutes``/``save_on_sigterm`` feed
    ``SaveSchedule``; ``resume`` is ``"auto"`` or ``"never"``."""

    folder: str | os.PathLike
    keep_last: int = 3
    async_save: bool = False
    every_steps: int | None = None
    every_minutes: float | None = None
    save_on_sigterm: bool = True
    resume: str = "auto"
    split_min_numel: int = SPLIT_MIN_NUMEL

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last}")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"CheckpointConfig.resume must be 'auto' or 'never', got {self.resume!r}")
        if self.every_steps is not None and self.every_steps <= 0:
            raise ConfigError(f"CheckpointConfig.every_steps must be positive, got {self.every_steps}")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ConfigError(f"CheckpointConfig.every_minutes must be positive, got {self.every_minutes}")


@dataclass(frozen=True, kw_only=True)
class _SaveJob:
    step: int
    tmp: Path
    plan: dict
    pieces: dict
    objects: Any
    state: dict
    config: Any


def _to_json(value: Any, what: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (it goes into manifest.json): {exc}",
                              ) from None


class Checkpointer:
    """Saves and finds checkpoints in ``config.folder`` for all ranks of the default process group.

    Construct it on every rank (it creates a gloo process group for its own control messages). ``save``,
    ``find_latest_valid``, ``resume_point`` and ``close`` are collective; ``load`` is not.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.folder = Path(config.folder)
        self._group = None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if self.world_size > 1:
                self._group = private_group()  # gloo: host-side control messages, on GPU runs too
        else:
            self.rank, self.world_size = 0, 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: Path | None = None

    def _gather(self, obj: Any) -> list[Any]:
        """All ranks' ``obj`` in rank order (control traffic on the private group, not traced)."""
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # -- save ------------------------------------------------------------------------------------------

    def save(self, step: int, tensors: Mapping[str, LocalShard | torch.Tensor], *,
             state: Mapping[str, Any] | None = None, rank_state: Any = None, config: Any = None) -> None:
        """Save ``tensors`` (global name -> this rank's ``LocalShard``, or a full tensor) at ``step``.

        ``state`` (JSON, rank 0's copy is kept) goes into the manifest; ``rank_state`` (tensors, numbers,
        strings, containers) into this rank's file. With ``async_save`` it returns after the snapshot.
        """
        self.wait()
        shards = {name: as_local_shard(v) for name, v in tensors.items()}
        check_plain(rank_state, "rank_state")
        state_json, config_json = _to_json(dict(state or {}), "state"), _to_json(config, "config")
        gathered = self._gather((shard_metadata(shards), uuid.uuid4().hex[:8]))
        plan = plan_pieces([g[0] for g in gathered], split_min_numel=self.config.split_min_numel)
        job = _SaveJob(step=step, tmp=self.folder / f"{step_dir_name(step)}{TMP_MARK}{gathered[0][1]}",
                       plan=plan, pieces=snapshot_pieces(shards, plan, self.rank),
                       objects=copy.deepcopy(rank_state), state=state_json, config=config_json)
        if self.config.async_save:
            self._thread = threading.Thread(target=self._run_async, args=(job,), name="checkpoint-save",
                                            daemon=True)
            self._thread.start()
        else:
            self._write_and_commit(job)

    def _run_async(self, job: _SaveJob) -> None:
        try:
            self._write_and_commit(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = exc

    def _write_and_commit(self, job: _SaveJob) -> None:
        try:
            if self.rank == 0:
                clean_leftovers(self.folder, keep=job.tmp.name)
            job.tmp.mkdir(parents=True, exist_ok=True)
            written = write_rank_file(job.tmp / rank_file_name(self.rank), job.pieces, job.objects)
            status: dict[str, object] = {"ok": written}
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            status = {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}
        statuses = self._gather(status)
        errors = [s["error"] for s in statuses if "error" in s]
        if errors:
            if self.rank == 0:
                shutil.rmtree(job.tmp, ignore_errors=True)
            raise CheckpointError(f"saving step {job.step} failed, nothing was committed: "
                                  + "; ".join(errors))
        self._commit(job, {rank_file_name(r): s["ok"] for r, s in enumerate(statuses)})

    def _commit(self, job: _SaveJob, files: dict[str, dict]) -> None:
        error = None
        if self.rank == 0:
            try:
                manifest = build_manifest(step=job.step, world_size=self.world_size, plan=job.plan,
                                          files=files, state=job.state, config=job.config,
                                          versions=library_versions())
                commit(job.tmp, manifest, keep_last=self.config.keep_last)
            except Exception as exc:  # noqa: BLE001 - every rank must learn it, or they would diverge
                error = f"{type(exc).__name__}: {exc}"
        error = self._gather(error)[0]
        if error:
            raise CheckpointError(f"committing step {job.step} in {self.folder} failed: {error}")
        self.last_committed = self.folder / step_dir_name(job.step)

    def wait(self) -> Path | None:
        """Block until an asynchronous save has committed; re-raise its error. Returns the last commit."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last_committed

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- find and load ---------------------------------------------------------------------------------

    def find_latest_valid(self, *, expected: Mapping[str, Sequence[int]] | None = None,
                          ) -> CheckpointInfo | None:
        self.wait()
        return find_latest_valid(self.folder, expected=expected, share=(self.rank, self.world_size),
                                 gather=self._gather)

    def resume_point(self, *, expected: Mapping[str, Sequence[int]] | None = None) -> CheckpointInfo | None:
        """Where a run pointed at this folder starts: a checkpoint to load, or None for a fresh start."""
        if self.config.resume == "auto":
            return self.find_latest_valid(expected=expected)
        self.wait()
        names = self._gather([p.name for p in list_checkpoints(self.folder)] if self.rank == 0 else None)[0]
        if names:
            raise CheckpointError(f"{self.folder} already holds checkpoints (newest {names[0]}) and resume "
                                  "is 'never', which refuses to overwrite them; resume with 'auto' or "
                                  "choose another folder")
        return None

    def load(self, info: CheckpointInfo, tensors: Mapping[str, LocalShard | torch.Tensor]) -> Any:
        """Copy each requested box into its tensor (in place, any strides); return this rank's
        ``rank_state`` (None if the checkpoint was written by fewer ranks)."""
        reader = CheckpointReader(info.path, info.manifest)
        try:
            reader.load_into(tensors)
            return reader.rank_objects(self.rank)
        finally:
            reader.close()
