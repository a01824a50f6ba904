"""The planner's pipeline terms (chapter 08, ``refimpl.planner.pipeline_*``) against what the runtime holds.

* Parameters per pipeline rank: the shapes of ``build_stages``' stages on every rank (pp 4; pp 2 with 3
  chunks per rank; 7 blocks, so uneven stages; split by layers and by parameters, tied and untied
  embeddings: the last stage's copy of a tied embedding counts there); the model state after an AdamW
  step, counted from the tensors (``refimpl.measure.state_bytes``), equals
  ``pipeline_state_memory`` to the byte.
* One micro-batch's saved bytes per stage: ``SavedTensorMeter`` on the stage's forward (and the loss on
  the last stage) equals ``stage_saved_bytes`` to the byte, in float32, under bfloat16 autocast and
  with checkpointed blocks; with zbh1's deferred weight gradients, the tensors the queued ``dW`` keep after
  the backward (the seam declares them to the store's ``on_push``) equal ``stage_deferred_bytes``.
* The peak of a real step: ``PipelineModule.step`` at pp 2 and 4 over m = 4 micro-batches (gpipe,
  1f1b, interleaved v = 2, zbh1) with the bytes alive counted as they come and go (saved tensors through
  ``saved_tensors_hooks``, released when autograd frees them; the tensors sent, plain or batched, seen by
  the tracer's ``on_send`` and released when their storage is freed; those a queued ``dW`` keeps, released
  when the runtime drops them): the highest count between actions (read when
  the executor reads its clock) equals the planner's held bytes at its peak, per rank, and within actions
  only the planner's transients come on top.
  Negative controls: GPipe's planned peak is not what 1F1B holds where 1F1B holds fewer than m (nor the
  reverse), the plan without the sends the runtime keeps (outputs until their backward, an input gradient
  until the next action starts) is not what is held, nor is zbh1's plan with every micro-batch keeping all its
  activations until its W.
* Inside the other axes (world 4, ``parallelize``'s own pipeline, 1F1B, m = 4, a tied embedding):
  pp 2 x tp 2 with and without sequence parallelism, pp 2 x cp 2 ring and Ulysses: each rank's held bytes
  between actions == the plan of its pipeline rank, and the stages' state after AdamW == the plan's (the
  tensor-parallel shards, the tied copy a vocab-parallel shard). Negative controls: the plan without tp,
  with the SP boundaries unsplit, with SDPA's terms at s/cp tokens. The trainer's preflight on --pp 2 --dp
  2 --zero-stage 1 == what its setup holds (AdamW state sharded over dp; ZeRO-0's state is not).
* Refused as parallelize refuses them: pp with ZeRO-3; zbh1 with tp is planned (its TP layers defer dW).
"""

from __future__ import annotations

import pytest
import torch

from refimpl.comm.tracer import now
from refimpl.config import ModelConfig, ParallelConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.measure import SavedTensorMeter, state_bytes
from refimpl.measure.run_measurement import LiveTensorBytes
from refimpl.models import GPT, lm_loss
from refimpl.models.gpt_stages import build_stages
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.pipeline_parallel import PipelineModule, build_schedule
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients
from refimpl.planner import run_memory_per_rank, state_memory_per_rank
from refimpl.planner.pipeline_memory import (
    PER_STEP,
    pipeline_memory_per_rank,
    stage_deferred_bytes,
    stage_saved_bytes,
)
from refimpl.planner.pipeline_stages import pipeline_state_memory, stage_layers
from refimpl.train.layout import resolve
from tests.support.timeouts import SPAWN_TIMEOUT_S

M, B, S = 4, 2, 8  # micro-batches, sequences per micro-batch, tokens
LIVE = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1)]


def _config(*, layers: int = 8, tied: bool = True) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=16, num_attention_heads=2, max_seq_len=S,
                       tie_word_embeddings=tied, ffn_hidden_size=48)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("balance", ["layers", "parameters"])
@pytest.mark.parametrize(("pp", "v"), [(4, 1), (2, 3)])
def test_stage_parameters_and_state_per_rank_equal_the_built_stages(pp, v, balance, tied):
    config = _config(layers=7, tied=tied)  # 7 blocks: uneven stages
    model = GPT(config, seed=0)
    for rank in range(pp):
        stages = build_stages(model, pp_rank=rank, pp_size=pp, virtual_stages=v, balance=balance)
        params = [q for st in sorted(stages) for q in stages[st].parameters()]
        plan = pipeline_memory_per_rank(config, pp=pp, num_microbatches=2 * pp, virtual_stages=v,
                                        schedule="interleaved" if v > 1 else "1f1b", micro_batch=1,
                                        seq_len=S, balance=balance)[rank]
        assert plan.stages == tuple(sorted(stages))
        assert plan.blocks == tuple(stages[st].block_ids for st in sorted(stages))
        assert sorted(plan.param_shapes) == sorted(tuple(q.shape) for q in params), (rank, pp, v)
        for q in params:
            q.grad = torch.ones_like(q)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()
        state = state_bytes(params, optimizer)
        assert state == pipeline_state_memory(config, pp=pp, pp_rank=rank, virtual_stages=v, balance=balance)
        assert state == state_memory_per_rank(config, ParallelDims(dp=1, pp=pp), pp_rank=rank,
                                              virtual_stages=v, pp_balance=balance)
        planned = plan.memory.state
        assert (planned["weights"], planned["grads"], planned["AdamW state"]) == (
            state.weights, state.grads, state.optimizer)
        ranges = stage_layers(config, num_stages=pp * v, balance=balance)
        assert [ranges[st] for st in sorted(stages)] == [stages[st].block_ids for st in sorted(stages)]


@pytest.mark.parametrize("deferred", [False, True], ids=["whole-backward", "zbh1-deferred-W"])
@pytest.mark.parametrize(("precision", "checkpointed"), [("fp32", ()), ("bf16", ()), ("fp32", (1, 4))],
                         ids=["fp32", "bf16-autocast", "fp32-checkpointed"])
def test_one_microbatch_saves_what_the_planner_counts_per_stage(precision, checkpointed, deferred):
    """Forward: the saved bytes; with zbh1's deferred weight gradients also what the backward leaves for
    W (the tensors the seam declares its queued weight gradients hold), against
    ``stage_deferred_bytes``."""
    config, pp = _config(tied=False), 4
    model = GPT(config, seed=0)
    if checkpointed:
        apply_activation_checkpointing(model, list(checkpointed))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (B, S), generator=g)
    labels = torch.randint(0, 256, (B, S), generator=g)
    for rank in range(pp):
        (st, stage), = build_stages(model, pp_rank=rank, pp_size=pp).items()
        store = WeightGradStore()
        if deferred:
            defer_weight_gradients(stage, store)
        x = ids if st == 0 else torch.randn(B, S, config.hidden_size, generator=g).requires_grad_()
        with SavedTensorMeter(stage) as meter, torch.autocast("cpu", dtype=torch.bfloat16,
                                                              enabled=dtype != torch.float32):
            y = stage(x)
            if st == pp - 1:
                y = lm_loss(y, labels)
        plan = stage_saved_bytes(config, stage=st, num_stages=pp, blocks=stage.block_ids, micro_batch=B,
                                 seq_len=S, compute_dtype=dtype, checkpointed_blocks=checkpointed,
                                 deferred_weights=deferred)
        got = meter.report
        assert got.total == sum(plan.values()), (rank, precision, dict(got.activations), plan)
        plain = [i for i in stage.block_ids if i not in checkpointed]
        widened = 2 * len(plain) * 2 * B * S * config.hidden_size if deferred and precision == "bf16" else 0
        assert sum(got.per_block()) == plan["block activations"] + widened, (rank, precision)
        if deferred:
            held: list[torch.Tensor] = []  # what the queued weight gradients keep (the seam declares it)
            store.on_push = lambda fn, tensors, held=held: held.extend(tensors)
            with store.capture("mb"):
                torch.autograd.backward(y, None if st == pp - 1 else torch.ones_like(y))
            skip = {q.untyped_storage().data_ptr() for q in stage.parameters()}
            kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held
                    if t.untyped_storage().data_ptr() not in skip}
            want = stage_deferred_bytes(config, stage=st, num_stages=pp, blocks=stage.block_ids,
                                        micro_batch=B, seq_len=S, compute_dtype=dtype)
            assert sum(kept.values()) == want, (rank, precision)
            assert store.flush("mb") == 4 * len(stage.block_ids) + (st == pp - 1)  # every linear's dW


def _counted_step(pipe, inputs, labels, loss_fn, *, num_microbatches: int = M) -> dict:
    """One ``PipelineModule.step`` with the bytes alive counted (saved tensors, sent tensors, queued
    weight gradients): the most between actions, the most within, and what is left after."""
    live = LiveTensorBytes(pipe.parameters(), skip_weight_copies=False)
    pack = live.pack

    def sampled_now() -> float:
        live.sample()  # the executor reads the clock at each action's start, ready and end
        return now()

    if pipe.store is not None:  # zbh1: what each queued weight gradient keeps until its W (the seam says)
        pipe.store.on_push = live.hold_queued
    # sent tensors count until their storage is freed (live.sends: the tracer's on_send)
    with live.sends(), torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
        pipe.step(inputs, labels, num_microbatches=num_microbatches, loss_fn=loss_fn, clock=sampled_now)
    return {"peak": live.between, "within": live.peak, "after": live.now}


def _live_worker(ctx) -> dict:
    out = {}
    config = _config(layers=2 * ctx.world_size, tied=False)  # interleaved v = 2: a block per stage
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (M * B, S + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # the step's batch
    for name, v in LIVE:
        pipe = PipelineModule(GPT(config, seed=0), pp_group=None, pp_rank=ctx.rank, pp_size=ctx.world_size,
                              schedule=name, virtual_stages=v)
        out[name] = _counted_step(pipe, inputs, labels,
                                  lambda logits, y: lm_loss(logits, y, num_tokens=M * B * S))
    return out


FLAT_M = (4, 8, 16)


def _flat_worker(ctx) -> dict:
    """The peak bytes alive between actions (saved, sent and received tensors) per schedule and m."""
    config = _config(layers=2 * ctx.world_size, tied=True)
    out = {}
    for name in ("gpipe", "1f1b"):
        for m in FLAT_M:
            tokens = torch.randint(0, 256, (m * B, S + 1), generator=torch.Generator().manual_seed(1))
            inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            pipe = PipelineModule(GPT(config, seed=0), pp_group=None, pp_rank=ctx.rank,
                                  pp_size=ctx.world_size, schedule=name)
            out[(name, m)] = _counted_step(pipe, inputs, labels,
                                           lambda logits, y, m=m: lm_loss(logits, y, num_tokens=m * B * S),
                                           num_microbatches=m)["peak"]
    return out


def test_1f1b_holds_the_same_whatever_m_and_gpipe_grows():
    """Chapter 08's claim, measured with the sent tensors counted: at pp 2 and m = 4, 8, 16 the 1F1B peak
    per rank grows by no more than the step's own token ids (first stage) or labels (last stage), int64
    ``[m b, s]``, which the embedding and the loss save as views of the whole batch, while GPipe's grows
    by at least one micro-batch's activations per extra micro-batch (negative control: the same bound
    fails for GPipe)."""
    peaks = run_ranks(_flat_worker, 2, timeout_s=SPAWN_TIMEOUT_S)
    ids_growth = (FLAT_M[-1] - FLAT_M[0]) * B * S * 8  # one int64 [m b, s] tensor, from m = 4 to 16
    for rank, got in enumerate(peaks):
        one = [got[("1f1b", m)] for m in FLAT_M]
        gp = [got[("gpipe", m)] for m in FLAT_M]
        print(f"rank {rank}: 1f1b {one}, gpipe {gp} bytes at m = {FLAT_M}")
        assert 0 <= one[-1] - one[0] <= ids_growth, (rank, one)
        per_mb = (gp[1] - gp[0]) / (FLAT_M[1] - FLAT_M[0])
        assert per_mb > 4 * ids_growth / (FLAT_M[-1] - FLAT_M[0]), (rank, gp)  # activations, not ids
        assert gp[-1] - gp[0] > ids_growth, (rank, gp)  # the same bound fails for GPipe
        assert gp[0] < gp[1] < gp[2], (rank, gp)


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def live(request):
    return request.param, run_ranks(_live_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


def _until_w(plan, config: ModelConfig, pp: int) -> int:
    """The wrong zbh1 plan: a micro-batch keeps all of its saved bytes until its W."""
    from refimpl.planner import pipeline_memory as planner_pipeline

    table = build_schedule("zbh1", pp_size=pp, num_microbatches=M)[plan.rank]
    whole = {st: sum(v for k, v in t.items() if k not in PER_STEP) for st, t in plan.saved.items()}
    terms, _ = planner_pipeline._walk(table, saved=plan.saved, deferred=whole, num_stages=pp,
                                      outputs=4 * S * B * config.hidden_size)
    return sum(terms.values())


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_peak_of_a_real_step_equals_the_plan_per_rank(live):
    pp, live = live
    config = _config(layers=2 * pp, tied=False)
    plans = {name: pipeline_memory_per_rank(config, pp=pp, num_microbatches=M, schedule=name,
                                            virtual_stages=v, micro_batch=B, seq_len=S) for name, v in LIVE}
    for name, _ in LIVE:
        for rank, got in enumerate(live):
            plan = plans[name][rank]
            assert got[name]["after"] == 0, (name, rank)  # everything counted was released by the end
            assert got[name]["peak"] == plan.peak_held, (name, rank, got[name], plan.peak_terms)
            # within an action only the planned transients come on top; ZB-H1's first deferred linear keeps
            # the received output gradient while the micro-batch's activations are still alive
            assert 0 <= got[name]["within"] - got[name]["peak"] <= sum(plan.transient.values()), (name, rank)
    # ZB-H1's rank 0: inside a B the micro-batch's output is still alive (autograd.backward(y, dy) needs it,
    # its storage counts until freed) while the first deferred linear keeps the received output gradient
    # (the planned transient): exactly that comes on top of the peak
    received = "output gradient received for a backward (transient)"
    assert plans["zbh1"][0].transient[received] > 0
    assert live[0]["zbh1"]["within"] - live[0]["zbh1"]["peak"] == plans["zbh1"][0].transient[received]
    checked = fewer = 0
    for rank, got in enumerate(live):
        assert plans["gpipe"][rank].in_flight == M and plans["1f1b"][rank].in_flight == min(pp - rank, M)
        assert plans["1f1b"][rank].in_flight == plans["1f1b"][rank].peak_in_flight
        # negative controls: the other schedule's plan where 1F1B holds fewer than m, and the plan without
        # the kept sends
        if plans["1f1b"][rank].in_flight < M:
            assert got["1f1b"]["peak"] != plans["gpipe"][rank].peak_held, rank
            assert got["gpipe"]["peak"] != plans["1f1b"][rank].peak_held, rank
            fewer += 1
        for name, _ in LIVE:
            terms = plans[name][rank].peak_terms
            unsent = sum(v for k, v in terms.items() if "sent" not in k)
            if unsent < plans[name][rank].peak_held:
                assert got[name]["peak"] != unsent, (name, rank)
                checked += 1
    assert checked >= len(LIVE) + 1 and fewer >= 1  # every schedule's first rank sends before its peak
    # zbh1's W-held bytes matter: counting its micro-batches' whole activations until W is not what it holds
    zb = plans["zbh1"]
    # rank 0 peaks before its first W
    assert any(live[r]["zbh1"]["peak"] != _until_w(zb[r], config, pp) for r in range(pp))


def test_run_memory_is_the_worst_rank_and_names_it():
    config = _config(layers=4, tied=True)
    dims = ParallelDims(dp=2, pp=2)
    kw = {"micro_batch": B, "seq_len": S, "num_microbatches": M}
    for name, v in LIVE + [("zbh1", 1)]:
        ranks = pipeline_memory_per_rank(config, pp=2, schedule=name, virtual_stages=v, **{
            "micro_batch": B, "seq_len": S, "num_microbatches": M, "precision": "bf16"})
        worst = max(ranks, key=lambda r: r.memory.total)
        got = run_memory_per_rank(config, dims, precision="bf16", pp_schedule=name, virtual_stages=v, **kw)
        assert got == worst.memory and got.rank == worst.rank
        assert got.describe().startswith(f"pipeline rank {worst.rank}: ")
        assert got.state["autocast weight copies"] > 0
    assert run_memory_per_rank(config, dims, micro_batch=B, seq_len=S) == run_memory_per_rank(
        config, dims, micro_batch=B, seq_len=S, num_microbatches=2)  # m defaults to pp
    assert PER_STEP[0] in pipeline_memory_per_rank(config, pp=2, num_microbatches=M, micro_batch=B,
                                                   seq_len=S)[0].peak_terms


COMPOSED = {  # pp 2 inside the other axes, as parallelize builds it (world 4): layout, options
    "pp2-tp2": (dict(tp=2), dict()),
    "pp2-tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "pp2-cp2-ring": (dict(cp=2), dict(cp_method="ring")),
    "pp2-cp2-ulysses": (dict(cp=2), dict(cp_method="ulysses")),
}
VOCAB = 256  # parallelize asks tp to divide V (no padding): the tied copy is a V/t-row shard


def _composed_config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=2, max_seq_len=S, vocab_size=VOCAB,
                       tie_word_embeddings=True, ffn_hidden_size=48)


def _composed_worker(ctx) -> dict:
    """Per layout: the held bytes of one real step of parallelize's pipeline, and its stages' state after an
    AdamW step; then the trainer's own pp 2 x dp 2 ZeRO-1 setup's state before its second update."""
    from refimpl.config import DataConfig, OptimConfig, TrainConfig
    from refimpl.parallel.parallelize import parallelize
    from refimpl.train import RunOptions, build_setup
    from refimpl.train.step import StepPoints, train_step

    out: dict = {}
    config = _composed_config()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (M * B, S + 1), generator=g)
    for key, (axes, options) in COMPOSED.items():
        dims = ParallelDims(dp=1, pp=2, **axes)
        groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
        par = parallelize(GPT(config, seed=0), groups, dims.config(**options))
        x, y = par.split_batch(tokens[:, :-1].contiguous()), par.split_batch(tokens[:, 1:].contiguous())
        got = _counted_step(par.pipeline, x, y, lambda logits, labels, par=par: par.loss(logits, labels) / M)
        params = list(par.pipeline.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()
        st = state_bytes(params, optimizer)
        out[key] = {**got, "pp_rank": dims.coordinates(ctx.rank).pp,
                    "state": (st.weights, st.grads, st.optimizer)}
    run = RunOptions(parallel=ParallelConfig(dp=2, pp=2, zero_stage=1, microbatches=2))
    dims = run.parallel_dims(ctx.world_size)
    train = TrainConfig(model=config, data=DataConfig(seq_len=S, global_batch_size=2 * B * dims.dp),
                        optim=OptimConfig(grad_clip=1.0))
    setup = build_setup(train, ctx, resolve(train, run, ctx.world_size),
                        dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s))
    held = []
    ids = torch.randint(0, VOCAB, (2 * B, S + 1), generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):  # AdamW's state exists from the first update on: the second step's is held
        train_step(setup, ids[:, :-1], ids[:, 1:], accumulation=2, micro=B, grad_clip=1.0,
                   points=StepPoints(before_optimizer_step=lambda: held.append(
                       state_bytes(setup.state_module, setup.optimizer))))
    out["zero1"] = {"pp_rank": dims.coordinates(ctx.rank).pp, "dp_rank": dims.coordinates(ctx.rank).dp,
                    "state": (held[-1].weights, held[-1].grads, held[-1].optimizer)}
    return out


@pytest.fixture(scope="module")
def composed():
    return run_ranks(_composed_worker, 4, timeout_s=SPAWN_TIMEOUT_S)


def _composed_plan(key: str, **change) -> list:
    axes, options = COMPOSED[key]
    kw = {"pp": 2, "num_microbatches": M, "micro_batch": B, "seq_len": S, **axes, **options, **change}
    return pipeline_memory_per_rank(_composed_config(), **kw)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_pipeline_inside_tensor_and_context_parallelism_holds_the_plan(composed):
    """pp 2 x tp 2 (SP off and on) and pp 2 x cp 2 (ring, Ulysses), 1F1B over m = 4: each rank's held
    bytes between actions == the plan of its pipeline rank, and its stages' state after AdamW == the plan's
    state. Negative controls, one per new term: the plan without tp (the shards, the vocab-parallel terms),
    with the SP boundaries unsplit, with SDPA's terms at the rank's s/cp tokens instead of the ring's or
    Ulysses'."""
    config = _composed_config()
    for key in COMPOSED:
        plans = _composed_plan(key)
        for rank, r in enumerate(composed):
            got, plan = r[key], plans[r[key]["pp_rank"]]
            where = (key, rank)
            assert got["after"] == 0, where
            assert got["peak"] == plan.peak_held, (where, got, plan.peak_terms)
            assert 0 <= got["within"] - got["peak"] <= sum(plan.transient.values()), where
            state = plan.memory.state
            assert got["state"] == (state["weights"], state["grads"], state["AdamW state"]), where
            if "tp" in COMPOSED[key][0]:
                whole = _composed_plan(key, tp=1, sequence_parallel=False)[got["pp_rank"]]
                assert got["peak"] != whole.peak_held and got["state"][0] != whole.memory.state["weights"]
            if COMPOSED[key][1].get("sequence_parallel") and plan.stages[0] == 0:  # rank 0 sends outputs
                unsplit = planner_walk(plan, outputs=4 * S * B * config.hidden_size)
                assert got["peak"] != unsplit, where
            if "cp" in COMPOSED[key][0]:
                sdpa = _composed_plan(key, cp=1, seq_len=S // 2)[got["pp_rank"]]
                assert got["peak"] != sdpa.peak_held, where


def planner_walk(plan, *, outputs: int) -> int:
    """A rank's held peak under 1F1B with another boundary size (the SP negative control)."""
    from refimpl.planner import pipeline_memory as planner_pipeline

    table = build_schedule("1f1b", pp_size=2, num_microbatches=M)[plan.rank]
    terms, _ = planner_pipeline._walk(table, saved=plan.saved, deferred=None, num_stages=2, outputs=outputs)
    return sum(terms.values())


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_preflight_of_pp2_dp2_zero1_is_what_its_setup_holds(composed):
    """The trainer's preflight on --pp 2 --dp 2 --zero-stage 1: the worst pipeline rank's weights, gradients
    and AdamW state (sharded over dp) == what that rank's setup holds before its second update (dp rank 0
    holds the larger shard); every rank == state_memory_per_rank. Negative control: ZeRO-0's state."""
    from refimpl.config import DataConfig, OptimConfig, TrainConfig
    from refimpl.train import RunOptions
    from refimpl.train.preflight import preflight_memory

    config = _composed_config()
    run = RunOptions(parallel=ParallelConfig(dp=2, pp=2, zero_stage=1, microbatches=2))
    train = TrainConfig(model=config, data=DataConfig(seq_len=S, global_batch_size=4 * B),
                        optim=OptimConfig(grad_clip=1.0))
    plan = preflight_memory(train, resolve(train, run, 4), ranks_per_node=4)
    assert plan is not None and plan.rank in (0, 1)
    dims, worst = run.parallel_dims(4), 0
    for rank, r in enumerate(composed):
        got = r["zero1"]
        state = state_memory_per_rank(config, dims, zero_stage=1, dp_rank=got["dp_rank"],
                                      pp_rank=got["pp_rank"])
        # before its step ZeRO-1 holds the reduced gradient shards (ZeRO-2's gradients) beside the full ones
        shards = state_memory_per_rank(config, dims, zero_stage=2, dp_rank=got["dp_rank"],
                                       pp_rank=got["pp_rank"]).grads
        assert got["state"] == (state.weights, state.grads + shards, state.optimizer), rank
        whole = state_memory_per_rank(config, dims, pp_rank=got["pp_rank"])
        assert got["state"] != (whole.weights, whole.grads + shards, whole.optimizer), rank
        if got["pp_rank"] == plan.rank and got["dp_rank"] == 0:
            assert got["state"] == (plan.state["weights"], plan.state["grads"] + shards,
                                    plan.state["AdamW state"])
            worst += 1
    assert worst == 1


def test_pipeline_with_zero_3_is_planned_with_its_gathered_stages_and_zbh1_with_tp_too():
    """ZeRO-3 under pp shards the stages' state at rest (less than ZeRO-2's weights) and holds, by
    default, its stages gathered with their full gradients through the step, or one unit at a time with
    --zero3-reshard-per-microbatch (tests/trainer/ranks/lane2/test_train_zero3.py runs both)."""
    config = _config(layers=4)
    kept, per_micro = (run_memory_per_rank(config, ParallelDims(dp=2, pp=2), micro_batch=1, seq_len=S,
                                           zero_stage=3, zero3_reshard_per_microbatch=r)
                       for r in (False, True))
    assert kept.state["ZeRO-3 gathered stages and their full gradients (kept through the step)"] > \
        per_micro.state["ZeRO-3 gathered units (per micro-batch)"] > 0
    three = state_memory_per_rank(config, ParallelDims(dp=2, pp=2), zero_stage=3)
    two = state_memory_per_rank(config, ParallelDims(dp=2, pp=2), zero_stage=2)  # ZeRO-2: grads sharded
    one = state_memory_per_rank(config, ParallelDims(dp=2, pp=2), zero_stage=1)
    assert two.grads < one.grads and two.weights == one.weights and three.weights < two.weights
    zbh1 = run_memory_per_rank(config, ParallelDims(dp=1, tp=2, pp=2), micro_batch=1, seq_len=S,
                               pp_schedule="zbh1")  # the TP layers defer their dW: no longer refused
    assert zbh1.activations and zbh1.total > 0


def test_the_planner_refuses_zbv_by_name_and_plans_zbh1():
    """ZB-V's V placement and its deferred weight gradients are not modelled: the pipeline memory model and
    ``predict_run`` refuse ``zbv`` in one sentence naming it, where the same call with zbh1 plans."""
    from refimpl.config import ParallelConfig
    from refimpl.planner.pipeline_memory import ZBV_NOT_MODELLED
    from refimpl.planner.run_prediction import predict_run

    kwargs = dict(pp=2, num_microbatches=4, micro_batch=B, seq_len=S)
    with pytest.raises(ValueError, match="does not model the zbv schedule") as info:
        pipeline_memory_per_rank(_config(), schedule="zbv", virtual_stages=2, **kwargs)
    assert str(info.value) == ZBV_NOT_MODELLED and "\n" not in ZBV_NOT_MODELLED
    assert pipeline_memory_per_rank(_config(), schedule="zbh1", **kwargs)  # the control plans
    with pytest.raises(ValueError, match="predict_run: the planner does not model the zbv schedule"):
        predict_run(_config(), ParallelConfig(dp=1, pp=2, pp_schedule="zbv", virtual_stages=2,
                                              microbatches=4), seq_len=S, global_batch=4 * B, micro_batch=B)
    assert predict_run(_config(), ParallelConfig(dp=1, pp=2, pp_schedule="zbh1", microbatches=4), seq_len=S,
                       global_batch=4 * B, micro_batch=B).bubble is not None
