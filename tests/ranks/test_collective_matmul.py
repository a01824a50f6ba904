"""Collective matmul (``refimpl.parallel.tensor_parallel.collective_matmul``, chapter 06) against the unfused
sequence-parallel layers, DTensor and one device, at tp 2 and 4 over gloo.

A column-parallel linear under sequence parallelism (input ``[b, s/t, h]``) and a row-parallel one (output
``[b, s/t, h]``), each built from the same dense ``nn.Linear`` three ways: ours with ``tp_comm_overlap``
(the ring ``all_gather_matmul`` / ``matmul_reduce_scatter``), the unfused layers (all-gather then matmul,
matmul then reduce-scatter) and PyTorch's ``parallelize_module`` with ``ColwiseParallel(input_layouts=
Shard(1))`` / ``RowwiseParallel(output_layouts=Shard(1))``. Output, input gradient, weight and bias
gradients are compared on every rank's box, and against the float64 one-device layer.

Tolerance, derived rather than fitted: every compared quantity is a sum of ``n`` products (a dot product of
length ``in``, or ``out``, or over the ``b s`` tokens for a weight gradient; plus one for a bias added), and
the three implementations add those products in different orders (the ring adds the ``t`` partial sums in ring
order, the weight gradient chunk by chunk). Each computed sum lies within ``gamma_n sum |terms|`` of the exact
one (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1: ``gamma_n = n u / (1 - n u)``,
``u = 2^-24`` in float32), whatever the order, so two of them lie within ``BOUND = 2 gamma_n sum |terms|``,
computed in float64 from the absolute values of the operands. Measured: the worst difference is 0.15 of
that bound (the row layer's input gradient against float64; against the unfused layer and DTensor at most
0.07), printed with ``-s``; the all-gather side's output is bitwise the unfused layer's (asserted).

Negative controls, in the same spawn: a reduce-scatter ring that computes its partial sum for the wrong
destination (``(r + i) mod t`` instead of ``(r - 1 - i) mod t``) fails the bound at tp 2 and 4; a ring that
rotates the wrong way (send to ``r - 1``, receive from ``r + 1``) fails at tp 4 and, at tp 2, where the two
neighbours are the same rank, gives bitwise the right result. The timed claim (faster than its serialized
control on a shaped link) is tests/ranks/cli/test_overlap.py's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import refimpl.parallel.tensor_parallel.collective_matmul as cm
from refimpl.comm import ops
from refimpl.distributed.placement import Box
from refimpl.launch import run_ranks
from refimpl.parallel.context_parallel.context_parallel_communications import RingTransfer, ring_neighbours
from refimpl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
)
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S, H, FF = 2, 8, 8, 16  # S, FF divide by 2 and 4
U = 2.0**-24  # float32's unit roundoff
QUANTITIES = ("y", "x.grad", "weight.grad", "bias.grad")


def _dense(kind: str) -> nn.Linear:
    torch.manual_seed(0 if kind == "column" else 1)
    return nn.Linear(H, FF) if kind == "column" else nn.Linear(FF, H)


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole input and the loss weights ``dY`` (``loss = sum(y * dY)``)."""
    g = torch.Generator().manual_seed(2)
    if kind == "column":
        return torch.randn(B, S, H, generator=g), torch.randn(B, S, FF, generator=g)
    return torch.randn(B, S, FF, generator=g), torch.randn(B, S, H, generator=g)


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _reference(kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """One device in float64 (``exact``) and the bound ``2 gamma_n sum |terms|`` of each quantity."""
    lin = _dense(kind)
    w, b = (p.detach().double() for p in (lin.weight, lin.bias))
    x, dy = (t.double() for t in _data(kind))
    xg = x.clone().requires_grad_()
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = torch.nn.functional.linear(xg, wg, bg)
    (y * dy).sum().backward()
    tokens = B * S
    ax, aw, ady = x.abs().reshape(tokens, -1), w.abs(), dy.abs().reshape(tokens, -1)
    bound = {"y": 2 * _gamma(w.shape[1] + 1) * (ax @ aw.t() + b.abs()).reshape(y.shape),
             "x.grad": 2 * _gamma(w.shape[0]) * (ady @ aw).reshape(x.shape),
             "weight.grad": 2 * _gamma(tokens) * ady.t() @ ax,
             "bias.grad": 2 * _gamma(tokens) * ady.sum(0)}
    exact = {"y": y.detach(), "x.grad": xg.grad, "weight.grad": wg.grad, "bias.grad": bg.grad}
    return {"exact": exact, "bound": bound}


def _boxes(kind: str, rank: int, t: int) -> dict[str, Box]:
    """Each quantity's box in the whole tensor on rank ``rank`` of ``t`` (the input's is ``x.grad``'s)."""
    if kind == "column":  # [b, s/t, h] -> [b, s, ff/t]
        return {"y": Box.chunk((B, S, FF), 2, rank, t), "x.grad": Box.chunk((B, S, H), 1, rank, t),
                "weight.grad": Box.chunk((FF, H), 0, rank, t), "bias.grad": Box.chunk((FF,), 0, rank, t)}
    return {"y": Box.chunk((B, S, H), 1, rank, t), "x.grad": Box.chunk((B, S, FF), 2, rank, t),  # row
            "weight.grad": Box.chunk((H, FF), 1, rank, t), "bias.grad": Box.full((H,))}


def _ours(kind: str, group, *, overlap: bool) -> nn.Module:
    """Our sequence-parallel layer from the dense one: the ring with ``overlap``, else the unfused one."""
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls.from_linear(_dense(kind), tp_group=group, sequence_parallel=True)
    layer.tp_comm_overlap = overlap
    return layer


def _dtensor(kind: str, mesh) -> nn.Module:
    """PyTorch's tensor parallelism on the same dense layer, the sequence (dim 1) sharded outside it."""
    style = (ColwiseParallel(input_layouts=Shard(1)) if kind == "column"
             else RowwiseParallel(output_layouts=Shard(1)))
    return parallelize_module(_dense(kind), mesh, style)


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None
    if hasattr(g, "redistribute"):  # a DTensor gradient: in the parameter's own layout, then local
        g = g.redistribute(placements=p.placements).to_local()
    return g


def _run(kind: str, layer: nn.Module, group) -> dict[str, np.ndarray]:
    """Forward and backward of ``sum(y * dY)`` on this rank's boxes in ``group``; the quantities in
    float64."""
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    x_full, dy_full = _data(kind)
    boxes = _boxes(kind, rank, t)
    x = x_full[boxes["x.grad"].slices()].clone().requires_grad_()
    y = layer(x)
    (y * dy_full[boxes["y"].slices()]).sum().backward()
    allreduce_sequence_parallel_grads(layer, group)  # the row bias's s/t-token sums (DTensor sums its own)
    out = {"y": y.detach(), "x.grad": x.grad, "weight.grad": _local_grad(layer.weight),
           "bias.grad": _local_grad(layer.bias)}
    return {k: v.double().numpy() for k, v in out.items()}  # picklable


def _wrong_destination(partial, *, group, serialized=False):
    """The negative control: ``ring_reduce_scatter`` computing its term for ``(r + i) mod t``."""
    r, t = dist.get_rank(group), dist.get_world_size(group)
    acc = partial(r % t)
    for i in range(1, t):
        transfer = cm.ring_exchange([acc], group=group, step=i)
        mine = partial((r + i) % t)
        (received,) = transfer.wait()
        acc = received + mine
    return acc


def _wrong_rotation(tensors, *, group, step=0) -> RingTransfer:
    """The negative control: ``ring_exchange`` sending to ``r - 1`` and receiving from ``r + 1``."""
    right, left = ring_neighbours(group=group)
    outgoing = [t.contiguous() for t in tensors]
    received = tuple(torch.empty_like(t) for t in outgoing)
    works = ops.batch_isend_irecv([ops.P2POp(dist.irecv, buf, right, group) for buf in received]
                                  + [ops.P2POp(dist.isend, t, left, group) for t in outgoing])
    return RingTransfer(received=received, sent=tuple(outgoing), works=works, src=right, dst=left, step=step)


@contextlib.contextmanager
def _patched(name: str, fn):
    original = getattr(cm, name)
    setattr(cm, name, fn)
    try:
        yield
    finally:
        setattr(cm, name, original)


def _worker(ctx) -> dict:
    """Every case at tp 4 (the world) and at tp 2 (the two groups of 2 adjacent ranks: ranks 2 and 3 address
    their neighbours by global rank)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    halves = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))["tp"]
    out: dict = {}
    for t, sub in ((ctx.world_size, mesh), (halves.size(), halves)):
        group = sub.get_group()
        for kind in ("column", "row"):
            out[t, kind, "ring"] = _run(kind, _ours(kind, group, overlap=True), group)
            out[t, kind, "unfused"] = _run(kind, _ours(kind, group, overlap=False), group)
            out[t, kind, "dtensor"] = _run(kind, _dtensor(kind, sub), group)
            for control, name, fn in (("wrong destination", "ring_reduce_scatter", _wrong_destination),
                                      ("wrong rotation", "ring_exchange", _wrong_rotation)):
                with _patched(name, fn):
                    out[t, kind, control] = _run(kind, _ours(kind, group, overlap=True), group)
    return out


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """One spawn of 4 ranks: the tp 4 and tp 2 cases (``_worker``)."""
    return run_ranks(_worker, 4, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def runs(request, spawned) -> tuple[int, list[tuple[int, dict]]]:
    """``(t, [(rank in its tp group, {(kind, case): quantities}), ...])`` for every global rank."""
    t = request.param
    return t, [(g % t, {k[1:]: v for k, v in out.items() if k[0] == t}) for g, out in enumerate(spawned)]


@pytest.fixture(scope="module")
def references() -> dict:
    return {kind: _reference(kind) for kind in ("column", "row")}


def _worst(kind: str, a: dict, b: dict, references: dict, rank: int, t: int) -> dict[str, float]:
    """Per quantity, the largest ``|a - b| / BOUND`` over the rank's box (at most 1: within the bound)."""
    boxes, bound = _boxes(kind, rank, t), references[kind]["bound"]
    return {k: float((np.abs(a[k] - b[k]) / bound[k][boxes[k].slices()].numpy()).max()) for k in QUANTITIES}


def _exact(kind: str, references: dict, rank: int, t: int) -> dict[str, np.ndarray]:
    boxes = _boxes(kind, rank, t)
    return {k: references[kind]["exact"][k][boxes[k].slices()].numpy() for k in QUANTITIES}


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_the_ring_equals_the_unfused_layer_dtensor_and_one_device_within_the_derived_bound(runs, references,
                                                                                          kind):
    t, per_rank = runs
    for rank, out in per_rank:
        ring = out[kind, "ring"]
        for name, other in (("unfused", out[kind, "unfused"]), ("DTensor", out[kind, "dtensor"]),
                            ("one device, float64", _exact(kind, references, rank, t))):
            worst = _worst(kind, ring, other, references, rank, t)
            print(f"tp {t} rank {rank} {kind}: ring vs {name}: worst |diff| / bound {worst}")
            assert max(worst.values()) <= 1.0, (name, worst)
        if kind == "column":  # the same rows through the same matmul: bitwise (module docstring)
            assert np.array_equal(ring["y"], out[kind, "unfused"]["y"])


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("kind", ["column", "row"])
def test_negative_controls_a_wrong_destination_or_rotation_fails_the_bound(runs, references, kind):
    t, per_rank = runs
    for rank, out in per_rank:
        exact = _exact(kind, references, rank, t)
        assert max(_worst(kind, out[kind, "wrong destination"], exact, references, rank, t).values()) > 1.0
        wrong_way = out[kind, "wrong rotation"]
        if t == 2:  # the left and the right neighbour are the same rank: the same ring
            assert all(np.array_equal(wrong_way[k], out[kind, "ring"][k]) for k in QUANTITIES)
        else:
            assert max(_worst(kind, wrong_way, exact, references, rank, t).values()) > 1.0


def test_the_flag_reaches_the_layers_and_is_refused_where_it_cannot_apply():
    """``--tp-comm-overlap`` parses into ``ParallelConfig.tp_comm_overlap``; the support table refuses it
    without sequence parallelism; ``apply_tensor_parallel`` refuses it where no layer is sequence-parallel
    (one process: tp 1), a layer given a pluggable matmul refuses it, and the planner's ``predict_run``
    says it does not model it (the same layout without the flag plans)."""
    from refimpl.config import ConfigError, ModelConfig, ParallelConfig
    from refimpl.parallel.tensor_parallel import ColwiseParallel as OurColwise
    from refimpl.parallel.tensor_parallel import apply_tensor_parallel
    from refimpl.planner.run_prediction import predict_run
    from refimpl.train import build_parser, options_from_args

    flags = ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap"]
    assert options_from_args(build_parser().parse_args(flags)).parallel.tp_comm_overlap
    with pytest.raises(ConfigError, match="--tp-comm-overlap without sequence parallelism"):
        options_from_args(build_parser().parse_args(["--tp", "2", "--tp-comm-overlap"]))
    with pytest.raises(ValueError, match="needs sequence parallelism over tp > 1"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(H, FF)), {"0": OurColwise()},
                              tp_group=None, tp_comm_overlap=True)
    layer = ColumnParallelLinear(H, FF, tp_group=None, sequence_parallel=True)
    layer.tp_comm_overlap, layer.matmul = True, torch.nn.functional.linear
    with pytest.raises(ValueError, match="no pluggable matmul"):
        layer(torch.randn(B, S, H))
    model = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, max_seq_len=S,
                        ffn_hidden_size=48)
    parallel = ParallelConfig(dp=1, tp=2, sequence_parallel=True)
    assert predict_run(model, parallel, seq_len=S, global_batch=2, micro_batch=1).ranks
    with pytest.raises(ValueError, match="--tp-comm-overlap's rings"):
        predict_run(model, ParallelConfig(dp=1, tp=2, sequence_parallel=True, tp_comm_overlap=True),
                    seq_len=S, global_batch=2, micro_batch=1)
