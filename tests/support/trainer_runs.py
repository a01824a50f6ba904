"""One table of layouts and one skeleton for the trainer tests at a parallel layout (tests/trainer/ranks/).

A module states its layouts as ``Case`` s (a ``refimpl.config.ParallelConfig`` and what the run does
besides: its steps, checkpoints, micro-batches) over one tiny ``TrainConfig`` (``tiny``); one spawn trains
them all in turn (``run_layouts``, each rank through ``refimpl.train.train`` with config objects, as a
learner's own script calls it), and ``layout_tests`` writes the two checks every layout gets: its losses,
and its first step's gradients before clipping and AdamW, against one device's
(tests/support/one_device.py), the gradients' negative control scaled by ``control``. The one-device
references come from ``tests/conftest.py``'s ``one_device_references(config)``, shared by the modules
that train the same ``tiny`` model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from refimpl.checkpoint import CheckpointConfig
from refimpl.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.train import RunOptions, build_parser, config_from_args, options_from_args, train
from refimpl.train.hooks import TrainHooks
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
)


def tiny(corpus: Mapping[str, Path], *, num_layers: int = 2, hidden_size: int = 32, batch_size: int = 4,
         steps: int = 4, **model: object) -> TrainConfig:
    """The trainer tests' model and data: ``num_layers`` blocks of width ``hidden_size``, 4 heads, 16
    tokens, ``batch_size`` sequences a step from the shared corpus (``corpus``, tests/conftest.py's), lr
    1e-2 after 2 warm-up steps; ``model``: more ``ModelConfig`` fields."""
    return TrainConfig(
        model=ModelConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=4,
                          max_seq_len=16, **model),  # type: ignore[arg-type]
        data=DataConfig(data=str(corpus["corpus"]), cache_dir=str(corpus["cache"]), seq_len=16,
                        global_batch_size=batch_size),
        optim=OptimConfig(lr=1e-2, warmup_steps=2), steps=steps, log_every=100)


def from_flags(flags: Sequence[str]) -> tuple[TrainConfig, RunOptions]:
    """The run the command line's ``flags`` describe (for the tests whose tables are flags)."""
    args = build_parser().parse_args(list(flags))
    return config_from_args(args), options_from_args(args)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One layout of a module's table: ``parallel`` (its ``precision`` names the one-device reference it is
    compared with), ``steps`` (None: the base's), a checkpoint every ``checkpoint_every`` steps (0: none),
    ``micro_batch_size`` (None: no accumulation), ``report`` (the end's loss plot and sample)."""

    parallel: ParallelConfig
    steps: int | None = None
    checkpoint_every: int = 0
    micro_batch_size: int | None = None
    report: bool = False

    @property
    def precision(self) -> str:
        return self.parallel.precision


def run_case(ctx, base: TrainConfig, case: Case, out: Path, *, checkpoint_dir: Path | None = None,
             probe: Callable | None = None, hooks: TrainHooks | None = None) -> list[dict]:
    """Train ``case`` on this rank into ``out``; its records. ``checkpoint_dir``: where checkpoints are
    saved and resumed from (default the trainer's, ``out / "checkpoints"``); ``probe`` the first step's
    gradients (``first_step_gradients``), or ``hooks`` (a negative control's, with its own probe)."""
    config = dataclasses.replace(base, out=str(out), steps=case.steps or base.steps,
                                 data=dataclasses.replace(base.data, micro_batch_size=case.micro_batch_size))
    checkpoint = CheckpointConfig(folder=str(checkpoint_dir or out / "checkpoints"),
                                  every_steps=case.checkpoint_every or None)
    options = RunOptions(parallel=case.parallel, checkpoint=checkpoint, report=case.report)
    return train(config, ctx, options, hooks=hooks, gradient_probe=probe)


def run_layouts(ctx, base: TrainConfig, cases: Mapping[str, Case], root: Path) -> dict:
    """Every case in turn on this rank, each in ``root / name``: ``{name: losses, (name, "grads"): the
    first step's gradients (tests/support/one_device.py's ``Pieces``), (name, "records"): its records (the
    bytes sent by group, the pipeline's idle share ...)}``."""
    out: dict = {}
    for name, case in cases.items():
        grads: dict = {}
        records = run_case(ctx, base, case, root / name, probe=first_step_gradients(grads))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
        out[name, "records"] = records
    return out


def layout_tests(cases: Mapping[str, Case], *, factor: float, timeout_s: float,
                 control: Callable[[Case], float] = lambda case: 2.0,
                 reference: str = "one_device") -> tuple[Callable, Callable]:
    """The two tests of every layout, over the module's fixtures ``runs`` (``run_layouts`` per rank) and
    ``reference`` (its one-device runs): the losses within ``factor x`` the order spread of one device's
    (tests/support/one_device.py), and the first step's gradients, every rank's boxes, likewise, the same
    gradients x ``control(case)`` failing (the negative control: a sum over two replicas, 2, or ``m``
    micro-batches' losses not divided by ``m``). Bind them to the module's test names."""
    marks = [pytest.mark.numerics, pytest.mark.timeout(timeout_s),
             pytest.mark.parametrize("name", list(cases))]

    def trains_like_one_device(runs, request, name):
        one_device = request.getfixturevalue(reference)
        assert_trains_like_one_device([out[name] for out in runs], one_device, cases[name].precision,
                                      factor=factor, name=name)

    def hands_the_optimizer_one_devices_gradients(runs, request, name):
        one_device = request.getfixturevalue(reference)
        worst = assert_gradients_like_one_device([out[name, "grads"] for out in runs], one_device,
                                                 cases[name].precision, factor=factor, name=name,
                                                 control=control(cases[name]))
        print(f"{name}: worst gradient difference {worst:.3f} x its tolerance")

    for mark in marks:
        trains_like_one_device = mark(trains_like_one_device)
        hands_the_optimizer_one_devices_gradients = mark(hands_the_optimizer_one_devices_gradients)
    return trains_like_one_device, hands_the_optimizer_one_devices_gradients
