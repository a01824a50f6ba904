"""What a step asks of the host on a GPU, checked without one: the batch goes to the device once,
pinned and ``non_blocking``; AdamW takes the ``foreach`` path on CUDA and keeps the CPU's per-tensor path
(the course's bitwise references); the save schedule reads its two flags back in one host read per step
(one GPU sync, not two), and in none when there is nothing to agree on.

The CUDA side is faked where it would need a GPU (the device an optimizer is built for, the tensor methods
a copy calls, a peer's flags in the all-reduce); tests/ranks/test_gpu.py runs the real thing on a GPU box.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refimpl.checkpoint import CheckpointConfig
from refimpl.checkpoint.save_schedule import SaveSchedule
from refimpl.config import ModelConfig, OptimConfig, ParallelConfig
from refimpl.data import to_device
from refimpl.distributed import ParallelDims
from refimpl.models import GPT
from refimpl.optim import adamw_foreach, build_optimizer
from refimpl.parallel.parallelize import parallelize

CONFIG = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, max_seq_len=16)
CUDA = torch.device("cuda", 0)


# ---------------------------------------------------------------- the batch

def test_on_the_cpu_the_batch_is_the_same_tensor():
    window = torch.arange(40).reshape(4, 10)
    inputs = window[:, :-1]  # a view, as ShardedBatches.batch returns it
    assert to_device(inputs, torch.device("cpu")) is inputs  # no copy, no pinning: bitwise as before


def test_on_a_gpu_the_batch_is_pinned_and_copied_without_waiting(monkeypatch):
    calls: list[tuple] = []

    def pin_memory(self):
        calls.append(("pin_memory",))
        return self

    def to(self, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return self

    batch = torch.zeros(2, 8, dtype=torch.int64)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert to_device(batch, CUDA) is batch
    assert calls == [("pin_memory",), ("to", (CUDA,), {"non_blocking": True})]


# ---------------------------------------------------------------- AdamW's foreach

def test_adamw_foreach_only_on_cuda():
    assert adamw_foreach(CUDA) and adamw_foreach("cuda")
    assert not adamw_foreach(torch.device("cpu")) and not adamw_foreach("meta")


def test_the_cpu_optimizer_is_as_before_and_a_cuda_one_is_foreach(monkeypatch):
    model = GPT(CONFIG, seed=0)
    assert build_optimizer(model, OptimConfig()).defaults["foreach"] is False  # bitwise as today
    import refimpl.optim

    seen: list[torch.device] = []

    def device_of(groups):
        seen.append(next(p.device for g in groups for p in g["params"]))
        return CUDA  # as if the parameters were on a GPU (AdamW checks the devices only in step)

    monkeypatch.setattr(refimpl.optim, "_device_of", device_of)
    assert build_optimizer(model, OptimConfig()).defaults["foreach"] is True
    assert seen == [torch.device("cpu")]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_parallelized_optimizer_takes_foreach_from_its_parameters_device(zero_stage, monkeypatch):
    """The trainer's path (``Parallelized.build_optimizer``): AdamW, or ZeRO-1's inner AdamW over the
    shards, asks ``adamw_foreach`` about the parameters' device and takes its answer."""
    import refimpl.optim
    import refimpl.parallel.optimizer_setup as setup

    def build(rule):
        monkeypatch.setattr(setup, "adamw_foreach", rule)
        monkeypatch.setattr(refimpl.optim, "adamw_foreach", rule)
        par = parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1),
                          ParallelConfig(dp=1, zero_stage=zero_stage))
        optimizer = par.build_optimizer(OptimConfig()).optimizer
        return getattr(optimizer, "optimizer", optimizer).defaults["foreach"]  # ZeRO: the inner AdamW

    asked: list[torch.device] = []
    assert build(lambda device: asked.append(torch.device(device)) or adamw_foreach(device)) is False
    assert asked == [torch.device("cpu")]
    assert build(lambda device: True) is True  # what CUDA parameters get


# ---------------------------------------------------------------- the save schedule's flags

class _Reads:
    """Counts ``Tensor.item`` and ``Tensor.tolist`` calls: each is a device-to-host copy, a GPU sync."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in ("item", "tolist"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)
        return read


def _two_ranks(monkeypatch, *, rank: int, peer: tuple[float, float]) -> list[torch.Tensor]:
    """This process as ``rank`` of 2, the all-reduce (MAX) taking the peer's flags; returns what was
    reduced."""
    import refimpl.comm.ops as ops

    reduced: list[torch.Tensor] = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        assert op == ops.ReduceOp.MAX
        reduced.append(tensor)
        tensor.copy_(torch.maximum(tensor, torch.tensor(peer, dtype=tensor.dtype)))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(ops, "all_reduce", all_reduce)
    return reduced


def test_the_save_flags_come_back_in_one_read(monkeypatch, tmp_path: Path):
    """Rank 1 of 2, a peer that received SIGTERM and whose (rank 0's) clock says "save": one tensor, one
    all-reduce, one host read per ``due``; the flags are the MAX over the ranks."""
    reduced = _two_ranks(monkeypatch, rank=1, peer=(1.0, 1.0))
    schedule = SaveSchedule(CheckpointConfig(folder=tmp_path, every_minutes=60.0))
    try:
        reads = _Reads(monkeypatch)
        assert schedule.due(1) is True and schedule.stop_requested
        assert reads.count == 1 and len(reduced) == 1 and reduced[0].tolist() == [1.0, 1.0]
    finally:
        schedule.close()


def test_rank_0s_clock_decides(monkeypatch, tmp_path: Path):
    for rank, want in ((1, False), (0, True)):  # time is up on every rank; only rank 0's counts
        reduced = _two_ranks(monkeypatch, rank=rank, peer=(0.0, 0.0))
        schedule = SaveSchedule(CheckpointConfig(folder=tmp_path, every_minutes=1e-9, save_on_sigterm=False))
        try:
            assert schedule.due(3) is want and not schedule.stop_requested
            assert reduced[0].tolist() == [0.0, float(want)]
        finally:
            schedule.close()


def test_nothing_to_agree_on_reads_nothing(monkeypatch, tmp_path: Path):
    """No minutes and no SIGTERM handler (the every-N-steps rule needs no communication), or one rank:
    no tensor, no all-reduce, no read."""
    reduced = _two_ranks(monkeypatch, rank=0, peer=(1.0, 1.0))
    reads = _Reads(monkeypatch)
    schedule = SaveSchedule(CheckpointConfig(folder=tmp_path, every_steps=2, save_on_sigterm=False))
    assert [schedule.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    schedule.close()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    schedule = SaveSchedule(CheckpointConfig(folder=tmp_path, every_minutes=60.0))
    try:
        assert schedule.due(1) is False
    finally:
        schedule.close()
    assert reads.count == 0 and reduced == []
