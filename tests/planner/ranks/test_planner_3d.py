"""The planner's prediction of a 3D trainer run against the run itself (chapter 12).

ONE spawn of 8 ranks trains a tiny GPT (4 blocks, width 32, 4 heads, 16 tokens, global batch 8, 2 steps)
through ``refimpl.train.train`` at ``dp x tp x pp`` layouts (ZeRO-1 at one, bf16 at one, sequence
parallelism at two, one of them with gradient accumulation; ZeRO-3 over the stages' TP blocks, with and
without every block checkpointed; checkpointing under GPipe and interleaved 1F1B; HSDP under the pipeline;
sequence parallelism with ZeRO 1-3 under the pipeline)
and with ``cp 2`` (ring attention; with ZeRO-3, with checkpointing). Per rank,
``refimpl.planner.predict_run``'s figures equal, to the byte:

* the bytes sent per step and process group that ``metrics.jsonl`` records (the tracer: point-to-point
  sends measured, collectives by the ring model), every key, both steps;
* the model state counted from the live tensors just before the second optimizer step
  (``refimpl.measure.state_bytes`` of the rank's parameters, gradients, optimizer state);
* the saved activations held at the peak: ``SavedTensorMeter`` over the step without pipeline
  parallelism, the bytes alive between the schedule's actions with it
  (``refimpl.measure.run_measurement.TrainerProbe``, a different source from the formulas).

Negative controls: the plausible wrong predictions (the tied embedding's gradient exchange forgotten, the
gradient norm's scalar forgotten, the gradients' group named ``dp`` instead of ``dp x cp``, ZeRO-1 taken as
ZeRO-0 for the bytes and for the state, GPipe's held activations for 1F1B's, sequence parallelism's
gradient all-reduce counted per micro-batch instead of once per step, the SP embedding as an all-reduce
whose ``s/t`` split at micro-batch 1 would be a view of the whole output, in bytes held and sent) each fail
the same check. Sequence parallelism at micro-batch 1 is run with and without pipeline parallelism.
The bubble (measured ``pipeline_idle`` against the schedule's formula) is timing on a loaded 2-core box:
not checked here, only that it is a share; bench/bench_3d.py and chapter 12 compare it.
Bytes and state bytes are exact (no rounding involved): no numerics marker.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from refimpl.launch import run_ranks
from refimpl.measure.run_measurement import TrainerProbe
from refimpl.planner import predict_run
from refimpl.train import build_parser, config_from_args, options_from_args, train
from tests.support import timeouts

WORLD, STEPS = 8, 2
# the one spawn timeout x 2: 8 ranks train and measure every layout of the table; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--steps", str(STEPS), "--lr", "1e-2", "--warmup-steps", "1",
        "--log-every", "100", "--checkpoint-every", "0", "--no-report"]
LLAMA = ["--arch", "llama", "--num-kv-heads", "2"]
LAYOUTS = {  # dp x tp x pp -> the trainer's flags at world size 8
    "8x1x1": ["--dp", "8"],
    "4x2x1-sp-accum": ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "1"],
    "2x2x2-zero1": ["--tp", "2", "--pp", "2", "--zero-stage", "1", "--microbatches", "2"],
    "2x2x2-zero3": ["--tp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2"],
    # sequence parallelism with ZeRO under the pipeline (ZeRO-1 holds its reduced shards' gradients too)
    "2x2x2-zero1-sp": ["--tp", "2", "--pp", "2", "--zero-stage", "1", "--microbatches", "2",
                       "--sequence-parallel"],
    "2x2x2-zero2-sp": ["--tp", "2", "--pp", "2", "--zero-stage", "2", "--microbatches", "2",
                       "--sequence-parallel"],
    "2x2x2-zero3-sp": ["--tp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2",
                       "--sequence-parallel"],
    # every block recomputed in backward: its tp collectives again before checkpoint's early stop
    "2x2x2-zero3-actckpt": ["--tp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2",
                            "--activation-checkpointing"],
    "1x4x2": ["--tp", "4", "--pp", "2", "--microbatches", "4"],
    "2x1x4-bf16": ["--pp", "4", "--microbatches", "4", "--precision", "bf16"],
    "1x2x4-sp": ["--tp", "2", "--sequence-parallel", "--pp", "4", "--microbatches", "8"],  # micro-batch 1
    "2x1x2-cp2": ["--cp", "2", "--pp", "2", "--microbatches", "2"],  # dp 2 x cp 2 x pp 2, ring attention
    "2x1x2-cp2-zero3": ["--cp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2"],
    "2x1x2-cp2-actckpt": ["--cp", "2", "--pp", "2", "--microbatches", "2", "--activation-checkpointing"],
    # checkpointing under the other schedules: blocks 1 and 3 (one per stage) under GPipe, every block
    # under interleaved 1F1B (2 virtual stages of one block each)
    "2x2x2-gpipe-actckpt13": ["--tp", "2", "--pp", "2", "--microbatches", "4", "--pp-schedule", "gpipe",
                              "--activation-checkpointing", "1,3"],
    "2x2x2-interleaved-actckpt": ["--tp", "2", "--pp", "2", "--microbatches", "2", "--pp-schedule",
                                  "interleaved", "--virtual-stages", "2", "--activation-checkpointing"],
    # zbh1 under tp: the deferred dW operands are the rank's shards' (with and without checkpointing)
    "2x2x2-zbh1": ["--tp", "2", "--pp", "2", "--microbatches", "4", "--pp-schedule", "zbh1"],
    "2x2x2-zbh1-actckpt": ["--tp", "2", "--pp", "2", "--microbatches", "4", "--pp-schedule", "zbh1",
                           "--activation-checkpointing"],
    # HSDP under the pipeline: each stage sharded over dp_shard 2, its shards all-reduced over 2 replicas
    "4x1x2-hsdp2-zero3": ["--pp", "2", "--dp-replicate", "2", "--zero-stage", "3", "--microbatches", "2"],
    # the Llama form (RMSNorm, RoPE, SwiGLU, no biases, GQA: 4 query heads in 2 groups)
    "4x2x1-sp-llama": ["--tp", "2", "--sequence-parallel", *LLAMA],
    "2x4x1-actckpt-llama": ["--tp", "4", "--activation-checkpointing", *LLAMA],  # 2 ranks share a k/v head
    "2x2x2-zero1-llama": ["--tp", "2", "--pp", "2", "--zero-stage", "1", "--microbatches", "2", *LLAMA],
    "2x1x4-bf16-zbh1-llama": ["--pp", "4", "--microbatches", "4", "--precision", "bf16", "--pp-schedule",
                              "zbh1", *LLAMA],
    "2x1x2-cp2-zero3-llama": ["--cp", "2", "--pp", "2", "--zero-stage", "3", "--microbatches", "2", *LLAMA],
    "4x1x1-cp2-ulysses-llama": ["--cp", "2", "--cp-method", "ulysses", *LLAMA],
    "8x1x1-zero3-bf16-llama": ["--zero-stage", "3", "--precision", "bf16", *LLAMA],
}


def _args(files: dict, name: str):
    return build_parser().parse_args([*TINY, *LAYOUTS[name], "--data", str(files["corpus"]), "--cache-dir",
                                      str(files["cache"]), "--out", str(Path(files["root"]) / name)])


def predict(args, **change):
    """predict_run on the trainer's own parsed flags (``change``: a wrong variant's arguments)."""
    config, options = config_from_args(args), options_from_args(args)
    grad_clip = change.pop("grad_clip", config.optim.grad_clip)
    return predict_run(config.model, dataclasses.replace(options.parallel, **change), world_size=WORLD,
                       seq_len=config.data.seq_len, global_batch=config.data.global_batch_size,
                       micro_batch=config.data.micro_batch_size, grad_clip=grad_clip)


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus: dict) -> dict:
    """The shared corpus and its token cache (tests/conftest.py), and this module's folder for its runs."""
    return {"root": tmp_path_factory.mktemp("planner_3d"), **corpus}


def _worker(ctx, files: dict) -> dict:
    out = {}
    for name in LAYOUTS:
        args = _args(files, name)
        options = dataclasses.replace(options_from_args(args), checkpoint=None)  # no save at the end
        probe = TrainerProbe(step=1)
        records = train(config_from_args(args), ctx, options, hooks=probe)
        out[name] = {"bytes": [r["bytes_sent"] for r in records],
                     "idle": [r.get("pipeline_idle") for r in records],
                     "measured": dataclasses.asdict(probe.measured)}
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, WORLD, files, timeout_s=SPAWN_TIMEOUT_S)


TIMEOUT = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)


@TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_group_per_rank_equal_the_recorded_bytes(runs, files, name):
    plan = predict(_args(files, name))
    for rank, out in enumerate(runs):
        want = plan.ranks[rank].bytes_sent
        for step in out[name]["bytes"]:
            assert step == want, (name, rank, step, want)
        assert all(v is None or 0 <= v < 1 for v in out[name]["idle"])  # a share; its value is timing


@TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_and_held_activations_per_rank_equal_the_measurement(runs, files, name):
    plan = predict(_args(files, name))
    for rank, out in enumerate(runs):
        got, want = out[name]["measured"], plan.ranks[rank]
        assert tuple(got["state"]) == (want.state.weights, want.state.grads, want.state.optimizer), (
            name, rank, got, want.state)
        assert got["activations"] == want.activation_bytes, (name, rank, got, want.activations)


@TIMEOUT
def test_plausible_wrong_predictions_fail_the_same_checks(runs, files):
    def recorded(name: str, rank: int) -> dict:
        return runs[rank][name]["bytes"][0]

    # the tied embedding's gradient exchange between the first and the last pipeline rank forgotten
    name = "1x2x4-sp"
    plan = predict(_args(files, name))
    tied = 4 * 256 // 2 * 32  # the vocab-parallel embedding shard, float32
    for rank in (0, WORLD - 1):  # pp rank 0 and pp rank 3
        sent = dict(plan.ranks[rank].bytes_sent)
        assert sent == recorded(name, rank)
        assert {**sent, "pp": sent["pp"] - tied} != recorded(name, rank)
    # the gradient norm's scalar over pp forgotten (grad_clip None predicts no norm)
    assert predict(_args(files, name), grad_clip=None).ranks[2].bytes_sent != recorded(name, 2)
    # the gradients' group named dp instead of dp x cp (the trainer averages over the dp x cp group) ...
    sent = dict(predict(_args(files, "8x1x1")).ranks[0].bytes_sent)
    assert {"dp": sent.pop("dp x cp")} != recorded("8x1x1", 0)
    # ... and, with cp 2, the gradients and the loss averaged over the dp ranks only (ring all-reduces over
    # 2 ranks, 2 (2-1)/2, instead of 4, 2 (4-1)/4, of the same payloads)
    name = "2x1x2-cp2"
    sent = predict(_args(files, name)).ranks[0].bytes_sent
    assert sent == recorded(name, 0)
    assert {**sent, "dp x cp": sent["dp x cp"] * 1.0 / 1.5} != recorded(name, 0)
    # ZeRO-1 predicted as ZeRO-0: other bytes on dp x cp (unpadded all-reduce, no norm) and other state
    name = "2x2x2-zero1"
    zero0 = predict(_args(files, name), zero_stage=0)
    for rank, out in enumerate(runs):
        assert zero0.ranks[rank].bytes_sent["dp x cp"] != recorded(name, rank)["dp x cp"], rank
        state = zero0.ranks[rank].state
        assert tuple(out[name]["measured"]["state"]) != (state.weights, state.grads, state.optimizer)
    # sequence parallelism's s/t-token gradients summed once per step, not per micro-batch (2 here)
    name = "4x2x1-sp-accum"
    plan = predict(_args(files, name))
    once = 4 * (6 * 4 + 2) * 32  # the blocks' LayerNorms and row biases, the final LayerNorm, float32
    assert plan.ranks[0].bytes_sent == recorded(name, 0)
    per_micro = {**plan.ranks[0].bytes_sent, "tp": plan.ranks[0].bytes_sent["tp"] + once}  # 2 (t-1)/t = 1
    assert per_micro != recorded(name, 0)
    # the embedding reduce-scatters into the sequence shard: at b = 1 nothing holds the whole [1, s, h]
    # output (an all-reduce's split would be a view of it, 4 (t-1)/t s h bytes more), and its forward
    # sends (t-1)/t of b s h, not an all-reduce's 2 (t-1)/t (here 2 micro-batches of [1, 16, 32] float32)
    held = plan.ranks[0].activations
    assert runs[0][name]["measured"]["activations"] == sum(held.values())
    assert runs[0][name]["measured"]["activations"] != sum(held.values()) + 4 * (16 - 8) * 32
    all_reduce = {**plan.ranks[0].bytes_sent, "tp": plan.ranks[0].bytes_sent["tp"] + 2 * 4 * 16 * 32 / 2}
    assert all_reduce != recorded(name, 0)
    # GPipe's held activations (all m micro-batches in flight) where 1F1B holds fewer (pp rank > 0)
    name = "2x1x4-bf16"
    gpipe = predict(_args(files, name), pp_schedule="gpipe")
    for rank in range(2, WORLD):
        assert runs[rank][name]["measured"]["activations"] != gpipe.ranks[rank].activation_bytes, rank
