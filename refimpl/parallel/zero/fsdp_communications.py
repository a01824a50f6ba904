"""ZeRO stage 3's data movement per unit: shard it, all-gather it, reduce-scatter its gradients (chapter 04).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (stage 3,
``P_os+g+p``); the dtypes are FSDP2's ``fully_shard(mp_policy=MixedPrecisionPolicy(...))`` (Zhao et al. 2023).
A unit's parameters ``W_1 .. W_k`` are split along dim 0 over the ``N`` ranks (``ShardSpec``), rank
``r`` keeping the fp32 rows ``W_i[r]`` (the master weights the optimizer steps). Each collective serves
a whole unit, its tensors packed side by side (``refimpl.parallel.zero.sharding``):

* **shard** (``shard_into_units``, once, no traffic: every rank starts from the same weights): cut the
  module into units (each submodule of ``unit_types``, the rest in the root), replace each parameter by
  its rows ``W_i[r]`` and give it a full tensor in ``param_dtype`` whose storage is freed;
* **all-gather** (``start_all_gather``, then ``finish_all_gather``): ``W_i = concat_r W_i[r]``,
  each shard cast to ``param_dtype`` *before* the collective (half the bytes in bf16/fp16), written into
  the unit's full tensors, whose storage is allocated only while the unit is gathered
  (``free_full_params`` gives it back). Started asynchronously, so a prefetch overlaps compute.
  Under ``--precision fp8`` the fp8 linears' weights are cast to e4m3 before it instead, the unit's
  parameters gathered as bytes (``refimpl.parallel.zero.fsdp_float8``, chapter 10);
* **reduce-scatter** (``reduce_scatter_grads``): the full gradients ``g`` (in ``param_dtype``) are cast
  to ``reduce_dtype`` and each rank receives the mean of its rows, ``sum_r g_r[rank] / N`` (fp16:
  ``sum_r (g_r / pre) / post`` with ``pre * post = N``, ``fp16_divide_factors``), cast to fp32 and
  added to the shard's ``.grad``;
* ``all_gather_full``: the full parameters in the shards' dtype, for a state dict.

A unit of ``Psi_u`` elements, freed after its forward, moves ``(N - 1) / N * Psi_u`` elements per rank in
each of two all-gathers (forward, backward) and one reduce-scatter: 1.5x data parallelism's all-reduce.
Every call goes through ``refimpl.comm.ops``, so ``refimpl.comm.tracer.CommTracer`` sees it. The
schedule (when a unit is gathered, freed, reduced) is ``FullyShardedDataParallel``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.parallel.zero.fsdp_float8 import (
    float8_gather_inputs,
    float8_gather_outputs,
    float8_unit,
    release_float8,
    use_float8,
)
from refimpl.parallel.zero.fsdp_unit import FSDPUnit, _alloc, _free, _ShardedParam
from refimpl.parallel.zero.sharding import (
    ShardSpec,
    copy_out_all_gather,
    pack_for_all_gather,
    shard_of,
    unpack_reduce_scatter,
)
from refimpl.parallel.zero.zero_communications import (
    all_gather_into,
    all_reduce_mean_,
    reduce_scatter_mean_packed,
)

__all__ = [
    "all_gather_full",
    "finish_all_gather",
    "free_full_params",
    "reduce_scatter_grads",
    "shard_into_units",
    "start_all_gather",
]


def shard_into_units(
    module: nn.Module, unit_types: tuple[type[nn.Module], ...], *, rank: int, world_size: int,
    param_dtype: torch.dtype | None,
    own_groups: Mapping[nn.Module, tuple[dist.ProcessGroup | None, int | None]] | None = None,
) -> list[FSDPUnit]:
    """Cut ``module`` into units, the root first, and replace every parameter by this rank's rows.

    A unit is each outermost submodule of a type in ``unit_types``; the root unit holds the rest, and any
    parameter registered in two units (tied embeddings). Each parameter gets a full tensor (in
    ``param_dtype`` when floating point and given) whose storage is freed until the unit is gathered.
    ``own_groups``: submodules that are units of their own wherever they sit (inside a block unit too),
    sharded over their own group with their own gradient divisor: ``{module: (group, divide_factor)}``
    (the experts of an MoE block over the expert-data-parallel group, torchtitan's efsdp). The other units
    are sharded ``world_size`` ways, this rank keeping chunk ``rank``; their ``group`` is left None (the
    wrapper's)."""
    own_groups = dict(own_groups or {})
    unit_modules: dict[str, nn.Module] = {"": module}  # unit name -> its module ("" is the root)
    owner: dict[int, str] = {}  # id(module) -> the unit it belongs to

    def walk(m: nn.Module, prefix: str, unit: str) -> None:
        if m is not module and (m in own_groups or (unit == "" and isinstance(m, unit_types))):
            unit = prefix  # an outermost match, or a module with its own group
            unit_modules[unit] = m
        owner.setdefault(id(m), unit)
        for name, child in m.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name, unit)

    walk(module, "", "")
    regs: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    units_of: dict[nn.Parameter, set[str]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            regs.setdefault(p, []).append((m, name))
            units_of.setdefault(p, set()).add(owner[id(m)])
    params_by_unit: dict[str, list[_ShardedParam]] = {name: [] for name in unit_modules}
    group_of = {name: own_groups.get(m, (None, None)) for name, m in unit_modules.items()}
    where = {name: group_rank_size(group_of[name][0]) if m in own_groups else (rank, world_size)
             for name, m in unit_modules.items()}  # (rank, size) each unit is sharded by
    for p, registrations in regs.items():
        units = units_of[p]
        unit = units.pop() if len(units) == 1 else ""  # shared by two units: the root holds it
        spec = ShardSpec(p.shape, *where[unit])
        # [rows_r, ...]: this rank's rows, what the optimizer steps
        sharded = nn.Parameter(shard_of(p.detach(), spec).clone(), requires_grad=p.requires_grad)
        dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
        unsharded = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
        _free(unsharded)
        sp = _ShardedParam(registrations=registrations, spec=spec, sharded=sharded, unsharded=unsharded)
        params_by_unit[unit].append(sp)
        for m, name in registrations:
            m._parameters[name] = sharded
    return [FSDPUnit(name=name or "<root>", module=unit_modules[name], params=params_by_unit[name],
                     group=group_of[name][0], divide_factor=group_of[name][1])
            for name in unit_modules]


def start_all_gather(unit: FSDPUnit, group: dist.ProcessGroup | None) -> None:
    """Launch the unit's all-gather (async, one collective for all its parameters) into ``unit.pending``.

    Nothing to do if the unit is gathered, already in flight or has no parameters."""
    if unit.gathered or unit.pending is not None or not unit.params:
        return
    specs = [sp.spec for sp in unit.params]
    n = specs[0].world_size
    if float8_unit(unit):  # fp8 weights inside: every parameter as bytes, the fp8 ones cast to e4m3
        shards, specs = float8_gather_inputs(unit, group)
    else:  # cast before the all-gather (FSDP2 does the same): a bf16/fp16 all-gather moves half the bytes
        shards = [sp.sharded.detach().to(sp.unsharded.dtype) for sp in unit.params]
    packed = pack_for_all_gather(shards, specs)  # [S]
    gathered = packed.new_empty(n * packed.numel())  # [N * S]
    work = None
    if n > 1:
        work = ops.all_gather_into_tensor(gathered, packed, group=group, async_op=True)
    else:
        gathered.copy_(packed)
    unit.pending = (work, gathered)


def finish_all_gather(unit: FSDPUnit, group: dist.ProcessGroup | None) -> None:
    """Make the unit's full parameters available: wait for its all-gather (started now if none is in
    flight) and copy every rank's rows into the full tensors."""
    if unit.gathered:
        return
    start_all_gather(unit, group)
    if unit.pending is None:  # a unit without parameters
        unit.gathered = True
        return
    work, gathered = unit.pending
    unit.pending = None
    if work is not None:
        work.wait()
    if float8_unit(unit):  # the bytes into the full parameters and the fp8 weights, which the layers take
        fulls, specs = float8_gather_outputs(unit)
        copy_out_all_gather(gathered, specs, fulls)
        use_float8(unit)
        unit.gathered = True
        return
    for sp in unit.params:
        _alloc(sp.unsharded)
    # Write through .data: the same storage autograd saved, without bumping the version counter.
    specs = [sp.spec for sp in unit.params]
    copy_out_all_gather(gathered, specs, [sp.unsharded.data for sp in unit.params])
    unit.gathered = True


def free_full_params(unit: FSDPUnit, group: dist.ProcessGroup | None) -> None:
    """Free the unit's full parameters (the shards stay); an unused prefetch is finished first."""
    if unit.pending is not None:  # a prefetch that was not used: finish it to keep ranks in step
        finish_all_gather(unit, group)
    for sp in unit.params:
        _free(sp.unsharded)
    release_float8(unit)
    unit.gathered = False


def reduce_scatter_grads(
    unit: FSDPUnit, group: dist.ProcessGroup | None, reduce_dtype: torch.dtype | None, *,
    replicate_group: dist.ProcessGroup | None = None,
) -> None:
    """Reduce-scatter the unit's full gradients (mean over ranks, in ``reduce_dtype`` when given) into its
    shards' ``.grad`` (fp32, accumulated), and drop the full gradients. One collective for the unit; under
    HSDP (``replicate_group``) one more, the reduced shards all-reduced (mean) over the replicas before
    they are added (FSDP2's order: reduce-scatter, then all-reduce)."""
    with_grad = [sp for sp in unit.trainable if sp.unsharded.grad is not None]
    if not with_grad:
        return
    specs = [sp.spec for sp in with_grad]
    grads = [g for sp in with_grad if (g := sp.unsharded.grad) is not None]  # all of them
    if reduce_dtype is not None:
        grads = [g.to(reduce_dtype) for g in grads]
    # [S]: this rank's padded shard, the mean (an expert unit: the sum over edp divided by dp x cp)
    reduced = reduce_scatter_mean_packed(grads, specs, group, divide_factor=unit.divide_factor)
    if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
        all_reduce_mean_(reduced, replicate_group)  # HSDP: and the mean over the replicas
    local = unpack_reduce_scatter(reduced, specs)
    for sp, g in zip(with_grad, local, strict=True):
        g = g.to(sp.sharded.dtype)  # fp32 gradient shards for the fp32 master shards
        sp.sharded.grad = g.clone() if sp.sharded.grad is None else sp.sharded.grad.add_(g)
        sp.unsharded.grad = None


def all_gather_full(unit: FSDPUnit, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every parameter of the unit in full, new tensors in the shards' dtype (one all-gather). Collective."""
    specs = [sp.spec for sp in unit.params]
    outs = [sp.sharded.new_empty(sp.spec.shape) for sp in unit.params]
    all_gather_into([sp.sharded.detach() for sp in unit.params], specs, outs, group)
    return outs


@torch.no_grad()
def full_parameters(units: list[FSDPUnit], module: nn.Module,
                    group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` in full, by its name, on every rank: each unit all-gathered once
    (``all_gather_full``). Collective."""
    full: dict[int, torch.Tensor] = {}
    for unit in units:
        if unit.params:
            for sp, t in zip(unit.params, all_gather_full(unit, unit.group), strict=True):
                full[id(sp.sharded)] = t
    return {name: full[id(p)] for name, p in module.named_parameters()}
