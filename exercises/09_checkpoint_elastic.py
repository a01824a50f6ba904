"""Exercises of chapter 09: checkpoints you can trust.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=09`` (or
``python -m exercises.grade 09``) to see your score per task. The grader

* commits a checkpoint with your ``commit`` over a folder that already holds a committed one, and then
  again with a crash injected at every ``os.replace``, ``os.rename`` and ``os.fsync`` your code makes, one
  crash point per run: after each crash the previous checkpoint must still be found, ``latest`` must name
  a checkpoint that verifies, and the order of the durable steps is checked;
* damages copies of a real checkpoint (a flipped bit late in a file larger than 1 MiB, a truncated file,
  a deleted file, an edited manifest) and expects your ``verify_checkpoint`` to reject each one with a
  :class:`CheckpointError`, and to accept the intact one;
* saves tensors at 4 ranks with uneven flat ranges, reads them back at 3 ranks through your ``plan_read``
  and compares with the saved values element for element.

You may use ``os``, ``shutil``, ``hashlib``, ``json``, ``pathlib`` and the helpers imported below; do not
call ``refimpl.checkpoint.commit``, ``refimpl.checkpoint.verify_checkpoint`` /
``sha256_file`` / ``plan_read`` or ``CheckpointReader`` (that is the answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from refimpl.checkpoint import (  # noqa: F401 - for your commit and your answers
    LATEST,
    MANIFEST,
    CheckpointError,
    fsync_dir,
    list_checkpoints,
    read_manifest,
    step_dir_name,
    write_manifest,
)


def commit(tmp: Path, manifest: dict, *, keep_last: int) -> Path:
    """Commit the checkpoint whose rank files lie in ``tmp`` (``<folder>/step_K.tmp-<id>``); return the
    committed folder ``<folder>/step_K`` (``K = manifest["step"]``, named by ``step_dir_name``).

    Contract:

    * afterwards ``<folder>/step_K`` holds the rank files and ``manifest.json`` (``write_manifest``), ``tmp``
      is gone, and the file ``<folder>/latest`` holds the line ``step_K``;
    * at most ``keep_last`` committed checkpoints with a step ``<= K`` remain (the newest); newer ones (a run
      that resumed from an older step) are left alone;
    * ``step_K`` may already exist (the same step saved again after a resume): it is replaced;
    * a crash (any ``os.replace``, ``os.rename`` or ``os.fsync`` raising) at any point leaves the folder
      loadable: the previous checkpoint is still complete, nothing incomplete is named ``step_N``, and
      ``latest``, when it exists, names a complete checkpoint;
    * durable before it is visible: the manifest and ``tmp``'s entries are fsynced before the rename, the
      rename is fsynced (the parent folder) before ``latest`` changes.

    Traps: ``os.replace`` onto a non-empty folder fails; a crash can happen between any two of your calls;
    writing ``latest`` in place can leave it empty.
    """
    raise NotImplementedError("commit: manifest, fsync, rename (the commit point), then latest, then prune")


def verify_checkpoint(folder: str | Path) -> dict:
    """Return the manifest of the checkpoint folder ``folder`` if every file in it is what the manifest
    says; otherwise raise :class:`CheckpointError` with a message that names the file and what is wrong.

    ``read_manifest(folder)`` parses the manifest and checks the manifest's own checksum (it raises
    ``CheckpointError``); ``manifest["files"]`` maps each file name to ``{"sha256": hex digest, "bytes":
    size}``. A missing file, a file of another size and a file whose content differs (one flipped bit
    anywhere) must all be rejected.

    Traps: only ``CheckpointError`` counts as a rejection (not ``FileNotFoundError``, not an assert); a
    file of the right size can still be wrong; rank files can be gigabytes (do not read one into memory
    at once, but do not stop hashing early either).
    """
    raise NotImplementedError("verify_checkpoint: every file's size and sha256 against the manifest")


def plan_read(pieces: Sequence[Mapping[str, Any]], start: int, numel: int) -> list[tuple[int, int, int, int]]:
    """Which bytes of which saved pieces a reader of the flat range ``[start, start + numel)`` copies.

    ``pieces`` are one tensor's pieces from the manifest, sorted by ``start`` and tiling the flattened tensor:
    piece ``i`` holds elements ``[pieces[i]["start"], pieces[i]["start"] + pieces[i]["numel"])`` (and names
    its ``"file"``). Return one tuple ``(i, offset in piece i, offset in the range, length)`` per piece that
    shares at least one element with the range, in piece order; copying
    ``piece_i[offset_in_piece : offset_in_piece + length]`` into ``range[offset_in_range : ... + length]``
    for every tuple fills the range exactly once.

    Traps: offsets are local (a piece's element 0 is global element ``pieces[i]["start"]``); a piece that
    ends where the range starts shares no element; ``numel`` may be 0.
    """
    raise NotImplementedError("plan_read: intersect the range with every overlapping piece")
