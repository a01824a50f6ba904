"""The one-device reference of the trainer tests at a parallel layout (tests/test_train_tp.py, _cp, _pp).

The numerics rule: a layout sums the same numbers as one device in other orders, so its losses are compared
with one device's within ``factor x spread``, ``spread`` the largest difference between two one-device runs
of the same arithmetic in two summation orders (the whole batch at once vs one sequence per micro-batch),
measured in the same session, per precision; in 16 bits at least ``|16-bit - fp32|`` on one device (a
16-bit parallel run rounds partial results, e.g. TP's row-layer sums or ring attention's float32 blocks,
where one device rounds once: a rounding no reordering of one device's arithmetic contains).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from refimpl.distributed import DistributedContext
from refimpl.measure import order_tolerance
from refimpl.train import config_from_args, options_from_args, train

PRECISIONS = ("fp32", "bf16", "fp16")


def one_device_losses(args_for: Callable[..., object], root: Path, *, steps: int) -> dict:
    """``{(precision, "batch" | "micro"): losses}`` of ``steps`` one-device steps in this process (one
    thread, as each rank runs; the caller's RNG states and thread count restored). ``args_for(out, *flags)``
    parses the trainer's flags for a run in ``out``."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    try:
        out = {}
        for precision in PRECISIONS:
            for order, extra in (("batch", []), ("micro", ["--micro-batch-size", "1"])):
                args = args_for(root / f"{precision}-{order}", "--precision", precision,
                                "--steps", str(steps), *extra)
                out[precision, order] = [r["loss"] for r in train(config_from_args(args), ctx,
                                                                  options_from_args(args))]
        return out
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])
        torch.set_num_threads(state[3])


def tolerance(one_device: dict, precision: str, *, factor: float) -> float:
    """``factor x`` the order spread of ``precision`` (16 bits: at least ``|16-bit - fp32|``): the package's
    :func:`refimpl.measure.order_tolerance`, which chapter 10 uses too."""
    return order_tolerance(one_device, precision, factor=factor)


def assert_trains_like_one_device(per_rank: list[list[float]], one_device: dict, precision: str, *,
                                  factor: float, name: str) -> None:
    """Every rank's losses within :func:`tolerance` of one device's; negative control: one device's losses
    move by more than the tolerance from step to step (so a run that did not train would fail)."""
    want = np.array(one_device[precision, "batch"][:len(per_rank[0])])
    tol = tolerance(one_device, precision, factor=factor)
    for rank, losses in enumerate(per_rank):
        got = np.array(losses)
        assert len(got) == len(want)
        diff = float(np.abs(got - want).max())
        assert diff <= tol, f"{name} rank {rank}: losses {got} vs one device {want}: {diff:.2e} > {tol:.2e}"
    assert float(np.abs(np.diff(want)).min()) > tol
