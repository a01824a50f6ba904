"""``survivor_layout`` (refimpl.train.layout; chapters 11-12) as a property over tp, pp, cp and survivors.

An elastic restart with another number of ranks keeps the model split: for every ``tp, pp, cp``, first
``dp`` and survivor count, the layout it returns keeps ``tp``, ``pp`` and ``cp``, its product is the
survivor count (``dp = survivors / (tp pp cp)``) and it builds; a count that ``tp x pp x cp`` does not divide
is refused with one line that names both; a first attempt, or a run without ``--dp``, is never changed.

The same checker is fed a deliberately wrong implementation, ``dp = survivors / (tp pp)`` (cp left out,
which every test at ``cp = 1`` passes), and must find it wrong: the negative control that shows the property
can fail, and fails exactly where ``cp > 1``.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.config import ConfigError, ParallelConfig
from refimpl.train.args import RunOptions
from refimpl.train.layout import survivor_layout


def _cp_forgotten(options: RunOptions, world_size: int, *, restart_count: int):
    """Wrong on purpose: survivor_layout with dp = world / (tp x pp), as if cp did not take ranks."""
    par = options.parallel
    if par.dp is None or restart_count == 0:
        return options, None
    if world_size == par.dp * par.tp * par.pp * par.cp:
        return options, None
    others = par.tp * par.pp
    if world_size % others:
        raise ConfigError(f"{world_size} ranks survived; tp x pp = {others} does not divide it")
    return (replace(options, parallel=replace(par, dp=world_size // others)),
            f"resuming at dp {world_size // others}")


def violations(impl, *, tp: int, pp: int, cp: int, dp: int | None, survivors: int, restart: int) -> list[str]:
    """What ``impl`` (survivor_layout's signature) gets wrong for this case; [] when nothing."""
    options = RunOptions(parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp))
    case = f"tp {tp} pp {pp} cp {cp} dp {dp}, {survivors} survivors, restart {restart}"
    per_copy = tp * pp * cp
    try:
        chosen, said = impl(options, survivors, restart_count=restart)
        layout = chosen.parallel
    except ConfigError as exc:
        message = str(exc)
        if dp is not None and restart > 0 and survivors % per_copy:
            wrong = []
            if "\n" in message:
                wrong.append(f"{case}: the refusal is not one line: {message!r}")
            if str(survivors) not in message or str(per_copy) not in message:
                wrong.append(f"{case}: the refusal names neither the survivors nor tp x pp x cp: {message!r}")
            return wrong
        return [f"{case}: refused a count that tp x pp x cp = {per_copy} divides: {message}"]
    if dp is None or restart == 0:
        return [] if chosen == options and said is None else [f"{case}: changed a layout it must keep"]
    if survivors % per_copy:
        return [f"{case}: accepted {survivors} survivors, which tp x pp x cp = {per_copy} does not divide"]
    wrong = []
    if (layout.tp, layout.pp, layout.cp) != (tp, pp, cp):
        wrong.append(f"{case}: the model split changed to tp {layout.tp} pp {layout.pp} cp {layout.cp}")
    if layout.dp * layout.tp * layout.pp * layout.cp != survivors:
        wrong.append(f"{case}: dp {layout.dp} x tp x pp x cp != {survivors} survivors")
    else:
        chosen.parallel_dims(survivors)  # builds (raises otherwise)
    if (said is None) != (survivors == dp * per_copy):
        wrong.append(f"{case}: said {said!r}")
    elif said is not None and "\n" in said:
        wrong.append(f"{case}: the sentence is not one line: {said!r}")
    return wrong


GRID = [dict(tp=tp, pp=pp, cp=cp, dp=dp, survivors=n, restart=r)
        for tp, pp, cp in itertools.product((1, 2, 3, 4), repeat=3)
        for dp in (None, 1, 2, 3) for n in range(1, 49) for r in (0, 1)]


def test_survivor_layout_holds_on_every_case_of_the_grid():
    wrong = [w for case in GRID for w in violations(survivor_layout, **case)]
    assert wrong == [], f"{len(wrong)} violations, e.g. {wrong[:5]}"


def test_negative_control_forgetting_cp_fails_the_same_check_exactly_where_cp_exceeds_one():
    failed = [case for case in GRID if violations(_cp_forgotten, **case)]
    assert failed, "dp = survivors / (tp pp) passed the property: the check cannot see cp"
    assert all(case["cp"] > 1 for case in failed), [c for c in failed if c["cp"] == 1][:3]
    # it is wrong at every cp > 1 the grid has
    assert {case["cp"] for case in failed} == {2, 3, 4}


@settings(max_examples=300, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 8), cp=st.integers(1, 8), dp=st.integers(1, 16),
       survivors=st.integers(1, 1024), restart=st.integers(1, 5))
def test_survivor_layout_property(tp, pp, cp, dp, survivors, restart):
    assert violations(survivor_layout, tp=tp, pp=pp, cp=cp, dp=dp, survivors=survivors, restart=restart) == []


@settings(max_examples=300, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 8), k=st.integers(1, 16), dp=st.integers(1, 16),
       cp=st.integers(1, 8), restart=st.integers(1, 5))
def test_survivors_that_divide_keep_the_split(tp, pp, k, dp, cp, restart):
    """Survivor counts that are a multiple of tp pp cp (a random draw rarely is): dp = k, always."""
    chosen, _ = survivor_layout(RunOptions(parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp)),
                                k * tp * pp * cp, restart_count=restart)
    layout = chosen.parallel
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (k, tp, pp, cp)
