"""The GPT with mixture-of-experts blocks (chapter 09), in one process: the configuration, the model, its
balance loss and its scale, the per-step figures and the bias update, the planner's counts, the refusals.

* **Dense is unchanged**: a configuration without experts has no MoE field in ``to_dict`` and builds the
  same modules and parameter names as before (the bitwise equality of its weights is
  tests/unit/models/test_model.py's and every trainer test's).
* **MoE builds** from the config: blocks ``0, N, 2N, ...`` get a router ``[E, h]`` and grouped experts
  ``[E, h, f]``; the parameter count (total and active) equals the model's, the matmul FLOPs per token a
  FLOP counter's (float64, where the experts run as plain matmuls), the TP plan keeps the experts whole.
* **The balance loss** is DeepSeek-V3's sequence-wise one: for one sequence it is Switch's loss of the
  layer (bit for bit against ``load_balancing_loss``), a uniform router gives ``alpha``, and it is the
  mean of the per-sequence losses. **Its scale**: the loss of a model is the LM loss plus the blocks' balance
  losses, and the trainer's step over 4 micro-batches hands the optimizer the gradient of the whole batch
  at once (every parameter within 1e-5 of its largest element; measured 5e-7); negative control: the
  balance loss not divided by the micro-batches (or computed per micro-batch, Switch's way) moves the
  router's gradient by far more.
* **Top-1 learns**: at ``k = 1`` the combine weight is the raw probability (Switch), so the
  router's gradient from the task alone is of the order of ``k = 2``'s; always renormalised (the old
  default, the negative control) it is ~0. ``--moe-top-k 1`` reaches the router so and trains.
* **Figures and bias**: the step's tokens per expert (mean ``k T / E``), the dropped fraction under
  capacity (the layer's own figure), DeepSeek-V3's bias step ``u sign(mean - load)``, and a one-device
  trainer run writes them to metrics.jsonl.
* **Host syncs**: a micro-batch (forward, loss, ``record_micro_batch``, backward) reads the device on
  the host once per MoE block (the layer's counts; ``HostSyncCounter``), twice under activation
  checkpointing (the recomputed forward reads them again). Before: 12 per block and micro-batch (the
  layer's 10 reads and its offsets' host copy, and the per-step counters' ``.cpu()`` and ``float()`` in
  ``record_micro_batch``); the counters now stay on the device until ``finish_step``.
* **Refusals**: each MoE row of the support table refuses its case and lets the nearest neighbour through;
  the trainer refuses bad flags in one line with exit status 2; the planner plans MoE memory, refuses MoE run
  predictions.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from refimpl.config import ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from refimpl.distributed import ParallelDims
from refimpl.distributed.host_syncs import HostSyncCounter
from refimpl.distributed.placement import Box
from refimpl.models import GPT, MLP, lm_loss
from refimpl.models.moe import MoEMLP, moe_aux_loss, moe_blocks, sequence_balance_loss
from refimpl.moe_balance import ExpertLoad, finish_step, record_micro_batch
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.expert_parallel import load_balancing_loss
from refimpl.parallel.parallelize import parallelize
from refimpl.parallel.placements import HeldGradient, Placement, clip_grad_norm_
from refimpl.planner import flops_per_token, param_count
from refimpl.planner.param_table import param_table
from refimpl.support import MOE_SUPPORT_TABLE, check_supported, refusals

DENSE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=16)
MOE = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, max_seq_len=16, num_experts=4,
                  top_k=2, moe_every=2, aux_loss_coeff=0.1)
CPU = torch.device("cpu")


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(seed))


def test_a_dense_config_is_what_it_was():
    before = ["vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_seq_len", "tie_word_embeddings", "layernorm_eps"]
    assert list(DENSE.to_dict()) == before
    assert list(TrainConfig(model=DENSE, data=DataConfig(seq_len=16)).to_dict()["model"]) == before
    model = GPT(DENSE)
    assert moe_blocks(model) == [] and all(isinstance(b.mlp, MLP) for b in model.layers)
    assert [n for n, _ in model.layers[0].named_parameters()] == [
        "input_layernorm.weight", "input_layernorm.bias", "self_attention.query_key_value.weight",
        "self_attention.query_key_value.bias", "self_attention.dense.weight", "self_attention.dense.bias",
        "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight",
        "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"]
    assert moe_aux_loss(model) is None and record_micro_batch(model) is None
    assert finish_step(model, None, micro_batches=1, device=CPU) is None
    assert param_count(DENSE).active == param_count(DENSE).total and param_count(DENSE).inactive == 0


def test_an_moe_config_builds_its_blocks_and_the_planner_counts_them():
    model = GPT(MOE, seed=1)
    assert MOE.moe_layers == [0, 2]
    assert [isinstance(b.mlp, MoEMLP) for b in model.layers] == [True, False, True]
    shapes = {n: tuple(p.shape) for n, p in model.layers[0].mlp.named_parameters()}
    assert shapes == {"moe.router.gate.weight": (4, 32), "moe.experts.w1": (4, 32, 128),
                      "moe.experts.w2": (4, 128, 32)}
    count = param_count(MOE)
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.inactive == 2 * (4 - 2) * 2 * 32 * 128 and count.active == count.total - count.inactive
    swiglu = ModelConfig(**{**MOE.to_dict(), "moe_activation": "swiglu", "moe_ffn_hidden_size": 40,
                            "tie_word_embeddings": False})
    assert param_count(swiglu).total == sum(p.numel() for p in GPT(swiglu).parameters())
    # the residual projection of each expert is drawn with GPT-2's 1/sqrt(2L) scale, the others with 0.02
    assert model.layers[0].mlp.moe.experts.w2.std() < 0.7 * model.layers[0].mlp.moe.experts.w1.std()
    # the TP plan: the dense blocks split, the experts and routers whole on every tp rank
    table = {p.name: p.shape for p in param_table(MOE, tp=2).params}
    assert table["layers.1.mlp.dense_h_to_4h.weight"] == (64, 32)
    assert table["layers.0.mlp.moe.experts.w1"] == (4, 32, 128)
    assert table["layers.2.mlp.moe.router.gate.weight"] == (4, 32)


def test_flops_per_token_counts_the_active_experts_like_a_flop_counter():
    """float64: the experts run their per-expert loop of plain matmuls, which the counter sees (it has no
    formula for ``_grouped_mm``); dropless top-k: every token through exactly k experts."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(MOE, seed=2).double()
    ids = _ids(2, 16)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    assert counter.get_total_flops() == flops_per_token(MOE, 16, matmul_only=True) * 2 * 16
    dense_equivalent = ModelConfig(**{**MOE.to_dict(), "num_experts": 0})
    assert flops_per_token(MOE, 16) > flops_per_token(dense_equivalent, 16)  # k = 2 experts and a router


def test_the_sequence_balance_loss_is_switchs_per_sequence():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3 * 5, 4, generator=gen).softmax(-1)
    ids = torch.topk(scores, 2, dim=-1).indices
    one = sequence_balance_loss(scores[:5], ids[:5], sequences=1, coeff=0.1, score_func="softmax")
    assert torch.equal(one, load_balancing_loss(scores[:5], ids[:5], 0.1, "softmax"))
    per = [load_balancing_loss(scores[5 * b:5 * b + 5], ids[5 * b:5 * b + 5], 0.1, "softmax")
           for b in range(3)]
    mean = sequence_balance_loss(scores, ids, sequences=3, coeff=0.1, score_func="softmax")
    assert torch.allclose(mean, torch.stack(per).mean(), rtol=1e-6, atol=0)
    assert not torch.allclose(mean, load_balancing_loss(scores, ids, 0.1, "softmax"), rtol=1e-4)  # per batch
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    even = sequence_balance_loss(uniform, balanced, sequences=2, coeff=0.1, score_func="softmax")
    assert torch.allclose(even, torch.tensor(0.1))
    sig = torch.rand(10, 4, generator=gen)
    assert torch.allclose(sequence_balance_loss(sig, ids[:10], sequences=1, coeff=1.0, score_func="sigmoid"),
                          load_balancing_loss(sig, ids[:10], 1.0, "sigmoid"))


def test_the_models_loss_adds_the_balance_losses():
    model = GPT(MOE, seed=4)
    par = parallelize(model, ParallelDims(dp=1))
    ids = _ids(2, 16)
    logits = par.forward(ids[:, :-1])
    aux = [b.aux_loss for b in moe_blocks(model)]
    assert len(aux) == 2 and all(a.requires_grad and a > 0 for a in aux)
    assert torch.equal(par.loss(logits, ids[:, 1:]), lm_loss(logits, ids[:, 1:]) + (aux[0] + aux[1]))


def _step_gradients(micro: int, *, broken: str | None = None) -> dict[str, torch.Tensor]:
    """The gradients the trainer's step hands the optimizer for 4 sequences in micro-batches of
    ``micro``; ``broken``: ``"undivided"`` adds the balance loss without dividing it by the micro-batches,
    ``"per-forward"`` computes Switch's loss over each forward's tokens instead of per sequence."""
    from refimpl.train.setup import _Setup
    from refimpl.train.step import StepPoints, train_step

    torch.manual_seed(0)
    model = GPT(MOE, seed=5)
    if broken == "per-forward":
        for block in moe_blocks(model):
            block.moe.router.config = type(block.moe.router.config)(
                **{**vars(block.moe.router.config), "aux_loss_coeff": block.aux_loss_coeff})
            block.aux_loss_coeff = 0.0  # the layer's Switch loss over its T tokens instead
    par = parallelize(model, ParallelDims(dp=1))
    opt = par.build_optimizer(OptimConfig(grad_clip=None))
    got: dict = {}

    plain = par.loss

    def loss(logits, labels):
        out = plain(logits, labels)
        if broken == "undivided":
            out = out + (accumulation - 1) * moe_aux_loss(model)  # / accumulation afterwards: undivided
        elif broken == "per-forward":
            out = out + sum(b.moe.aux_loss for b in moe_blocks(model))
        return out

    accumulation = 4 // micro
    par.loss = loss  # the variant under test
    setup = _Setup(parallel=par, optim=opt, experts=ExpertLoad(model=model, group=None, device=CPU))
    ids = _ids(4, 16, seed=6)
    def keep_gradients() -> None:
        got.update({n: p.grad.clone() for n, p in model.named_parameters()})

    train_step(setup, ids[:, :-1], ids[:, 1:], accumulation=accumulation, micro=micro, grad_clip=None,
               points=StepPoints(before_optimizer_step=keep_gradients))
    got["figures"] = setup.experts.figures
    return got


@pytest.mark.numerics
def test_the_balance_loss_is_scaled_like_the_main_loss_over_micro_batches():
    """Measured: the two orders differ by at most 3.2e-7 to 4.8e-7 of each tensor's largest gradient
    (default, avx2 and avx512 kernels), so 1e-5 holds with a 20x margin; the controls move the router's
    gradient by 3.4 (the balance loss not divided by the 4 micro-batches) and 0.27 (Switch's loss over the
    forward's 4 sequences instead of per sequence) of its largest element."""
    whole, micro = _step_gradients(4), _step_gradients(1)
    for name, g in whole.items():
        if name != "figures":
            assert torch.allclose(micro[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max())), name
    assert micro["figures"]["moe_aux_loss"] == pytest.approx(whole["figures"]["moe_aux_loss"], rel=1e-5)
    router = "layers.0.mlp.moe.router.gate.weight"
    for micro_size, broken in ((1, "undivided"), (4, "per-forward")):  # per forward: 4 sequences at once
        wrong = _step_gradients(micro_size, broken=broken)[router]
        assert float((wrong - whole[router]).abs().max()) > 1e-2 * float(whole[router].abs().max()), broken


def test_step_figures_capacity_drops_and_the_bias_update():
    config = ModelConfig(**{**MOE.to_dict(), "capacity_factor": 0.5, "moe_load_balance": "bias",
                            "moe_bias_update_rate": 0.25})
    model = GPT(config, seed=8)
    ids = _ids(2, 16)
    model(ids[:, :-1])
    record_micro_batch(model)
    loads = [b.moe.tokens_per_expert.double() for b in moe_blocks(model)]
    dropped = [b.moe.dropped_fraction for b in moe_blocks(model)]
    assert all(d > 0 for d in dropped)  # C = ceil(2 x 32 / 4 x 0.5) = 8 slots of 16 wanted on average
    figures = finish_step(model, None, micro_batches=1, device=CPU)
    assert figures["moe_tokens_per_expert_mean"] == 2 * 32 / 4
    assert figures["moe_tokens_per_expert_max"] == max(float(x.max()) for x in loads)
    assert figures["moe_dropped_fraction"] == pytest.approx(sum(dropped) / 2)
    for block, load in zip(moe_blocks(model), loads, strict=True):
        assert torch.equal(block.moe.router.expert_bias, 0.25 * torch.sign(load.mean() - load).float())
        assert block.counters is None  # reset for the next step
    assert finish_step(model, None, micro_batches=1, device=CPU) is None  # nothing recorded since


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_micro_batch_reads_the_host_once_per_moe_block(checkpointed):
    """Capacity (drops) and the bias balance, two micro-batches: one ``tolist`` per MoE block and forward
    (module docstring), none in backward or in the counters; the step's figures are then read once."""
    config = ModelConfig(**{**MOE.to_dict(), "capacity_factor": 0.5, "moe_load_balance": "bias"})
    model = GPT(config, seed=8)
    if checkpointed:
        apply_activation_checkpointing(model, list(range(config.num_layers)))
    blocks = len(moe_blocks(model))
    for seed in (1, 2):
        ids = _ids(2, 16, seed)
        with HostSyncCounter() as syncs:
            loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
            (loss + record_micro_batch(model)).backward()
        forwards = 2 if checkpointed else 1
        assert syncs.count == forwards * blocks, syncs.by_place()
        assert all(e.what == "tolist" for e in syncs.events), syncs.by_place()
    figures = finish_step(model, None, micro_batches=2, device=CPU)
    assert figures["moe_dropped_fraction"] > 0 and figures["moe_tokens_per_expert_mean"] == 2 * (2 * 32) / 4


def test_a_one_device_trainer_run_writes_the_moe_figures(tmp_path, corpus):
    from refimpl.distributed import DistributedContext
    from refimpl.train import build_parser, config_from_args, options_from_args, train

    args = build_parser().parse_args([
        "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "2", "--steps", "2", "--log-every", "100", "--checkpoint-every", "0",
        "--data", str(corpus["corpus"]), "--cache-dir", str(corpus["cache"]), "--out", str(tmp_path),
        "--moe-experts", "4", "--moe-capacity-factor", "1.0", "--moe-load-balance", "bias"])
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=CPU, backend="gloo")
    records = train(config_from_args(args), ctx, options_from_args(args))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    for r in lines:
        assert {"moe_aux_loss", "moe_tokens_per_expert_max", "moe_tokens_per_expert_mean",
                "moe_dropped_fraction", "lm_loss"} <= set(r)
        assert r["moe_tokens_per_expert_mean"] == 2 * 16 * 2 / 4 and 0 <= r["moe_dropped_fraction"] < 1
    assert records[-1]["moe_aux_loss"] == lines[-1]["moe_aux_loss"]


def _router_grad_norm(config: ModelConfig, ids: torch.Tensor) -> float:
    """The norm of every router's gradient from the language-model loss alone."""
    model = GPT(config)
    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    return torch.stack([b.moe.router.gate.weight.grad.norm() for b in moe_blocks(model)]).norm().item()


def test_a_top_1_router_learns_from_the_task():
    """With its top-k always renormalised, a top-1 router's combine weight is ``s / s = 1`` and
    the task's loss gives it no gradient (only the balance loss trained it). By default the weight is now
    the raw probability at ``k = 1`` (Switch) and renormalised above (GShard, Mixtral, DeepSeek-V3, as
    before: k = 2 is unchanged). Balance loss 0: the gradient is the task's. Measured (this batch): 4.8e-3
    at k = 1 against 1.0e-2 at k = 2; always renormalised, k = 1 gets 6.8e-10 (the negative control)."""
    ids = _ids(4, 16)
    base = {**MOE.to_dict(), "aux_loss_coeff": 0.0}
    k2 = _router_grad_norm(ModelConfig(**{**base, "top_k": 2}), ids)
    k1 = _router_grad_norm(ModelConfig(**{**base, "top_k": 1}), ids)
    always = _router_grad_norm(ModelConfig(**{**base, "top_k": 1, "moe_normalize_topk": True}), ids)
    assert k2 / 10 <= k1 <= 10 * k2, (k1, k2)
    assert always < 1e-5 * k2, (always, k2)
    # k = 2 renormalises by default, bit for bit as an explicit True
    assert _router_grad_norm(ModelConfig(**{**base, "top_k": 2, "moe_normalize_topk": True}), ids) == k2
    with pytest.raises(ConfigError, match="moe_normalize_topk must be None"):
        ModelConfig(**{**base, "moe_normalize_topk": "yes"})


def test_the_trainers_top_1_routes_with_the_raw_score_and_trains(tmp_path, corpus):
    """``--moe-top-k 1`` reaches the router without renormalisation (``--moe-normalize-topk`` forces it,
    ``--no-moe-normalize-topk`` turns it off at k = 2), and a run of it trains."""
    from refimpl.distributed import DistributedContext
    from refimpl.train import build_parser, config_from_args, options_from_args, train

    def routers(*flags):
        config = config_from_args(build_parser().parse_args(["--moe-experts", "4", *flags]))
        return {b.moe.router.config.normalize_topk for b in moe_blocks(GPT(config.model))}

    assert routers("--moe-top-k", "1") == {False} and routers() == {True}
    assert routers("--moe-top-k", "1", "--moe-normalize-topk") == {True}
    assert routers("--no-moe-normalize-topk") == {False}
    args = build_parser().parse_args([
        "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--steps", "3", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "100",
        "--checkpoint-every", "0", "--data", str(corpus["corpus"]), "--cache-dir", str(corpus["cache"]),
        "--out", str(tmp_path), "--moe-experts", "4", "--moe-top-k", "1", "--moe-aux-loss-coeff", "0"])
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=CPU, backend="gloo")
    losses = [r["loss"] for r in train(config_from_args(args), ctx, options_from_args(args))]
    assert losses[-1] < losses[0], losses


# name -> (a ParallelConfig it refuses for an MoE model, the nearest one that passes)
CASES = {
    "moe-hsdp": (dict(dp=4, dp_replicate=2, zero_stage=3), dict(dp=4, zero_stage=3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_moe_row_refuses_its_case_and_lets_the_neighbour_through(name):
    assert {row.name for row in MOE_SUPPORT_TABLE} == set(CASES)
    refused, neighbour = (ParallelConfig(**kw) for kw in CASES[name])
    assert [row.name for row in refusals(refused, moe=True)] == [name]
    assert refusals(refused) == []  # a dense model: not refused
    assert [row.name for row in refusals(ParallelConfig(**CASES[name][0], ep=2))] == [name]  # ep implies MoE
    (row,) = [r for r in MOE_SUPPORT_TABLE if r.name == name]
    with pytest.raises(ConfigError) as info:
        check_supported(refused, moe=True)
    assert str(info.value) == row.message()
    assert refusals(neighbour, moe=True) == []


def test_parallelize_and_the_trainer_refuse_an_moe_model_in_the_rows_words():
    from refimpl.train import RunOptions, build_parser, config_from_args
    from refimpl.train.layout import check_experts

    message = next(r for r in MOE_SUPPORT_TABLE if r.name == "moe-hsdp").message()
    with pytest.raises(ConfigError) as parallel:
        parallelize(GPT(MOE), ParallelDims(dp=4, dp_replicate=2),
                    ParallelConfig(dp=4, dp_replicate=2, zero_stage=3))
    config = config_from_args(build_parser().parse_args(["--moe-experts", "4"]))
    with pytest.raises(ConfigError) as trainer:
        check_experts(config, RunOptions(parallel=ParallelConfig(dp=4, dp_replicate=2, zero_stage=3)))
    assert str(parallel.value) == str(trainer.value) == message
    with pytest.raises(ConfigError, match="give --moe-experts"):
        check_experts(config_from_args(build_parser().parse_args([])),
                      RunOptions(parallel=ParallelConfig(ep=2, dp=2)))
    with pytest.raises(ConfigError, match="do not split over --ep 4"):
        check_experts(config_from_args(build_parser().parse_args(["--moe-experts", "6"])),
                      RunOptions(parallel=ParallelConfig(ep=4)))
    with pytest.raises(ConfigError, match="must divide dp x cp"):
        ParallelDims(dp=3, ep=2)


@pytest.mark.parametrize("flags, fragment", [
    (["--moe-experts", "4", "--moe-top-k", "5"], "top_k must be in [1, num_experts = 4]"),
    (["--moe-experts", "4", "--moe-capacity-factor", "0"], "capacity_factor must be > 0"),
    (["--ep", "2"], "ep 2 must divide dp x cp"),
    (["--moe-experts", "4", "--nproc-per-node", "4", "--dp", "4", "--dp-replicate", "2", "--zero-stage", "3"],
     "MoE blocks or expert parallelism with HSDP"),
    (["--moe-experts", "-1"], "num_experts must be 0 (dense) or a positive integer"),
])
def test_the_trainer_refuses_bad_moe_flags_in_one_line(flags, fragment, capsys, tmp_path, monkeypatch):
    from refimpl.train import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*flags, "--out", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err


def test_the_planner_plans_an_moe_memory_and_refuses_an_moe_run_prediction():
    """run_memory_per_rank plans MoE blocks (tests/planner/ranks/test_planner_moe.py measures it);
    predict_run's bytes per group do not model them and say so in one line."""
    from refimpl.planner import predict_run, run_memory_per_rank

    assert run_memory_per_rank(MOE, ParallelDims(dp=2, ep=2), micro_batch=1, seq_len=16).total > 0
    with pytest.raises(ConfigError, match="does not model an MoE run's bytes per process group"):
        predict_run(MOE, ParallelConfig(dp=2, ep=2), seq_len=16, global_batch=2)


def test_the_norm_reads_dp_cp_as_ep_x_edp_when_experts_are_placed():
    """One process (every axis of one rank): the norm is torch's; the factoring keeps the placements
    valid (a dense replica over dp x cp becomes one over ep and edp)."""
    from refimpl.parallel.placements import _factored

    gen = torch.Generator().manual_seed(9)
    dense = HeldGradient("w", torch.randn(3, 4, generator=gen),
                         Placement(box=Box.full((3, 4)), replicated_over=("dp x cp",),
                                   reduce_over=("dp x cp",)))
    expert = HeldGradient("e", torch.randn(2, 4, generator=gen),
                          Placement(box=Box.full((4, 4)).narrow(0, 0, 2), sharded_over=("ep",),
                                    replicated_over=("edp",), reduce_over=("edp",)))
    factored = _factored([dense, expert])
    assert factored[0].placement.replicated_over == ("ep", "edp")
    assert factored[1].placement == expert.placement
    assert _factored([dense])[0].placement == dense.placement  # no expert axis: as it was
    want = torch.cat([dense.grad.flatten(), expert.grad.flatten()]).norm()
    got = clip_grad_norm_([dense, expert], 1e9, groups={}, device=CPU)
    assert torch.allclose(got, want)


def test_shard_experts_keeps_the_ranks_rows_and_declares_their_boxes():
    block = MoEMLP(MOE, layer=0)
    whole = block.moe.experts.w1.detach().clone()
    assert block.local_shards()["moe.experts.w1"].box == Box.full((4, 32, 128))
    with pytest.raises(ValueError, match="already sharded"):
        block.moe.ep_size = 2
        block.shard_experts(None)
    block.moe.ep_size = 1
    block.shard_experts(None)  # no group: every expert stays
    assert torch.equal(block.moe.experts.w1, whole) and isinstance(block.moe.router.gate, nn.Linear)
    assert block.expert_parallel_parameters() == ["moe.experts.w1", "moe.experts.w2"]


def test_the_expert_view_carves_ep_out_of_dp_x_cp_and_leaves_every_other_group():
    """ep consecutive ranks of the dp x cp view (torchtitan's dp2ep); edp = dp x cp / ep holds the same
    experts; the four axes' groups and the rank order are the layout's without ep."""
    dp4 = ParallelDims(dp=4, ep=2)
    assert dp4.edp == 2 and dp4.expert_grid.groups_of("ep") == [(0, 1), (2, 3)]
    assert dp4.expert_grid.groups_of("edp") == [(0, 2), (1, 3)]
    tp2 = ParallelDims(dp=2, tp=2, ep=2)  # the tp ranks of a dp rank hold the same experts
    assert tp2.expert_grid.groups_of("ep") == [(0, 2), (1, 3)] and tp2.edp == 1
    cp2 = ParallelDims(dp=2, cp=2, tp=2, ep=4)  # the whole dp x cp group
    assert cp2.expert_grid.groups_of("ep") == cp2.groups_of("dp", "cp")
    assert ParallelDims(dp=4, cp=2, ep=4).expert_grid.groups_of("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for dims, plain in ((dp4, ParallelDims(dp=4)), (tp2, ParallelDims(dp=2, tp=2)),
                        (cp2, ParallelDims(dp=2, cp=2, tp=2))):
        for axes in (("pp",), ("dp",), ("cp",), ("tp",), ("dp", "cp")):
            assert dims.groups_of(*axes) == plain.groups_of(*axes)
        assert [dims.coordinates(r) for r in range(dims.world_size)] == [
            plain.coordinates(r) for r in range(plain.world_size)]
    assert dp4.describe() == "dp 4 x cp 1 x tp 1 x pp 1 (experts: ep 2 x edp 2)"
    assert dp4.config(zero_stage=1).ep == 2
