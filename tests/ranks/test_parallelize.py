"""``refimpl.parallel.parallelize``: the techniques applied in one order, on the ``dp x cp`` group.

On 4 ranks (``dp = 4``, the groups built once by ``ParallelDims.build``) every ZeRO stage is checked for its
wrapper, the group that wrapper reduces over (the very ``groups.group("dp", "cp")`` object, whose ranks are
``groups.ranks("dp", "cp")``) and the precision policy it was handed; activation checkpointing is applied to
the blocks inside the wrapper. Under ``dp 2 x cp 2`` context parallelism comes before the wrapper, which
reduces over all four ranks, and each rank gets its part of the sequence. A layout with ``pp`` above 1 is
refused, naming the chapter, before the model is touched. The trainer's ``build_setup`` wraps on the
groups it is handed.

The gradients after a ZeRO-0 backward are the same bits on every rank of the group and the mean of the
ranks' own gradients within ``FACTOR x`` the spread of that mean over every order of summation (measured in
the same run: the all-reduce adds in an order of its own). Negative controls: under ``no_sync`` the ranks'
gradients differ and are far from the mean; a wrapper built on another group fails the group-ranks check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

from refimpl.config import ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.parallel.parallelize import ORDER, parallelize
from refimpl.train.layout import resolve
from tests.support.timeouts import SPAWN_TIMEOUT_S

WORLD = 4
FACTOR = 2  # x the largest spread of the mean over the 24 orders of summation of 4 ranks
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, max_seq_len=16)
CASES = {  # name -> the technique options at dp 4
    "zero0": dict(zero_stage=0),
    "zero0-ac-bf16": dict(zero_stage=0, activation_checkpointing="all", precision="bf16"),
    "zero1": dict(zero_stage=1),
    "zero2-ac": dict(zero_stage=2, activation_checkpointing="0"),
    "zero3": dict(zero_stage=3),
    "zero3-bf16": dict(zero_stage=3, precision="bf16"),
    "zero3-ac": dict(zero_stage=3, activation_checkpointing="all"),
}
REFUSED = {  # layout at world size 4 and options -> what the error must say
    "dp2-pp2-zero3-reshard-zbh1": (dict(dp=2, pp=2), dict(zero_stage=3, pp_schedule="zbh1",
                                                          zero3_reshard_per_microbatch=True),
                                   "--zero3-reshard-per-microbatch with the zbh1 schedule"),
}


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _describe(par, groups) -> dict:
    """What the wrapper, the optimizer and the policy are, and on which group (picklable)."""
    from refimpl.parallel.activation_checkpoint import checkpointed_blocks

    opt = par.build_optimizer(OptimConfig())
    optimizer = opt.optimizer
    wrapper = par.sync if par.sync is not None else (
        optimizer if type(optimizer).__name__ == "ShardedOptimizer" else par.state_module)
    want = groups.group("dp", "cp")
    return {"forward": type(par.forward).__name__, "state_module": type(par.state_module).__name__,
            "sync": type(par.sync).__name__ if par.sync is not None else None,
            "optimizer": type(optimizer).__name__, "zero_stage": getattr(optimizer, "zero_stage", None),
            "group_is_dp_cp": wrapper.group is want and par.group is want,
            "group_ranks": _ranks(wrapper.group), "dp_cp_ranks": groups.ranks("dp", "cp"),
            "fsdp_param_dtype": getattr(par.forward, "param_dtype", None),
            "compute_dtype": par.mp.policy.compute_dtype, "own_master": par.mp.master is not None,
            "checkpointed": checkpointed_blocks(par.model), "applied": list(par.applied),
            "wrapped_is_model": getattr(par.forward, "module", par.model) is par.model}


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _zero0_gradients(ctx, groups, *, sync: bool) -> torch.Tensor:
    """Flattened gradients after one backward of this rank's own batch through ZeRO-0."""
    par = parallelize(GPT(CONFIG, seed=0), groups, groups.dims.config(zero_stage=0))
    g = torch.Generator().manual_seed(100 + ctx.rank)  # every rank its own tokens
    x = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    y = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    with contextlib.nullcontext() if sync else par.sync.no_sync():
        loss = lm_loss(par.forward(x), y)
        loss.backward()
    if sync:
        par.sync.finish_gradient_synchronization()
    return _flat_grads(par.model)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def _worker(ctx) -> dict:
    dims = ParallelDims(dp=WORLD)
    # once, passed to every call
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    result: dict = {"cases": {}}
    for name, options in CASES.items():
        result["cases"][name] = _describe(parallelize(GPT(CONFIG, seed=0), groups, dims.config(**options)),
                                           groups)
    # gradients: the same bits on every rank and the mean of the ranks' own gradients
    dp_cp = groups.group("dp", "cp")
    own = _zero0_gradients(ctx, groups, sync=False)  # under no_sync: this rank's own gradient
    synced = _zero0_gradients(ctx, groups, sync=True)
    result["own"] = _gather(own, dp_cp)
    result["synced"] = _gather(synced, dp_cp)
    # negative control for the group check: a wrapper on another group (pairs of ranks)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    from refimpl.parallel.data_parallel import DataParallelBucket

    other = DataParallelBucket(GPT(CONFIG, seed=0), group=pairs[ctx.rank // 2])
    result["other_group_ranks"] = _ranks(other.group)
    # dp 2 x cp 2: attention across the cp pair, the wrapper over all four ranks, the sequence split
    cp_groups = ParallelDims(dp=2, cp=2).build(rank=ctx.rank, world_size=ctx.world_size,
                                               timeout_s=ctx.timeout_s)
    par = parallelize(GPT(CONFIG, seed=0), cp_groups, cp_groups.dims.config(cp_method="ring"))
    tokens = torch.arange(2 * 16).reshape(2, 16)  # [b, s]
    result["cp"] = {"applied": par.applied, "group_ranks": _ranks(par.group),
                    "cp_ranks": _ranks(par.cp_group),
                    "forward": type(par.forward).__name__, "part": par.split_batch(tokens)[0].tolist(),
                    "attention": type(par.model.layers[0].self_attention.core_attention).__name__}
    # dp 2 x pp 2: this rank's stages, the replicas averaged once per step (no per-backward hooks)
    pp_groups = ParallelDims(dp=2, pp=2).build(rank=ctx.rank, world_size=ctx.world_size,
                                               timeout_s=ctx.timeout_s)
    par = parallelize(GPT(CONFIG, seed=0), pp_groups,
                      pp_groups.dims.config(activation_checkpointing="all"))
    opt = par.build_optimizer(OptimConfig())
    result["pp"] = {"applied": par.applied, "group_ranks": _ranks(par.group),
                    "model": type(par.model).__name__, "stages": par.pipeline.stage_ids,
                    "sync": par.sync, "finish": opt.finish is not None,
                    "params": sorted(par.pipeline.local_shards())}
    # refusals: pp with tp or cp, before the model is touched (no block checkpointed)
    result["refused"] = {}
    for name, (degrees, options, _) in REFUSED.items():
        layout_groups = ParallelDims(**degrees).build(rank=ctx.rank, world_size=ctx.world_size,
                                                      timeout_s=ctx.timeout_s)
        model = GPT(CONFIG, seed=0)
        try:
            parallelize(model, layout_groups,
                        layout_groups.dims.config(**{"activation_checkpointing": "all"} | options))
            message = None
        except ValueError as exc:
            message = str(exc)
        from refimpl.parallel.activation_checkpoint import checkpointed_blocks

        result["refused"][name] = (message, checkpointed_blocks(model))
    try:  # several ranks need their groups, not only the degrees
        parallelize(GPT(CONFIG, seed=0), dims, dims.config())
        result["dims_only"] = None
    except ValueError as exc:
        result["dims_only"] = str(exc)
    # the trainer's setup goes through parallelize on the groups it is given
    from refimpl.train import RunOptions, build_setup

    config = TrainConfig(model=CONFIG, data=DataConfig(seq_len=16, global_batch_size=4))
    result["setup"] = {}
    for stage in (0, 1, 3):
        options = RunOptions(parallel=ParallelConfig(zero_stage=stage))
        setup = build_setup(config, ctx, resolve(config, options, ctx.world_size), groups)
        holder = setup.parallel.sync if stage == 0 else setup.optimizer if stage == 1 else setup.state_module
        result["setup"][stage] = (type(holder).__name__,
                                  holder.group is dp_cp and setup.parallel.group is dp_cp)
    return result


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_each_zero_stage_wraps_the_model_on_the_dp_cp_group(ranks):
    for rank, r in enumerate(ranks):
        for name, case in r["cases"].items():
            assert case["group_is_dp_cp"], (rank, name)  # the very group object of ParallelGroups
            assert case["group_ranks"] == case["dp_cp_ranks"] == tuple(range(WORLD)), (rank, name, case)
        c = r["cases"]
        assert (c["zero0"]["forward"], c["zero0"]["sync"], c["zero0"]["optimizer"]) == (
            "DataParallelBucket", "DataParallelBucket", "AdamW"), c["zero0"]
        for stage in (1, 2):
            case = c["zero1"] if stage == 1 else c["zero2-ac"]
            assert (case["forward"], case["sync"], case["optimizer"], case["zero_stage"]) == (
                "GPT", None, "ShardedOptimizer", stage), case
        for name in ("zero3", "zero3-bf16", "zero3-ac"):
            case = c[name]
            assert (case["forward"], case["state_module"], case["sync"], case["optimizer"]) == (
                "FullyShardedDataParallel", "FullyShardedDataParallel", None, "AdamW"), case


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_trainer_setup_wraps_on_the_groups_it_is_given(ranks):
    for r in ranks:
        assert r["setup"] == {0: ("DataParallelBucket", True), 1: ("ShardedOptimizer", True),
                              3: ("FullyShardedDataParallel", True)}, r["setup"]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_precision_and_checkpointing_come_before_the_wrapper(ranks):
    c = ranks[0]["cases"]
    # ZeRO-3 + bf16: FSDP2's path, the wrapper was handed the policy (gathers bf16, keeps fp32 masters)
    assert c["zero3-bf16"]["fsdp_param_dtype"] == torch.bfloat16 and not c["zero3-bf16"]["own_master"]
    assert c["zero3"]["fsdp_param_dtype"] is None  # control: fp32 does not cast
    assert c["zero3-bf16"]["applied"] == ["mixed precision", "data parallel"]
    # ZeRO-0 + AC + bf16: autocast over fp32 weights; the wrapper holds the checkpointed model itself
    case = c["zero0-ac-bf16"]
    assert case["compute_dtype"] == torch.bfloat16 and not case["own_master"]
    assert case["checkpointed"] == [0, 1] and case["wrapped_is_model"], case
    assert case["applied"] == ["activation checkpointing", "mixed precision", "data parallel"]
    assert c["zero2-ac"]["checkpointed"] == [0] and c["zero0"]["checkpointed"] == []
    # ZeRO-3 + AC: the blocks are checkpointed first, then each becomes a unit of the wrapper
    assert c["zero3-ac"]["checkpointed"] == [0, 1] and c["zero3-ac"]["wrapped_is_model"]
    assert c["zero3-ac"]["applied"] == ["activation checkpointing", "data parallel"]
    for names in (case["applied"], c["zero3-bf16"]["applied"]):
        assert [ORDER.index(n) for n in names] == sorted(ORDER.index(n) for n in names)  # ORDER's order


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_zero0_gradients_are_the_mean_over_the_dp_cp_group(ranks):
    own = ranks[0]["own"]
    mean = sum(g / WORLD for g in own)  # DataParallelBucket: g / W on each rank, then the all-reduce's sum
    sums = [sum(own[i] / WORLD for i in order) for order in itertools.permutations(range(WORLD))]
    spread = max(float((s - mean).norm() / mean.norm()) for s in sums)
    assert spread > 0, "every order of summation gives the same bits: no yardstick"
    for rank, r in enumerate(ranks):
        for g in r["synced"]:
            assert torch.equal(g, r["synced"][0]), rank  # one value on every rank of the group
        err = float((r["synced"][0] - mean).norm() / mean.norm())
        assert err <= FACTOR * spread, (rank, err, spread)
    # Negative control: without the sync the ranks keep their own gradients, far from the mean
    assert not torch.equal(own[0], own[1])
    assert float((own[0] - mean).norm() / mean.norm()) > 1e3 * FACTOR * spread


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_context_parallel_comes_before_the_wrapper_which_reduces_over_dp_x_cp(ranks):
    for rank, r in enumerate(ranks):
        cp = r["cp"]
        assert cp["applied"] == ["context parallel", "data parallel"], cp
        assert cp["group_ranks"] == (0, 1, 2, 3) and cp["forward"] == "DataParallelBucket", cp
        assert cp["cp_ranks"] == ((0, 1) if rank < 2 else (2, 3)), cp  # cp inside dp (tp innermost)
        assert cp["attention"] == "partial", cp  # the blocks' core_attention is ring attention now
        # zig-zag: cp rank i holds chunks i and 3 - i of 4 (of 4 tokens each)
        i = rank % 2
        assert cp["part"] == list(range(4 * i, 4 * i + 4)) + list(range(4 * (3 - i), 4 * (4 - i))), cp


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_pipeline_split_keeps_this_ranks_stages_and_averages_over_dp_once_per_step(ranks):
    for rank, r in enumerate(ranks):
        pp = r["pp"]
        assert pp["applied"] == ["pipeline split", "activation checkpointing", "data parallel"], pp
        assert pp["model"] == "PipelineModule" and pp["sync"] is None and pp["finish"], pp
        dp_ranks = (0, 1) if rank < 2 else (2, 3)  # pp outermost: pp rank = global rank // 2
        assert pp["group_ranks"] == dp_ranks, pp
        assert pp["stages"] == [rank // 2], pp
        # the stage's parameters under the plain GPT's names: embedding with stage 0, head with stage 1
        assert ("embedding.word_embeddings.weight" in pp["params"]) and any(
            n.startswith(f"layers.{rank // 2}.") for n in pp["params"]), pp["params"]
        assert ("final_layernorm.weight" in pp["params"]) == (rank // 2 == 1)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_a_wrapper_on_another_group_fails_the_group_check(ranks):
    for rank, r in enumerate(ranks):
        assert r["other_group_ranks"] == ((0, 1) if rank < 2 else (2, 3))
        assert r["other_group_ranks"] != r["cases"]["zero0"]["dp_cp_ranks"]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(REFUSED))
def test_unbuilt_combinations_are_refused_before_the_model_is_touched(ranks, name):
    for r in ranks:
        message, checkpointed = r["refused"][name]
        assert message is not None and REFUSED[name][2] in message, message
        assert checkpointed == [], "the model was changed before the refusal"
        assert "pass its process groups" in r["dims_only"]


def test_one_process_layout_needs_no_group():
    par = parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1), ParallelConfig(dp=1, precision="bf16"))
    assert par.forward is par.model and par.sync is None and par.group is None
    assert par.applied == ["mixed precision"]
    assert type(par.build_optimizer(OptimConfig()).optimizer).__name__ == "AdamW"
    with pytest.raises(ValueError, match="pass its process groups"):
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=2))
    with pytest.raises(ValueError, match="zero3-reshard"):  # what is not built is named before the groups
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1, pp=2),
                    ParallelConfig(pp=2, zero_stage=3, pp_schedule="zbh1", zero3_reshard_per_microbatch=True))
    with pytest.raises(ValueError, match="pass its process groups"):
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1, cp=2))
    with pytest.raises(ValueError, match="needs tp > 1"):
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1), ParallelConfig(sequence_parallel=True))


@pytest.mark.parametrize("bad, match", [
    (dict(zero_stage=4), "zero_stage must be"),
    (dict(precision="fp4"), "precision must be"),
    (dict(fp8_scaling="blockwise"), "fp8_scaling must be"),
    (dict(bucket_cap_mb=0), "bucket sizes must be positive"),
    (dict(cp_method="striped"), "cp_method must be one of"),
    (dict(cp_method="ulysses", cp_layout="zigzag"), "cp_layout must be"),
    (dict(cp_layout="diagonal"), "cp_layout must be"),
    (dict(pp_schedule="zb1p"), "pp_schedule must be one of"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**bad)


def test_a_config_whose_degrees_are_not_the_layouts_is_refused():
    """parallelize takes one ParallelConfig: its degrees must be the groups' (dp None: any), so a config
    written for one layout cannot silently run on another; what is not built is the support table's
    refusal."""
    with pytest.raises(ValueError, match=r"degrees \{'tp': 2\} are not the layout's"):
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1), ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match="HSDP .* without ZeRO-3"):
        parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=2, dp_replicate=2), ParallelConfig(dp_replicate=2))
    par = parallelize(GPT(CONFIG, seed=0), ParallelDims(dp=1), ParallelConfig(dp=None, zero_stage=1))
    assert par.config.zero_stage == 1


def test_options_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ParallelConfig(1)  # noqa: F841 (positional)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelConfig().zero_stage = 2
