"""The planner under tensor and sequence parallelism (chapter 06) against measurements of the TP GPT.

At tp 2 and 4, with and without sequence parallelism, in float32 and under bfloat16 autocast, on every
rank of ``refimpl.parallel.tensor_parallel.apply_tensor_parallel``'s GPT:

* the bytes each block saves for backward (and a checkpointed block's), and what the model saves outside
  the blocks, term by term of dtype, equal ``refimpl.planner.activation_bytes`` /
  ``refimpl.planner.outside_block_bytes`` exactly, as ``refimpl.measure.SavedTensorMeter``
  measures them (Korthikanti et al. 2022 adjusted to our block: see ``refimpl.planner.activations``);
* the model state the trainer's own setup (``refimpl.train.build_setup``) holds after a step, weights,
  gradients and AdamW state, equals ``refimpl.planner.state_memory_per_rank`` at tp 2 and 4 and at
  dp 2 x tp 2 under ZeRO 0, 1 and 2 (the TP shards, then ZeRO over dp), counted by
  ``refimpl.measure.state_bytes``;
* the collectives of one forward + backward, counted and sized by ``refimpl.comm.CommTracer``, equal
  ``refimpl.planner.tensor_parallel_collectives``;
* negative controls: the formula without sequence parallelism does not match an SP run (nor the SP one a
  plain TP run), the one-device figure does not match a TP rank, and column layers that kept the
  all-gathered ``[b, s, h]`` input (autograd's default, not Megatron's ``s/t`` shard) are not our block.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer
from refimpl.config import LLAMA, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.measure import OUTSIDE, measure_saved_activations, state_bytes
from refimpl.models import GPT
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.tensor_parallel import (
    allreduce_sequence_parallel_grads,
    apply_tensor_parallel,
    tensor_parallel_sharded,
    tp_lm_loss,
)
from refimpl.planner import (
    activation_bytes,
    activation_bytes_per_layer,
    korthikanti_bytes_per_layer,
    outside_block_bytes,
    param_shapes,
    run_memory_per_rank,
    state_memory_per_rank,
    tensor_parallel_collectives,
    wire_bytes,
)
from refimpl.train.layout import resolve
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S = 3, 8  # S divides by 2 and 4 (sequence parallelism)
CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=S, ffn_hidden_size=48,
                  vocab_size=254)  # 254 does not divide by 4: the padded vocab-parallel shard (ceil(V/t))
CFG_DIVIDES = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=S,
                          ffn_hidden_size=48)  # vocab 256: what the trainer accepts
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
CHECKPOINTED = [1]


def _dtype_bytes(report, owner: str) -> dict[str, int]:
    return dict(report.activations.get(owner, {}))


def _measure_activations(group, *, sp: bool, dtype: torch.dtype | None, checkpointed: list[int]) -> dict:
    model = apply_tensor_parallel(GPT(CFG, seed=1), tp_group=group, sequence_parallel=sp, pad_vocab=True)
    apply_activation_checkpointing(model, checkpointed)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, CFG.vocab_size, (B, S), generator=g), torch.randint(0, CFG.vocab_size, (B, S),
                                                                                 generator=g)

    def forward():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            return tp_lm_loss(model(x), y, tp_group=group, vocab_size=CFG.vocab_size)

    report = measure_saved_activations(model, forward)
    return {"per_block": report.per_block(), "outside": _dtype_bytes(report, OUTSIDE)}


def _trace_collectives(group, *, sp: bool, config: ModelConfig = CFG) -> dict[str, tuple[int, int]]:
    """One forward + backward (+ the SP gradient sums) of the float32 TP GPT under a CommTracer."""
    model = apply_tensor_parallel(GPT(config, seed=1), tp_group=group, sequence_parallel=sp, pad_vocab=True)
    x = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with CommTracer() as tracer:
        tp_lm_loss(model(x), x, tp_group=group, vocab_size=config.vocab_size).backward()
        if sp:
            allreduce_sequence_parallel_grads(model, group)
    return {op: (total.count, total.nbytes) for op, total in tracer.summary().items()}


def _state_after_a_step(ctx, dims: ParallelDims, zero_stage: int) -> tuple[int, int, int]:
    """The trainer's setup on ``dims``, two steps; the state held after the second (grads in place)."""
    from refimpl.train import RunOptions, build_setup
    from refimpl.train.step import StepPoints, train_step

    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    config = TrainConfig(model=CFG_DIVIDES, data=DataConfig(seq_len=S, global_batch_size=2 * dims.dp),
                         optim=OptimConfig(grad_clip=1.0))
    options = RunOptions(parallel=ParallelConfig(zero_stage=zero_stage, dp=dims.dp, tp=dims.tp))
    setup = build_setup(config, ctx, resolve(config, options, ctx.world_size), groups)
    ids = torch.randint(0, 256, (2, S + 1), generator=torch.Generator().manual_seed(ctx.rank // dims.tp))
    held = []

    def measure() -> None:  # after the reductions, before the step: every gradient is in place
        held.append(state_bytes(setup.state_module, setup.optimizer))

    for _ in range(2):  # the second step's measurement sees the AdamW state the first one made
        train_step(setup, ids[:, :-1], ids[:, 1:], accumulation=1, micro=2, grad_clip=1.0,
                   points=StepPoints(before_optimizer_step=measure))
    state = held[-1]
    return state.weights, state.grads, state.optimizer


def _worker(ctx) -> dict:
    t = ctx.world_size
    out: dict = {"activations": {}, "state": {}}
    for sp in (False, True):
        for name, dtype in DTYPES.items():
            for ckpt in ([], CHECKPOINTED):
                out["activations"][sp, name, tuple(ckpt)] = _measure_activations(
                    dist.group.WORLD, sp=sp, dtype=dtype, checkpointed=ckpt)
    out["collectives"] = {sp: _trace_collectives(dist.group.WORLD, sp=sp) for sp in (False, True)}
    out["llama collectives"] = {(sp, kv): _trace_collectives(dist.group.WORLD, sp=sp, config=_llama(kv))
                                for sp in (False, True) for kv in (1, 2)}
    model = apply_tensor_parallel(GPT(CFG, seed=1), tp_group=dist.group.WORLD, pad_vocab=True)
    sharded = tensor_parallel_sharded(model)
    out["shapes"] = [(tuple(p.shape), n in sharded) for n, p in model.named_parameters()]
    out["state"][1, t, 0] = _state_after_a_step(ctx, ParallelDims(dp=1, tp=t), 0)
    if t == 4:
        for zero_stage in (0, 1, 2):
            out["state"][2, 2, zero_stage] = _state_after_a_step(ctx, ParallelDims(dp=2, tp=2), zero_stage)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


def _planned(sp: bool, name: str, ckpt: tuple[int, ...], t: int) -> tuple[list[int], int]:
    compute = DTYPES[name] or torch.float32
    blocks = activation_bytes(CFG, micro_batch=B, seq_len=S, compute_dtype=compute, tp=t,
                              sequence_parallel=sp, checkpointed_blocks=ckpt)
    outside = outside_block_bytes(CFG, micro_batch=B, seq_len=S, compute_dtype=compute, tp=t,
                                  sequence_parallel=sp)
    return blocks, sum(outside.values())


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_activation_bytes_per_rank_equal_the_measured_ones(ranks):
    t, results = ranks
    for rank, r in enumerate(results):
        for (sp, name, ckpt), got in r["activations"].items():
            blocks, outside = _planned(sp, name, ckpt, t)
            where = (t, rank, sp, name, ckpt)
            assert got["per_block"] == blocks, where
            assert sum(got["outside"].values()) == outside, (where, got["outside"])
            # the outside terms by dtype: int64 ids, labels and positions; bool masks
            assert got["outside"]["int64"] == 8 * (2 * S * B + S), where
            assert got["outside"]["bool"] == 3 * S * B, where
            # negative controls: the other SP setting, the one-device block, Megatron's figure
            other, other_outside = _planned(not sp, name, ckpt, t)
            assert got["per_block"] != other, where
            if not ckpt:
                assert got["per_block"] != _planned(sp, name, ckpt, 1)[0], where
                if sp:  # column layers that kept autograd's gathered [b, s, h] input: not what ours do
                    p = 2 if name == "bf16" else 4
                    gathered = blocks[0] + 2 * p * S * B * CFG.hidden_size * (t - 1) // t
                    assert got["per_block"][0] != gathered, where
            if sp:
                assert outside != other_outside, where  # the final LayerNorm sees s/t tokens


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_collectives_per_micro_batch_equal_the_traced_ones(ranks):
    t, results = ranks
    x = B * S * CFG.hidden_size
    kw = {"num_layers": CFG.num_layers, "hidden_size": CFG.hidden_size, "micro_batch": B, "seq_len": S,
          "tp": t}
    for rank, r in enumerate(results):
        for sp, got in r["collectives"].items():
            assert got == tensor_parallel_collectives(sequence_parallel=sp, **kw), (t, rank, sp, got)
            assert got != tensor_parallel_collectives(sequence_parallel=not sp, **kw)  # negative control
        # on the wire (ring model) the blocks cost the same with SP (an all-gather + a reduce-scatter per
        # all-reduce), and so does the embedding (its all-reduce forward becomes a reduce-scatter, half of
        # it, and an all-gather backward); SP adds the column layers' (2 L + 1, the head too) second
        # all-gather of their saved input in backward, and the s/t-token gradient sums
        wire = {sp: sum(wire_bytes(op, nbytes, t) for op, (_, nbytes) in got.items())
                for sp, got in r["collectives"].items()}
        sp_grads = (6 * CFG.num_layers + 2) * CFG.hidden_size
        extra = (2 * CFG.num_layers + 1) * x + 2 * sp_grads
        assert wire[True] - wire[False] == pytest.approx((t - 1) / t * 4 * extra, rel=1e-12)


def _llama(kv: int) -> ModelConfig:
    return ModelConfig(**{**CFG_DIVIDES.to_dict(), **LLAMA, "num_key_value_heads": kv})


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_the_llama_forms_collectives_equal_the_traced_ones(ranks):
    """The Llama form (RMSNorm: one parameter per norm to sum under SP, no biases) with 1 and 2 key/value
    heads: at ``g < t`` each block adds an all-gather of its qkv output and a reduce-scatter of its gradient
    (negative control: the count of GPT-2's form, which has neither)."""
    t, results = ranks
    kw = {"num_layers": CFG.num_layers, "hidden_size": CFG.hidden_size, "micro_batch": B, "seq_len": S,
          "tp": t}
    for rank, r in enumerate(results):
        for (sp, kv), got in r["llama collectives"].items():
            want = tensor_parallel_collectives(sequence_parallel=sp, config=_llama(kv), **kw)
            assert got == want, (t, rank, sp, kv, got, want)
            if kv < t or sp:
                assert got != tensor_parallel_collectives(sequence_parallel=sp, **kw), (t, rank, sp, kv)


def _state(config: ModelConfig, dims: ParallelDims, zero_stage: int, dp_rank: int) -> tuple[int, int, int]:
    """The state measured before the step: ZeRO-1 then holds the reduced gradient shards (ZeRO-2's
    gradients) beside the full gradients."""
    s = state_memory_per_rank(config, dims, zero_stage=zero_stage, dp_rank=dp_rank)
    shards = state_memory_per_rank(config, dims, zero_stage=2, dp_rank=dp_rank).grads
    return s.weights, s.grads + (shards if zero_stage == 1 else 0), s.optimizer


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_state_bytes_per_rank_equal_what_the_tp_model_holds(ranks):
    t, results = ranks
    for rank, r in enumerate(results):
        for (dp, tp, zero_stage), got in r["state"].items():
            dims = ParallelDims(dp=dp, tp=tp)
            dp_rank = rank // tp  # ParallelDims orders the ranks (dp, cp, tp, pp): tp innermost here
            assert got == _state(CFG_DIVIDES, dims, zero_stage, dp_rank), (rank, dims, zero_stage)
            # negative control: the one-device replica (tp ignored) is another figure
            assert got != _state(CFG_DIVIDES, ParallelDims(dp=dp), zero_stage, dp_rank), (rank, dims)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)
def test_param_shapes_per_rank_are_the_tp_models_parameters(ranks):
    """``param_shapes(config, tp=t)`` is the TP model's ``parameters()`` on every rank, in order (the
    padded vocabulary shard too), and the tensors whose shape it splits are exactly those
    ``tensor_parallel_sharded`` names (the rest are replicated, whole)."""
    t, results = ranks
    full = param_shapes(CFG)
    for rank, r in enumerate(results):
        shapes = [shape for shape, _ in r["shapes"]]
        assert shapes == param_shapes(CFG, tp=t), rank
        assert [is_sharded for _, is_sharded in r["shapes"]] == [a != b for a, b in zip(full, shapes,
                                                                                           strict=True)]


def test_param_shapes_split_only_by_t():
    """Shapes only, one process: every split tensor holds 1/t of the full one."""
    full = param_shapes(CFG_DIVIDES)
    assert full == [tuple(p.shape) for p in GPT(CFG_DIVIDES).parameters()]
    for t in (2, 4):
        local = param_shapes(CFG_DIVIDES, tp=t)
        assert len(local) == len(full)
        split = [(a, b) for a, b in zip(full, local, strict=True) if a != b]
        # word embedding, and per block qkv weight + bias, dense weight, h_to_4h weight + bias, 4h_to_h weight
        assert len(split) == 1 + 6 * CFG_DIVIDES.num_layers
        assert sum(map(_numel, local)) < sum(map(_numel, full))
        assert all(_numel(a) == t * _numel(b) for a, b in split), split


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_formula_terms_with_tp_and_sp():
    """The docstring's 16-bit forms (p = 2, r = 4, f = 4h) and Korthikanti's eqs. 1, 2 and 4."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, max_seq_len=128)
    s, b, h, a = 128, 2, 64, 8
    for t in (1, 2, 4):
        kw = {"micro_batch": b, "seq_len": s, "compute_dtype": torch.bfloat16, "tp": t}
        plain = activation_bytes_per_layer(cfg, **kw).total
        sp = activation_bytes_per_layer(cfg, sequence_parallel=True, **kw).total
        assert plain == s * b * h * (12 * t + 24) // t + 16 * s * b + 4 * a * s * b // t
        assert sp == (36 * s * b * h + 16 * s * b + 4 * a * s * b) // t
        assert (plain == sp) == (t == 1)
        paper = korthikanti_bytes_per_layer(seq_len=s, micro_batch=b, hidden_size=h, num_heads=a, tp=t)
        paper_sp = korthikanti_bytes_per_layer(seq_len=s, micro_batch=b, hidden_size=h, num_heads=a, tp=t,
                                               sequence_parallel=True)
        assert paper == s * b * h * (10 * t + 24) // t + 5 * a * s * s * b // t
        assert paper_sp == (34 * s * b * h + 5 * a * s * s * b) // t
    with pytest.raises(ValueError, match="does not divide by tp=3"):
        activation_bytes_per_layer(cfg, micro_batch=b, seq_len=s, tp=3)
    with pytest.raises(ValueError, match="seq_len=10 does not divide by tp=4"):
        activation_bytes_per_layer(cfg, micro_batch=b, seq_len=10, tp=4, sequence_parallel=True)


def test_the_trainers_preflight_plans_a_tp_run():
    """``--tp 2`` passes the memory preflight (which refused tp > 1 before), and its plan is smaller per
    rank than the one-rank plan of the same model; ZeRO-3 with tp plans the rows of the tp blocks."""
    from refimpl.train import RunOptions
    from refimpl.train.preflight import preflight_memory

    config = TrainConfig(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2),
                         data=DataConfig(seq_len=32, global_batch_size=4))
    one = preflight_memory(config, resolve(config, RunOptions(), 1), ranks_per_node=1)
    for sp in (False, True):
        options = RunOptions(parallel=ParallelConfig(tp=2, sequence_parallel=sp))
        plan = preflight_memory(config, resolve(config, options, 2), ranks_per_node=2)
        assert plan.total < one.total, (sp, plan.describe(), one.describe())
        assert plan == run_memory_per_rank(config.model, ParallelDims(dp=1, tp=2), micro_batch=4, seq_len=32,
                                           sequence_parallel=sp)
    two_d = state_memory_per_rank(config.model, ParallelDims(dp=2, tp=2), zero_stage=3)  # 2-D sharding
    assert two_d.total < state_memory_per_rank(config.model, ParallelDims(dp=2, tp=2), zero_stage=2).total
