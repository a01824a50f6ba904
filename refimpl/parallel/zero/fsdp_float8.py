"""ZeRO-3's all-gather in fp8: the fp8 linears' weights travel as e4m3 bytes (chapters 04 and 10).

torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` under FSDP2 (its
``WeightWithDynamicFloat8CastTensor``: the weight is cast to fp8 *before* the all-gather, and the linear
uses the gathered fp8 weight as it is). A tensorwise fp8 GEMM reads the weight ``W [N, K]`` only through
``W8 = saturate(W * s)`` with one scale ``s = fmax / amax(W)`` for the whole tensor, so the cast commutes
with ZeRO-3's row cut as soon as every rank casts with the whole tensor's scale::

    a_r   = max |W[r]|                         this rank's rows (0 for an empty shard)
    amax  = all_reduce_MAX(a_r) = max |W|      one MAX all-reduce of the unit's k fp32 amaxes
    s     = fmax / max(amax, eps)              fp32, the same number on every rank
    W8[r] = saturate(W[r] * s) in e4m3         elementwise: bitwise rows r of the whole tensor's cast
    W8    = all_gather(W8[r])                  1 byte per element where bf16 moves 2
    y     = scaled_mm(x8, W8^T, 1/sx, 1/s)     forward; backward dx = scaled_mm(g8, W8, 1/sg, 1/s)

Since the cast is elementwise and the scale is the whole tensor's, ``concat_r W8[r]`` is bit for bit the
cast one device makes of the full fp32 ``W`` (and ZeRO 0-2 make: they cast the fp32 weight under autocast),
never the cast of a bf16 copy (a second rounding; what gathering in ``param_dtype`` hands the layer). A
shard cast with its own ``a_r`` would give other bytes (tests/ranks/test_fp8_zero3.py's negative control).

**Wiring** (``enable_float8_all_gather``, called by ``refimpl.parallel.parallelize`` under
``--precision fp8 --zero-stage 3``): every weight registered only in tensorwise fp8 layers
(``refimpl.precision.fp8.Float8Linear``, or tensor-parallel blocks: below) gets a
``Float8Gather``, a full fp8 tensor (its storage freed between gathers, like the unit's full
parameters) and its scale. A unit holding such a
weight gathers all its parameters in **one** collective of bytes (FSDP2 packs mixed all-gather dtypes
into a ``uint8`` buffer alike; gloo refuses float8 dtypes anyway): the other parameters (LayerNorms,
biases, the layers kept in bf16) in ``param_dtype`` as before, each as ``itemsize`` bytes per element
(``byte_spec``), the fp8 weights as one byte. While the unit is gathered its layers hold the fp8
weight as ``weight_fp8``; their ``weight`` (the bf16 full parameter) is never allocated: it only
receives the gradient, which is reduce-scattered in ``reduce_dtype`` (fp32) as for every parameter.

Per unit and gather, with ``c_p = ceil(rows_p / N) * row_numel_p`` the padded chunk of parameter ``p``,
the collective moves ``N * (sum_{p not fp8} 2 c_p + sum_{p fp8} c_p)`` bytes, plus one all-reduce of
``4 k`` bytes: the fp8 weights' part is exactly half of their bf16 gather.

**2-D (tp > 1)**: a tensor-parallel block (its seam matmul ``refimpl.precision.fp8.Float8Matmul``,
chapter 06) is sharded again over dp; its shard's amax is agreed over the dp group and then over the tp
group (a second MAX all-reduce of the same ``4 k`` bytes), so the block is cast with its whole layer's
scale, one device's, as ``refimpl.precision.fp8.ShardedScales`` casts it without ZeRO-3; the
gathered block goes to the layer as its matmul's ``weight_fp8``. (torchao's fp8 all-gather under DTensor
TP takes the amax of the whole DTensor the same way.)

**Rowwise** layers are not gathered in fp8 (torchao: tensorwise only): their forward casts ``W`` per row
and their input gradient per column, two fp8 copies with per-slice scales; refimpl/support.py refuses
rowwise with ZeRO-3 rather than hand those layers bf16 weights to round a second time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.zero.fsdp_unit import FSDPUnit, _alloc, _free
from refimpl.parallel.zero.sharding import ShardSpec
from refimpl.precision.fp8 import (
    Float8Config,
    Float8Format,
    Float8Linear,
    Float8Matmul,
    Float8Tensor,
    amax_to_scale,
    operand_amax,
    quantize,
)

if TYPE_CHECKING:
    from refimpl.parallel.zero.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["Float8Gather", "agree_amaxes", "byte_spec", "enable_float8_all_gather", "float8_gather_inputs",
           "float8_gather_outputs", "float8_unit", "release_float8", "use_float8"]


@dataclass(eq=False)
class Float8Gather:
    """One weight all-gathered in fp8: the layers that read it, its format, and ``tensor``: the full fp8
    weight (storage allocated only while its unit is gathered) and its 0-d fp32 scale (written in place
    at each gather, so a backward reads the bytes and scale its unit's latest gather brought)."""

    layers: list[nn.Module]
    fmt: Float8Format
    tensor: Float8Tensor
    next_scale: torch.Tensor | None = field(default=None)  # the scale of the gather in flight
    tp_group: Any = None  # a tensor-parallel block's group: its amax agreed over it too (the whole layer's)


def _float8_config(module: nn.Module) -> Float8Config | None:
    """The tensorwise fp8 recipe ``module``'s weight is multiplied with: a ``Float8Linear``'s, or a
    tensor-parallel block's whose seam matmul is fp8 (``refimpl.precision.fp8.Float8Matmul``)."""
    if isinstance(module, Float8Linear):
        config = module.config
    elif isinstance(matmul := getattr(module, "matmul", None), Float8Matmul):
        config = matmul.config
    else:
        return None
    return config if config.scaling == "tensorwise" else None


def enable_float8_all_gather(fsdp: FullyShardedDataParallel) -> list[str]:
    """Give every weight of ``fsdp`` (a ``refimpl.parallel.zero.FullyShardedDataParallel``, before
    its first forward) that only tensorwise fp8 layers read (``Float8Linear``, or tensor-parallel blocks
    with the fp8 seam matmul) an fp8 all-gather (module docstring). Returns the layers' names in the
    wrapped module."""
    names = {id(m): n for n, m in fsdp.module.named_modules()}
    enabled = []
    for unit in fsdp.units:
        for sp in unit.params:
            found = [(m, c) for m, attr in sp.registrations
                     if attr == "weight" and (c := _float8_config(m)) is not None]
            layers = [m for m, _ in found]
            if not layers or len(layers) != len(sp.registrations):  # read elsewhere too: keep param_dtype
                continue
            fmt = found[0][1].weight_format
            if any(c.weight_format != fmt for _, c in found):
                continue
            matmuls = [mm for m in layers if isinstance(mm := getattr(m, "matmul", None), Float8Matmul)]
            sharded = [mm.sharded for mm in matmuls if mm.sharded is not None]
            data = torch.empty(sp.spec.shape, dtype=fmt.dtype, device=sp.sharded.device)
            _free(data)
            scale = torch.ones((), dtype=torch.float32, device=sp.sharded.device)
            sp.float8 = Float8Gather(layers=layers, fmt=fmt, tensor=Float8Tensor(data, scale),
                                     tp_group=sharded[0].group if sharded else None)
            enabled += [names[id(m)] for m in layers]
    return enabled


def float8_unit(unit: FSDPUnit) -> bool:
    """Whether ``unit`` holds a weight gathered in fp8 (then its collective moves bytes)."""
    return any(sp.float8 is not None for sp in unit.params)


def byte_spec(spec: ShardSpec, itemsize: int) -> ShardSpec:
    """``spec`` counted in bytes: the same row cut of a ``[rows, row_numel * itemsize]`` uint8 tensor."""
    return ShardSpec(torch.Size((spec.rows, spec.row_numel * itemsize)), spec.rank, spec.world_size)


def _as_bytes(t: torch.Tensor, spec: ShardSpec, rows: int) -> torch.Tensor:
    return t.reshape(rows, spec.row_numel).view(torch.uint8)  # [rows, row_numel * itemsize]


def agree_amaxes(amaxes: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole tensors' amaxes from the shards' (``[k]`` fp32): one MAX all-reduce over ``group``."""
    if group_rank_size(group)[1] > 1:
        ops.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return amaxes


@torch.no_grad()
def float8_gather_inputs(unit: FSDPUnit, group: dist.ProcessGroup | None
                         ) -> tuple[list[torch.Tensor], list[ShardSpec]]:
    """This rank's all-gather inputs of ``unit`` as bytes, and their byte specs: each fp8 weight's shard
    cast with the agreed scale (module docstring), every other parameter cast to its full tensor's dtype
    (``param_dtype``). Collective: the MAX all-reduce of the unit's fp8 amaxes."""
    fp8 = [sp for sp in unit.params if sp.float8 is not None]
    amaxes = torch.stack([operand_amax(sp.sharded.detach(), scaling="tensorwise", contraction_dim=0)
                          .to(torch.float32) for sp in fp8])
    amaxes = agree_amaxes(amaxes, group)
    tp_groups = {id(sp.float8.tp_group): sp.float8.tp_group for sp in fp8 if sp.float8.tp_group is not None}
    if tp_groups:  # tensor-parallel blocks: the whole layer's amax, over tp too (one device's scale)
        (tp_group,) = tp_groups.values()  # one per rank; a weight replicated over tp has one amax there
        amaxes = agree_amaxes(amaxes, tp_group)
    inputs, specs = [], []
    for sp in unit.params:
        rows = sp.spec.end - sp.spec.start
        if sp.float8 is None:
            shard = sp.sharded.detach().to(sp.unsharded.dtype)
        else:
            f = sp.float8
            f.next_scale = amax_to_scale(amaxes[fp8.index(sp)], f.fmt)  # 0-d, as the layer's own cast
            shard = quantize(sp.sharded.detach(), f.next_scale, f.fmt)
        inputs.append(_as_bytes(shard, sp.spec, rows))
        specs.append(byte_spec(sp.spec, shard.element_size()))
    return inputs, specs


def float8_gather_outputs(unit: FSDPUnit) -> tuple[list[torch.Tensor], list[ShardSpec]]:
    """Where the gathered bytes of ``unit`` go, allocated (the full parameters, the fp8 weights in place of
    theirs), and their byte specs; the fp8 weights' scales are those of the gather just finished."""
    outputs, specs = [], []
    for sp in unit.params:
        full = sp.unsharded.data if sp.float8 is None else sp.float8.tensor.data
        if sp.float8 is not None:
            sp.float8.tensor.scale.copy_(sp.float8.next_scale)
        _alloc(full)
        outputs.append(_as_bytes(full, sp.spec, sp.spec.rows))
        specs.append(byte_spec(sp.spec, full.element_size()))
    return outputs, specs


def _hand(layer: nn.Module, weight_fp8: Float8Tensor | None) -> None:
    """Give ``layer`` the gathered fp8 weight (None: take it back): a ``Float8Linear``'s ``weight_fp8``, a
    tensor-parallel block's fp8 seam matmul."""
    if isinstance(layer, Float8Linear):
        layer.weight_fp8 = weight_fp8
    else:
        matmul = layer.matmul
        assert isinstance(matmul, Float8Matmul)  # the other fp8 layer (_float8_config)
        layer.matmul = dataclasses.replace(matmul, weight_fp8=weight_fp8)


def use_float8(unit: FSDPUnit) -> None:
    """The unit is gathered: its fp8 layers take the gathered weight (``Float8Linear.weight_fp8``, or the
    seam matmul's of a tensor-parallel block)."""
    for sp in unit.params:
        if sp.float8 is not None:
            for layer in sp.float8.layers:
                _hand(layer, sp.float8.tensor)


def release_float8(unit: FSDPUnit) -> None:
    """The unit is freed: its fp8 layers let go of the fp8 weight, whose storage is freed."""
    for sp in unit.params:
        if sp.float8 is not None:
            for layer in sp.float8.layers:
                _hand(layer, None)
            _free(sp.float8.tensor.data)
