"""ZeRO stages 1 and 2: the sharded optimizer (Rajbhandari et al. 2020; chapter 04).

* **stage 1** (``ShardedOptimizer``, ``zero_stage=1``): each rank keeps optimizer state for its shard
  only. After backward the gradients are *reduce-scattered* (each rank receives the mean of its shard),
  the rank steps its shard, and the updated shards are *all-gathered* into every rank's full parameters.
  Reduce-scatter + all-gather move exactly what one all-reduce moves: no extra traffic.
* **stage 2** (``zero_stage=2``): the same, but each gradient is reduce-scattered as soon as backward produced
  it (in buckets) and the full gradient is freed: a rank keeps only its shard of the gradients.

Assumption, as for DDP without ``find_unused_parameters``: every rank uses the same parameters in a step
(collectives are issued in the order gradients arrive, which must be the same everywhere). The same step
tensor by tensor, without buckets, is ``refimpl.parallel.zero.sharded_step.sharded_step``.

**Shard groups** (chapter 09): a parameter given a ``ShardGroup`` is sharded over that group instead,
and its gradient's sum divided by the group's ``divide_factor``: under expert parallelism an expert tensor
is sharded over the expert-data-parallel group (the ranks that hold the same experts) and its gradient
summed there and divided by ``dp x cp`` (``refimpl.parallel.expert_parallel_gpt``), as torchtitan shards
the experts with a second ``fully_shard`` over its ``efsdp`` mesh and Megatron-LM's distributed optimizer
over the expert-data-parallel group. Each group's collectives are issued in the parameters' order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn

from refimpl.distributed.placement import Box
from refimpl.measure.state import StateMemory, state_bytes
from refimpl.parallel.data_parallel.bucket import assign_buckets
from refimpl.parallel.zero.clip_grad import clip_sharded_grad_norm_
from refimpl.parallel.zero.sharding import ShardSpec, shard_of
from refimpl.parallel.zero.zero_communications import _world, all_gather_into, reduce_scatter_mean


def _buckets(items: Sequence, sizes: Sequence[int], limit: int) -> list[list]:
    """``items`` in buckets of about ``limit`` elements: refimpl's one bucketing rule, DDP's (reverse order,
    a bucket closed once it holds ``limit``; whole tensors, since a packed shard is not split), from
    ``refimpl.parallel.data_parallel.bucket.assign_buckets``."""
    return [[items[i] for i in bucket] for bucket in assign_buckets(sizes, limit, whole_tensors=True)]


@dataclass(frozen=True, kw_only=True)
class ShardGroup:
    """The process group a parameter is sharded over, and what its gradient's sum is divided by (None: the
    group's size, a mean)."""

    group: dist.ProcessGroup | None
    divide_factor: int | None = None


def _is_sharded_state(value: object, shard: torch.Tensor) -> bool:
    """An optimizer state entry with one value per element of the shard (a moment), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any ``torch.optim`` optimizer (Rajbhandari et al. 2020; chapter 04).

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` behaves like the wrapped
    optimizer on the full parameters of a data-parallel model, but each rank builds the inner optimizer
    (``self.optimizer``) over *views of its rows* of every parameter, so it keeps state for ``1/N`` of
    them. Do not all-reduce the gradients yourself: ``step()`` averages them.

    * ``zero_stage=1``: the full gradients stay where backward put them; ``step()`` reduce-scatters them,
      steps the shards, all-gathers the updated rows into the parameters.
    * ``zero_stage=2``: a hook reduce-scatters the gradients during backward, in buckets of about
      ``bucket_numel`` elements, keeps the rank's shard (the ``.grad`` of the shard views) and frees the
      full gradient (``param.grad`` is None after backward).

    ``param_groups`` are the full-parameter groups (change ``lr`` there, as with any optimizer; it is
    copied to the inner optimizer at each step). ``state_dict()`` is the *consolidated* state, the one the
    wrapped optimizer would have on a single device, and ``load_state_dict`` accepts it at any world size;
    both are collective calls.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_cls: type[torch.optim.Optimizer],
        group: dist.ProcessGroup | None = None,
        *,
        zero_stage: int = 1,
        bucket_numel: int = 2**20,
        shard_groups: Mapping[torch.Tensor, ShardGroup] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if zero_stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer is ZeRO stages 1 and 2, got zero_stage={zero_stage!r}; "
                             "stage 3 is FullyShardedDataParallel")
        self.group = group
        self.rank, self.world_size = _world(group)
        self.zero_stage = zero_stage
        self.bucket_numel = bucket_numel
        self._shard_groups = dict(shard_groups or {})  # parameter -> its ShardGroup (default: group, mean)
        self._specs: dict[torch.Tensor, ShardSpec] = {}
        self._shards: dict[torch.Tensor, torch.Tensor] = {}
        self._inner_groups: list[dict] = []
        self._hooks: list = []
        self._pending: list[torch.Tensor] = []  # stage 2: gradients ready, not yet reduced
        self._pending_numel = 0
        self._callback_queued = False
        self._grads_reduced = False  # stage 1: the shards' .grad hold this step's mean gradient
        super().__init__(params, dict(optimizer_kwargs))
        self.optimizer = optimizer_cls(self._inner_groups, **optimizer_kwargs)
        self.state = self.optimizer.state  # keyed by the shard views
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in inner.items():
                if key != "params":
                    outer.setdefault(key, value)

    # -- construction ----------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        shards = []
        for p in group["params"]:
            if not p.is_contiguous():
                raise ValueError("ShardedOptimizer needs contiguous parameters (a shard is a view of rows)")
            rank, world = _world(self.reduction(p)[0])
            spec = ShardSpec(p.shape, rank, world)
            self._specs[p] = spec
            self._shards[p] = shard_of(p.detach(), spec)  # a leaf view: stepping it updates p in place
            shards.append(self._shards[p])
            if self.zero_stage == 2 and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        inner = {k: v for k, v in group.items() if k != "params"} | {"params": shards}
        if hasattr(self, "optimizer"):
            self.optimizer.add_param_group(inner)
        else:
            self._inner_groups.append(inner)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def reduction(self, param: torch.Tensor) -> tuple[dist.ProcessGroup | None, int | None]:
        """``(the group param is sharded over, what its gradient's sum is divided by; None: the group's
        size)`` (``ShardGroup``; default: the optimizer's group, a mean)."""
        shard_group = self._shard_groups.get(param)
        return (self.group, None) if shard_group is None else (shard_group.group, shard_group.divide_factor)

    def _by_group(self, params: Sequence[torch.Tensor]) -> list[tuple[tuple, list[torch.Tensor]]]:
        """``params`` split by their reduction (``reduction``), each in the given order."""
        out: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            group, divide = self.reduction(p)
            out.setdefault((id(group), divide), []).append(p)
        return [(self.reduction(ps[0]), ps) for ps in out.values()]

    def shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``param`` (the tensor the inner optimizer steps)."""
        return self._shards[param]

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, built over this rank's shards: it holds the (sharded) state."""
        return self.optimizer

    def local_state_shards(self) -> list[tuple[torch.Tensor, torch.Tensor, Box]]:
        """Per parameter: ``(param, the tensor the inner optimizer steps, its Box inside param)``, the
        rows ``ShardSpec`` gives this rank (the checkpoint composes it with param's own box)."""
        return [(p, self._shards[p], self._specs[p].box) for p in self.params]

    # -- gradients -------------------------------------------------------------------------------------

    def _reduce(self, params: list[torch.Tensor]) -> None:
        """Reduce-scatter ``params``' gradients; add the mean of this rank's rows to the shards' grads."""
        for (group, divide), members in self._by_group(params):
            sizes = [self._specs[p].padded_numel for p in members]
            for bucket in _buckets(members, sizes, self.bucket_numel):
                specs = [self._specs[p] for p in bucket]
                local = reduce_scatter_mean([p.grad for p in bucket], specs, group, divide_factor=divide)
                for p, g in zip(bucket, local, strict=True):
                    shard = self._shards[p]
                    shard.grad = g.clone() if shard.grad is None else shard.grad.add_(g)

    def _on_grad_ready(self, param: torch.Tensor) -> None:  # stage 2, inside backward
        if param.grad is None:  # a deferred weight gradient (zbh1): it comes in its W action
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._callback_queued = True
        self._pending.append(param)
        self._pending_numel += self._specs[param].padded_numel
        if self._pending_numel >= self.bucket_numel:
            self._flush_bucket()

    def _flush_bucket(self) -> None:
        bucket, self._pending, self._pending_numel = self._pending, [], 0
        if bucket:
            self._reduce(bucket)
            for p in bucket:
                p.grad = None  # the full gradient is gone: only the shard stays

    def _flush(self) -> None:  # stage 2, at the end of backward
        self._callback_queued = False
        self._flush_bucket()

    def reduce_gradients_now(self, params: Sequence[torch.Tensor]) -> None:
        """Stage 2, outside backward: reduce-scatter ``params``' gradients into the shards now and free
        them, as the hooks do in backward (zero-bubble's ``W`` actions add weight gradients after their
        backward: ``refimpl.parallel.pipeline_parallel.WeightGradStore.after_flush``)."""
        ready = [p for p in params if p.grad is not None]
        if self.zero_stage == 2 and ready:
            self._reduce(ready)
            for p in ready:
                p.grad = None

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter the full gradients into the shards (``step`` calls it if needed)."""
        if self.zero_stage == 1 and not self._grads_reduced:
            self._reduce([p for p in self.params if p.grad is not None])
            self._grads_reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm.

        The norm of the whole (averaged) gradient from the shards: each rank sums the squares of its
        rows, one all-reduce adds the sums. Same rule as ``torch.nn.utils.clip_grad_norm_``. (With shard
        groups that split the optimizer's group, e.g. experts over ``ep x edp = dp x cp``, every rank still
        holds disjoint rows, so the sum over the group counts each element once.)
        """
        self.reduce_gradients()
        grads = [s.grad for s in self._shards.values() if s.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, device=self.params[0].device,
                                       group=self.group, world_size=self.world_size)

    # -- the step --------------------------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        for group, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in group.items() if k != "params"})
        self.optimizer.step()
        stepped = [p for p in self.params if self._shards[p].grad is not None]
        for (group, _), members in self._by_group(stepped):
            sizes = [self._specs[p].padded_numel for p in members]
            for bucket in _buckets(members, sizes, self.bucket_numel):
                all_gather_into([self._shards[p] for p in bucket], [self._specs[p] for p in bucket],
                                [p.detach() for p in bucket], group)
        if self.zero_stage == 1:
            for p in stepped:
                self._shards[p].grad = None  # stage 1 keeps full gradients only; the shard was transient
        self._grads_reduced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            for t in (p, self._shards[p]):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.zero_()
        self._grads_reduced = False

    # -- state dict ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The consolidated state (the wrapped optimizer's format, full tensors) on every rank. Collective."""
        state: dict[int, dict] = {}
        for index, p in enumerate(self.params):
            shard = self._shards[p]
            local = self.optimizer.state.get(shard, {})
            entry = {}
            for key in sorted(local):
                value = local[key]
                if _is_sharded_state(value, shard):
                    full = value.new_empty(p.shape)
                    all_gather_into([value], [self._specs[p]], [full], self.reduction(p)[0])
                    entry[key] = full
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if entry:
                state[index] = entry
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params"}
                          | {"params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state (``state_dict``, or a plain optimizer's); keep this rank's rows."""
        params = self.params
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's")
        inner_state = {}
        for index, p in enumerate(params):
            full = state_dict["state"].get(index)
            if full is None:
                continue
            spec = self._specs[p]
            inner_state[index] = {
                k: shard_of(v, spec).clone() if _is_sharded_state(v, p) else v for k, v in full.items()
            }
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": [dict(g) for g in groups]})

    def state_bytes(self, module: nn.Module | None = None) -> StateMemory:
        """Parameter, gradient and optimizer-state bytes this rank holds (``refimpl.measure.state``)."""
        return state_bytes(module if module is not None else self.params, self)
