"""The planner's prediction of ZeRO-2/3, HSDP and activation-checkpointed trainer runs against the runs
themselves (chapters 04, 05, 08 and 10).

ONE spawn of 4 ranks trains tests/planner/ranks/test_planner_3d.py's tiny GPT (4 blocks, width 32, 4 heads, 16
tokens, global batch 8, 2 steps) through ``refimpl.train.train`` at eighteen layouts: ZeRO-3 over dp 4; ZeRO-3
of the tensor-parallel blocks (2-D) with checkpointing, and with sequence parallelism too; HSDP (dp 4 as
2 replicas of 2) and HSDP with ring attention and checkpointing (a shard group of the 2 cp ranks); ZeRO-3
in bf16 (FSDP2's mixed precision: 16-bit gathers and compute) with gradient accumulation; ZeRO-2 over
dp 4, with sequence parallelism and accumulation, and under pipeline parallelism; ZeRO-1 with sequence
parallelism and two of the four blocks checkpointed; ZeRO-3 under pipeline parallelism (dp 2 x pp 2, each
stage sharded in place over dp): 1F1B over 4 micro-batches gathered once per step (the default) and
gathered per micro-batch (``--zero3-reshard-per-microbatch``), GPipe over 2 micro-batches of 2 sequences
per micro-batch, interleaved 1F1B (2 virtual stages of one block), ZB-H1 (its held activations include
what the queued weight gradients keep until their W) and 1F1B in bf16 (16-bit gathers, a 16-bit residual
stream in the stages) over 4 micro-batches; ZeRO-1 and ZeRO-3 under 1F1B with every block checkpointed.
Per rank,
``refimpl.planner.predict_run``'s figures equal, to the byte:

* the bytes sent per step and process group that ``metrics.jsonl`` records (``"dp x cp"``, under HSDP
  ``"dp_shard x cp"`` and ``"dp_replicate"``, ``"tp"``, ``"cp"``, ``"pp"``), every key, both steps;
* the model state counted from the live tensors just before the second optimizer step
  (``refimpl.measure.run_measurement.TrainerProbe``): under ZeRO-3 the shards, their gradients and
  the AdamW state; the full tensors ZeRO-3 gathers are all freed by then, with and without the pipeline
  (measured from the wrapper's units, ``FullTensors``: none allocated before the step);
* the saved activations held at the peak, ``refimpl.measure.run_measurement.TrainerProbe``'s (one
  micro-batch's at its loss; under the pipeline the bytes alive between the schedule's actions). Its
  meters key a storage by identity and take ZeRO-3's gathered weights (``nn.Parameter`` objects outside
  ``model.parameters()``) for parameters; keyed by address they misread ZeRO-3
  (tests/planner/ranks/test_planner_cp.py found it: a storage ZeRO-3 frees by resizing it to 0 gives its
  address to a later activation, which was skipped, and the gathered LayerNorm weights counted as activations;
  its figure differed from rank to rank, 269332 to 285076 bytes at dp 4 where the ZeRO-2 twin saves 308116 on
  every rank). Checked: the probe reads on ZeRO-3 what it reads on the ZeRO-2 twin, at pp 1 and under the
  pipeline.

Also measured against the memory preflight's ZeRO-3 terms, which are peaks, not the state at the step
(``refimpl.planner.pipeline_memory.pipeline_memory_per_rank``): under the pipeline, gathered once per step,
the most full bytes alive between the schedule's actions are the stage's weights and full gradients
(the preflight's term, to the byte); gathered per micro-batch, the stage's root unit (the term adds one
block, gathered within an action). At pp 1 at the first loss only the root unit is gathered (the blocks'
gathered weights are freed after their forward; a checkpointed block's too).

Negative controls, each failing the same check: ZeRO-3 predicted as ZeRO-1 (bytes and state), HSDP
without the replicas' all-reduce and as ZeRO-3 over all of dp x cp, the recomputed forward's collectives
forgotten (tp and cp), ZeRO-3's bf16 gathers counted in fp32 and its activations with autocast's float32
residual stream, ZeRO-2's reduce-scatter counted once per step instead of per micro-batch, the pipeline's
tied-embedding exchange of the whole gradient instead of ZeRO-2's shard, ZeRO-1's gradient shards under
sequence parallelism left out of the state; under the pipeline, ZeRO-3's bytes of the other mode (once per
step / per micro-batch), its tied-embedding exchange of the whole gradient instead of the shard, its state
as ZeRO-2's (whole weights) or with the preflight's gathered stage on top, GPipe's held activations as
1F1B's, and the last stage's labels at 2 sequences per micro-batch as a view of the step's window (each
loss saves a flattened copy instead). Bytes and state bytes are exact (no rounding involved): no numerics
marker.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refimpl.comm.tracer import now
from refimpl.launch import run_ranks
from refimpl.measure.run_measurement import TrainerProbe
from refimpl.parallel.zero.fsdp_unit import gathered_bytes
from refimpl.planner import activation_bytes, predict_run, sharded_numel
from refimpl.planner.param_table import param_table
from refimpl.planner.pipeline_memory import pipeline_memory_per_rank
from refimpl.train import build_parser, config_from_args, options_from_args, train
from refimpl.train.hooks import compose
from tests.support import timeouts

WORLD, STEPS = 4, 2
# the one spawn timeout x 2: 4 ranks train and measure each ZeRO-3 layout; it was 300 s
SPAWN_TIMEOUT_S = 2 * timeouts.SPAWN_TIMEOUT_S
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--steps", str(STEPS), "--lr", "1e-2", "--warmup-steps", "1",
        "--log-every", "100", "--checkpoint-every", "0", "--no-report"]
ZERO3, AC = ["--zero-stage", "3"], ["--activation-checkpointing"]
LAYOUTS = {  # the trainer's flags at world size 4
    "dp4-zero3": ["--dp", "4", *ZERO3],
    "dp2-tp2-zero3-ac": ["--dp", "2", "--tp", "2", *ZERO3, *AC],
    "dp2-tp2-sp-zero3-ac": ["--dp", "2", "--tp", "2", "--sequence-parallel", *ZERO3, *AC],
    "dp4-hsdp2-zero3": ["--dp", "4", "--dp-replicate", "2", *ZERO3],
    "dp2-cp2-hsdp2-zero3-ac": ["--dp", "2", "--dp-replicate", "2", "--cp", "2", *ZERO3, *AC],
    "dp4-zero3-bf16-accum": ["--dp", "4", *ZERO3, "--precision", "bf16", "--micro-batch-size", "1"],
    "dp4-zero2": ["--dp", "4", "--zero-stage", "2"],
    "dp2-tp2-sp-zero2-accum": ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "2",
                               "--micro-batch-size", "1"],  # 4 micro-batches of 1 sequence
    "dp2-pp2-zero2": ["--dp", "2", "--pp", "2", "--zero-stage", "2", "--microbatches", "4"],
    "dp2-tp2-sp-zero1-ac02": ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "1",
                              "--activation-checkpointing", "0,2"],  # blocks 0 and 2 recomputed
    # ZeRO-3 under the pipeline: each stage gathered once per step (default) or per micro-batch
    "dp2-pp2-zero3": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4"],
    "dp2-pp2-zero3-reshard": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4",
                              "--zero3-reshard-per-microbatch"],
    "dp2-pp2-zero3-gpipe-reshard": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "2",  # b = 2
                                    "--pp-schedule", "gpipe", "--zero3-reshard-per-microbatch"],
    "dp2-pp2-zero3-zbh1": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4", "--pp-schedule",
                           "zbh1"],
    "dp2-pp2-zero3-bf16": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4", "--precision", "bf16"],
    # zbh1 in bf16: its deferred linears keep the 16-bit LayerNorm outputs (the gathered weights are 16-bit)
    "dp2-pp2-zero3-bf16-zbh1": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4", "--precision",
                                "bf16", "--pp-schedule", "zbh1"],
    "dp2-pp2-zero3-ac": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4", *AC],
    "dp2-pp2-zero1-ac": ["--dp", "2", "--pp", "2", "--zero-stage", "1", "--microbatches", "4", *AC],
    "dp2-pp2-zero3-interleaved": ["--dp", "2", "--pp", "2", *ZERO3, "--microbatches", "4", "--pp-schedule",
                                  "interleaved", "--virtual-stages", "2"],
}
KEPT = "ZeRO-3 gathered stages and their full gradients (kept through the step)"  # the preflight's peak
PIPELINE_ZERO3 = ("dp2-pp2-zero3", "dp2-pp2-zero3-reshard", "dp2-pp2-zero3-gpipe-reshard",
                  "dp2-pp2-zero3-zbh1", "dp2-pp2-zero3-bf16", "dp2-pp2-zero3-interleaved",
                  "dp2-pp2-zero3-bf16-zbh1")


def _args(files: dict, name: str):
    return build_parser().parse_args([*TINY, *LAYOUTS[name], "--data", str(files["corpus"]), "--cache-dir",
                                      str(files["cache"]), "--out", str(Path(files["root"]) / name)])


def predict(args, **change):
    """predict_run on the trainer's own parsed flags (``change``: a wrong variant's arguments)."""
    config, options = config_from_args(args), options_from_args(args)
    return predict_run(config.model, dataclasses.replace(options.parallel, **change), world_size=WORLD,
                       seq_len=config.data.seq_len, global_batch=config.data.global_batch_size,
                       micro_batch=config.data.micro_batch_size, grad_clip=config.optim.grad_clip)


def _zero3_units(setup) -> list:
    """The ZeRO-3 units of a rank: the wrapper's (pp 1), or those of each pipeline stage's wrapper, found
    through the ``local_shards`` it declares on the stage (FSDP2's in-place shape: a bound method)."""
    if setup.pipeline is None:
        return list(setup.forward.units)
    return [u for stage in setup.pipeline.stages.values() for u in stage.local_shards.__self__.units]


class FullTensors:
    """Trainer hooks (``refimpl.train.hooks``) over step ``step`` of a ZeRO-3 run: the full (gathered)
    tensors the wrapper's units hold (``refimpl.parallel.zero.fsdp_unit.gathered_bytes``, weights and
    full gradients), ``measured``: ``"at_loss"`` at the first micro-batch's loss (pp 1), ``"at_step"``
    before the optimizer step (where the probe reads the state) and ``"between_actions"``, the most at the
    pipeline executor's clock reads (between the schedule's actions, where the probe samples)."""

    def __init__(self, *, step: int = 1) -> None:
        self.step, self.measured = step, {"between_actions": 0}
        self._first: int | None = None
        self._units: list | None = None

    def _read(self) -> tuple[int, int]:
        held = gathered_bytes(self._units)
        return held.weights, held.grads

    @contextlib.contextmanager
    def around_step(self, step: int, setup) -> Iterator[None]:
        self._first = step if self._first is None else self._first
        if step - self._first != self.step:
            yield
            return
        self._units = _zero3_units(setup)
        try:
            yield
        finally:
            self._units = None

    def after_first_loss(self, step: int, setup, loss: torch.Tensor) -> None:
        if self._units is not None:
            self.measured["at_loss"] = self._read()

    def before_optimizer_step(self, step: int, setup) -> None:
        if self._units is not None:
            self.measured["at_step"] = self._read()

    def clock(self) -> float:
        if self._units is not None:
            self.measured["between_actions"] = max(self.measured["between_actions"], sum(self._read()))
        return now()


@pytest.fixture(scope="module")
def files(tmp_path_factory, corpus) -> dict:
    return {"root": tmp_path_factory.mktemp("planner_zero3"), **corpus}


def _worker(ctx, files: dict) -> dict:
    out = {}
    for name in LAYOUTS:
        args = _args(files, name)
        options = dataclasses.replace(options_from_args(args), checkpoint=None)  # no save at the end
        probe, full = TrainerProbe(step=1), FullTensors(step=1)
        hooks = compose(probe, full) if options.parallel.zero_stage == 3 else probe
        records = train(config_from_args(args), ctx, options, hooks=hooks)
        measured = dataclasses.asdict(probe.measured)
        if options.parallel.zero_stage == 3:
            measured["full"] = full.measured
        out[name] = {"bytes": [r["bytes_sent"] for r in records], "measured": measured}
    return out


@pytest.fixture(scope="module")
def runs(files) -> list[dict]:
    return run_ranks(_worker, WORLD, files, timeout_s=SPAWN_TIMEOUT_S)


TIMEOUT = pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)


def _recorded(runs: list[dict], name: str, rank: int) -> dict:
    return runs[rank][name]["bytes"][0]


def _state(plan_rank) -> tuple[int, int, int]:
    return plan_rank.state.weights, plan_rank.state.grads, plan_rank.state.optimizer


@TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_group_per_rank_equal_the_recorded_bytes(runs, files, name):
    plan = predict(_args(files, name))
    for rank, out in enumerate(runs):
        want = plan.ranks[rank].bytes_sent
        assert len(out[name]["bytes"]) == STEPS
        for step in out[name]["bytes"]:
            assert step == want, (name, rank, step, want)


@TIMEOUT
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_and_held_activations_per_rank_equal_the_measurement(runs, files, name):
    plan = predict(_args(files, name))
    for rank, out in enumerate(runs):
        got, want = out[name]["measured"], plan.ranks[rank]
        assert tuple(got["state"]) == _state(want), (name, rank, got["state"], want.state)
        assert got["activations"] == want.activation_bytes, (name, rank, got, want.activations)


@TIMEOUT
def test_the_probe_reads_zero3_as_its_zero2_twin(runs):
    """ZeRO-3 saves the tensors ZeRO-2 saves (its gathered weights are parameters): the probe's meters read
    the same bytes on both, at pp 1 (``refimpl.measure.activations.SavedTensorMeter``) and under 1F1B
    over 4 micro-batches (the bytes alive between the actions), every rank."""
    for rank, out in enumerate(runs):
        for zero3, zero2 in (("dp4-zero3", "dp4-zero2"), ("dp2-pp2-zero3", "dp2-pp2-zero2")):
            got = out[zero3]["measured"]["activations"]
            assert got == out[zero2]["measured"]["activations"] > 0, (zero3, rank, got)


def _preflight(args, plan, rank: int):
    """The memory preflight's ``refimpl.planner.run_memory.RunMemory`` of ``rank`` under the pipeline
    (``refimpl.planner.pipeline_memory.pipeline_memory_per_rank`` at the layout, ZeRO-3 over the 2 dp ranks):
    its ZeRO-3 term is the gathered tensors' peak."""
    config, parallel = config_from_args(args).model, options_from_args(args).parallel
    c = plan.ranks[rank].coords
    ranks = pipeline_memory_per_rank(config, pp=2, num_microbatches=plan.microbatches,
                                     schedule=parallel.pp_schedule, micro_batch=plan.micro_batch, seq_len=16,
                                     precision=parallel.precision, zero_stage=3, zero_shards=2, dp_rank=c.dp,
                                     zero3_reshard_per_microbatch=parallel.zero3_reshard_per_microbatch)
    return ranks[c.pp].memory


def _stage_root_numel(config, pp_rank: int) -> int:
    """Elements of the root unit of pipeline rank ``pp_rank``'s stage at pp 2 (tied embedding): the
    embedding on the first, the final LayerNorm and the tied copy on the last."""
    table = param_table(config)
    root = table.embedding if pp_rank == 0 else (*table.final_layernorm, table.head)
    return sum(q.numel for q in root)


@TIMEOUT
def test_zero3_full_tensors_are_freed_before_the_step_and_the_preflight_peaks_hold(runs, files):
    """What the probe's state reads (the shards) is all ZeRO-3 holds where the trainer steps: no gathered
    weight, no full gradient is allocated then (every ZeRO-3 layout, every rank). Earlier in the step the
    full tensors are the memory preflight's (peaks, not the state): at pp 1 at the first loss the root unit
    alone (the blocks' freed after their forward); under the pipeline, between the schedule's actions, the
    stage's weights and full gradients when gathered once per step (the preflight's term, to the byte, in
    fp32 and in bf16), the
    stage's root unit when gathered per micro-batch (the preflight's term adds its largest block)."""
    names = [n for n in LAYOUTS if options_from_args(_args(files, n)).parallel.zero_stage == 3]
    assert len(names) == 14
    for name in names:
        args = _args(files, name)
        config, parallel = config_from_args(args).model, options_from_args(args).parallel
        plan = predict(args)
        for rank, out in enumerate(runs):
            full = out[name]["measured"]["full"]
            assert tuple(full["at_step"]) == (0, 0), (name, rank, full)
            if parallel.pp == 1:
                table = param_table(config, tp=parallel.tp)  # the rank's tp blocks of the root unit
                root = sum(q.numel for q in (*table.embedding, *table.final_layernorm, *table.output_layer))
                p = 2 if parallel.precision == "bf16" else 4  # FSDP2's mixed precision: 16-bit gathers
                assert tuple(full["at_loss"]) == (p * root, 0), (name, rank, full)
                continue
            c = plan.ranks[rank].coords
            memory = _preflight(args, plan, rank)
            if not parallel.zero3_reshard_per_microbatch:  # bf16 too: 16-bit weights and full gradients
                assert full["between_actions"] == memory.state[KEPT], (name, rank, full, memory.state)
            else:
                root = 4 * _stage_root_numel(config, c.pp)
                peak = memory.state["ZeRO-3 gathered units (per micro-batch)"]
                assert full["between_actions"] == root < peak, (name, rank, full, memory.state)


def test_zero3_under_the_pipeline_is_refused_where_not_measured(files):
    args = _args(files, "dp2-pp2-zero3")
    with pytest.raises(ValueError, match="fp8 with ZeRO 0-3 at pp = 1 and ZeRO 0-2 under pp"):
        predict(args, precision="fp8")  # the stages' fp8 gathers
    predict(args, zero3_reshard_per_microbatch=True, pp_schedule="gpipe")  # what is measured is predicted
    predict(args, tp=2, dp=1)  # tests/planner/ranks/test_planner_3d.py measures it at 2 x 2 x 2


def test_checkpointing_under_the_pipeline_is_refused_where_not_measured(files):
    args = _args(files, "dp2-pp2-zero1-ac")
    with pytest.raises(ValueError, match="activation checkpointing under pp in fp32"):
        predict(args, precision="bf16")
    predict(args, pp_schedule="zbh1")  # tests/planner/ranks/test_planner_3d.py measures it (2 x 2 x 2)


@TIMEOUT
def test_plausible_wrong_predictions_fail_the_same_checks(runs, files):
    def recorded(name: str, rank: int) -> dict:
        return _recorded(runs, name, rank)

    # checkpointed blocks under the pipeline held as if whole (the stages' saved bytes not recomputed)
    for name in ("dp2-pp2-zero1-ac", "dp2-pp2-zero3-ac"):
        args = _args(files, name)
        whole = predict(args, activation_checkpointing=None)
        for rank, out in enumerate(runs):
            got = out[name]["measured"]["activations"]
            assert got == predict(args).ranks[rank].activation_bytes != whole.ranks[rank].activation_bytes
    # ZeRO-3 predicted as ZeRO-1: one reduce-scatter and one all-gather, not 9 gathers and 5 reductions;
    # and the weights whole
    name = "dp4-zero3"
    zero1 = predict(_args(files, name), zero_stage=1)
    for rank, out in enumerate(runs):
        assert zero1.ranks[rank].bytes_sent != recorded(name, rank), rank
        assert tuple(out[name]["measured"]["state"]) != _state(zero1.ranks[rank]), rank
    # HSDP without the replicas' all-reduce of each unit's shard, or as ZeRO-3 over all of dp x cp
    name = "dp4-hsdp2-zero3"
    plan = predict(_args(files, name))
    flat = predict(_args(files, name), dp_replicate=1)
    for rank in range(WORLD):
        sent = plan.ranks[rank].bytes_sent
        assert sent == recorded(name, rank) and sent["dp_replicate"] > 0
        assert {k: v for k, v in sent.items() if k != "dp_replicate"} != recorded(name, rank), rank
        assert flat.ranks[rank].bytes_sent != recorded(name, rank), rank
    # the recomputed forwards' collectives forgotten: the checkpointed blocks' attention all-reduce (tp),
    # their ring exchanges (cp); without checkpointing the held activations differ too
    recomputed = {"dp2-tp2-zero3-ac": "tp", "dp2-tp2-sp-zero3-ac": "tp", "dp2-cp2-hsdp2-zero3-ac": "cp"}
    for name, key in recomputed.items():
        plan = predict(_args(files, name))
        off = predict(_args(files, name), activation_checkpointing=None)
        for rank, out in enumerate(runs):
            assert plan.ranks[rank].bytes_sent == recorded(name, rank)
            assert off.ranks[rank].bytes_sent[key] < recorded(name, rank)[key], (name, rank)
            assert off.ranks[rank].activation_bytes != out[name]["measured"]["activations"], (name, rank)
    # ZeRO-3 in bf16: the gathers counted in fp32 (autocast's path) send more; its activations with
    # autocast's float32 residual stream (the blocks' LayerNorm inputs and statistics) are more
    name = "dp4-zero3-bf16-accum"
    args = _args(files, name)
    plan, fp32 = predict(args), predict(args, precision="fp32")
    config = config_from_args(args).model
    autocast = sum(activation_bytes(config, micro_batch=1, seq_len=16, compute_dtype=torch.bfloat16))
    for rank, out in enumerate(runs):
        assert fp32.ranks[rank].bytes_sent["dp x cp"] > recorded(name, rank)["dp x cp"], rank
        outside = plan.ranks[rank].activation_bytes - plan.ranks[rank].activations["block activations"]
        assert out[name]["measured"]["activations"] != outside + autocast, rank
    # ZeRO-2 reduce-scatters in every backward (4 micro-batches here), not once per step as ZeRO-1; and
    # keeps only the gradient shards
    name = "dp2-tp2-sp-zero2-accum"
    zero1 = predict(_args(files, name), zero_stage=1)
    for rank, out in enumerate(runs):
        assert zero1.ranks[rank].bytes_sent["dp x cp"] < recorded(name, rank)["dp x cp"], rank
        assert tuple(out[name]["measured"]["state"]) != _state(zero1.ranks[rank]), rank
    # under the pipeline ZeRO-2 exchanges the tied embedding's gradient shard, not the whole gradient
    name = "dp2-pp2-zero2"
    plan = predict(_args(files, name))
    head = param_table(config).head
    for rank in range(WORLD):  # every rank is a first or a last stage here (pp 2)
        sent = plan.ranks[rank].bytes_sent
        shard = sharded_numel([head.shape], plan.ranks[rank].coords.dp, 2)
        assert sent == recorded(name, rank) and 0 < shard < head.numel
        assert {**sent, "pp": sent["pp"] + 4 * (head.numel - shard)} != recorded(name, rank), rank
    # ZeRO-3 under the pipeline: the other mode's bytes (each unit gathered and reduced once per step, or
    # per micro-batch: the root once and the blocks twice per micro-batch) are far from the recorded ones
    for name in PIPELINE_ZERO3:
        args = _args(files, name)
        parallel = options_from_args(args).parallel
        if parallel.pp_schedule == "zbh1":  # per micro-batch resharding is refused with zbh1
            continue
        other = predict(args, zero3_reshard_per_microbatch=not parallel.zero3_reshard_per_microbatch)
        for rank in range(WORLD):
            assert predict(args).ranks[rank].bytes_sent == recorded(name, rank)
            assert other.ranks[rank].bytes_sent["dp x cp"] != recorded(name, rank)["dp x cp"], (name, rank)
    # ... its tied-embedding exchange is the gradient shard (the stage's parameter is the shard again); its
    # state the shards (not ZeRO-2's whole weights, not with the preflight's gathered stage on top)
    name = "dp2-pp2-zero3"
    args = _args(files, name)
    plan, zero2 = predict(args), predict(args, zero_stage=2)
    for rank, out in enumerate(runs):
        sent, c = plan.ranks[rank].bytes_sent, plan.ranks[rank].coords
        shard = sharded_numel([head.shape], c.dp, 2)
        assert {**sent, "pp": sent["pp"] + 4 * (head.numel - shard)} != recorded(name, rank), rank
        measured = tuple(out[name]["measured"]["state"])
        assert measured == _state(plan.ranks[rank]) != _state(zero2.ranks[rank]), rank
        gathered = _preflight(args, plan, rank).state[KEPT] // 2  # the full weights, the full gradients
        weights, grads, optimizer = _state(plan.ranks[rank])
        assert measured != (weights + gathered, grads + gathered, optimizer), rank
    # GPipe holds both micro-batches on the last stage (1F1B one); there, at 2 sequences per micro-batch,
    # each loss saves its labels flattened (a copy: the [2, 16] rows of the [4, 17] window are strided),
    # not a view of the window held once per step: 2 x 8 x 2 x 16 bytes, not 8 x 4 x 17
    name = "dp2-pp2-zero3-gpipe-reshard"
    args = _args(files, name)
    plan, one_f_one_b = predict(args), predict(args, pp_schedule="1f1b")
    for rank in (2, 3):  # the last stage
        got = runs[rank][name]["measured"]["activations"]
        assert got == plan.ranks[rank].activation_bytes
        assert got != one_f_one_b.ranks[rank].activation_bytes, rank
        assert got != plan.ranks[rank].activation_bytes - 2 * 8 * 2 * 16 + 8 * 4 * 17, rank
    # ZeRO-1 under sequence parallelism: the tp sum reads the reduced gradient shards before the step, so
    # the rank holds them beside its full gradients
    name = "dp2-tp2-sp-zero1-ac02"
    plan = predict(_args(files, name))
    for rank, out in enumerate(runs):
        weights, grads, optimizer = _state(plan.ranks[rank])
        assert tuple(out[name]["measured"]["state"]) == (weights, grads, optimizer)
        assert tuple(out[name]["measured"]["state"]) != (weights, weights, optimizer), rank
