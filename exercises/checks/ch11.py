"""Checks of chapter 11's exercises (``exercises/11_checkpoint_elastic.py``); see exercises/grading.py.

* ``commit`` runs over a folder that holds a committed checkpoint (written by refimpl), first without a
  fault (the result, ``latest``, pruning to ``keep_last``, replacing a step saved again, the order of the
  fsyncs and renames), then once per crash point: the n-th ``os.replace`` / ``os.rename`` / ``os.fsync``
  raises, for n = 1, 2, ... until a run goes through. After every crash the previous checkpoint must be
  found by refimpl's loader and ``latest`` must name a checkpoint that verifies.
* ``verify_checkpoint`` gets an intact checkpoint (a rank file of about 1.6 MB) and copies of it with a
  flipped bit near the end of a file (past the first MiB), a truncated file, a deleted file and an edited
  manifest.
* ``plan_read`` reads, at 3 ranks as blocks of rows and as blocks of columns (ceil-sized chunks), whole,
  empty, one piece exactly and an inner block, tensors that 4 ranks saved as boxes (rows, columns, a 2 x 2
  grid, a 1-D tensor with an empty shard, a replica written in slabs, a 0-d tensor; refimpl's
  ``plan_pieces``); the copies it plans must reproduce every element exactly once.

``MUTANTS`` holds one plausible wrong implementation per task (tests/course/cli/test_exercises.py grades
them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import torch

from exercises.grading import Task, load_module
from refimpl.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    ShardMeta,
    build_manifest,
    find_latest_valid,
    list_checkpoints,
    piece_box,
    piece_key,
    plan_pieces,
    rank_file_name,
    verify_checkpoint,
    write_rank_file,
)
from refimpl.distributed.placement import Box


class _Crash(OSError):
    """The injected fault (an OSError, as a failing disk or a killed process would look to the code)."""


def _committed(folder: Path, step: int) -> None:
    """A checkpoint of ``step`` committed by refimpl (one process)."""
    Checkpointer(CheckpointConfig(folder=folder, keep_last=100)).save(
        step, {"w": torch.full((64,), float(step))}, state={"step": step})


def _prepared(folder: Path, step: int) -> tuple[Path, dict]:
    """A written but uncommitted save of ``step``: its temp folder and its manifest."""
    tmp = folder / f"step_{step:08d}.tmp-check{step}"
    tmp.mkdir()
    plan = plan_pieces([[ShardMeta("w", "float32", Box.full((64,)))]])
    files = {rank_file_name(0): write_rank_file(tmp / rank_file_name(0),
                                                {piece_key("w", (0,)): torch.full((64,), float(step))}, None)}
    manifest = build_manifest(step=step, world_size=1, plan=plan, files=files, state={"step": step},
                              config=None, versions={})
    return tmp, manifest


def _find(folder: Path):
    """refimpl's loader, without its warnings about the leftovers of the crashes injected here."""
    logger = logging.getLogger("refimpl.checkpoint")
    level, logger.level = logger.level, logging.ERROR
    try:
        return find_latest_valid(folder)
    finally:
        logger.setLevel(level)


def _latest(folder: Path) -> str | None:
    path = folder / "latest"
    return path.read_text().strip() if path.exists() else None


def _names(folder: Path) -> list[str]:
    return [p.name for p in list_checkpoints(folder)]


@contextlib.contextmanager
def _recording(crash_at: int | None = None):
    """Record every os.replace / os.rename / os.fsync; make call number ``crash_at`` (1-based) raise."""
    events: list[tuple[str, str, str]] = []
    real = {"replace": os.replace, "rename": os.rename, "fsync": os.fsync}

    def wrap(kind):
        def call(*args, **kwargs):
            if kind == "fsync":
                fd = args[0] if isinstance(args[0], int) else args[0].fileno()
                what = (os.readlink(f"/proc/self/fd/{fd}"), "")
            else:
                what = (os.fspath(args[0]), os.fspath(args[1]))
            events.append((kind, *what))
            if crash_at is not None and len(events) == crash_at:
                raise _Crash(f"injected crash at call {crash_at} ({kind} {what[0]})")
            return real[kind](*args, **kwargs)
        return call

    with mock.patch.object(os, "replace", wrap("replace")), mock.patch.object(os, "rename", wrap("rename")), \
            mock.patch.object(os, "fsync", wrap("fsync")):
        yield events


def check_commit(path: str) -> None:
    commit = load_module(path).commit
    with tempfile.TemporaryDirectory(prefix="grade09-") as root:
        folder = Path(root).resolve() / "ckpt"
        folder.mkdir()
        _committed(folder, 1)
        tmp, manifest = _prepared(folder, 2)
        with _recording() as events:
            final = commit(tmp, manifest, keep_last=2)
        assert Path(final) == folder / "step_00000002", f"commit returned {final}, not {folder}/step_00000002"
        assert not tmp.exists(), "the temp folder still exists after the commit (rename it, do not copy it)"
        assert _latest(folder) == "step_00000002", f"latest holds {_latest(folder)!r}, not 'step_00000002'"
        verify_checkpoint(final)  # refimpl's verifier: the manifest is in place and matches the files
        assert _find(folder).step == 2
        _check_order(events, tmp, final, folder)

        for step in (3, 4):  # pruning: keep the newest 2 at or below the committed step
            commit(*_prepared(folder, step), keep_last=2)
        assert _names(folder) == ["step_00000004", "step_00000003"], (
            f"after committing steps 1-4 with keep_last=2 the folder holds {_names(folder)}")
        commit(*_prepared(folder, 3), keep_last=2)  # the same step again (a resumed run): replace it
        assert _names(folder) == ["step_00000004", "step_00000003"] and _latest(folder) == "step_00000003", (
            f"saving step 3 again: {_names(folder)}, latest {_latest(folder)!r}")
        leftovers = sorted(p.name for p in folder.iterdir() if p.name not in ("latest", *_names(folder)))
        assert not leftovers, f"files left next to the checkpoints: {leftovers}"

    for crash_at in range(1, 100):
        with tempfile.TemporaryDirectory(prefix="grade09-") as root:
            folder = Path(root).resolve() / "ckpt"
            folder.mkdir()
            _committed(folder, 1)
            tmp, manifest = _prepared(folder, 2)
            try:
                with _recording(crash_at) as events:
                    commit(tmp, manifest, keep_last=1)  # it prunes step 1 too: crash points there as well
                return  # this many calls: the commit went through; every crash point before was checked
            except _Crash:
                pass
            where = f"after a crash at {events[-1][0]}({events[-1][1]}) (call {crash_at} of the commit)"
            latest = _latest(folder)
            assert latest is None or latest in _names(folder), (
                f"{where}: latest names {latest!r}, which is not a committed checkpoint "
                f"(committed: {_names(folder)})")
            if latest is not None:
                verify_checkpoint(folder / latest)
            info = _find(folder)
            assert info is not None and info.step in (1, 2), f"{where}: no valid checkpoint is found"
            assert "step_00000001" in _names(folder) or info.step == 2, f"{where}: step 1 is gone"
    raise AssertionError("commit made more than 99 replace/rename/fsync calls")


def _check_order(events: list[tuple[str, str, str]], tmp: Path, final: Path, folder: Path) -> None:
    renames = [i for i, e in enumerate(events) if e[0] in ("replace", "rename") and e[1] == str(tmp)]
    assert renames, f"no os.replace/os.rename of {tmp.name} to {final.name}: the commit point is missing"
    commit_at = renames[0]
    fsynced = {e[1] for e in events[:commit_at] if e[0] == "fsync"}
    assert str(tmp / "manifest.json") in fsynced or str(tmp) in fsynced, (
        "the manifest was not fsynced before the rename (write_manifest does it)")
    assert str(tmp) in fsynced, f"{tmp.name} (the folder) was not fsynced before the rename"
    latest = str(folder / "latest")
    latest_at = [i for i, e in enumerate(events) if e[0] in ("replace", "rename") and e[2] == latest]
    assert latest_at, "latest was not written atomically: no os.replace of a temp file onto it was seen"
    between = {e[1] for e in events[commit_at + 1 : latest_at[-1]] if e[0] == "fsync"}
    assert str(folder) in between, "the rename was not made durable (fsync of the parent) before latest"
    assert latest_at[-1] > commit_at, "latest was replaced before the commit point"


def _real_checkpoint(folder: Path) -> Path:
    big = torch.randn(400_000, generator=torch.Generator().manual_seed(0))  # 1.6 MB: more than one MiB
    Checkpointer(CheckpointConfig(folder=folder)).save(1, {"big": big, "small": torch.arange(10.0)},
                                                       state={"step": 1})
    return list_checkpoints(folder)[0]


def _flip_late(step_dir: Path) -> None:
    path = step_dir / "rank_00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) - 4096] ^= 0x04  # inside the tensor bytes, past the first MiB
    path.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
    path = step_dir / "rank_00000.pt"
    path.write_bytes(path.read_bytes()[:-64])


def _edit_manifest(step_dir: Path) -> None:
    path = step_dir / "manifest.json"
    path.write_text(path.read_text().replace('"step": 1', '"step": 7', 1))


DAMAGES = {"a flipped bit past the first MiB": _flip_late, "a truncated rank file": _truncate,
           "a deleted rank file": lambda d: (d / "rank_00000.pt").unlink(),
           "an edited manifest": _edit_manifest}


def check_verify(path: str) -> None:
    verify = load_module(path).verify_checkpoint
    with tempfile.TemporaryDirectory(prefix="grade09-") as root:
        intact = _real_checkpoint(Path(root) / "ckpt")
        manifest = verify(intact)
        assert isinstance(manifest, dict) and manifest.get("step") == 1 and "files" in manifest, (
            f"verify_checkpoint of an intact checkpoint must return its manifest, got {manifest!r:.200}")
        for what, damage in DAMAGES.items():
            copy = Path(root) / what.replace(" ", "_")
            shutil.copytree(intact, copy)
            damage(copy)
            try:
                verify(copy)
            except CheckpointError:
                continue
            except Exception as exc:  # noqa: BLE001 - the message tells the learner what was raised instead
                raise AssertionError(f"{what}: verify_checkpoint raised {type(exc).__name__} ({exc}); "
                                     "a damaged checkpoint must raise CheckpointError") from None
            raise AssertionError(f"{what} was not detected: verify_checkpoint returned the manifest")


def _grid(shape: tuple[int, ...], r: int) -> Box:
    """Rank r's block of a 2 x 2 grid of blocks (ceil-sized in both dims)."""
    return Box.chunk(shape, 0, r // 2, 2).within(Box.chunk(Box.chunk(shape, 0, r // 2, 2).shape, 1, r % 2, 2))


SAVED_AT_4 = {  # global shape and the box each of 4 ranks held when saving
    "qkv": ((54, 18), lambda r: Box.chunk((54, 18), 0, r, 4)),  # ZeRO rows, cut 14/14/14/12
    "dense": ((6, 10), lambda r: Box.chunk((6, 10), 1, r, 4)),  # row-parallel columns, 3/3/3/1
    "blocks": ((7, 9), lambda r: _grid((7, 9), r)),  # 4 x 5, 4 x 4, 3 x 5, 3 x 4
    "gappy": ((31,), lambda r: Box((31,), ((0, 1, 1, 30)[r],), ((1, 0, 29, 1)[r],))),  # rank 1 empty
    "replica": ((8, 5), lambda r: Box.full((8, 5))),  # written in 4 slabs
    "scalar": ((), lambda r: Box.full(())),
}


def _inside(outer: Box, inner: Box) -> bool:
    return all(o <= i and i + s <= o + t for o, t, i, s in
               zip(outer.offsets, outer.shape, inner.offsets, inner.shape, strict=True))


def _requests(shape: tuple[int, ...], pieces: list[Box]) -> list[tuple[str, Box]]:
    out = [("whole", Box.full(shape))]
    for dim in range(len(shape)):
        out += [(f"rank {r} of 3 along dim {dim}", Box.chunk(shape, dim, r, 3)) for r in range(3)]
    if shape:
        out.append(("an empty box", Box.full(shape).narrow(0, 0, 0)))
        out.append(("an inner block", Box(shape, (1,) * len(shape), tuple(n - 2 for n in shape))))
    out += [(f"exactly piece {i}", box) for i, box in enumerate(pieces)]
    return out


def check_plan_read(path: str) -> None:
    plan_read = load_module(path).plan_read
    metas = [[ShardMeta(name, "float32", box_of(r)) for name, (_, box_of) in SAVED_AT_4.items()]
             for r in range(4)]
    plan = plan_pieces(metas, split_min_numel=4)  # the replica is written in 4 slabs
    for name, entry in plan.items():
        shape = tuple(entry["shape"])
        value = (torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32) + 1000 * len(name))
        value = value.reshape(shape)
        boxes = [piece_box(shape, p) for p in entry["pieces"]]
        saved = [value[b.slices()] for b in boxes]
        layout = [(b.offsets, b.shape) for b in boxes]
        for what, want in _requests(shape, boxes):
            where = (f"{name!r} of shape {shape} (pieces (offsets, shape) {layout}), {what} {want.offsets} "
                     f"{want.shape}")
            got = [(int(i), common) for i, common in plan_read(entry["pieces"], want)]
            for i, common in got:
                assert 0 <= i < len(saved), f"{where}: piece index {i} does not exist"
                assert isinstance(common, Box), f"{where}: ({i}, {common!r}) is not (index, Box)"
                assert common.global_shape == shape, f"{where}: piece {i}: a box of another tensor shape"
                assert common.numel > 0, f"{where}: piece {i}: {common} copies nothing; leave such pieces out"
                assert _inside(boxes[i], common), (
                    f"{where}: piece {i}: {common.offsets} {common.shape} lies outside the piece")
                assert _inside(want, common), (
                    f"{where}: piece {i}: {common.offsets} {common.shape} lies outside the box read")
            order = [i for i, _ in got]
            assert order == sorted(set(order)), f"{where}: not in piece order {order}"
            out = torch.full(want.shape, float("nan"))
            count = torch.zeros(want.shape, dtype=torch.int64)
            for i, common in got:
                out[common.slices(want)] = saved[i][common.slices(boxes[i])]
                count[common.slices(want)] += 1
            assert torch.equal(count, torch.ones_like(count)), (
                f"{where}: elements copied {count.tolist()} times")
            assert torch.equal(out, value[want.slices()]), f"{where}: the copies {got} give other values"


TASKS = [
    Task(name="commit: atomic, crash-safe", points=4, check=check_commit),
    Task(name="verify_checkpoint: sha256", points=2, check=check_verify),
    Task(name="plan_read: reshard boxes 4 -> 3", points=3, check=check_plan_read),
]

_HEADER = "from exercises.reference.ch11 import *  # noqa: F403\n"
MUTANTS = {
    "commit: atomic, crash-safe": _HEADER + (
        "import os\n"
        "from refimpl.checkpoint import STEP_DIR, list_checkpoints, step_dir_name\n"
        "from refimpl.checkpoint.folder import _delete, _write_latest\n"
        "from refimpl.checkpoint import fsync_dir, write_manifest\n"
        "def commit(tmp, manifest, *, keep_last):\n"
        "    write_manifest(tmp, manifest)\n"
        "    fsync_dir(tmp)\n"
        "    folder, step = tmp.parent, manifest['step']\n"
        "    final = folder / step_dir_name(step)\n"
        "    _write_latest(folder, final.name)  # latest moved before the commit point\n"
        "    if final.exists():\n"
        "        _delete(final)\n"
        "    os.replace(tmp, final)\n"
        "    fsync_dir(folder)\n"
        "    older = [p for p in list_checkpoints(folder) if int(STEP_DIR.match(p.name).group(1)) <= step]\n"
        "    for p in older[keep_last:]:\n"
        "        _delete(p)\n"
        "    return final\n"
    ),
    "verify_checkpoint: sha256": _HEADER + (
        "from refimpl.checkpoint import CheckpointError, read_manifest\n"
        "def verify_checkpoint(folder):\n"
        "    manifest = read_manifest(folder)\n"
        "    for name, record in manifest['files'].items():  # sizes only: hashing is slow\n"
        "        path = folder / name\n"
        "        if not path.is_file() or path.stat().st_size != record['bytes']:\n"
        "            raise CheckpointError(f'{path} is missing or has another size')\n"
        "    return manifest\n"
    ),
    "plan_read: reshard boxes 4 -> 3": _HEADER + (
        "from refimpl.distributed.placement import Box\n"
        "def plan_read(pieces, want):\n"
        "    out = []\n"
        "    for i, p in enumerate(pieces):\n"
        "        if not want.ndim:\n"
        "            out.append((i, want))\n"
        "            continue\n"
        "        lo = max(p['offsets'][0], want.offsets[0])  # dim 0 only: every piece taken as whole rows\n"
        "        hi = min(p['offsets'][0] + p['shape'][0], want.offsets[0] + want.shape[0])\n"
        "        if lo < hi:\n"
        "            box = Box(want.global_shape, (lo, *want.offsets[1:]), (hi - lo, *want.shape[1:]))\n"
        "            out.append((i, box))\n"
        "    return out\n"
    ),
}
