"""The folder protocol: commit atomically, point ``latest``, list, clean, find the newest valid (ch. 09).

A save writes ``step_K.tmp-<id>/``; ``commit`` (rank 0) writes the manifest, fsyncs, renames the folder
to ``step_K`` (the commit point), fsyncs the parent, writes ``latest`` atomically and prunes to the last K.
A crash before the rename leaves a ``*.tmp-*`` folder that no loader reads and ``clean_leftovers``
deletes; a crash after it leaves a complete checkpoint. ``latest`` is for people and tools: the loader
trusts only what it verifies (``find_latest_valid``, newest first, saying why each was rejected).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refimpl.checkpoint.files import fsync_dir
from refimpl.checkpoint.format import CheckpointError
from refimpl.checkpoint.manifest import verify_checkpoint, write_manifest

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_MARK = ".tmp-"  # in the name of anything not (or no longer) committed: deleted by clean_leftovers
LATEST = "latest"


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
    older = [p for p in list_checkpoints(folder) if (m := STEP_DIR.match(p.name)) and int(m.group(1)) <= step]
    for p in older[keep_last:]:
        _delete(p)
    return final


def _local_gather(obj: Any) -> list[Any]:
    return [obj]


def find_latest_valid(folder: str | os.PathLike, *, expected: Mapping[str, Sequence[int]] | None = None,
                      share: tuple[int, int] = (0, 1), gather=_local_gather) -> CheckpointInfo | None:
    """The newest checkpoint in ``folder`` that verifies; None if there is none at all.

    Raises ``CheckpointError`` listing every rejection when checkpoints exist but none is valid.
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
            assert manifest is not None  # no rank rejected it, this one included
            return CheckpointInfo(path=folder / name, step=manifest["step"], manifest=manifest,
                                  skipped=tuple(skipped))
        skipped.append(f"{name} rejected: {reasons[0]}")
        if share[0] == 0:
            log.warning("%s; trying an older checkpoint", skipped[-1])
    if not names:
        return None
    raise CheckpointError(f"no valid checkpoint in {folder}:\n  " + "\n  ".join(skipped))
