"""The planner under context parallelism (chapter 07) against measurements of the context-parallel GPT.

At cp 2 and 4 (ring attention, zig-zag and contiguous, and Ulysses) and at tp 2 x cp 2 (with and without
sequence parallelism), in float32, under bfloat16 autocast and with bfloat16 weights, on every rank of
``refimpl.parallel.context_parallel.apply_context_parallel``'s GPT fed its ``s/cp`` tokens:

* the bytes each block saves for backward (and a checkpointed block's) and what the model saves outside the
  blocks, as ``refimpl.measure.SavedTensorMeter`` measures them, equal
  ``refimpl.planner.activation_bytes`` / ``refimpl.planner.outside_block_bytes`` and
  ``refimpl.planner.run_memory_per_rank``'s terms to the byte (the terms and their reasons:
  ``refimpl.planner.activations``);
* the bytes one rank sends per layer, forward and backward, equal
  ``refimpl.planner.context_parallel_bytes`` x layers: the ring's ``isend`` bytes measured by
  ``refimpl.comm.CommTracer``; Ulysses' all-to-alls by the tracer's ring model ``(n-1)/n`` of each
  measured payload, exact for an equal-split all-to-all (a rank keeps the one of its ``n`` equal blocks
  addressed to itself and sends the others), the payloads and the count (4 per layer each way) measured;
* the trainer's preflight (``refimpl.train.preflight.preflight_memory``) on ``--cp`` runs equals what
  its own setup saves, and the model state it holds after a step under ZeRO 0-3 over ``dp x cp`` equals
  ``refimpl.planner.state_memory_per_rank`` (sharded over ``dp * cp``, not ``dp``);
* negative controls: SDPA's terms at ``s/cp`` tokens are not the ring's (nor Ulysses') measured bytes,
  the ring's ``cp`` blocks instead of ``cp - 1`` and a backward without dK/dV are not its traffic, ZeRO
  over ``dp`` alone is not the state held; and the refusals (sizes the split cannot take).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer
from refimpl.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.measure import OUTSIDE, SavedTensorMeter, measure_saved_activations, state_bytes
from refimpl.models import GPT, lm_loss
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.context_parallel import apply_context_parallel, split_for_context_parallel
from refimpl.parallel.tensor_parallel import apply_tensor_parallel, tp_lm_loss
from refimpl.planner import (
    activation_bytes,
    activation_bytes_per_layer,
    context_parallel_bytes,
    context_parallel_degree,
    outside_block_bytes,
    run_memory_per_rank,
    state_memory_per_rank,
)
from refimpl.train import RunOptions, build_setup
from refimpl.train.layout import resolve
from refimpl.train.preflight import preflight_memory
from refimpl.train.step import StepPoints, train_step
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S = 3, 16  # S cuts into 2 cp = 8 zig-zag chunks at cp 4; s/cp = 8 divides by tp 2 (SP)
CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=S, ffn_hidden_size=48,
                  vocab_size=254)  # 254: the padded vocab-parallel shard under tp 2 (ceil(V/t))
CFG_DIVIDES = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=S,
                          ffn_hidden_size=48)
# name: (compute dtype, residual dtype, autocast)
PRECISIONS = {"fp32": (torch.float32, torch.float32, False),
              "bf16 autocast": (torch.bfloat16, torch.float32, True),
              "bf16 weights": (torch.bfloat16, torch.bfloat16, False)}
METHODS = [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", None)]
CHECKPOINTED = (1,)


def _data(cp_group, method: str, layout: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, CFG.vocab_size, (B, S), generator=g) for _ in range(2))
    return tuple(split_for_context_parallel(t, cp_group=cp_group, method=method, layout=layout)
                 for t in (x, y))


def _model(cp_group, tp_group, *, method: str, layout: str | None, sp: bool, precision: str,
           checkpointed: tuple[int, ...] = ()):
    model = GPT(CFG, seed=1)
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group=tp_group, sequence_parallel=sp, pad_vocab=True)
    apply_context_parallel(model, cp_group=cp_group, method=method, layout=layout)
    apply_activation_checkpointing(model, list(checkpointed))
    x, y = _data(cp_group, method, layout)
    autocast = PRECISIONS[precision][2]

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        if tp_group is None:
            return lm_loss(logits, y)
        return tp_lm_loss(logits, y, tp_group=tp_group, vocab_size=CFG.vocab_size)

    return model, forward


def _run(cp_group, tp_group, **case) -> dict:
    """One forward, measured (saved tensors), then backward: the ring's isends and Ulysses' all-to-alls of
    each (tracer steps 0 and 1; not with a checkpointed block, whose backward runs its forward again)."""
    model, forward = _model(cp_group, tp_group, **case)
    with CommTracer() as tracer:
        with SavedTensorMeter(model) as meter:
            loss = forward()
        tracer.step()
        loss.backward()
    report = meter.report
    out = {"per_block": report.per_block(), "outside": sum(report.activations.get(OUTSIDE, {}).values())}
    for step, name in () if case["checkpointed"] else ((0, "forward"), (1, "backward")):
        sends, a2a = tracer.select(op="isend", step=step), tracer.select(op="all_to_all", step=step)
        out[name] = {"isend": tracer.measured_bytes_sent(step=step, op="isend"),
                     "isend payloads": sorted({e.nbytes for e in sends}),
                     "all_to_all": sum(e.wire_bytes for e in a2a), "all_to_all count": len(a2a),
                     "all_to_all payloads": sorted({e.nbytes for e in a2a}),
                     "all_to_all sizes": sorted({e.group_size for e in a2a})}
    return out


TRAINER_RUNS = {  # world size: the trainer's options whose preflight plan the rank's measurements must equal
    2: [{"cp": 2, "cp_method": "ring", "precision": "bf16", "zero_stage": 2, "activation_checkpointing": "1"},
        {"cp": 2, "cp_method": "ulysses", "zero_stage": 3}],
    4: [{"dp": 2, "cp": 2, "cp_method": "ring", "precision": "bf16", "zero_stage": 1},
        {"dp": 2, "cp": 2, "cp_method": "ring", "zero_stage": 3},
        {"tp": 2, "cp": 2, "cp_method": "ulysses", "precision": "bf16", "sequence_parallel": True}],
}


def _train_config(dims: ParallelDims) -> TrainConfig:
    return TrainConfig(model=CFG_DIVIDES, data=DataConfig(seq_len=S, global_batch_size=B * dims.dp),
                       optim=OptimConfig(grad_clip=1.0))


def _trainer_run(ctx, options: dict) -> dict:
    """The trainer's own setup (``refimpl.train.build_setup``) on ``options``: the activations one
    forward of the rank's part of a batch saves, and the state held before the second step's update.

    The activations of a ZeRO-3 run are measured on its ZeRO-2 twin (the same saved tensors): on ZeRO-3
    itself ``SavedTensorMeter`` miscounts both ways. It de-duplicates by address, and ZeRO-3 frees each
    gathered weight with ``untyped_storage().resize_(0)``, so activations allocated at a freed address are
    skipped; and the gathered LayerNorm weights are not the module's parameters (those are the shards), so
    they count as activations (found: keyed by storage instead of address, the meter reads 4 x 128 bytes
    more per block, the two LayerNorms' weights and biases, and 256 outside, the final one's)."""
    run = RunOptions(parallel=ParallelConfig(**options))
    dims = run.parallel_dims(ctx.world_size)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    config = _train_config(dims)
    g = torch.Generator().manual_seed(dims.coordinates(ctx.rank).dp)
    ids = torch.randint(0, 256, (B, S + 1), generator=g)
    twin = RunOptions(parallel=ParallelConfig(**{**options, "zero_stage": min(run.parallel.zero_stage, 2)}))
    setup = build_setup(config, ctx, resolve(config, twin, ctx.world_size), groups)
    x, y = setup.parallel.split_batch(ids[:, :-1]), setup.parallel.split_batch(ids[:, 1:])

    def forward() -> torch.Tensor:
        with setup.mp.autocast():
            logits = setup.forward(x)
        return setup.parallel.loss(logits, y)

    report = measure_saved_activations(setup.model, forward)
    layout = resolve(config, run, ctx.world_size)
    setup = build_setup(config, ctx, layout, groups)  # a fresh one for the steps
    held = []
    for _ in range(2):
        def measure() -> None:
            held.append(state_bytes(setup.state_module, setup.optimizer))

        train_step(setup, x, y, accumulation=1, micro=B, grad_clip=1.0,  # as the loop
                   points=StepPoints(before_optimizer_step=measure))
    return {"blocks": sum(report.per_block()), "outside": sum(report.activations.get(OUTSIDE, {}).values()),
            "state": (held[-1].weights, held[-1].grads, held[-1].optimizer)}


def _worker(ctx) -> dict:
    world = dist.group.WORLD
    out: dict = {"runs": {}}
    layouts = [(ctx.world_size, 1, world, None)]  # (cp, tp, cp group, tp group)
    if ctx.world_size == 4:
        groups = ParallelDims(dp=1, cp=2, tp=2).build(rank=ctx.rank, world_size=4, timeout_s=ctx.timeout_s)
        layouts.append((2, 2, groups.group("cp"), groups.group("tp")))
    for cp, tp, cp_group, tp_group in layouts:
        for method, layout in METHODS:
            for precision in PRECISIONS:
                contiguous = layout == "contiguous" and (precision != "fp32" or tp > 1)
                if contiguous or (tp > 1 and precision == "bf16 weights"):
                    continue  # the contiguous split saves and sends what the zig-zag does: fp32 shows it
                for sp in (False, True) if tp > 1 else (False,):
                    case = {"method": method, "layout": layout, "sp": sp, "precision": precision}
                    for ckpt in ((), CHECKPOINTED):
                        out["runs"][cp, tp, method, layout, sp, precision, ckpt] = _run(
                            cp_group, tp_group, checkpointed=ckpt, **case)
    out["trainer"] = [_trainer_run(ctx, options) for options in TRAINER_RUNS[ctx.world_size]]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request) -> list[dict]:
    return run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


def _planned(cp: int, tp: int, method: str, layout: str | None, sp: bool, precision: str,
             ckpt: tuple[int, ...] = ()) -> tuple[list[int], int]:
    compute, residual, _ = PRECISIONS[precision]
    kw = {"micro_batch": B, "seq_len": S, "compute_dtype": compute, "tp": tp, "sequence_parallel": sp,
          "cp": cp, "cp_method": method, "cp_layout": layout}
    blocks = activation_bytes(CFG, residual_dtype=residual, checkpointed_blocks=ckpt, **kw)
    return blocks, sum(outside_block_bytes(CFG, **kw).values())


def _outside(plan) -> int:
    """A plan's saved bytes outside the blocks: its activation terms but the blocks' and the transient."""
    inside = ("block activations", "recomputed block (backward)", "logits + their gradient (transient)")
    return sum(v for k, v in plan.activations.items() if k not in inside)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_activation_bytes_per_rank_equal_the_measured_ones(ranks):
    for rank, r in enumerate(ranks):
        for (cp, tp, method, layout, sp, precision, ckpt), got in r["runs"].items():
            where = (rank, cp, tp, method, layout, sp, precision, ckpt)
            blocks, outside = _planned(cp, tp, method, layout, sp, precision, ckpt)
            assert got["per_block"] == blocks, where
            if precision != "bf16 weights":  # outside_block_bytes counts a float32 residual stream
                assert got["outside"] == outside, where
                plan = run_memory_per_rank(CFG, ParallelDims(dp=1, cp=cp, tp=tp), micro_batch=B, seq_len=S,
                                           precision="fp32" if precision == "fp32" else "bf16",
                                           checkpointed_blocks=ckpt, sequence_parallel=sp, cp_method=method,
                                           cp_layout=layout)
                assert plan.activations["block activations"] == sum(got["per_block"]), where
                assert _outside(plan) == got["outside"], where
            if ckpt:
                continue
            # negative control: SDPA's terms at the rank's s/cp tokens are not what the rank saves (the ring
            # keeps its own output and log-sum-exp beside the projection's input; Ulysses' output comes back
            # through an all-to-all, a copy)
            compute, residual, _ = PRECISIONS[precision]
            sdpa = activation_bytes(CFG, micro_batch=B, seq_len=S // cp, compute_dtype=compute,
                                    residual_dtype=residual, tp=tp, sequence_parallel=sp)
            assert got["per_block"] != sdpa, where
            assert got["per_block"] != _planned(1, tp, "ring", None, sp, precision)[0], where  # nor s tokens


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_bytes_sent_per_layer_equal_the_traced_ones(ranks):
    L = CFG.num_layers  # noqa: N806
    for rank, r in enumerate(ranks):
        for (cp, tp, method, layout, sp, precision, ckpt), got in r["runs"].items():
            if ckpt:
                continue
            where = (rank, cp, tp, method, layout, sp, precision)
            compute = PRECISIONS[precision][0]
            plan = context_parallel_bytes(CFG, micro_batch=B, seq_len=S, cp=cp, method=method, tp=tp,
                                          compute_dtype=compute)
            p = torch.empty((), dtype=compute).element_size()
            x = B * (CFG.num_attention_heads // tp) * (S // cp) * CFG.head_dim  # one rank's q, k or v
            for direction in ("forward", "backward"):
                traced = got[direction]
                if method == "ring":
                    assert traced["isend"] == L * plan[direction], (where, direction, traced)
                    assert traced["all_to_all count"] == 0, where
                else:
                    assert traced["isend"] == 0, where
                    assert traced["all_to_all"] == L * plan[direction], (where, direction, traced)
                    # what the model is applied to, measured: 4 per layer, each of the local tensor
                    assert traced["all_to_all count"] == 4 * L, where
                    assert traced["all_to_all payloads"] == [p * x] and traced["all_to_all sizes"] == [cp]
            if method == "ring":  # each isend one K or V block, or (backward) one dK/dV block
                assert got["forward"]["isend payloads"] == [p * x], where
                assert got["backward"]["isend payloads"] == sorted({p * x, 4 * x}), where  # dK/dV float32
                # negative controls: cp blocks (the whole sequence), or a backward without dK/dV
                assert got["forward"]["isend"] != L * 2 * cp * p * x, where
                assert got["backward"]["isend"] != L * plan["forward"], where
                if compute != torch.float32:  # the dK/dV dtype: measured, and it matters
                    assert got["backward"]["isend"] != L * 4 * (cp - 1) * p * x, where


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_the_trainers_preflight_plans_what_its_cp_ranks_hold(ranks):
    """The trainer's memory preflight (``refimpl.train.preflight.preflight_memory``) on a ``--cp`` run
    gives, per rank, what the trainer's own setup saves and holds: block activations and what is saved
    outside the blocks (one forward of the rank's ``s/cp`` tokens, measured), and weights, gradients and
    AdamW state after a step (ZeRO over dp x cp, measured)."""
    world = len(ranks)
    for i, options in enumerate(TRAINER_RUNS[world]):
        run = RunOptions(parallel=ParallelConfig(**options))
        dims, stage = run.parallel_dims(world), run.parallel.zero_stage
        config = _train_config(dims)
        plan = preflight_memory(config, resolve(config, run, world), ranks_per_node=world)
        planned = (plan.activations["block activations"], _outside(plan))
        for rank, r in enumerate(ranks):
            got = r["trainer"][i]
            assert (got["blocks"], got["outside"]) == planned, (rank, options)
            index = dims.coordinates(rank).dp * dims.cp + dims.coordinates(rank).cp
            state = state_memory_per_rank(CFG_DIVIDES, dims, zero_stage=stage, dp_rank=index)
            # ZeRO-1 before its step holds the reduced gradient shards (ZeRO-2's gradients) beside the full
            shards = (state_memory_per_rank(CFG_DIVIDES, dims, zero_stage=2, dp_rank=index).grads
                      if stage == 1 else 0)
            assert got["state"] == (state.weights, state.grads + shards, state.optimizer), (rank, options)
            if stage:  # negative control: ZeRO over dp alone holds more
                alone = state_memory_per_rank(CFG_DIVIDES, ParallelDims(dp=dims.dp, tp=dims.tp),
                                              zero_stage=stage, dp_rank=dims.coordinates(rank).dp)
                assert got["state"] != (alone.weights, alone.grads, alone.optimizer), (rank, options)
            if index == 0:  # the preflight plans the first rank of the group (the largest ZeRO shard)
                assert got["state"] == (plan.state["weights"], plan.state["grads"] + shards,
                                        plan.state["AdamW state"])


def test_sizes_the_split_cannot_take_are_refused():
    """One-line ValueErrors: the ring's zig-zag needs 2 cp chunks, contiguous and Ulysses cp parts, Ulysses
    whole heads per rank (a/t divisible by cp), SP the s/cp tokens divisible by tp."""
    kw = {"micro_batch": 1}
    cases = [({"seq_len": 12, "cp": 4}, "does not divide by 8"),
             ({"seq_len": 10, "cp": 4, "cp_layout": "contiguous"}, "does not divide by 4"),
             ({"seq_len": 16, "cp": 8, "cp_method": "ulysses"}, "4 heads per tensor-parallel rank"),
             ({"seq_len": 16, "cp": 4, "tp": 2, "cp_method": "ulysses"}, "2 heads per tensor-parallel"),
             ({"seq_len": 16, "cp": 8, "tp": 4, "sequence_parallel": True}, "the 2 tokens of each rank"),
             ({"seq_len": 16, "cp": 2, "cp_method": "ulysses", "cp_layout": "zigzag"}, "not a layout"),
             ({"seq_len": 16, "cp": 2, "cp_method": "all-gather"}, "cp_method must be one of"),
             ({"seq_len": 16, "cp": 0}, "cp must be a positive integer")]
    for extra, message in cases:
        for fn in (activation_bytes, outside_block_bytes):
            with pytest.raises(ValueError, match=message) as e:
                fn(CFG, **kw, **extra)
            assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not divide by 8"):
        context_parallel_bytes(CFG, micro_batch=1, seq_len=12, cp=4, method="ring")
    with pytest.raises(ValueError, match="method must be one of"):
        context_parallel_bytes(CFG, micro_batch=1, seq_len=16, cp=2, method="allgather")
    assert context_parallel_bytes(CFG, micro_batch=1, seq_len=16, cp=1, method="ring") == {
        "forward": 0, "backward": 0}
    assert context_parallel_degree(ParallelDims(dp=2, cp=4)) == 4


def test_formula_terms_under_cp():
    """The module docstring's 16-bit forms under autocast (p = 2, q = r = 4, f = 4h, no SP) at s_c = s/cp
    tokens: ring ``s_c bh (12 + 28/t) + 16 s_c b + 4 a s_c b/t``, Ulysses ``(12 + 26/t)`` with the same
    ``4 a s_c b/t``."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, max_seq_len=128)
    s, b, h, a = 128, 2, 64, 8
    for t in (1, 2):
        for cp in (2, 4):
            c = s // cp
            kw = {"micro_batch": b, "seq_len": s, "compute_dtype": torch.bfloat16, "tp": t, "cp": cp}
            ring = activation_bytes_per_layer(cfg, cp_method="ring", **kw).total
            ulysses = activation_bytes_per_layer(cfg, cp_method="ulysses", **kw).total
            assert ring == c * b * h * (12 * t + 28) // t + 16 * c * b + 4 * a * c * b // t, (t, cp)
            assert ulysses == c * b * h * (12 * t + 26) // t + 16 * c * b + 4 * a * c * b // t, (t, cp)
