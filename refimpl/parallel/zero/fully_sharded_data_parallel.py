"""ZeRO stage 3: the fully sharded module (Rajbhandari et al. 2020; FSDP, Zhao et al. 2023; chapter 04).

Parameters are sharded too. The module is cut into *units* (a transformer block each, the rest in the root
unit); a unit is all-gathered just before its forward, freed after it, all-gathered again before its
backward, and its gradients reduce-scattered. One extra all-gather per unit: 1.5x the traffic of data
parallelism. ``refimpl.parallel.zero.unit_hooks.install_unit_hooks`` is the same schedule in its
simplest form (synchronous, no reduction), the lesson and exercise 04.4-04.5. This file is the schedule
(hooks, prefetch order, accounting); ``refimpl.parallel.zero.fsdp_communications`` shards the units
and runs each unit's collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from refimpl.distributed.placement import Box, LocalShard, module_shards
from refimpl.measure.state import StateMemory
from refimpl.parallel.declarations import declared
from refimpl.parallel.zero.clip_grad import clip_sharded_grad_norm_
from refimpl.parallel.zero.fsdp_communications import (
    finish_all_gather,
    free_full_params,
    full_parameters,
    reduce_scatter_grads,
    shard_into_units,
    start_all_gather,
)
from refimpl.parallel.zero.fsdp_unit import (
    FSDPUnit,
    _cast_floats,
    _tensors,
    gathered_bytes,
    held_bytes,
    units_local_shards,
)
from refimpl.parallel.zero.zero_communications import _world
from refimpl.precision import MixedPrecisionPolicy


class FullyShardedDataParallel(nn.Module):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded over the ranks (chapter 04).

    ``FullyShardedDataParallel(model, unit_types=(Block,))`` makes every submodule of a type in
    ``unit_types`` a unit and puts the remaining parameters in the root unit. ``unit_types`` None: the
    types the model declares (``shard_units()``, ``refimpl.parallel.declarations``); a model that
    declares none is refused (there is no silent default: ``()`` makes the whole model one unit). Each
    parameter is replaced by this rank's rows (``model.parameters()`` yields the shards: build a plain
    optimizer on them and its state is sharded too). Around each unit:

    * before forward: all-gather the unit (one collective for all its parameters) into full tensors and
      register them in the modules; with ``prefetch`` the next unit's all-gather is started too;
    * after forward: put the shards back and free the full tensors (storage resized to 0, so the tensors
      autograd saved stay valid), except for the root unit, which backward needs again at once;
    * before its backward (a hook on the unit's output): all-gather again (prefetching the previous unit);
    * when every gradient of the unit has arrived: reduce-scatter them (mean over ranks), add this rank's
      rows to the shards' ``.grad``, free the full gradients and the full parameters (a unit with frozen
      parameters is freed at the end of backward: its frozen weights may still be needed for the gradient
      of their input).

    Shared parameters (tied embeddings) must be in one unit: a parameter registered in two units moves to
    the root unit. Frozen parameters are gathered but never reduced. Gradient accumulation works by
    calling backward several times (each reduces its gradients). ``full_state_dict()`` gathers the full
    parameters (collective).

    **Hybrid sharding** (HSDP, ``replicate_group``; FSDP2's ``fully_shard`` on a 2-D mesh): ``group`` is a
    shard group of ``S`` ranks and ``replicate_group`` the ``R`` ranks holding the same shard in the other
    shard groups. The gradients are reduce-scattered (mean) over the shard group, then the shards
    all-reduced (mean) over the replicas: ``(1/R) sum_r (1/S) sum_s g_{r,s}``, the mean over the ``R S``
    ranks; the all-gathers stay inside a shard group (a node), only the shards' all-reduce crosses.

    **Units of their own group** (``own_groups``: ``{submodule: (group, divide_factor)}``; torchtitan's
    ``fully_shard`` of the experts on the ``efsdp`` mesh, chapter 09): such a submodule is a unit wherever
    it sits (inside a block unit too), sharded over its own group, its gradients reduce-scattered there and
    divided by ``divide_factor`` (None: that group's size). An expert-parallel rank's experts are sharded
    over the expert-data-parallel group and their gradients divided by ``dp x cp``, not averaged over it
    (``refimpl.parallel.expert_parallel_gpt``). Not with HSDP.

    **Mixed precision** (``mp_policy``, a ``refimpl.precision.MixedPrecisionPolicy``; chapter 05),
    as FSDP2's ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` does it: the
    shards stay fp32 (the master weights; the optimizer and its state see only them), the all-gather and
    the unit's compute run in ``param_dtype`` (floating-point inputs cast to it, ``output_dtype`` the
    output's when given), the reduce-scatter in ``reduce_dtype``
    (``refimpl.parallel.zero.fsdp_communications`` has the casts). Buffers are left alone.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        unit_types: tuple[type[nn.Module], ...] | None = None,
        prefetch: bool = False,
        reshard_after_forward: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        declare_on_module: bool = False,
        output_dtype: torch.dtype | None = None,
        own_groups: dict[nn.Module, tuple[dist.ProcessGroup | None, int | None]] | None = None,
    ) -> None:
        super().__init__()
        if unit_types is None:  # the model's declaration, or a refusal saying to pass unit_types
            unit_types = tuple(declared(module, "shard_units")())
        self.module = module
        self.group = group
        self.replicate_group = replicate_group  # HSDP: the shards' replicas, one per shard group
        self.rank, self.world_size = _world(group)
        # FSDP2's MixedPrecisionPolicy: gather and compute in param_dtype, reduce in reduce_dtype
        self.param_dtype = None if mp_policy is None else mp_policy.param_dtype
        self.reduce_dtype = None if mp_policy is None else mp_policy.reduce_dtype
        self.output_dtype = output_dtype  # FSDP2's output_dtype: a pipeline stage's boundary is float32
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        # where each parameter of the wrapped module lies before sharding (a tensor-parallel layer's block,
        # else the whole tensor): the boxes the row shards are composed into (2-D sharding, local_shards)
        self.inner_boxes: dict[str, Box] = {n: s.box for n, s in module_shards(module).items()}
        if own_groups and replicate_group is not None:
            raise ValueError("units with their own group (experts) under HSDP are not built")
        self.units = shard_into_units(module, unit_types, rank=self.rank, world_size=self.world_size,
                                      param_dtype=self.param_dtype, own_groups=own_groups)  # [root, ...]
        for unit in self.units:
            if unit.module not in (own_groups or {}):
                unit.group = group  # the others: the wrapper's group (an own unit keeps its own)
        self._forward_order: list[FSDPUnit] = []  # units in the order this step's forward ran them
        self._last_order: list[FSDPUnit] = list(self.units[1:])  # ... and the previous step's
        self._callback_queued = False
        self.requires_gradient_sync = True  # False: backward keeps the full gradients (micro-batches)
        root = self.units[0]
        root.hooks.append(module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        root.hooks.append(module.register_forward_hook(self._root_post_forward))
        if declare_on_module:  # FSDP2's in-place shape: the module itself now says what this rank holds
            # the ignore: torch types Module.__setattr__'s value as Tensor | Module, not a method
            module.local_shards = self.local_shards  # type: ignore[assignment]
        for unit in self.units[1:]:
            unit.hooks.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            unit.hooks.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        for unit in self.units:
            for sp in unit.trainable:
                sp.unsharded.register_post_accumulate_grad_hook(self._make_grad_ready(unit))
        self._root = root

    # -- gather and free (the collectives are fsdp_communications') ----------------------------------

    def unshard(self, unit: FSDPUnit) -> None:
        """Make the unit's full parameters available (wait for a prefetch, or all-gather now)."""
        finish_all_gather(unit, unit.group)

    def reshard(self, unit: FSDPUnit) -> None:
        """Free the unit's full parameters (the shards stay, and the modules point at them again)."""
        self._use(unit, "sharded")
        free_full_params(unit, unit.group)

    @staticmethod
    def _use(unit: FSDPUnit, which: str) -> None:
        for sp in unit.params:
            t = sp.unsharded if which == "unsharded" else sp.sharded
            for m, name in sp.registrations:
                m._parameters[name] = t

    # -- hooks -----------------------------------------------------------------------------------------

    def _make_pre_forward(self, unit: FSDPUnit):
        def hook(module: nn.Module, args: tuple) -> None:
            self._forward_order.append(unit)
            self._unshard_for_forward(unit)
        return hook

    def _unshard_for_forward(self, unit: FSDPUnit) -> None:
        """Gather ``unit``, point its modules at the full tensors, start gathering the next unit."""
        self.unshard(unit)
        self._use(unit, "unsharded")
        if self.prefetch:
            following = self._neighbour(unit, +1)
            if following is not None:
                start_all_gather(following, following.group)

    def _make_post_forward(self, unit: FSDPUnit):
        def hook(module: nn.Module, args: tuple, output: object) -> object:
            self._use(unit, "sharded")
            if self.reshard_after_forward:
                self.reshard(unit)
            self._register_pre_backward(unit, output)
            return output
        return hook

    def _neighbour(self, unit: FSDPUnit, step: int) -> FSDPUnit | None:
        """The unit run ``step`` places after ``unit`` in forward order (this step's order going backward,
        the previous step's going forward; the root comes before every unit)."""
        order = self._forward_order if step < 0 else self._last_order
        if unit is self._root:
            return (order[-1] if step < 0 else order[0]) if order else None
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    def _register_pre_backward(self, unit: FSDPUnit, output: object) -> None:
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return

        def pre_backward(_grads: object) -> None:
            self._queue_final_callback()
            self._unshard_for_backward(unit)
            if self.prefetch:
                previous = self._neighbour(unit, -1)
                if previous is not None:
                    start_all_gather(previous, previous.group)

        torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")

    def _unshard_for_backward(self, unit: FSDPUnit) -> None:
        """Gather ``unit`` for its backward and point its modules at the full tensors: the saved tensors of
        a plain block refer to them already, and a checkpointed block's recomputed forward (which runs in
        backward, after this hook, without the module hooks) reads the weights from the modules. The
        modules get the shards back when the unit is freed (FSDP2 re-gathers under ``checkpoint`` alike)."""
        self.unshard(unit)
        self._use(unit, "unsharded")

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _make_grad_ready(self, unit: FSDPUnit):
        def hook(param: torch.Tensor) -> None:
            self._queue_final_callback()
            unit.ready += 1
            if unit.ready == len(unit.trainable) and self.requires_gradient_sync:
                self._reduce(unit)
        return hook

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """FSDP2's switch for micro-batches: with ``False`` a backward keeps each unit's full gradients
        (accumulating over the micro-batches; the units are freed after it only if
        ``reshard_after_forward``) and reduce-scatters nothing; ``finish_gradient_sync`` then reduces
        them once. Pipeline parallelism under ZeRO-3 runs its schedule so (chapter 08)."""
        self.requires_gradient_sync = requires

    def finish_gradient_sync(self) -> None:
        """Reduce-scatter every unit's accumulated full gradients into the shards' ``.grad`` (once) and free
        the units: the end of a step whose backwards ran without gradient sync."""
        for unit in self.units:
            if any(sp.unsharded.grad is not None for sp in unit.trainable):
                self._reduce(unit)
            self.reshard(unit)
            unit.ready, unit.reduced = 0, False

    def _reduce(self, unit: FSDPUnit) -> None:
        """Reduce-scatter the unit's gradients into the shards' ``.grad``; free the full ones and the unit."""
        reduce_scatter_grads(unit, unit.group, self.reduce_dtype, replicate_group=self.replicate_group)
        unit.reduced = True
        if len(unit.trainable) == len(unit.params):
            # Every operation that reads these parameters has run: it produced their gradients. A frozen
            # parameter may still be read later (for its input's gradient): then wait for the end.
            self.reshard(unit)

    def _finish_backward(self) -> None:
        """End of backward: reduce units some of whose parameters got no gradient; free every unit. Without
        gradient sync: nothing is reduced, and the units are freed only if ``reshard_after_forward``."""
        self._callback_queued = False
        if not self.requires_gradient_sync:
            for unit in self.units:
                if self.reshard_after_forward:
                    self.reshard(unit)
                unit.ready = 0
            return
        for unit in self.units:
            pending = any(sp.unsharded.grad is not None for sp in unit.trainable)
            if pending and not unit.reduced:
                self._reduce(unit)
            self.reshard(unit)
            unit.ready, unit.reduced = 0, False

    # -- forward ---------------------------------------------------------------------------------------

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)  # the root unit's hooks on the module gather and free it

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._forward_order:
            self._last_order = self._forward_order
        self._forward_order = []
        self._unshard_for_forward(self._root)
        if self.param_dtype is None:
            return None
        # FSDP2's cast_forward_inputs (token ids stay)
        return tuple(_cast_floats(a, self.param_dtype) for a in args), kwargs

    def _root_post_forward(self, module: nn.Module, args: tuple, output: object) -> object:
        self._use(self._root, "sharded")
        if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output)):
            self._register_pre_backward(self._root, output)
        elif self.requires_gradient_sync:  # no backward will come (evaluation): free everything now
            for unit in self.units:
                self.reshard(unit)
        return output if self.output_dtype is None else _cast_floats(output, self.output_dtype)

    # -- utilities -------------------------------------------------------------------------------------

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [sp.sharded for u in self.units for sp in u.params]

    def local_shards(self) -> dict[str, LocalShard]:
        """What this rank holds, by name in the wrapped module: the row shards, 2-D inside a tensor-parallel
        block (``refimpl.parallel.zero.fsdp_unit.units_local_shards``), the buffers whole."""
        return units_local_shards(self.module, self.units, self.inner_boxes)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (from the shards, one all-reduce); return the norm before. Not
        with units of their own group (experts: ``refimpl.parallel.placements.clip_grad_norm_``)."""
        if any(unit.group is not self.group for unit in self.units):
            raise ValueError("units sharded over other groups (experts): clip by their placements "
                             "(refimpl.parallel.placements.clip_grad_norm_)")
        grads = [p.grad for p in self.sharded_parameters() if p.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, device=self.sharded_parameters()[0].device,
                                       group=self.group, world_size=self.world_size)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, by its name in the wrapped module, on every rank. Collective."""
        return full_parameters(self.units, self.module, self.group)

    def gathered_bytes(self) -> StateMemory:
        """Bytes of *full* tensors this rank holds now (gathered weights and all-gathers in flight, full
        gradients not yet reduced; ``refimpl.parallel.zero.fsdp_unit.gathered_bytes``)."""
        return gathered_bytes(self.units)

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> StateMemory:
        """Bytes this rank holds now in parameters, gradients and optimizer state, gathered tensors included
        (``refimpl.parallel.zero.fsdp_unit.held_bytes``)."""
        return held_bytes(self.units, optimizer)

