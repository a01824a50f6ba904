"""Trustworthy sharded checkpoints: save the whole training state, commit atomically, resume exactly.

Chapter 11.

What a checkpoint holds (``save_training_state``): the model's parameters and persistent buffers and
the optimizer state *as each rank holds them* (full tensors, ZeRO-1/2 optimizer shards, FSDP parameter
shards), the optimizer's hyperparameters, the loss scaler, the step (from which the learning-rate
schedule and the data position follow: both are pure functions of the step in refimpl), the run's config,
library versions, and each rank's RNG states. The format (version 2) is in
``refimpl.checkpoint.format``: tensors are described by global name and shape, and every piece is a box
of its tensor (``refimpl.distributed.placement.Box``: offsets and shape), so a checkpoint written at
one data-parallel size, ZeRO stage or layout loads at another, by box intersection. The wrappers say
themselves which boxes they hold (``local_shards()`` on a module, ``local_state_shards()`` on an
optimizer), and so do torch's DTensors (FSDP2 ``fully_shard``'s parameters and their ``AdamW`` moments:
the box of their placements, ``refimpl.distributed.placement.dtensor_box``); the checkpoint reads
only that.

**The commit protocol** (``Checkpointer.save``, collective)::

    every rank   snapshot its pieces to CPU copies          (training may go on from here when async)
    every rank   write step_K.tmp-<id>/rank_R.pt, fsync it, hash it
    all ranks    exchange "ok + sha256 + size" or the error (one all_gather on a private gloo group)
    rank 0       write manifest.json (every file's sha256 and size), fsync it and the folder
    rank 0       rename step_K.tmp-<id> -> step_K, fsync the parent     <- the commit point
    rank 0       write "latest" atomically (temp file, fsync, os.replace), prune to the last K
    all ranks    learn the outcome (a second all_gather): the same error is raised everywhere

A crash before the rename leaves a ``*.tmp-*`` folder that no loader reads and the next save or load
deletes; a crash after it leaves a complete checkpoint. ``latest`` is a pointer for people and tools; the
loader trusts only what it verifies: ``find_latest_valid`` walks the committed checkpoints newest
first, checks manifest, format version, expected shapes, sizes and sha256 (ranks hash files in parallel),
says why each rejected one was rejected and returns the newest valid one.

**Asynchronous save** (``async_save=True``): ``Checkpointer.save`` returns once the snapshot is taken;
a background thread writes, hashes and commits. It talks to the other ranks on its own gloo process group,
so its collectives never interleave with the training's. The next ``save``, ``wait``, ``close`` or load
joins it and raises its error, if any.

**Resume** (``Checkpointer.resume_point``): ``resume="auto"`` continues from the newest valid
checkpoint (a fresh start when the folder holds none; an error when it holds some and none is valid);
``resume="never"`` refuses a folder that already holds checkpoints. Decide from the disk, not from the
elastic agent's restart counter (it is per agent). A run stopped after step k and resumed gives the same
losses, bit for bit, as an uninterrupted run: the weights, moments, step, RNG states and data position are
exactly those the uninterrupted run had.

The package, one concept per file, imports running down the list::

    format.py          the on-disk format (version 2): ShardMeta (a rank's box), piece keys, what is stored
    plan.py            who writes which box (plan_pieces), who reads which (plan_read: box intersection)
    files.py           fsync, sha256, a rank's file written; CheckpointReader reads boxes back
    manifest.py        the manifest built, written, read, its checksum; verify_checkpoint
    folder.py          the folder protocol: commit, latest, list, clean, find_latest_valid
    checkpointer.py    Checkpointer: the collective save (sync or async), find, resume_point, load
    training_state.py  parameter/optimizer shards (declared, or DTensor boxes), RNG states, save/load
    save_schedule.py   SaveSchedule: every N steps, every M minutes, on SIGTERM
"""

from refimpl.checkpoint.checkpointer import CheckpointConfig, Checkpointer
from refimpl.checkpoint.files import CheckpointReader, fsync_dir, sha256_file, write_rank_file
from refimpl.checkpoint.folder import (
    LATEST,
    STEP_DIR,
    TMP_MARK,
    CheckpointInfo,
    clean_leftovers,
    commit,
    find_latest_valid,
    list_checkpoints,
    step_dir_name,
)
from refimpl.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    SPLIT_MIN_NUMEL,
    CheckpointError,
    ShardMeta,
    as_local_shard,
    check_plain,
    describe_box,
    dtype_of,
    piece_box,
    piece_key,
    rank_file_name,
    shard_metadata,
)
from refimpl.checkpoint.manifest import (
    build_manifest,
    check_expected,
    library_versions,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from refimpl.checkpoint.plan import plan_pieces, plan_read, snapshot_pieces
from refimpl.checkpoint.save_schedule import SaveSchedule
from refimpl.checkpoint.training_state import (
    capture_rng_state,
    expected_shapes,
    load_training_state,
    optimizer_shards,
    parameter_shards,
    restore_rng_state,
    save_training_state,
)

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "LATEST", "MANIFEST", "SPLIT_MIN_NUMEL", "STEP_DIR", "TMP_MARK",
    "CheckpointConfig", "CheckpointError", "CheckpointInfo", "CheckpointReader", "Checkpointer",
    "SaveSchedule", "ShardMeta", "as_local_shard", "build_manifest", "capture_rng_state", "check_expected",
    "check_plain", "clean_leftovers", "commit", "describe_box", "dtype_of", "expected_shapes",
    "find_latest_valid", "fsync_dir", "library_versions", "list_checkpoints", "load_training_state",
    "optimizer_shards", "parameter_shards", "piece_box", "piece_key", "plan_pieces", "plan_read",
    "rank_file_name", "read_manifest", "restore_rng_state", "save_training_state", "sha256_file",
    "shard_metadata", "snapshot_pieces",
    "step_dir_name", "verify_checkpoint", "write_manifest", "write_rank_file",
]
