"""``refimpl.planner.step_time``: the two-stream schedule of a step's program, on programs whose times are
worked out by hand (the measured check against the shaped link is tests/ranks/cli/test_overlap.py's).

- a collective launched after a compute piece runs beside the next piece, and the step ends when both
  streams are done; serialized, the compute waits for it: ``T = sum compute + sum comm``;
- a blocking collective stops the compute in the overlapped schedule too (ZeRO-3's reduce-scatter);
- the link carries one collective at a time, in issue order;
- ``exposed`` is each collective's time with no compute beside it, ``hidden`` the ones with none;
- the shared link of the shaped loopback carries every rank's bytes: ``n`` times one rank's link time;
- the data-parallel and ZeRO-3 programs of ``layer_stack_step`` on their own terms.
"""

from __future__ import annotations

import pytest

from refimpl.planner.step_time import (
    Collective,
    Compute,
    data_parallel_program,
    layer_stack_step,
    link_seconds,
    schedule,
    zero3_program,
)


def test_a_collective_runs_beside_the_next_compute_and_serialized_adds_up():
    program = [Compute(name="a", seconds=1.0), Collective(name="c", seconds=1.5),
               Compute(name="b", seconds=1.0)]
    over, ser = schedule(program), schedule(program, serialized=True)
    assert over.seconds == 2.5  # c runs 1.0-2.5 beside b (1.0-2.0), waited for at the end
    assert over.exposed == {"c": 0.5} and over.exposed_s == 0.5 and over.hidden == ()
    assert ser.seconds == 3.5 and ser.exposed == {"c": 1.5}
    assert (over.compute_s, over.comm_s) == (2.0, 1.5)


def test_a_piece_that_needs_a_collective_waits_for_it():
    program = [Collective(name="gather", seconds=2.0), Compute(name="a", seconds=1.0),
               Compute(name="b", seconds=1.0, needs=("gather",))]
    t = schedule(program)
    assert t.seconds == 3.0 and t.exposed == {"gather": 1.0}  # a hides half of it; b starts at 2.0


def test_a_blocking_collective_stops_the_compute_when_overlapped_too():
    program = [Compute(name="a", seconds=1.0), Collective(name="rs", seconds=1.0, blocking=True),
               Compute(name="b", seconds=1.0)]
    assert schedule(program).seconds == 3.0 == schedule(program, serialized=True).seconds


def test_the_link_carries_one_collective_at_a_time():
    program = [Collective(name="x", seconds=1.0), Collective(name="y", seconds=1.0),
               Compute(name="a", seconds=3.0)]
    t = schedule(program)
    assert t.seconds == 3.0 and t.hidden == ("x", "y")  # 0-1 and 1-2, both beside a
    program = [Collective(name="x", seconds=1.0), Collective(name="y", seconds=1.0),
               Compute(name="a", seconds=0.5, needs=("y",))]
    assert schedule(program).seconds == 2.5  # y ends at 2.0, not 1.0: it queued behind x


def test_the_shared_link_carries_every_ranks_bytes():
    sixteen_mb = 16e6
    assert link_seconds(sixteen_mb, ranks=2, rate_bits_per_s=400e6, shared=False) == pytest.approx(0.32)
    assert link_seconds(sixteen_mb, ranks=2, rate_bits_per_s=400e6, shared=True) == pytest.approx(0.64)


def test_data_parallel_hides_a_bucket_behind_the_backward_that_follows_it():
    program = data_parallel_program(forward_s=[1.0] * 3, backward_s=[1.0, 2.0, 2.0], all_reduce_s=[1.5] * 3)
    t = schedule(program)
    # backward 3-5 (B2), 5-7 (B1), 7-8 (B0); all-reduces 5-6.5 (beside B1), 7-8.5 (half a second beside
    # nothing), 8.5-10 (the first layer's: launched after the last backward, nothing hides it)
    assert t.seconds == 10.0 and t.hidden == ("all-reduce 2",)
    assert t.exposed == {"all-reduce 2": 0.0, "all-reduce 1": 0.5, "all-reduce 0": 1.5}
    assert schedule(program, serialized=True).seconds == 8.0 + 4.5


def test_zero3_prefetch_hides_the_gathers_but_not_the_reduce_scatters():
    terms = {"forward_s": [1.0] * 3, "backward_s": [1.0, 2.0, 2.0], "all_gather_s": [0.5] * 3,
             "reduce_scatter_s": [0.5] * 3}
    ahead, plain = zero3_program(**terms, prefetch=True), zero3_program(**terms, prefetch=False)
    assert schedule(plain).seconds == 8.0 + 9 * 0.5  # every transfer waited for
    t = schedule(ahead)
    # exposed: the first gather of forward and of backward (nothing before them) and the 3 reduce-scatters
    assert t.seconds == 8.0 + 5 * 0.5
    assert sorted(n for n in t.exposed if n not in t.hidden) == [
        "all-gather B2", "all-gather F0", "reduce-scatter 0", "reduce-scatter 1", "reduce-scatter 2"]
    assert [op.name for op in ahead if isinstance(op, Collective)][:3] == ["all-gather F0", "all-gather F1",
                                                                            "all-gather F2"]


def test_layer_stack_step_splits_the_compute_by_flops_and_refuses_other_layouts():
    free = layer_stack_step("dp", layers=4, width=1024, compute_s=1.1, rate_bits_per_s=1e30)
    assert free["overlapped"].seconds == pytest.approx(1.1) == free["serialized"].seconds
    t = layer_stack_step("zero3", layers=2, width=1024, compute_s=1.0, rate_bits_per_s=1e9, backend="nccl")
    # 3 L - 1 = 5 units of 0.2 s; each tensor 4 MiB: a gather or a reduce-scatter sends 2 MiB per rank,
    # 4 MiB on the shared link, 0.0336 s at 1 Gbit/s; serialized: 2 + 2 gathers and 2 reduce-scatters
    link = 4 * 2**20 * 8 / 1e9
    assert t["serialized"].seconds == pytest.approx(1.0 + 6 * link)
    gloo = layer_stack_step("zero3", layers=2, width=1024, compute_s=1.0, rate_bits_per_s=1e9, backend="gloo")
    assert gloo["serialized"].seconds == pytest.approx(1.0 + 8 * link)  # its reduce-scatter: an all-reduce
    with pytest.raises(ValueError, match="'dp' or 'zero3'"):
        layer_stack_step("tp", layers=2, width=8, compute_s=1.0, rate_bits_per_s=1e9)
