"""ColumnParallelLinear -> RowParallelLinear against one device and against DTensor (chapter 06).

A column -> GeLU -> row MLP, its weights sharded from a dense ``nn.Linear`` pair (``from_linear``), at tp 2
and 4, without and with sequence parallelism (input and output ``[batch, seq / t, hidden]``):

* its output and every sharded gradient (and the input's gradient) equal the matching box of the one-device
  MLP's (the box each module declares in ``local_shards()``);
* PyTorch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (with SP:
  ``input_layouts=Shard(1)`` / ``output_layouts=Shard(1)``) on the same weights gives the same;
* the tracer sees exactly 1 all-reduce forward and 1 backward of ``b*s*h`` floats without SP, an all-gather
  and a reduce-scatter each way with SP; negative control: an ``f`` that all-reduces in forward fails both
  checks.

Tolerance (the numerics rule): the TP sums run in another order than one device's, so each quantity ``k`` is
compared within ``FACTOR x spread_k``, ``spread_k`` measured in the same run: the larger of (one device in
float32 vs float64) and (one device in float32, chunked into ``t`` column / row blocks and sequence chunks
added in reverse order, vs unchunked). Also: a checkpoint saved at tp 2 and 4 loads bitwise into a plain
``nn.Linear`` pair at one process; sizes that do not divide by ``t`` are one-line ``ValueError`` s. One
spawn per tp size runs all of it (tests/support/folded.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import refimpl.parallel.tensor_parallel.layers as layers
from refimpl.checkpoint import CheckpointConfig, Checkpointer, find_latest_valid
from refimpl.comm import CommTracer
from refimpl.distributed.placement import Box, module_shards
from refimpl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
)
from tests.ranks.test_tp_communications import (
    _AllReducingCopy,  # the negative control: f that all-reduces forward
)
from tests.support.folded import run_folded
from tests.support.timeouts import SPAWN_TIMEOUT_S

B, S, H, FF = 2, 4, 8, 16  # S and FF divide by 2 and 4
FACTOR = 4.0  # TP's error against float64 is at most about twice one device's; x2 margin
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _dense() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(H, FF), nn.Linear(FF, H)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)  # input, loss weights


class _MLP(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _reference(dtype: torch.dtype, chunks: int | None = None) -> dict[str, torch.Tensor]:
    """One device: output and gradients of ``sum(y * c)``; ``chunks``: the same maths cut into ``chunks``
    column / row blocks and sequence chunks, summed in reverse order (another summation order)."""
    l1, l2 = _dense()
    w1, b1, w2, b2 = (p.detach().to(dtype).requires_grad_() for p in (l1.weight, l1.bias, l2.weight, l2.bias))
    x, c = (t.to(dtype) for t in _data())
    x.requires_grad_()
    if chunks is None:
        y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    else:
        blocks = [slice(r * FF // chunks, (r + 1) * FF // chunks) for r in reversed(range(chunks))]
        partial = sum(F.linear(F.gelu(F.linear(x, w1[k], b1[k])), w2[:, k]) for k in blocks)  # [B, S, H]
        seq = list(partial.chunk(chunks, 1))
        y = torch.cat([seq[r] + b2 for r in range(chunks)], 1)  # the bias added per sequence chunk, as SP
    (y * c).sum().backward()
    grads = {"y": y, "x": x.grad, "fc1.weight": w1.grad, "fc1.bias": b1.grad, "fc2.weight": w2.grad,
             "fc2.bias": b2.grad}
    return {k: v.detach().to(torch.float64) for k, v in grads.items()}


def _spreads(t: int) -> dict[str, float]:
    r32, r64, chunked = _reference(torch.float32), _reference(torch.float64), _reference(torch.float32, t)
    return {k: max(float((r32[k] - r64[k]).abs().max()), float((chunked[k] - r32[k]).abs().max()))
            for k in r32}


def _boxes(model: nn.Module, sp: bool, rank: int, t: int) -> dict[str, Box]:
    act = Box.chunk((B, S, H), 1, rank, t) if sp else Box.full((B, S, H))
    return {"y": act, "x": act, **{k: s.box for k, s in module_shards(model).items()}}


def _local(name: str, model: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if name == "y":
        return y.detach()
    if name == "x":
        return x.grad
    p = model.get_parameter(name)
    g = p.grad
    if hasattr(g, "redistribute"):  # a DTensor gradient: in the parameter's own layout, then local
        g = g.redistribute(placements=p.placements).to_local()
    return g


def _run(model: nn.Module, sp: bool, group, rank: int, t: int, *, sp_grads: bool) -> dict:
    x_full, c_full = _data()
    box = Box.chunk((B, S, H), 1, rank, t) if sp else Box.full((B, S, H))
    x = x_full[box.slices()].clone().requires_grad_()
    with CommTracer() as tracer:
        y = model(x)
        tracer.step()
        (y * c_full[box.slices()]).sum().backward()
        tracer.step()
        if sp_grads:
            layers.allreduce_sequence_parallel_grads(model, group)
    out = {k: _local(k, model, y, x).to(torch.float64).numpy() for k in ("y", "x", *NAMES)}  # picklable
    ops_of = [[(e.op, e.nbytes) for e in tracer.select(step=s)] for s in range(3)]
    return {"values": out, "ops": ops_of}


def _ours(group, sp: bool, rank: int, t: int) -> _MLP:
    l1, l2 = _dense()
    return _MLP(ColumnParallelLinear.from_linear(l1, tp_group=group, sequence_parallel=sp),
                RowParallelLinear.from_linear(l2, tp_group=group, sequence_parallel=sp))


def _dtensor(sp: bool, mesh) -> _MLP:
    """PyTorch's tensor parallelism on the same dense weights (SP: the sequence, dim 1, sharded outside)."""
    plan = ({"fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Shard(1))}
            if sp else {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return parallelize_module(_MLP(*_dense()), mesh, plan)


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _worker(ctx) -> dict:
    t, rank, world = ctx.world_size, ctx.rank, dist.group.WORLD
    reference = _reference(torch.float32)
    out: dict = {"spread": _spreads(t), "cases": {}}
    mesh = init_device_mesh("cpu", (t,))
    for sp in (False, True):
        model = _ours(world, sp, rank, t)
        boxes = _boxes(model, sp, rank, t)
        out["cases"][f"ours sp={sp}"] = _run(model, sp, world, rank, t, sp_grads=sp)
        out["cases"][f"dtensor sp={sp}"] = _run(_dtensor(sp, mesh), sp, world, rank, t, sp_grads=False)
        out["cases"][f"reference sp={sp}"] = {"values": {k: reference[k][b.slices()].numpy()
                                                         for k, b in boxes.items()}}
    original = layers.copy_to_tensor_parallel_region
    layers.copy_to_tensor_parallel_region = _AllReducingCopy.apply
    try:
        broken = _ours(world, False, rank, t)
        out["cases"]["broken sp=False"] = _run(broken, False, world, rank, t, sp_grads=False)
    finally:
        layers.copy_to_tensor_parallel_region = original
    l1, l2 = _dense()  # gather_output / a whole input: the other two paths
    gathered = _MLP(ColumnParallelLinear.from_linear(l1, tp_group=world, gather_output=True),
                    RowParallelLinear.from_linear(l2, tp_group=world, input_is_parallel=False))
    out["cases"]["gathered sp=False"] = _run(gathered, False, world, rank, t, sp_grads=False)
    odd = 2 * t + 1
    out["errors"] = [
        _error(lambda: ColumnParallelLinear(H, odd, tp_group=world)),
        _error(lambda: RowParallelLinear(odd, H, tp_group=world)),
        _error(lambda: ColumnParallelLinear.from_linear(nn.Linear(H, odd), tp_group=world)),
        _error(lambda: RowParallelLinear.from_linear(nn.Linear(odd, H), tp_group=world)),
    ]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def folds(request, tmp_path_factory):
    """``(t, {key: per-rank results})``: this module's rank functions at tp ``t`` in one spawn
    (tests/support/folded.py): the MLP cases (``"mlp"``), the saved activations (``"saved"``) and the
    checkpoint save (``"save"``, its folder under ``"folder"``)."""
    t, folder = request.param, tmp_path_factory.mktemp(f"tp_layers_{request.param}")
    calls = {"mlp": (_worker, ()), "saved": (_saved_worker, ()), "save": (_save_at_tp, (str(folder),))}
    return t, run_folded(t, calls, timeout_s=SPAWN_TIMEOUT_S) | {"folder": folder}


@pytest.fixture
def results(folds):
    t, out = folds
    return t, out["mlp"]


def _diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: float(np.abs(a[k] - b[k]).max()) for k in a}


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_column_row_mlp_equals_one_device_and_dtensor_within_the_measured_spread(results, sp):
    t, per_rank = results
    for rank, out in enumerate(per_rank):
        tol = {k: FACTOR * s for k, s in out["spread"].items()}
        ref = out["cases"][f"reference sp={sp}"]["values"]
        ours = out["cases"][f"ours sp={sp}"]["values"]
        theirs = out["cases"][f"dtensor sp={sp}"]["values"]
        for what, d in (("ours vs one device", _diffs(ours, ref)),
                        ("DTensor vs one device", _diffs(theirs, ref)),
                        ("ours vs DTensor", _diffs(ours, theirs))):
            bad = {k: (v, tol[k]) for k, v in d.items() if v > tol[k]}
            assert not bad, (t, rank, sp, what, bad)
        if not sp:
            gathered = _diffs(out["cases"]["gathered sp=False"]["values"], ref)
            assert all(v <= tol[k] for k, v in gathered.items()), (t, rank, gathered, tol)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_one_all_reduce_each_way_without_sp_and_all_gather_plus_reduce_scatter_with_sp(results):
    t, per_rank = results
    act = B * S * H * 4  # bytes of the whole [b, s, h] float32 activation
    for rank, out in enumerate(per_rank):
        cases = out["cases"]
        assert cases["ours sp=False"]["ops"] == [[("all_reduce", act)], [("all_reduce", act)], []], (t, rank)
        fwd, bwd, after = cases["ours sp=True"]["ops"]
        assert fwd == [("all_gather", act), ("reduce_scatter", act)], (t, rank, fwd)
        # backward: the row layer's all-gather, then the column layer gathers its saved s/t input again
        assert bwd == [("all_gather", act), ("all_gather", act), ("reduce_scatter", act)], (t, rank, bwd)
        assert after == [("all_reduce", H * 4)], (t, rank, after)  # the row bias's partial gradient


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_negative_control_an_f_that_all_reduces_in_forward_fails_counts_and_values(results):
    t, per_rank = results
    for rank, out in enumerate(per_rank):
        broken = out["cases"]["broken sp=False"]
        assert broken["ops"][0] != out["cases"]["ours sp=False"]["ops"][0], (t, rank)
        d = _diffs(broken["values"], out["cases"]["reference sp=False"]["values"])
        assert d["y"] > FACTOR * out["spread"]["y"], (t, rank, d)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_sizes_that_do_not_divide_by_tp_are_one_line_value_errors(results):
    t, per_rank = results
    for out in per_rank:
        for message in out["errors"]:
            assert "does not divide by the tensor-parallel size" in message and "\n" not in message, message


def _save_at_tp(ctx, folder: str) -> None:
    l1, l2 = _dense()
    model = _MLP(ColumnParallelLinear.from_linear(l1, tp_group=dist.group.WORLD),
                 RowParallelLinear.from_linear(l2, tp_group=dist.group.WORLD))
    Checkpointer(CheckpointConfig(folder=folder)).save(1, module_shards(model))


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_checkpoint_saved_at_tp_loads_bitwise_into_plain_linears(folds):
    t, out = folds
    tmp_path = out["folder"]
    plain = _MLP(nn.Linear(H, FF), nn.Linear(FF, H))
    expected = {k: v.shape for k, v in plain.state_dict().items()}
    info = find_latest_valid(tmp_path, expected=expected)
    entries = info.manifest["entries"]
    pieces = {k: [(p["offsets"], p["shape"]) for p in e["pieces"]] for k, e in entries.items()}
    assert pieces["fc1.weight"] == [([k * FF // t, 0], [FF // t, H]) for k in range(t)]  # column: rows
    assert pieces["fc2.weight"] == [([0, k * FF // t], [H, FF // t]) for k in range(t)]  # row: columns
    with torch.no_grad():
        for p in plain.parameters():
            p.fill_(float("nan"))
    Checkpointer(CheckpointConfig(folder=tmp_path)).load(info, dict(plain.named_parameters()))
    l1, l2 = _dense()
    for name, want in (("fc1", l1), ("fc2", l2)):
        got = getattr(plain, name)
        assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias), name


def test_from_linear_without_a_process_group_is_the_dense_layer_bitwise():
    l1, l2 = _dense()
    x, _ = _data()
    tp = _ours(None, False, 0, 1)
    assert torch.equal(tp(x), _MLP(l1, l2)(x))
    assert all(s.box.is_full for s in module_shards(tp).values())
    with pytest.raises(ValueError, match="exclude each other"):
        ColumnParallelLinear(H, FF, tp_group=None, gather_output=True, sequence_parallel=True)


def _saved_shapes(fn, x: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the activations autograd saves during ``fn(x)`` (parameters left out)."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return shapes


def _saved_worker(ctx) -> dict:
    t, world = ctx.world_size, dist.group.WORLD
    l1, _ = _dense()
    layer = ColumnParallelLinear.from_linear(l1, tp_group=world, sequence_parallel=True)
    x = torch.randn(B, S // t, H, requires_grad=True)
    naive = lambda v: F.linear(gather_from_sequence_parallel_region(v, world), layer.weight,  # noqa: E731
                               layer.bias)
    return {"ours": _saved_shapes(layer, x), "gather then linear": _saved_shapes(naive, x)}


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_sequence_parallel_column_layer_saves_only_its_sequence_chunk(folds):
    t, per_call = folds
    for out in per_call["saved"]:
        assert out["ours"] == [(B, S // t, H)], out  # backward gathers it again (sequence_parallel_linear)
        # negative control: autograd's own gather + linear saves the whole gathered sequence ([b*s, h])
        assert B * S * H in [int(np.prod(shape)) for shape in out["gather then linear"]], out
