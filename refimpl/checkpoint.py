"""Trustworthy sharded checkpoints: save the whole training state, commit atomically, resume exactly.

Chapter 09.

What a checkpoint holds (:func:`save_training_state`): the model's parameters and persistent buffers and
the optimizer state *as each rank holds them* (full tensors, ZeRO-1/2 optimizer shards, FSDP parameter
shards), the optimizer's hyperparameters, the loss scaler, the step (from which the learning-rate
schedule and the data position follow: both are pure functions of the step in refimpl), the run's config,
library versions, and each rank's RNG states. The format is in :mod:`refimpl.checkpoint_format`: tensors
are described by global name, shape and flat ranges, so a checkpoint written at one data-parallel size or
ZeRO stage loads at another.

**The commit protocol** (:meth:`Checkpointer.save`, collective)::

    every rank   snapshot its pieces to CPU copies          (training may go on from here when async)
    every rank   write step_K.tmp-<id>/rank_R.pt, fsync it, hash it
    all ranks    exchange "ok + sha256 + size" or the error (one all_gather on a private gloo group)
    rank 0       write manifest.json (every file's sha256 and size), fsync it and the folder
    rank 0       rename step_K.tmp-<id> -> step_K, fsync the parent     <- the commit point
    rank 0       write "latest" atomically (temp file, fsync, os.replace), prune to the last K
    all ranks    learn the outcome (a second all_gather): the same error is raised everywhere

A crash before the rename leaves a ``*.tmp-*`` folder that no loader reads and the next save or load
deletes; a crash after it leaves a complete checkpoint. ``latest`` is a pointer for people and tools; the
loader trusts only what it verifies: :func:`find_latest_valid` walks the committed checkpoints newest
first, checks manifest, format version, expected shapes, sizes and sha256 (ranks hash files in parallel),
says why each rejected one was rejected and returns the newest valid one.

**Asynchronous save** (``async_save=True``): :meth:`Checkpointer.save` returns once the snapshot is taken;
a background thread writes, hashes and commits. It talks to the other ranks on its own gloo process group,
so its collectives never interleave with the training's. The next ``save``, ``wait``, ``close`` or load
joins it and raises its error, if any.

**Resume** (:meth:`Checkpointer.resume_point`): ``resume="auto"`` continues from the newest valid
checkpoint (a fresh start when the folder holds none; an error when it holds some and none is valid);
``resume="never"`` refuses a folder that already holds checkpoints. Decide from the disk, not from the
elastic agent's restart counter (it is per agent). A run stopped after step k and resumed gives the same
losses, bit for bit, as an uninterrupted run: the weights, moments, step, RNG states and data position are
exactly those the uninterrupted run had.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from refimpl.checkpoint_format import (
    FORMAT_VERSION,
    SPLIT_MIN_NUMEL,
    CheckpointError,
    CheckpointReader,
    FlatShard,
    as_flat_shard,
    build_manifest,
    check_plain,
    fsync_dir,
    plan_pieces,
    rank_file_name,
    shard_metadata,
    snapshot_pieces,
    verify_checkpoint,
    write_manifest,
    write_rank_file,
)
from refimpl.config import ConfigError

__all__ = [
    "CheckpointConfig", "CheckpointError", "CheckpointInfo", "Checkpointer", "FlatShard", "SaveSchedule",
    "capture_rng_state", "clean_leftovers", "expected_shapes", "find_latest_valid", "library_versions",
    "list_checkpoints", "load_training_state", "optimizer_shards", "parameter_shards", "restore_rng_state",
    "save_training_state",
]

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_MARK = ".tmp-"  # in the name of anything not (or no longer) committed: deleted by clean_leftovers
LATEST = "latest"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how to checkpoint. ``every_steps``/``every_minutes``/``save_on_sigterm`` feed
    :class:`SaveSchedule`; ``resume`` is ``"auto"`` or ``"never"``."""

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
class CheckpointInfo:
    """A verified checkpoint: its folder, step and manifest, and why newer ones were rejected."""

    path: Path
    step: int
    manifest: dict
    skipped: tuple[str, ...] = ()

    @property
    def state(self) -> dict:
        return self.manifest["state"]


# -- the folder ------------------------------------------------------------------------------------------

def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Committed checkpoint folders (``step_N``), newest (highest step) first; [] for a missing folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def clean_leftovers(folder: str | os.PathLike, *, keep: str | None = None) -> list[Path]:
    """Delete ``*.tmp-*`` leftovers of crashed saves (all but ``keep``); return what was deleted."""
    folder = Path(folder)
    removed = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if TMP_MARK in p.name and p.name != keep:
            log.warning("removing %s, left over by a save that did not commit", p)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _write_latest(folder: Path, name: str) -> None:
    tmp = folder / f"{LATEST}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / LATEST)
    fsync_dir(folder)


def _delete(path: Path) -> None:
    """Rename out of the committed namespace first, so a crash mid-delete leaves no half checkpoint."""
    trash = path.with_name(f"{path.name}{TMP_MARK}deleted-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def commit(tmp: Path, manifest: dict, *, keep_last: int) -> Path:
    """Rank 0's part of the protocol: manifest, rename (the commit point), ``latest``, pruning."""
    write_manifest(tmp, manifest)
    fsync_dir(tmp)
    folder, step = tmp.parent, manifest["step"]
    final = folder / step_dir_name(step)
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        _delete(final)
    os.replace(tmp, final)
    fsync_dir(folder)
    _write_latest(folder, final.name)
    # Keep the newest K at or below this step. Newer ones were rejected at resume (this run continues
    # from an older step); they are left alone and replaced when the run reaches their step.
    older = [p for p in list_checkpoints(folder) if int(STEP_DIR.match(p.name).group(1)) <= step]
    for p in older[keep_last:]:
        _delete(p)
    return final


def _local_gather(obj: Any) -> list[Any]:
    return [obj]


def find_latest_valid(folder: str | os.PathLike, *, expected: Mapping[str, Sequence[int]] | None = None,
                      share: tuple[int, int] = (0, 1), gather=_local_gather) -> CheckpointInfo | None:
    """The newest checkpoint in ``folder`` that verifies; None if there is none at all.

    Raises :class:`CheckpointError` listing every rejection when checkpoints exist but none is valid.
    Rank 0 (``share[0] == 0``) deletes ``*.tmp-*`` leftovers. With ``share=(rank, world)`` and ``gather``
    (an all_gather of a Python object) the ranks split the hashing and agree on the outcome.
    """
    folder = Path(folder)
    names = None
    if share[0] == 0:
        clean_leftovers(folder)
        names = [p.name for p in list_checkpoints(folder)]
    names = gather(names)[0]
    skipped: list[str] = []
    for name in names:
        manifest, reason = None, None
        try:
            manifest = verify_checkpoint(folder / name, expected=expected, share=share)
        except CheckpointError as exc:
            reason = str(exc)
        reasons = [r for r in gather(reason) if r]
        if not reasons:
            return CheckpointInfo(path=folder / name, step=manifest["step"], manifest=manifest,
                                  skipped=tuple(skipped))
        skipped.append(f"{name} rejected: {reasons[0]}")
        if share[0] == 0:
            log.warning("%s; trying an older checkpoint", skipped[-1])
    if not names:
        return None
    raise CheckpointError(f"no valid checkpoint in {folder}:\n  " + "\n  ".join(skipped))


def library_versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "cuda": torch.version.cuda, "format_version": str(FORMAT_VERSION)}


# -- RNG -------------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """Python ``random``, NumPy's global generator, torch CPU and (when initialised) every CUDA device."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    numpy_keys = torch.from_numpy(keys.astype(np.int64))
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, numpy_keys, int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


# -- the checkpointer ------------------------------------------------------------------------------------

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
                self._group = dist.new_group(backend="gloo")
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

    def save(self, step: int, tensors: Mapping[str, FlatShard | torch.Tensor], *,
             state: Mapping[str, Any] | None = None, rank_state: Any = None, config: Any = None) -> None:
        """Save ``tensors`` (global name -> this rank's :class:`FlatShard`, or a full tensor) at ``step``.

        ``state`` (JSON, rank 0's copy is kept) goes into the manifest; ``rank_state`` (tensors, numbers,
        strings, containers) into this rank's file. With ``async_save`` it returns after the snapshot.
        """
        self.wait()
        shards = {name: as_flat_shard(v) for name, v in tensors.items()}
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
            status = {"ok": write_rank_file(job.tmp / rank_file_name(self.rank), job.pieces, job.objects)}
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

    def load(self, info: CheckpointInfo, tensors: Mapping[str, FlatShard | torch.Tensor]) -> Any:
        """Copy each requested range into its tensor; return this rank's ``rank_state`` (None if the
        checkpoint was written by fewer ranks)."""
        reader = CheckpointReader(info.path, info.manifest)
        try:
            reader.load_into(tensors)
            return reader.rank_objects(self.rank)
        finally:
            reader.close()


# -- the training state ----------------------------------------------------------------------------------

def _zero():
    from refimpl.parallel import zero

    return zero


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / refimpl's data-parallel wrappers (their names must not leak into the file)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or (
            type(model).__module__ == "refimpl.parallel.data_parallel" and hasattr(model, "module")):
        model = model.module
    return model


def parameter_shards(model: nn.Module) -> dict[str, FlatShard]:
    """``{"model/<name>": FlatShard}`` of every parameter and persistent buffer, as this rank holds it.

    A plain (or data-parallel) model holds full tensors; a :class:`FullyShardedDataParallel` holds rows
    ``[start, end)`` of each parameter, the flat range ``[start * row_numel, end * row_numel)``.
    """
    model = _unwrap(model)
    out: dict[str, FlatShard] = {}
    if isinstance(model, _zero().FullyShardedDataParallel):
        module = model.module
        order = {(id(m), attr): f"{prefix}.{attr}" if prefix else attr
                 for prefix, m in module.named_modules() for attr in m._parameters}
        index = {key: i for i, key in enumerate(order)}
        for unit in model.units:
            for sp in unit.params:
                name = order[min(((id(m), a) for m, a in sp.registrations), key=index.__getitem__)]
                out[name] = FlatShard(sp.sharded, tuple(sp.spec.shape), sp.spec.start * sp.spec.row_numel)
    else:
        module = model
        out = {name: FlatShard.full(p) for name, p in model.named_parameters()}
    persistent = set(module.state_dict(keep_vars=True))
    out |= {name: FlatShard.full(b) for name, b in module.named_buffers() if name in persistent}
    return {f"model/{name}": shard for name, shard in sorted(out.items())}


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor: pass to ``find_latest_valid`` to reject another model."""
    return {name: shard.global_shape for name, shard in parameter_shards(model).items()}


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                     ) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, str, FlatShard]]]:
    """The optimizer that holds the state, and for each tensor it steps (in its order): name and placement."""
    by_id = {id(s.tensor): (name.removeprefix("model/"), s) for name, s in parameter_shards(model).items()}
    inner, where = optimizer, {}
    if isinstance(optimizer, _zero().ShardedOptimizer):  # state keyed by views of this rank's rows
        inner = optimizer.optimizer
        for p in optimizer.params:
            name, full = by_id[id(p)]
            view = optimizer.shard(p)
            if view.numel() and view.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                raise CheckpointError(f"the optimizer shard of {name!r} is not a view of the parameter")
            offset = view.storage_offset() - p.storage_offset()
            where[id(view)] = (name, FlatShard(view, full.global_shape, offset))
    else:
        where = by_id
    slots = []
    for group in inner.param_groups:
        for t in group["params"]:
            if id(t) not in where:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of the model")
            name, placement = where[id(t)]
            slots.append((t, name, placement))
    return inner, slots


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, FlatShard]:
    """``{"optimizer/<param>/<key>": FlatShard}``: per-element state (moments) placed like its parameter's
    shard, other tensors (the step count) whole."""
    inner, slots = _optimizer_slots(model, optimizer)
    out = {}
    for t, name, placement in slots:
        for key, value in inner.state.get(t, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name}/{key} is a {type(value).__name__}, "
                                      "not a tensor")
            per_element = value.shape == t.shape
            out[f"optimizer/{name}/{key}"] = (FlatShard(value, placement.global_shape, placement.offset)
                                              if per_element else FlatShard.full(value))
    return out


def _group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    def plain(v: Any) -> Any:
        return v.item() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, tuple) else v

    return [{k: plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_training_state(checkpointer: Checkpointer, step: int, *, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        extra: Mapping[str, Any] | None = None, config: Any = None) -> None:
    """Save everything a bitwise resume needs after ``step`` completed optimizer steps. Collective.

    ``extra`` (JSON) joins the manifest's state: put the data position there if it is not a function
    of the step. Each rank's RNG states go into its own file.
    """
    tensors = parameter_shards(model)
    state: dict[str, Any] = {"step": step}
    if optimizer is not None:
        tensors |= optimizer_shards(model, optimizer)
        state["optimizer_param_groups"] = _group_hyperparameters(optimizer)
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    state |= dict(extra or {})
    checkpointer.save(step, tensors, state=state, rank_state={"rng": capture_rng_state()}, config=config)


def _load_optimizer(reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: list[dict] | None) -> None:
    inner, slots = _optimizer_slots(model, optimizer)
    keys_of: dict[str, list[str]] = {}
    for entry in reader.manifest["entries"]:
        if entry.startswith("optimizer/"):
            name, key = entry.removeprefix("optimizer/").rsplit("/", 1)
            keys_of.setdefault(name, []).append(key)
    state: dict[int, dict] = {}
    for index, (t, name, placement) in enumerate(slots):
        for key in keys_of.get(name, []):
            entry = f"optimizer/{name}/{key}"
            shape = tuple(reader.entry(entry)["shape"])
            if shape == placement.global_shape and shape:  # per element: this rank's range
                value = reader.read(entry, placement.offset, t.numel()).view(t.shape)
            else:
                value = reader.read(entry).view(shape)
            state.setdefault(index, {})[key] = value
    # Cast as Optimizer.load_state_dict would (moments to the parameter's device and dtype, the step count
    # stays a CPU float unless capturable/fused), but fill the state in place: a ZeRO optimizer shares
    # this dict with its wrapper, and load_state_dict would replace it.
    group_of = [g for g in inner.param_groups for _ in g["params"]]
    inner.state.clear()
    for index, entries in state.items():
        t, group = slots[index][0], group_of[index]
        on_device = group.get("capturable") or group.get("fused")
        inner.state[t] = {
            k: (v.to(t.device) if on_device else v) if k == "step"
            else v.to(t.device, t.dtype if v.is_floating_point() else v.dtype)
            for k, v in entries.items()
        }
    if groups is not None:
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{reader.folder}: {len(groups)} optimizer parameter groups saved, the "
                                  f"optimizer has {len(optimizer.param_groups)}")
        for target in {id(o): o for o in (optimizer, inner)}.values():
            for g, saved in zip(target.param_groups, groups, strict=True):
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in g})


def load_training_state(checkpointer: Checkpointer, info: CheckpointInfo, *, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        restore_rng: bool = True) -> dict:
    """Load what :func:`save_training_state` saved into this rank's model/optimizer/scaler, at any world
    size and sharding; restore this rank's RNG states; return the saved state (``state["step"]``, ...)."""
    reader = CheckpointReader(info.path, info.manifest)
    try:
        reader.load_into(parameter_shards(model))
        state = info.state
        if optimizer is not None:
            _load_optimizer(reader, model, optimizer, state.get("optimizer_param_groups"))
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        if restore_rng:
            objects = reader.rank_objects(checkpointer.rank)
            if objects is None:
                log.warning("rank %d: the checkpoint was written by %d ranks, no RNG state for this rank; "
                            "keeping the current seeding", checkpointer.rank, info.manifest["world_size"])
            else:
                restore_rng_state(objects["rng"])
        return state
    finally:
        reader.close()


# -- when to save ----------------------------------------------------------------------------------------

class SaveSchedule:
    """Decides, identically on every rank, whether to save after a step.

    Every ``every_steps`` steps (no communication); every ``every_minutes`` by rank 0's clock; and at once
    when any rank received SIGTERM (``stop_requested`` then tells the trainer to stop after saving). The
    time and signal flags travel in one all-reduce (MAX) per step, on ``device`` for the default process
    group's backend.

    A step that never ends (a hang, a run too large for the machine) would keep a SIGTERM waiting for ever,
    so a second SIGTERM, or the first once ``grace_s`` seconds have passed without the save (``None``:
    wait for ever), exits at once: a line on stderr and ``os._exit(143)`` (128 + SIGTERM), no save; the
    newest committed checkpoint stays valid (the commit is atomic, chapter 09). The grace runs in a thread
    of its own, so it fires even while the main thread is inside a long kernel; the second SIGTERM's
    handler runs in the main thread, as every Python signal handler does.
    """

    def __init__(self, config: CheckpointConfig, *, device: torch.device | str = "cpu",
                 grace_s: float | None = 60.0) -> None:
        if grace_s is not None and not grace_s >= 0:
            raise ValueError(f"the SIGTERM grace must be >= 0 seconds or None, got {grace_s}")
        self.grace_s = grace_s
        self._closed = threading.Event()  # stands the grace timer down
        self.every_steps = config.every_steps
        self.every_s = None if config.every_minutes is None else 60.0 * config.every_minutes
        self.device = torch.device(device)
        self.stop_requested = False
        self._signalled = False
        self._last = time.monotonic()
        self._previous = None
        self._use_signal = config.save_on_sigterm and threading.current_thread() is threading.main_thread()
        if self._use_signal:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self._signalled:
            self._exit_now("a second SIGTERM")
        self._signalled = True
        grace = "" if self.grace_s is None else f", or {self.grace_s:g} s (--sigterm-grace) before it,"
        os.write(2, f"\nSIGTERM: saving at the end of this step, then stopping; a second SIGTERM{grace} "
                    "exits at once without saving\n".encode())
        if self.grace_s is not None:
            threading.Thread(target=self._grace_timer, name="sigterm-grace", daemon=True).start()

    def _grace_timer(self) -> None:
        if not self._closed.wait(self.grace_s):
            self._exit_now(f"the step did not end within the grace of {self.grace_s:g} s (--sigterm-grace)")

    @staticmethod
    def _exit_now(why: str) -> None:
        os.write(2, f"error: SIGTERM: {why}; exiting at once with status 143, without saving (the newest "
                    "committed checkpoint stays valid)\n".encode())
        os._exit(143)

    def due(self, step: int) -> bool:
        """After ``step`` completed steps: save now? Collective when minutes or SIGTERM are watched."""
        timed = self.every_s is not None and time.monotonic() - self._last >= self.every_s
        flags = torch.tensor([float(self._signalled), float(timed)], device=self.device)
        watched = self._use_signal or self.every_s is not None
        if watched and dist.is_initialized() and dist.get_world_size() > 1:
            from refimpl.comm import ops

            if dist.get_rank() != 0:
                flags[1] = 0.0  # rank 0's clock decides
            ops.all_reduce(flags, op=ops.ReduceOp.MAX)
        signalled, timed = bool(flags[0].item()), bool(flags[1].item())
        self.stop_requested = self.stop_requested or signalled
        due = signalled or timed or (self.every_steps is not None and step % self.every_steps == 0)
        if due:
            self._last = time.monotonic()
        return due

    def close(self) -> None:
        self._closed.set()
        if self._use_signal:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
