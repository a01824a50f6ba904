"""refimpl's whole GPT under tensor (and sequence) parallelism against one device (chapter 06).

``apply_tensor_parallel`` on a copy of a one-device GPT, at tp 2 and 4, with and without sequence
parallelism, tied and untied output layer:

* the loss (vocab-parallel, on the logits shard) and every gradient, in the box each parameter's module
  declares, equal the one-device model's within ``FACTOR x spread``, ``spread`` measured in the same run
  (one device in float32 against float64, per tensor; for the loss at least 1 ulp, since the float32 loss
  often rounds to the float64 one exactly);
* the tracer sees, per block, 2 all-reduces forward and 2 backward of ``b*s*h`` floats without SP, and 2
  all-gathers + 2 reduce-scatters each way with SP (the embedding: an all-reduce forward without SP, a
  reduce-scatter forward and an all-gather backward with it);
* negative controls: the fused qkv weight split by plain rows in nanoGPT's ``[3, a, d]`` layout (the trap:
  rank 0 gets all of q and half of k) and sequence parallelism without summing the layer norms' gradients
  both fail the same check;
* the gradient norm (``clip_grad_norm_tensor_parallel_``) equals ``clip_grad_norm_``'s on one device;
  negative control: counting the replicated gradients on every rank;
* ``full_state_dict`` gives back the one-device weights bitwise; heads or widths that do not divide are
  one-line errors; an odd vocabulary is padded by the stated rule (tied) and equals one device too;
* the Llama form (RMSNorm, RoPE, SwiGLU, untied) with 1 and 2 key/value heads, so at tp 4 (and MQA at tp 2)
  fewer key/value heads than ranks (``refimpl.models.gpt_sharding.SharedKeyValueQKV``): the same
  checks; negative control: the shared k/v rows' gradients not summed over the ranks that read them
  (bigcode-project/Megatron-LM#35) fails on a ``query_key_value`` gradient.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer
from refimpl.config import LLAMA, ModelConfig
from refimpl.distributed.placement import module_shards
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.parallel.tensor_parallel import (
    allreduce_sequence_parallel_grads,
    apply_tensor_parallel,
    clip_grad_norm_tensor_parallel_,
    full_state_dict,
    gather_from_tensor_parallel_region,
    tensor_parallel_sharded,
    tp_lm_loss,
)
from tests.ranks.test_tp_layers import _error  # ValueError's message, "" when none is raised
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S = 2, 8
FACTOR = 4.0  # TP error vs float64 is about one device's (another summation order); x2 margin
CFG = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "max_seq_len": S}


def _data(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)


def _reference(cfg: ModelConfig, dtype: torch.dtype) -> tuple[GPT, float]:
    model = GPT(cfg, seed=1).to(dtype)
    x, y = _data(cfg.vocab_size)
    loss = lm_loss(model(x), y)
    loss.backward()
    return model, loss.item()


def _grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Gradient of every declared box, by the plain model's names (float64, picklable)."""
    out = {}
    params = dict(model.named_parameters())
    for name, shard in module_shards(model).items():
        p = params[name]
        g = p.grad[: shard.tensor.shape[0]] if p.grad.shape != shard.tensor.shape else p.grad  # vocab padding
        out[name] = g.detach().to(torch.float64).numpy()
    return out


def _boxes(model: torch.nn.Module) -> dict[str, tuple[slice, ...]]:
    return {name: shard.box.slices() for name, shard in module_shards(model).items()}


def _nanogpt_rows_qkv(model: GPT, t: int, rank: int, dense: GPT) -> None:
    """The trap: take rows [r 3h/t, (r+1) 3h/t) of a [3, a, d]-laid-out fused weight as if they were heads."""
    h, a = dense.config.hidden_size, dense.config.num_attention_heads
    d = h // a
    for block, full in zip(model.layers, dense.layers, strict=True):
        w = full.self_attention.query_key_value.weight.detach()  # [3h, h], Megatron's [a, 3, d] rows
        b = full.self_attention.query_key_value.bias.detach()
        w3 = w.view(a, 3, d, h).transpose(0, 1).reshape(3 * h, h)  # nanoGPT's [3, a, d] rows
        b3 = b.view(a, 3, d).transpose(0, 1).reshape(3 * h)
        rows = slice(rank * 3 * h // t, (rank + 1) * 3 * h // t)  # a plain row block of the fused matrix
        with torch.no_grad():  # read back as this rank's heads, in the per-head layout the forward expects
            block.self_attention.query_key_value.weight.copy_(w3[rows])
            block.self_attention.query_key_value.bias.copy_(b3[rows])


def _run(cfg: ModelConfig, group, *, sp: bool, rank: int, t: int, variant: str = "ok") -> dict:
    dense = GPT(cfg, seed=1)
    model = apply_tensor_parallel(copy.deepcopy(dense), tp_group=group, sequence_parallel=sp,
                                  pad_vocab=True)
    if variant == "nanogpt rows":
        _nanogpt_rows_qkv(model, t, rank, dense)
    if variant == "replicas not summed":  # the gather's backward keeps this rank's dy only
        for block in model.layers:
            block.self_attention.query_key_value.gather = gather_from_tensor_parallel_region
    x, y = _data(cfg.vocab_size)
    with CommTracer() as tracer:
        loss = tp_lm_loss(model(x), y, tp_group=group, vocab_size=cfg.vocab_size)
        tracer.step()
        loss.backward()
        tracer.step()
    if sp and variant != "no sp grad sum":
        allreduce_sequence_parallel_grads(model, group)
    ops_of = [[(e.op, e.nbytes) for e in tracer.select(step=s)] for s in range(2)]
    sharded = tensor_parallel_sharded(model)
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    params = [p for _, p in named]
    flags = [n in sharded for n, _ in named]
    cpu = torch.device("cpu")
    norm = clip_grad_norm_tensor_parallel_([p.grad.clone() for p in params], flags, float("inf"),
                                           tp_group=group, device=cpu).item()
    overcounted = clip_grad_norm_tensor_parallel_([p.grad.clone() for p in params], [True] * len(params),
                                                  float("inf"), tp_group=group, device=cpu).item()
    full = full_state_dict(model, group)
    weights_equal = all(torch.equal(full[k], v) for k, v in dense.state_dict().items() if k in full)
    return {"loss": loss.item(), "grads": _grads(model), "ops": ops_of, "weights_equal": weights_equal,
            "norm": norm, "overcounted norm": overcounted,
            "names": sorted(full) == sorted(n for n in dense.state_dict() if n != "output_layer.weight"
                                            or not cfg.tie_word_embeddings)}


def _configs(t: int) -> dict[str, tuple[ModelConfig, list[str]]]:
    """The cases: GPT-2 tied (and padded) and untied, the Llama form at 1 and 2 key/value heads; each with
    the negative controls its layout can show."""
    out = {}
    for tied in (True, False):
        for vocab in (256, 4 * t + 1) if tied else (256,):
            negatives = ["nanogpt rows"] if vocab == 256 and tied else []
            cfg = ModelConfig(**CFG, vocab_size=vocab, tie_word_embeddings=tied)
            out[f"tied={tied} vocab={vocab}"] = (cfg, negatives)
    for kv in (1, 2):
        negatives = ["replicas not summed"] if kv < t else []
        out[f"llama kv={kv}"] = (ModelConfig(**{**CFG, **LLAMA}, num_key_value_heads=kv), negatives)
    return out


def _worker(ctx) -> dict:
    t, rank, world = ctx.world_size, ctx.rank, dist.group.WORLD
    out: dict = {"cases": {}}
    for key, (cfg, negatives) in _configs(t).items():
        r32, loss32 = _reference(cfg, torch.float32)
        r64, loss64 = _reference(cfg, torch.float64)
        tp_probe = apply_tensor_parallel(copy.deepcopy(r32), tp_group=world, pad_vocab=True)
        boxes = _boxes(tp_probe)
        g32 = {n: p.grad for n, p in r32.named_parameters()}
        g64 = {n: p.grad for n, p in r64.named_parameters()}
        ref = {n: g32[n][b].to(torch.float64).numpy() for n, b in boxes.items()}
        spread = {n: float((g32[n][b].double() - g64[n][b]).abs().max()) for n, b in boxes.items()}
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")).item() for m in (r32, r64)]
        out["cases"][key] = {"ref": ref, "spread": spread, "loss32": loss32,
                             "loss_spread": abs(loss32 - loss64), "norm": norms[0],
                             "norm_spread": abs(norms[0] - norms[1]), "runs": {}}
        for sp in (False, True):
            sp_negative = ["no sp grad sum"] if sp and negatives == ["nanogpt rows"] else []
            variants = ["ok", *negatives, *sp_negative]
            for variant in variants:
                out["cases"][key]["runs"][f"sp={sp} {variant}"] = _run(cfg, world, sp=sp, rank=rank, t=t,
                                                                      variant=variant)
    out["errors"] = [
        _error(lambda: apply_tensor_parallel(GPT(ModelConfig(**{**CFG, "num_attention_heads": 2 * t + 1,
                                                                 "hidden_size": 2 * (2 * t + 1)})),
                                             tp_group=world)),
        _error(lambda: apply_tensor_parallel(GPT(ModelConfig(**CFG, ffn_hidden_size=4 * t + 1)),
                                             tp_group=world)),
        _error(lambda: apply_tensor_parallel(GPT(ModelConfig(**CFG, vocab_size=4 * t + 1)), tp_group=world)),
    ]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


def _off(run: dict, case: dict, name: str) -> float:
    """|TP - one device| / tolerance of the gradient ``name``."""
    return float(np.abs(run["grads"][name] - case["ref"][name]).max()) / (FACTOR * max(case["spread"][name],
                                                                                     1e-12))


def _worst(run: dict, case: dict) -> tuple[float, str]:
    """The largest |TP - one device| / tolerance over the gradients (and the loss)."""
    # the float32 loss often rounds to the float64 one exactly (spread 0): 1 ulp is the finest scale there is
    loss_scale = max(case["loss_spread"], float(np.spacing(np.float32(case["loss32"]))))
    worst, where = abs(run["loss"] - case["loss32"]) / (FACTOR * loss_scale), "loss"
    for n in run["grads"]:
        ratio = _off(run, case, n)
        if ratio > worst:
            worst, where = ratio, n
    return worst, where


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_whole_gpt_equals_one_device_within_the_measured_spread(results):
    t, per_rank = results
    for rank, out in enumerate(per_rank):
        for key, case in out["cases"].items():
            for name, run in case["runs"].items():
                worst, where = _worst(run, case)
                if name.endswith("ok"):
                    assert worst <= 1.0, f"tp={t} rank {rank} {key} {name}: {where}: {worst:.1f} x tol"
                    assert run["weights_equal"] and run["names"], f"{key} {name}: full_state_dict differs"
                else:  # the negative controls fail the same check
                    assert worst > 1.0, f"tp={t} {key} {name} passed: the check cannot see that mistake"
                    if name.endswith("replicas not summed"):  # the shared k/v rows' own gradients are off
                        qkv = [n for n in run["grads"] if n.endswith("query_key_value.weight")]
                        assert any(_off(run, case, n) > 1.0 for n in qkv), (t, key, name, where)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_gradient_norm_counts_every_element_once(results):
    t, per_rank = results
    for out in per_rank:
        for key, case in out["cases"].items():
            tol = FACTOR * max(case["norm_spread"], float(np.spacing(np.float32(case["norm"]))))
            for name, run in case["runs"].items():
                if name.endswith("ok"):
                    assert abs(run["norm"] - case["norm"]) <= tol, (t, key, name, run["norm"], case["norm"])
                    # negative control: the replicated gradients counted on every rank
                    assert run["overcounted norm"] - case["norm"] > 100 * tol, (t, key, name)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_per_block_collectives_are_two_all_reduces_each_way_or_their_sp_pairs(results):
    t, per_rank = results
    n_layers, h = CFG["num_layers"], CFG["hidden_size"]
    act = B * S * h * 4  # bytes of one [b, s, h] float32 activation
    for out in per_rank:
        fwd, bwd = out["cases"]["tied=True vocab=256"]["runs"]["sp=False ok"]["ops"]
        blocks = [(op, n) for op, n in fwd if n == act]
        # per block 2 (attention, MLP) + the vocab-parallel embedding's all-reduce of [b, s, h]
        assert blocks == [("all_reduce", act)] * (2 * n_layers + 1), fwd
        assert [op for op, n in fwd if n != act] == ["all_reduce"] * 3  # the loss: max, target, sum-exp
        assert [(op, n) for op, n in bwd] == [("all_reduce", act)] * (2 * n_layers + 1), bwd  # f's + head
        fwd, bwd = out["cases"]["tied=True vocab=256"]["runs"]["sp=True ok"]["ops"]
        ag = [op for op, _ in fwd if op == "all_gather"]
        rs = [op for op, _ in fwd if op == "reduce_scatter"]
        assert len(ag) == 2 * n_layers + 1 and len(rs) == 2 * n_layers + 1, fwd  # + the head's gather
        # no activation all-reduce is left: the embedding reduce-scatters into the sequence shard
        # (Megatron-Core's reduce_scatter_embeddings), its backward is an all-gather
        assert [op for op, n in fwd if op == "all_reduce" and n == act] == [], fwd
        assert fwd[0] == ("reduce_scatter", act) and bwd[-1] == ("all_gather", act), (fwd, bwd)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_sizes_that_do_not_divide_are_one_line_errors(results):
    t, per_rank = results
    heads, ffn, vocab = per_rank[0]["errors"]
    assert "num_attention_heads" in heads and f"tensor-parallel size {t}" in heads, heads
    assert "ffn_hidden_size" in ffn, ffn
    assert "vocab_size" in vocab and "pad_vocab=True" in vocab, vocab
    assert all("\n" not in e for e in (heads, ffn, vocab))
