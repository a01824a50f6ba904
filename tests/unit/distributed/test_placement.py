"""The shard descriptor: boxes, chunks, composition and intersection (refimpl.distributed.placement)."""

import pytest
import torch

from refimpl.distributed.placement import Box, LocalShard, chunk_range


def test_chunk_range_is_torch_chunk():
    for size in range(0, 12):
        for n in range(1, 6):
            # torch.chunk returns fewer chunks when they run out: pad with empties at the end
            expected, at = [], 0
            for c in torch.arange(size).chunk(n) if size else []:
                expected.append((at, at + len(c)))
                at += len(c)
            expected += [(size, size)] * (n - len(expected))
            assert [chunk_range(size, i, n) for i in range(n)] == expected


def test_boxes_index_the_global_tensor():
    full = torch.arange(6 * 8).view(6, 8)
    cols = Box.chunk((6, 8), 1, 1, 2)  # row-parallel TP: columns [4, 8)
    assert cols.offsets == (0, 4) and cols.shape == (6, 4)
    assert torch.equal(full[cols.slices()], full[:, 4:])
    rows_of_cols = cols.within(Box.chunk(cols.shape, 0, 2, 3))  # ZeRO-1 over the TP shard: rows [4, 6)
    assert rows_of_cols == Box((6, 8), (4, 4), (2, 4))
    assert torch.equal(full[rows_of_cols.slices()], full[:, 4:][4:6])
    inter = Box.chunk((6, 8), 0, 0, 2).intersection(cols)  # rows [0, 3) x cols [4, 8)
    assert inter == Box((6, 8), (0, 4), (3, 4))
    assert torch.equal(full[cols.slices()][inter.slices(cols)], full[:3, 4:])
    assert Box.chunk((6, 8), 1, 0, 2).intersection(cols) is None  # negative control: disjoint columns
    assert Box.full(()).intersection(Box.full(())) == Box.full(())


def test_bad_boxes_are_refused():
    with pytest.raises(ValueError, match="outside"):
        Box((4, 4), (2, 0), (3, 4))
    with pytest.raises(ValueError, match="one offset"):
        Box((4, 4), (0,), (4, 4))
    with pytest.raises(ValueError, match="cannot hold"):
        LocalShard(torch.zeros(2, 4), Box.chunk((4, 4), 1, 0, 2))
    with pytest.raises(ValueError, match="does not lie inside"):
        Box.chunk((4, 4), 0, 0, 2).slices(Box.chunk((4, 4), 0, 1, 2))
