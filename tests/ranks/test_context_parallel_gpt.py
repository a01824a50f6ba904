"""refimpl's whole GPT with its sequence split over cp ranks, against one device (chapter 07).

``apply_context_parallel`` on a copy of a one-device GPT, fed ``split_for_context_parallel``'s part
of the tokens, at cp 2 and 4: ring attention (zig-zag and contiguous) and Ulysses, and at world 4 tensor x
context parallel (tp 2 x cp 2, ring). The mean over the cp ranks of their losses and of their gradients
(what the data-parallel wrapper over ``dp x cp`` computes) equals the one-device loss and gradients (each
TP shard against its box) within ``FACTOR x spread``, ``spread`` measured in the same run (one device in
float32 against float64, per tensor; at least 1 ulp for the loss). Negative control: positions that do not
follow the split (each rank's ``[0, s/cp)``) fail the same check. Heads that do not divide by cp under
Ulysses are a one-line error.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.comm import ops
from refimpl.config import ModelConfig
from refimpl.distributed import ParallelDims
from refimpl.distributed.placement import module_shards
from refimpl.launch import run_ranks
from refimpl.models import GPT, Embedding, lm_loss
from refimpl.parallel.context_parallel import apply_context_parallel, split_for_context_parallel
from refimpl.parallel.tensor_parallel import apply_tensor_parallel, tp_lm_loss
from tests.ranks.test_tp_layers import _error
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S = 2, 16  # S divides into 2 cp = 8 zig-zag chunks
FACTOR = 4.0
CFG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, max_seq_len=S)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CFG.vocab_size, (B, S), generator=g), torch.randint(0, CFG.vocab_size, (B, S),
                                                                                generator=g)


def _reference(dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model = GPT(CFG, seed=1).to(dtype)
    x, y = _data()
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.detach().to(torch.float64) for n, p in model.named_parameters()}


def _run(cp_group, tp_group, *, method: str, layout: str | None, positions: bool = True) -> dict:
    model = copy.deepcopy(GPT(CFG, seed=1))
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group=tp_group)
    apply_context_parallel(model, cp_group=cp_group, method=method, layout=layout)
    if not positions:  # the negative control: every rank's positions start at 0
        model.embedding.position_ids = Embedding.position_ids
    x, y = (split_for_context_parallel(t, cp_group=cp_group, method=method, layout=layout) for t in _data())
    logits = model(x)
    loss = (tp_lm_loss(logits, y, tp_group=tp_group, vocab_size=CFG.vocab_size) if tp_group is not None
            else lm_loss(logits, y))
    loss.backward()
    n = dist.get_world_size(cp_group)
    mean = loss.detach().clone()
    ops.all_reduce(mean, group=cp_group)
    grads = {}
    params = dict(model.named_parameters())
    for name in module_shards(model):
        g = params[name].grad.detach().clone()
        ops.all_reduce(g, group=cp_group)  # the mean over the cp ranks, as the dp x cp wrapper averages
        grads[name] = (g / n).to(torch.float64)
    boxes = {name: shard.box.slices() for name, shard in module_shards(model).items()}
    return {"loss": mean.item() / n, "grads": grads, "boxes": boxes}


def _worst(run: dict, ref: tuple, spread: dict) -> tuple[float, str]:
    (loss32, g32), (loss_spread, g_spread) = ref, spread
    scale = max(loss_spread, float(np.spacing(np.float32(loss32))))
    worst, where = abs(run["loss"] - loss32) / (FACTOR * scale), "loss"
    for name, g in run["grads"].items():
        box = run["boxes"][name]
        tol = FACTOR * max(float(g_spread[name][box].max()), 1e-12)
        ratio = float((g - g32[name][box]).abs().max()) / tol
        if ratio > worst:
            worst, where = ratio, name
    return worst, where


def _worker(ctx) -> dict:
    world = dist.group.WORLD
    (l32, g32), (l64, g64) = _reference(torch.float32), _reference(torch.float64)
    ref = (l32, g32)
    spread = (abs(l32 - l64), {n: (g32[n] - g64[n]).abs() for n in g32})
    out: dict = {}
    cases = [("ring zigzag", "ring", "zigzag"), ("ring contiguous", "ring", "contiguous"),
             ("ulysses", "ulysses", None)]
    for name, method, layout in cases:
        out[name] = _worst(_run(world, None, method=method, layout=layout), ref, spread)
    out["ring zigzag, positions from 0"] = _worst(_run(world, None, method="ring", layout="zigzag",
                                                       positions=False), ref, spread)
    if ctx.world_size == 4:  # tp 2 x cp 2: tensor parallel inside each cp rank's part of the sequence
        groups = ParallelDims(dp=1, cp=2, tp=2).build(rank=ctx.rank, world_size=4, timeout_s=60)
        out["tp2 x cp2 ring"] = _worst(_run(groups.group("cp"), groups.group("tp"), method="ring",
                                            layout="zigzag"), ref, spread)
    heads = ModelConfig(num_layers=1, hidden_size=6, num_attention_heads=3, max_seq_len=S)
    out["error"] = _error(lambda: apply_context_parallel(GPT(heads), cp_group=world, method="ulysses"))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_gpt_under_context_parallelism_equals_one_device(results):
    cp, per_rank = results
    for rank, out in enumerate(per_rank):
        for name, value in out.items():
            if name == "error":
                continue
            worst, where = value
            if "positions from 0" in name:  # negative control
                assert worst > 1.0, f"cp={cp} rank {rank}: {name} passed; the check cannot see it"
            else:
                assert worst <= 1.0, f"cp={cp} rank {rank} {name}: {where} at {worst:.2f} x tolerance"


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_ulysses_refuses_heads_that_do_not_divide(results):
    cp, per_rank = results
    message = per_rank[0]["error"]
    assert f"cp = {cp}" in message and "3 attention heads" in message and "\n" not in message, message
