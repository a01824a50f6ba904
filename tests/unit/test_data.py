"""Byte tokenizer, corpus preparation (memmap + manifest) and rank-sharded batches (chapters 01 and 03)."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from refimpl.data import (
    DataError,
    ShardedBatches,
    decode,
    default_corpus_files,
    encode,
    make_corpus_file,
    prepare_corpus,
)


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return make_corpus_file(tmp_path / "corpus.txt", num_bytes=5_000)


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "hello, world\n", "héllo wörld: ∑ α→β 漢字 🙂", "\x00\x7f\t"])
def test_encode_decode_round_trip(text):
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and tokens.ndim == 1
    assert tokens.numel() == len(text.encode("utf-8"))  # one token per byte, not per character
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text
    if tokens.numel():
        assert 0 <= int(tokens.min()) and int(tokens.max()) < 256


def test_non_ascii_is_several_tokens_and_a_cut_character_is_replaced():
    tokens = encode("é")
    assert tokens.tolist() == [0xC3, 0xA9]
    assert decode(tokens[:1]) == "\ufffd"


# ---------------------------------------------------------------- corpus preparation


def _manifest_path(corpus) -> Path:
    return corpus.path.with_suffix(".json")


def test_prepare_corpus_writes_memmap_and_manifest(corpus_file, tmp_path):
    cache = tmp_path / "cache"
    corpus = prepare_corpus(str(corpus_file), cache_dir=cache)
    raw = corpus_file.read_bytes()
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint8
    assert len(corpus) == len(raw) == corpus.manifest["token_count"]
    assert corpus.tokens.tobytes() == raw
    assert corpus.path.parent == cache and corpus.path.read_bytes() == raw
    manifest = json.loads(_manifest_path(corpus).read_text())
    assert manifest == corpus.manifest
    assert manifest["sha256"] == hashlib.sha256(raw).hexdigest()
    assert manifest["sources"] == [str(corpus_file)]
    with pytest.raises((ValueError, OSError)):
        corpus.tokens[0] = 1  # read-only


def test_prepare_corpus_reuses_the_cache(corpus_file, tmp_path):
    first = prepare_corpus(str(corpus_file), cache_dir=tmp_path)
    mtime = first.path.stat().st_mtime_ns
    second = prepare_corpus(str(corpus_file), cache_dir=tmp_path)
    assert second.path == first.path and second.manifest == first.manifest
    assert second.path.stat().st_mtime_ns == mtime  # not rewritten
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("corpus-")) == sorted(
        [first.path.name, _manifest_path(first).name]
    )


def test_prepare_corpus_rebuilds_a_corrupted_token_file(corpus_file, tmp_path):
    first = prepare_corpus(str(corpus_file), cache_dir=tmp_path)
    data = bytearray(first.path.read_bytes())
    data[100] ^= 0x01  # flip one bit
    first.path.write_bytes(bytes(data))
    assert hashlib.sha256(first.path.read_bytes()).hexdigest() != first.manifest["sha256"]
    again = prepare_corpus(str(corpus_file), cache_dir=tmp_path)
    assert again.path.read_bytes() == corpus_file.read_bytes()
    assert again.tokens.tobytes() == corpus_file.read_bytes()
    assert hashlib.sha256(again.path.read_bytes()).hexdigest() == again.manifest["sha256"]


def test_prepare_corpus_of_a_folder(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bbb")
    (folder / "a.txt").write_text("aa")
    (folder / "sub" / "c.txt").write_text("c")
    (folder / ".hidden").write_text("hidden")
    corpus = prepare_corpus(str(folder), cache_dir=tmp_path / "cache")
    assert corpus.tokens.tobytes() == b"aabbbc"  # sorted files, hidden ones skipped


def test_missing_path_raises_data_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as info:
        prepare_corpus(str(missing), cache_dir=tmp_path)
    assert "nope.txt" in str(info.value)


def test_empty_file_raises_data_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare_corpus(str(empty), cache_dir=tmp_path / "cache")


def test_empty_folder_raises_data_error(tmp_path):
    folder = tmp_path / "nothing"
    folder.mkdir()
    with pytest.raises(DataError, match="no files") as info:
        prepare_corpus(str(folder), cache_dir=tmp_path / "cache")
    assert "nothing" in str(info.value)


# ---------------------------------------------------------------- sharded batches


@pytest.fixture
def tokens() -> np.ndarray:
    # Distinct-ish content so that windows can be told apart: 40 windows of 8 + 1 tokens.
    return np.random.default_rng(0).integers(0, 256, size=40 * 8 + 1, dtype=np.uint8)


def test_labels_are_inputs_shifted_by_one(tokens):
    batches = ShardedBatches(tokens, seq_len=8, global_batch_size=4, seed=1)
    for step in range(3):
        inputs, labels = batches.batch(step)
        assert inputs.shape == labels.shape == (4, 8) and inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        for x, y, window in zip(inputs, labels, batches.window_ids(step), strict=True):
            start = int(window) * 8  # windows of seq_len + 1 tokens at stride seq_len
            assert x.tolist() == tokens[start : start + 8].tolist()
            assert y.tolist() == tokens[start + 1 : start + 9].tolist()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_shards_union_is_the_world_size_one_batch(tokens, world_size):
    batches = ShardedBatches(tokens, seq_len=8, global_batch_size=8, seed=3)
    for step in range(batches.steps_per_epoch + 2):  # into the second epoch too
        full_inputs, full_labels = batches.batch(step, 0, 1)
        shards = [batches.batch(step, r, world_size) for r in range(world_size)]
        assert all(x.shape == (8 // world_size, 8) for x, _ in shards)
        assert torch.equal(torch.cat([x for x, _ in shards]), full_inputs)
        assert torch.equal(torch.cat([y for _, y in shards]), full_labels)
        ids = [set(batches.window_ids(step, r, world_size).tolist()) for r in range(world_size)]
        assert sum(len(s) for s in ids) == len(set().union(*ids)) == 8  # disjoint


def test_rank_outside_world_and_indivisible_batch_raise(tokens):
    batches = ShardedBatches(tokens, seq_len=8, global_batch_size=8)
    with pytest.raises(DataError):
        batches.batch(0, rank=2, world_size=2)
    with pytest.raises(DataError, match="does not divide"):
        batches.batch(0, rank=0, world_size=3)


def test_no_window_repeats_within_an_epoch_and_epochs_differ(tokens):
    batches = ShardedBatches(tokens, seq_len=8, global_batch_size=6, seed=0)
    n = batches.steps_per_epoch
    assert n == 40 // 6
    epoch0 = torch.cat([batches.window_ids(k) for k in range(n)]).tolist()
    assert len(epoch0) == len(set(epoch0)) == n * 6
    epoch1 = torch.cat([batches.window_ids(k) for k in range(n, 2 * n)]).tolist()
    assert len(epoch1) == len(set(epoch1))
    assert epoch0 != epoch1  # a new permutation each epoch
    assert all(0 <= i < batches.num_windows for i in epoch0 + epoch1)


def test_batches_are_a_pure_function_of_the_arguments(tokens):
    a = ShardedBatches(tokens, seq_len=8, global_batch_size=4, seed=5)
    b = ShardedBatches(tokens, seq_len=8, global_batch_size=4, seed=5)
    for step in [7, 0, 3, 100]:  # any order, any step: nothing but the step is needed to resume
        for rank in range(2):
            xa, ya = a.batch(step, rank, 2)
            xb, yb = b.batch(step, rank, 2)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = ShardedBatches(tokens, seq_len=8, global_batch_size=4, seed=6)
    assert not torch.equal(a.window_ids(0), other.window_ids(0))  # negative control: the seed matters


def test_too_small_corpus_raises_data_error():
    small = np.zeros(3 * 8 + 1, dtype=np.uint8)  # 3 windows
    with pytest.raises(DataError) as info:
        ShardedBatches(small, seq_len=8, global_batch_size=4)
    message = str(info.value)
    assert "3 windows" in message and "4" in message and "--batch-size" in message
    ShardedBatches(small, seq_len=8, global_batch_size=3)  # exactly one batch is enough


def test_default_corpus_files_are_sorted_stdlib_sources():
    files = default_corpus_files(max_bytes=200_000)
    assert files and files == sorted(files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert all(f.suffix == ".py" and f.parent == stdlib and f.is_file() for f in files)
    total = sum(f.stat().st_size for f in files)
    assert total >= 200_000 or len(files) == len(list(stdlib.glob("*.py")))
    assert total - files[-1].stat().st_size < 200_000  # stops at the first file past the budget
    assert default_corpus_files(max_bytes=200_000) == files  # deterministic
