"""The one-device reference of the trainer tests at a parallel layout (tests/trainer/ranks/test_train_tp.py,
_cp, _pp).

The numerics rule: a layout sums the same numbers as one device in other orders, so its losses are compared
with one device's within ``factor x spread``, ``spread`` the largest difference between two one-device runs
of the same arithmetic in two summation orders (the whole batch at once vs one sequence per micro-batch),
measured in the same session, per precision; in 16 bits at least ``|16-bit - fp32|`` on one device (a
16-bit parallel run rounds partial results, e.g. TP's row-layer sums or ring attention's float32 blocks,
where one device rounds once: a rounding no reordering of one device's arithmetic contains).

Losses alone hide a constant gradient factor (AdamW divides it out, clipping rescales it), so the layouts'
**gradients before the optimizer** are compared too: those of the first step, which no clipping or update
has touched yet, handed by ``refimpl.train.train``'s ``gradient_probe`` as boxes of the plain GPT's
tensors (a tensor-parallel block, a ZeRO row shard, a replica). Every rank's every box is compared with
the same box of one device's gradient, per parameter within ``factor x`` that parameter's order spread
(``refimpl.measure.order_tolerance`` applied to its elements), and the boxes of all ranks must cover
every element of every parameter. Negative control: the same gradients scaled by a factor (a pipeline's
``m`` micro-batches whose loss was not divided by ``m``, a sum instead of a mean over 2 replicas) fail.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from refimpl.config import ParallelConfig, TrainConfig
from refimpl.distributed import DistributedContext
from refimpl.distributed.placement import LocalShard
from refimpl.measure import order_tolerance
from refimpl.train import RunOptions, train

PRECISIONS = ("fp32", "bf16", "fp16")
# what a rank's probe keeps of the first step's gradients: name -> (box offsets, global shape, values)
Pieces = dict[str, tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]


def first_step_gradients(into: dict) -> Callable[[int, dict[str, LocalShard]], None]:
    """A ``gradient_probe`` for ``refimpl.train.train`` that keeps step 0's gradients in ``into``
    (``Pieces``: numpy, since tensors would travel back from a rank as shared memory)."""
    def probe(step: int, shards: dict[str, LocalShard]) -> None:
        if step == 0:
            into.update({name: (s.box.offsets, s.box.global_shape, s.tensor.detach().cpu().numpy().copy())
                         for name, s in shards.items()})
    return probe


def one_device_losses(config: TrainConfig, root: Path, *, steps: int, parallel: ParallelConfig | None = None,
                      precisions: Sequence[str] | Mapping[str, ParallelConfig] = PRECISIONS) -> dict:
    """``{(precision, "batch" | "micro"): losses}`` of ``steps`` one-device steps of ``config`` in this
    process (one thread, as each rank runs; the caller's RNG states and thread count restored), under
    ``("grads", precision, order)`` the first step's gradients (``Pieces``, whole tensors) and under
    ``("records", precision, order)`` the trainer's records. ``parallel``:
    the techniques at a world of one (e.g. ``zero_stage=3``: FSDP2's 16-bit arithmetic), its precision
    replaced by each of ``precisions`` ("fp32" must be one of them: the 16-bit rule reads it)."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    try:
        out = {}
        layouts = precisions if isinstance(precisions, Mapping) else {
            p: dataclasses.replace(parallel or ParallelConfig(), precision=p) for p in precisions}
        for precision, layout in layouts.items():
            options = RunOptions(parallel=layout, report=False)
            for order, micro_batch in (("batch", None), ("micro", 1)):
                run = dataclasses.replace(config, out=str(root / f"{precision}-{order}"), steps=steps,
                                          data=dataclasses.replace(config.data, micro_batch_size=micro_batch))
                grads: dict = {}
                records = train(run, ctx, options, gradient_probe=first_step_gradients(grads))
                out[precision, order] = [r["loss"] for r in records]
                out["grads", precision, order] = grads
                out["records", precision, order] = records
        return out
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        torch.set_num_threads(state[3])


def tolerance(one_device: dict, precision: str, *, factor: float) -> float:
    """``factor x`` the order spread of ``precision`` (16 bits: at least ``|16-bit - fp32|``): the package's
    ``refimpl.measure.order_tolerance``, which chapter 12 uses too."""
    return order_tolerance(one_device, precision, factor=factor)


def assert_trains_like_one_device(per_rank: list[list[float]], one_device: dict, precision: str, *,
                                  factor: float, name: str) -> None:
    """Every rank's losses within ``tolerance`` of one device's; negative control: one device's losses
    move by more than the tolerance from step to step (so a run that did not train would fail)."""
    want = np.array(one_device[precision, "batch"][:len(per_rank[0])])
    tol = tolerance(one_device, precision, factor=factor)
    for rank, losses in enumerate(per_rank):
        got = np.array(losses)
        assert len(got) == len(want)
        diff = float(np.abs(got - want).max())
        assert diff <= tol, f"{name} rank {rank}: losses {got} vs one device {want}: {diff:.2e} > {tol:.2e}"
    assert float(np.abs(np.diff(want)).min()) > tol


def _gradient_tolerances(one_device: dict, precision: str, *, factor: float) -> dict[str, float]:
    """Per parameter ``p``: ``factor x r x max|g_p|``, ``r`` the largest spread of one tensor's one-device
    gradient over the two summation orders relative to that tensor's largest element (16 bits: at least
    ``|16-bit - fp32|``), i.e. ``refimpl.measure.order_tolerance`` on the gradients, each tensor divided
    by its own scale ``max|g_p|`` (fp32). Relative because rounding scales with the magnitude, and the
    largest over the tensors because a tensor summed as a single reduction (a bias, the position
    embedding: one sum over the tokens) takes the same bits in both orders and has no spread of its own."""
    def grads(p: str, order: str) -> dict:
        return one_device["grads", p, order]

    scale = {n: float(np.abs(g).max()) or 1.0 for n, (_, _, g) in grads("fp32", "batch").items()}
    relative = {key: np.concatenate([grads(*key)[n][2].ravel() / scale[n] for n in scale])
                for key in ((precision, "batch"), (precision, "micro"), ("fp32", "batch"))}
    r = order_tolerance(relative, precision, factor=factor)
    return {n: r * s for n, s in scale.items()}


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


def gradient_ratios(per_rank: list[Pieces], one_device: dict, precision: str, *, factor: float,
                    scale: float = 1.0) -> dict[str, float]:
    """``{parameter: the worst |rank's box x scale - one device's box| / its tolerance}`` over the ranks
    (within the tolerance: at most 1)."""
    want = one_device["grads", precision, "batch"]
    tol = _gradient_tolerances(one_device, precision, factor=factor)
    worst: dict[str, float] = {}
    for pieces in per_rank:
        for name, (offsets, global_shape, got) in pieces.items():
            whole = want[name][2]
            assert tuple(global_shape) == whole.shape, (name, global_shape, whole.shape)
            diff = np.abs(got.astype(np.float64) * scale - whole[_box(offsets, got.shape)]).max(initial=0.0)
            worst[name] = max(float(diff) / tol[name], worst.get(name, 0.0))
    return worst


def assert_gradients_like_one_device(per_rank: list[Pieces], one_device: dict, precision: str, *,
                                     factor: float, name: str, control: float) -> float:
    """The first step's gradients of every rank equal one device's (module docstring): the ranks' boxes
    cover every element of every parameter of the plain GPT, each within its tolerance; negative control:
    scaled by ``control`` (a planted constant factor) at least 90% of the parameters fail the same
    comparison. Returns the worst ``|difference| / tolerance``."""
    want = one_device["grads", precision, "batch"]
    for pieces in per_rank:
        assert set(pieces) <= set(want), f"{name}: gradients of {sorted(set(pieces) - set(want))}"
    for param, (_, _, whole) in want.items():  # every element of every parameter is some rank's
        covered = np.zeros(whole.shape, dtype=bool)
        for pieces in per_rank:
            if param in pieces:
                covered[_box(pieces[param][0], pieces[param][2].shape)] = True
        assert covered.all(), f"{name}: no rank holds a gradient for part of {param}"
    ratios = gradient_ratios(per_rank, one_device, precision, factor=factor)
    bad = {k: v for k, v in ratios.items() if v > 1}
    assert not bad, f"{name}: gradients off one device's by more than the tolerance (x tol): {bad}"
    planted = gradient_ratios(per_rank, one_device, precision, factor=factor, scale=control)
    caught = [k for k, v in planted.items() if v > 1]
    assert len(caught) >= 0.9 * len(want), (name, control, sorted(set(want) - set(caught)))
    return max(ratios.values())
