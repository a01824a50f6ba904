"""tests/support/covering.py: the pairwise covering array that tests/trainer/ranks/lane2/test_train_pairs.py
trains.

It covers every allowed pair, each of its rows is a layout the trainer's own checks accept (the flags
parsed, the options built, the shapes, the experts and the batch split checked as before a launch), and the
pairs it leaves out are those the support table or 4 ranks refuse, not more.
"""

from __future__ import annotations

import itertools

import pytest

from refimpl.config import ConfigError
from refimpl.train import build_parser, check_shapes, config_from_args, options_from_args
from refimpl.train.layout import check_experts, forwards_per_step
from tests.support.covering import (
    FACTORS,
    MODEL,
    WORLD,
    accepted_rows,
    allowed_pairs,
    covering_rows,
    row_flags,
    row_name,
    why_not,
)


def _trainer_accepts(flags: list[str]) -> None:
    """What the trainer checks before it starts a process (raises ConfigError where it refuses)."""
    args = build_parser().parse_args([*MODEL, *flags])
    config, options = config_from_args(args), options_from_args(args)
    dims = options.parallel_dims(WORLD)
    check_shapes(config, options.parallel)
    check_experts(config, options)
    forwards_per_step(config, options, dims.dp)


def test_every_allowed_pair_is_in_a_row_and_every_row_is_accepted_by_the_trainer():
    rows = covering_rows()
    covered = {((a, row[a]), (b, row[b])) for row in rows for a, b in itertools.combinations(FACTORS, 2)}
    assert covered == allowed_pairs()
    for row in rows:
        _trainer_accepts(row_flags(row))
    assert len({row_name(row) for row in rows}) == len(rows)  # the test ids are distinct
    # a pairwise array needs at least the product of the two largest factors' levels
    largest = sorted(len(levels) for levels in FACTORS.values())[-2:]
    assert largest[0] * largest[1] <= len(rows) <= 2 * largest[0] * largest[1]


def test_the_pairs_left_out_are_the_ones_the_trainer_refuses():
    left_out = {((a, x), (b, y)) for a, b in itertools.combinations(FACTORS, 2)
                for x in FACTORS[a] for y in FACTORS[b]} - allowed_pairs()
    # HSDP is ZeRO-3's and not the experts' (the support table), and tp x cp x pp do not fit 4 ranks
    assert (("zero", 0), ("hsdp", True)) in left_out
    assert (("experts", "ep"), ("hsdp", True)) in left_out
    assert ((("precision", "fp8-rowwise"), ("zero", 3))) in left_out
    assert len(left_out) < 40, sorted(left_out)
    # each refused row is refused by the trainer too (a sample: one per refusing reason)
    reasons: dict[str, tuple] = {}
    for levels in itertools.product(*FACTORS.values()):
        row = dict(zip(FACTORS, levels, strict=True))
        why = why_not(row)
        if why and why[0] not in reasons and not why[0].startswith(f"{WORLD} ranks:"):
            reasons[why[0]] = levels
    assert len(reasons) >= 3, reasons  # HSDP without ZeRO-3, rowwise fp8 with ZeRO-3, MoE with HSDP
    for levels in reasons.values():
        with pytest.raises(ConfigError):
            _trainer_accepts(row_flags(dict(zip(FACTORS, levels, strict=True))))
    assert len(accepted_rows()) > 1000
