"""ZeRO-3's schedule in its simplest form: gather a unit before it runs, free it after (exercises 04.3-04.5).

The naive version, kept beside ``refimpl.parallel.zero.fully_sharded_data_parallel``: synchronous
all-gathers and no gradient reduction. The step from here to ``FullyShardedDataParallel`` (one
collective per unit, prefetch, reduce-scatter when a unit's gradients are ready) is chapter 04's lesson.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from refimpl.parallel.zero.fsdp_unit import _alloc, _free, _tensors
from refimpl.parallel.zero.sharding import ShardSpec
from refimpl.parallel.zero.zero_communications import _world, all_gather_into


def unshard_(
    fulls: Sequence[torch.Tensor], shards: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> None:
    """ZeRO-3 before a unit runs: give the full tensors ``fulls`` (storage freed) every rank's rows again.

    The storage of each full tensor is re-allocated in place (``untyped_storage().resize_``) and filled
    through ``.data``, which leaves the version counter alone: tensors that autograd saved in the forward
    pass (the parameter, or views of it such as ``weight.t()``) see the new values and stay valid.
    """
    rank, n = _world(group)
    for f in fulls:
        _alloc(f)
    specs = [ShardSpec(f.shape, rank, n) for f in fulls]
    all_gather_into([s.detach() for s in shards], specs, [f.data for f in fulls], group)


def reshard_(fulls: Sequence[torch.Tensor]) -> None:
    """ZeRO-3 after a unit ran: free the memory of the full tensors, keep the tensors (storage size 0)."""
    for f in fulls:
        _free(f)


# one schedule as closures over its state: each hook is a few lines, their sum counts as one function
def install_unit_hooks(  # noqa: C901
    units: Sequence[nn.Module], fulls: Sequence[Sequence[torch.Tensor]],
    shards: Sequence[Sequence[torch.Tensor]], group: dist.ProcessGroup | None = None, *,
    prefetch: bool = False,
) -> list:
    """ZeRO-3's schedule around units that run one after the other: the lesson behind
    ``FullyShardedDataParallel``, synchronous and without the gradient reduction.

    ``units[u]`` runs ``u``-th in forward; ``fulls[u]`` are its full parameters (registered in its modules,
    storage freed) and ``shards[u]`` this rank's rows of them. Hooks make each step:

    * before unit ``u``'s forward: gather it (``unshard_``), and with ``prefetch`` unit ``u + 1`` too;
    * after its forward: free it (``reshard_``), and register a hook on its output for the backward;
    * before its backward (the gradient of its output has arrived): gather it again, with ``prefetch``
      unit ``u - 1`` too;
    * when every parameter of the unit has its gradient accumulated: free it (the full ``.grad`` stays).

    A unit already gathered is not gathered again, so every unit is all-gathered exactly twice per step,
    prefetch or not. Returns the hook handles.
    """
    gathered = [False] * len(units)
    ready = [0] * len(units)
    handles: list = []

    def gather(u: int) -> None:
        if 0 <= u < len(units) and not gathered[u]:
            unshard_(fulls[u], shards[u], group)
            gathered[u] = True

    def free(u: int) -> None:
        reshard_(fulls[u])
        gathered[u] = False

    def on_forward_pre(u: int):
        def hook(module: nn.Module, args: tuple) -> None:
            gather(u)
            if prefetch:
                gather(u + 1)
        return hook

    def on_forward(u: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            free(u)
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                def before_backward(_grads: object) -> None:
                    gather(u)
                    if prefetch:
                        gather(u - 1)
                torch.autograd.graph.register_multi_grad_hook(tensors, before_backward, mode="any")
        return hook

    def on_grad(u: int):
        def hook(param: torch.Tensor) -> None:
            ready[u] += 1
            if ready[u] == sum(1 for f in fulls[u] if f.requires_grad):
                ready[u] = 0
                free(u)
        return hook

    for u, unit in enumerate(units):
        handles.append(unit.register_forward_pre_hook(on_forward_pre(u)))
        handles.append(unit.register_forward_hook(on_forward(u)))
        handles += [f.register_post_accumulate_grad_hook(on_grad(u)) for f in fulls[u] if f.requires_grad]
    return handles
