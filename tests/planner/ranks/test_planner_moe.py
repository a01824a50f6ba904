"""The planner's MoE terms against measurements (chapter 09; refimpl/planner/experts.py).

In this process (one rank, ``ep = 1``): every block's saved-for-backward bytes, as
``refimpl.measure.SavedTensorMeter`` measures them in a forward + loss of a small MoE GPT, equal
``refimpl.planner.moe_activation_bytes`` for the per-expert counts that forward produced, to the byte:
GELU and SwiGLU experts, softmax and sigmoid routers, dropless and with a capacity (drops), every block and
every other block MoE, ``_grouped_mm`` and the per-expert loop (odd widths), a checkpointed block, fp32 and
bf16 autocast; and ``refimpl.planner.run_memory_per_rank``'s saved terms equal the meter's total.
Dropless at ``ep = 1`` the bytes depend on the counts only through ``A = k T``, so uniform routing gives them
too; with a capacity the measured drops are what counts.

ONE ``run_ranks`` of 4 ranks trains the MoE GPT (8 experts, top 2) through ``refimpl.train.train`` at
``--dp 4 --ep 2 --zero-stage 2`` (edp 2), fp32 and bf16, 2 steps, and per rank:

* the model state before the second optimizer step (``refimpl.measure.state_bytes``) equals
  ``refimpl.planner.run_memory_per_rank``'s weights, gradients and AdamW state: the two experts of each
  block sharded over edp 2, the dense tensors over dp 4 (ZeRO-1 then holds the reduced gradient shards
  too, ZeRO-2's gradients, reduce-scattered before the loss scaler reads them);
* every block's saved bytes (the meter, second step) equal the planner's for the counts of that forward
  (every ep rank's kept counts, ``refimpl.planner.ExpertLoad.from_counts``);
* the bytes the tracer books for the step's all-to-alls (the counts' exchange and the token all-to-alls on
  the ep group, forward and backward) equal ``refimpl.planner.all_to_all_bytes`` for those counts;

and the same at ``--tp 2 --dp 2 --ep 2 --zero-stage 1`` (the experts whole on both tp ranks, which route
the same tokens; the dense part tensor-parallel). Uniform routing's figure is printed beside the measured.

Negative controls: the expert state sharded over dp x cp instead of edp, or whole (every expert on every
rank: what the grouped experts held before their rows were copied out of the ``[E, ...]`` draw); the dense
block's formula for an MoE block; the rows a rank routes to its own experts counted as sent.
Bytes are exact (no rounding involved): no numerics marker.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from refimpl.comm import CommTracer
from refimpl.config import ConfigError, ModelConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.measure import SavedTensorMeter, state_bytes
from refimpl.models import GPT, lm_loss
from refimpl.models.moe import moe_blocks
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.expert_parallel_gpt import expert_parameter_names
from refimpl.planner import (
    ExpertLoad,
    activation_bytes,
    all_to_all_bytes,
    moe_activation_bytes,
    param_shapes,
    run_memory_of,
    run_memory_per_rank,
    state_memory_per_rank,
    zero_memory,
)
from refimpl.planner.experts import is_expert_tensor
from refimpl.planner.param_table import param_table
from refimpl.train import build_parser, config_from_args, options_from_args, train
from refimpl.train.layout import resolve
from refimpl.train.preflight import MEMORY_ENV, preflight_memory
from tests.support.timeouts import SPAWN_TIMEOUT_S

ONE = ParallelDims(dp=1)
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16, num_experts=4, top_k=2)
CONFIGS = {
    "gelu-softmax": ModelConfig(**BASE),
    "swiglu-sigmoid-every2": ModelConfig(**{**BASE, "num_layers": 3}, moe_every=2, moe_activation="swiglu",
                                         score_func="sigmoid"),
    "capacity-1.0": ModelConfig(**BASE, capacity_factor=1.0, moe_activation="swiglu"),
    "odd-widths-no-aux": ModelConfig(**BASE, moe_ffn_hidden_size=18, aux_loss_coeff=0.0,  # the loop path
                                     moe_activation="swiglu"),
}
B, S = 3, 16


def _loads(model: torch.nn.Module) -> list[ExpertLoad]:
    """Each MoE block's load in the last forward (one rank: what it kept is what its experts computed)."""
    return [ExpertLoad.from_counts([b.moe.kept_per_expert.tolist()], 0) for b in moe_blocks(model)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_block_saved_bytes_equal_the_meter_for_the_forwards_counts(name, precision):
    config = CONFIGS[name]
    model = GPT(config, seed=0)
    checkpointed = (1,) if name == "gelu-softmax" else ()
    apply_activation_checkpointing(model, list(checkpointed))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (B, S), generator=gen), torch.randint(0, 256, (B, S), generator=gen)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    with SavedTensorMeter(model) as meter, torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
        loss = lm_loss(model(x), y)
    loads = _loads(model)
    kw = dict(micro_batch=B, seq_len=S, compute_dtype=dtype, checkpointed_blocks=checkpointed)
    planned = moe_activation_bytes(config, loads=loads, **kw)
    assert planned == meter.report.per_block(), (planned, meter.report.per_block())
    plan = run_memory_per_rank(config, ONE, micro_batch=B, seq_len=S, precision=precision,
                               checkpointed_blocks=checkpointed, expert_loads=loads)
    a = plan.activations
    saved = (a["block activations"] + a["final layernorm + output layer inputs"] + a["log-softmax (fp32)"]
             + a["token ids, labels, positions"])
    assert saved == meter.report.total
    if precision == "bf16" and not checkpointed:  # autocast's 16-bit weight copies: the linears', not the
        # fp32 routers'; the experts' (cast by autocast in their loop, by GroupedExperts for _grouped_mm; a
        # checkpointed block saves no weight in forward)
        assert plan.state["autocast weight copies"] == sum(
            d.get("bfloat16", 0) for d in meter.report.weights.values())
    # negative control: the dense block's formula for an MoE block
    dense = activation_bytes(config, micro_batch=B, seq_len=S, compute_dtype=dtype,
                             checkpointed_blocks=checkpointed)
    assert all(dense[i] != meter.report.block_bytes(i) for i in config.moe_layers if i not in checkpointed)
    uniform = moe_activation_bytes(config, **kw)  # uniform routing: k T / E per expert, capped at C
    if config.capacity_factor is None:  # dropless at ep 1: A = k T whatever the routing
        assert uniform == planned
    else:  # the measured drops count
        dropped = sum(1 for b in moe_blocks(model) if b.moe.dropped_fraction > 0)
        assert dropped and uniform != planned
    loss.backward()  # the graph the meter saw runs


def test_expert_tensors_are_the_models_and_the_state_at_ep1_is_the_replicas():
    config = CONFIGS["gelu-softmax"]
    model = GPT(config, seed=0)
    assert [p.name for p in param_table(config).params if is_expert_tensor(p.name)] == expert_parameter_names(
        model)
    for stage in (0, 1, 2):  # one ep rank holds every expert: the dense planner's state
        plan = run_memory_per_rank(config, ParallelDims(dp=4), micro_batch=1, seq_len=16, zero_stage=stage)
        z = zero_memory(param_shapes(config), 4, stage)
        assert (plan.state["weights"], plan.state["grads"], plan.state["AdamW state"]) == (
            z.weights, z.grads, z.optimizer)


def test_uniform_all_to_all_bytes_are_the_closed_form():
    """2 (ep - 1)/ep k T (4 + q) h + (ep - 1)/ep 8 E per block and forward + backward (module docstring of
    refimpl/planner/experts.py) at ep 2 and 4: the rows go out fp32 and come back in the experts' dtype, the
    compute dtype for the grouped experts (they cast to autocast's dtype themselves: autocast does not cast
    ``_grouped_mm``) and for the loop alike."""
    t = 2 * 16
    for name, dtype, q in (("gelu-softmax", torch.float32, 4), ("gelu-softmax", torch.bfloat16, 2),
                           ("odd-widths-no-aux", torch.bfloat16, 2)):
        config = CONFIGS[name]
        h, e, k = config.hidden_size, config.num_experts, config.top_k
        for ep in (2, 4):
            load = ExpertLoad.uniform(config, t, ep=ep, ep_rank=ep - 1)
            got = sum(all_to_all_bytes(config, load, compute_dtype=dtype).values())
            assert got == 2 * (ep - 1) / ep * k * t * (4 + q) * h + (ep - 1) / ep * 8 * e, (name, dtype, ep)
        assert all_to_all_bytes(config, ExpertLoad.uniform(config, t)) == {}  # ep 1: nothing leaves


def test_what_the_planner_does_not_model_is_refused_in_one_line():
    config = CONFIGS["gelu-softmax"]
    for dims, kw in ((ParallelDims(dp=2, pp=2), {}), (ParallelDims(dp=1), {"precision": "fp8"}),
                     (ParallelDims(dp=2, cp=2), {}), (ParallelDims(dp=2, tp=2), {"sequence_parallel": True})):
        with pytest.raises(ConfigError, match="the planner models MoE blocks at pp = 1"):
            run_memory_per_rank(config, dims, micro_batch=1, seq_len=16, **kw)
    shared = dataclasses.replace(config, moe_shared_experts=1)  # DeepSeekMoE's: saved tensors not counted
    with pytest.raises(ConfigError, match="not shared experts"):
        run_memory_per_rank(shared, ParallelDims(dp=1), micro_batch=1, seq_len=16)


def test_the_memory_preflight_checks_an_moe_run(corpus, monkeypatch):
    """The trainer's preflight plans an MoE run (uniform routing) and refuses it where it does not fit; fp8
    with MoE blocks is not planned (a note, no estimate)."""
    args = _args(corpus, Path("unused"), "dp4-ep2-zero2")
    config, options = config_from_args(args), options_from_args(args)
    need = run_memory_of(config.model, options.parallel, world_size=WORLD, micro_batch=2, seq_len=16)
    monkeypatch.setenv(MEMORY_ENV, str(WORLD * need.total))
    assert preflight_memory(config, resolve(config, options, WORLD), ranks_per_node=WORLD) == need
    monkeypatch.setenv(MEMORY_ENV, str(WORLD * need.total - WORLD))
    with pytest.raises(ConfigError, match="the run needs about"):
        preflight_memory(config, resolve(config, options, WORLD), ranks_per_node=WORLD)
    fp8 = dataclasses.replace(options, parallel=dataclasses.replace(options.parallel, precision="fp8"))
    assert preflight_memory(config, resolve(config, fp8, WORLD), ranks_per_node=WORLD) is None


# ---- the trainer: dp 4 x ep 2 (edp 2) at ZeRO-2 in fp32 and bf16, tp 2 x dp 2 x ep 2 at ZeRO-1 -------------

WORLD = 4
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--steps", "2", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "100",
        "--checkpoint-every", "0", "--no-report", "--moe-experts", "8", "--moe-top-k", "2",
        "--moe-aux-loss-coeff", "0.1",
        "--ep", "2"]
RUNS = {  # name -> the trainer's flags at world size 4
    "dp4-ep2-zero2": ["--zero-stage", "2"],
    "dp4-ep2-zero2-bf16": ["--zero-stage", "2", "--precision", "bf16"],
    "tp2-dp2-ep2-zero1": ["--tp", "2", "--zero-stage", "1"],
    "dp4-ep2-zero3": ["--zero-stage", "3"],  # each block's experts a unit of their own over edp 2
}


def _args(corpus: dict, root: Path, name: str):
    return build_parser().parse_args([*TINY, *RUNS[name], "--data", str(corpus["corpus"]), "--cache-dir",
                                      str(corpus["cache"]), "--out", str(root / name)])


@dataclasses.dataclass(kw_only=True)
class _MoEProbe:
    """The trainer's hooks (refimpl/train/hooks.py) at its second step: the saved bytes per block and the
    MoE blocks' kept counts once the forward is done, the state before the optimizer step, the all-to-alls'
    booked bytes over the step."""

    seen: dict = dataclasses.field(default_factory=dict)
    _meter: SavedTensorMeter | None = None

    @contextmanager
    def around_step(self, step: int, setup):
        if step != 1:
            yield
            return
        with SavedTensorMeter(setup.model) as self._meter, CommTracer() as tracer:
            yield
        self.seen["all_to_all"] = tracer.bytes_sent(op="all_to_all")
        self.seen["group_sizes"] = sorted({e.group_size for e in tracer.select(op="all_to_all")})
        self._meter = None

    def after_first_loss(self, step: int, setup, loss) -> None:
        if self._meter is not None:
            self.seen["per_block"] = self._meter.report.per_block()
            self.seen["kept"] = [b.moe.kept_per_expert.tolist() for b in moe_blocks(setup.model)]

    def before_optimizer_step(self, step: int, setup) -> None:
        if self._meter is not None:
            st = state_bytes(setup.model, setup.optimizer)
            self.seen["state"] = (st.weights, st.grads, st.optimizer)


def _worker(ctx, corpus: dict, root: str) -> dict:
    out = {}
    for name in RUNS:
        args = _args(corpus, Path(root), name)
        probe = _MoEProbe()
        options = dataclasses.replace(options_from_args(args), checkpoint=None)  # no save at the end
        train(config_from_args(args), ctx, options, hooks=probe)
        out[name] = probe.seen
    return out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("planner_moe")
    return run_ranks(_worker, WORLD, corpus, str(root), timeout_s=SPAWN_TIMEOUT_S)


def _run(corpus: dict, name: str) -> tuple[ModelConfig, ParallelDims, str, int]:
    """The run's model, layout, precision and micro-batch (the per-rank batch: one micro-batch)."""
    args = _args(corpus, Path("unused"), name)
    options = options_from_args(args)
    dims = options.parallel_dims(WORLD)
    return config_from_args(args).model, dims, options.parallel.precision, 8 // dims.dp


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_state_per_rank_is_the_experts_over_edp_and_the_rest_over_dp(runs, corpus, name):
    config, dims, precision, micro = _run(corpus, name)
    zero = options_from_args(_args(corpus, Path("unused"), name)).parallel.zero_stage
    table = param_table(config, tp=dims.tp)
    dense = [p.shape for p in table.params if not is_expert_tensor(p.name)]
    experts = [p.shape for p in table.params if is_expert_tensor(p.name)]
    local = [(s[0] // dims.ep, *s[1:]) for s in experts]
    plan = run_memory_per_rank(config, dims, micro_batch=micro, seq_len=16, zero_stage=zero,
                               precision=precision)
    # ZeRO-1 at the step holds its full gradients and the reduced shards (ZeRO-2's gradients) beside them
    def shards(dp_rank: int) -> int:
        return state_memory_per_rank(config, dims, zero_stage=2, dp_rank=dp_rank).grads if zero == 1 else 0

    terms = (plan.state["weights"], plan.state["grads"] + shards(0), plan.state["AdamW state"])
    assert runs[0][name]["state"] == terms  # rank 0: the planner's rank
    n = dims.dp * dims.cp
    for rank, out in enumerate(runs):
        got, dp_rank = out[name]["state"], rank // dims.tp  # tp innermost: the rank in the dp x cp view
        st = state_memory_per_rank(config, dims, zero_stage=zero, dp_rank=dp_rank)
        assert got == (st.weights, st.grads + shards(dp_rank), st.optimizer), (rank, got, st)
        # negative controls: the experts sharded over dp x cp instead of edp, or whole on every rank
        for shapes, over, r in ((local, n, dp_rank), (experts, n // dims.ep, dp_rank // dims.ep)):
            a, b = zero_memory(dense, n, zero, rank=dp_rank), zero_memory(shapes, over, zero, rank=r)
            assert got != (a.weights + b.weights, a.grads + b.grads, a.optimizer + b.optimizer), (rank, over)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_saved_bytes_and_all_to_all_bytes_equal_the_planner_for_the_measured_counts(runs, corpus,
                                                                                           name):
    config, dims, precision, micro = _run(corpus, name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    kw = dict(micro_batch=micro, seq_len=16, compute_dtype=dtype, tp=dims.tp)
    for rank, out in enumerate(runs):
        seen, dp_rank, tp_rank = out[name], rank // dims.tp, rank % dims.tp
        first = dp_rank // dims.ep * dims.ep  # the ep group: ep consecutive ranks of the dp x cp view
        members = [(first + j) * dims.tp + tp_rank for j in range(dims.ep)]  # global ranks, same tp rank
        kept = [[runs[q][name]["kept"][i] for q in members] for i in range(len(config.moe_layers))]
        loads = [ExpertLoad.from_counts(k, dp_rank % dims.ep) for k in kept]
        planned = moe_activation_bytes(config, ep=dims.ep, loads=loads, **kw)
        assert planned == seen["per_block"], (rank, planned, seen["per_block"])
        sent = sum(sum(all_to_all_bytes(config, load, compute_dtype=dtype).values()) for load in loads)
        assert seen["group_sizes"] == [dims.ep] and sent == seen["all_to_all"], (rank, sent, seen)
        # negative controls: the dense formula for the MoE blocks; the rows a rank routes to its own experts
        # counted as sent (they are copied locally by the all-to-all, not put on the wire)
        assert activation_bytes(config, **kw) != seen["per_block"]
        q = dtype.itemsize  # the rows go out fp32 and come back in the experts' compute dtype
        home = sum(2 * load.to_self * (4 + q) * config.hidden_size for load in loads)  # out and back
        assert home > 0 and sent + home != seen["all_to_all"]
        uniform = ExpertLoad.uniform(config, micro * 16, ep=dims.ep, ep_rank=dp_rank % dims.ep)
        even = len(loads) * sum(all_to_all_bytes(config, uniform, compute_dtype=dtype).values())
        if rank == 0:
            print(f"{name} rank 0: saved per block {seen['per_block']} (planner {planned}); all-to-all "
                  f"bytes {seen['all_to_all']:.0f} (planner {sent:.0f}, uniform routing {even:.0f}); kept "
                  f"rows per block {[load.sent for load in loads]}, home {[load.to_self for load in loads]}, "
                  f"computed {[load.computed for load in loads]}")
