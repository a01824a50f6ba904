"""Exercises of chapter 11: checkpoints you can trust.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=11`` (or
``python -m exercises.grade 11``) to see your score per task. The grader

* commits a checkpoint with your ``commit`` over a folder that already holds a committed one, and then
  again with a crash injected at every ``os.replace``, ``os.rename`` and ``os.fsync`` your code makes, one
  crash point per run: after each crash the previous checkpoint must still be found, ``latest`` must name
  a checkpoint that verifies, and the order of the durable steps is checked;
* damages copies of a real checkpoint (a flipped bit late in a file larger than 1 MiB, a truncated file,
  a deleted file, an edited manifest) and expects your ``verify_checkpoint`` to reject each one with a
  ``CheckpointError``, and to accept the intact one;
* saves tensors at 4 ranks as boxes (uneven blocks of rows, blocks of columns, a 2 x 2 grid of blocks, a
  1-D tensor with an empty shard, a replicated matrix written in slabs, a 0-d tensor), reads them back at
  3 ranks as rows and as columns, and whole, through your ``plan_read``, and compares with the saved values
  element for element.

You may use ``os``, ``shutil``, ``hashlib``, ``json``, ``pathlib`` and the helpers imported below; do not
call ``refimpl.checkpoint.commit``, ``refimpl.checkpoint.verify_checkpoint`` /
``sha256_file`` / ``plan_read``, ``Box.intersection`` or ``CheckpointReader`` (that is the answer).
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
from refimpl.distributed.placement import Box


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
    says; otherwise raise ``CheckpointError`` with a message that names the file and what is wrong.

    ``read_manifest(folder)`` parses the manifest and checks the manifest's own checksum (it raises
    ``CheckpointError``); ``manifest["files"]`` maps each file name to ``{"sha256": hex digest, "bytes":
    size}``. A missing file, a file of another size and a file whose content differs (one flipped bit
    anywhere) must all be rejected.

    Traps: only ``CheckpointError`` counts as a rejection (not ``FileNotFoundError``, not an assert); a
    file of the right size can still be wrong; rank files can be gigabytes (do not read one into memory
    at once, but do not stop hashing early either).
    """
    raise NotImplementedError("verify_checkpoint: every file's size and sha256 against the manifest")


def plan_read(pieces: Sequence[Mapping[str, Any]], want: Box) -> list[tuple[int, Box]]:
    """Which elements of which saved pieces a reader of the box ``want`` copies: resharding as box
    intersection.

    ``want`` is a ``refimpl.distributed.placement.Box`` of a global tensor (``want.global_shape``):
    the elements ``[want.offsets[d], want.offsets[d] + want.shape[d])`` in every dimension ``d``. ``pieces``
    are that tensor's pieces from the manifest: piece ``i`` is the box with ``pieces[i]["offsets"]`` and
    ``pieces[i]["shape"]`` (and names its ``"file"``); together they tile the tensor, each element in
    exactly one piece. Return, in piece order, one ``(i, common)`` per piece that shares at least one
    element with ``want``, ``common`` the ``Box`` of the elements they share. The reader then copies
    ``out[common.slices(want)] = piece_i[common.slices(box_i)]`` for every tuple, which must fill ``out``
    (the tensor holding ``want``) exactly once, whatever the layout that saved and the one that reads:
    rows into columns, blocks into rows, a 1-D range (the 1-D box) into another.

    Traps: two boxes share elements only if their ranges overlap in *every* dimension; a piece that only
    touches ``want`` at a face shares nothing; ``want`` may be empty (a dimension of size 0); a 0-d tensor
    is the box with no dimensions (one element). You may build boxes (``Box(global_shape, offsets,
    shape)``) and use ``.slices``; do not call ``Box.intersection``.
    """
    raise NotImplementedError("plan_read: intersect the box with every piece, dimension by dimension")
