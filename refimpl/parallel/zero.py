"""ZeRO from scratch: a sharded optimizer (stages 1 and 2) and a fully sharded module (stage 3) (chapter 04).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; the
fully sharded module follows FSDP (Zhao et al. 2023) and its second version, ``fully_shard``.

Data parallelism keeps a full copy of the parameters, the gradients and the optimizer state on every rank.
ZeRO removes the copies one kind at a time, without changing the arithmetic:

* **stage 1** (:class:`ShardedOptimizer`, ``stage=1``): each rank keeps optimizer state for its shard
  only. After backward the gradients are *reduce-scattered* (each rank receives the mean of its shard),
  the rank steps its shard, and the updated shards are *all-gathered* into every rank's full parameters.
  Reduce-scatter + all-gather move exactly what one all-reduce moves: no extra traffic.
* **stage 2** (``stage=2``): the same, but each gradient is reduce-scattered as soon as backward produced
  it (in buckets) and the full gradient is freed: a rank keeps only its shard of the gradients.
* **stage 3** (:class:`FullyShardedDataParallel`): parameters are sharded too. The module is cut into
  *units* (a transformer block each, the rest in the root unit); a unit is all-gathered just before its
  forward, freed after it, all-gathered again before its backward, and its gradients reduce-scattered.
  One extra all-gather per unit: 1.5x the traffic of data parallelism. :func:`install_unit_hooks` is the
  same schedule in its simplest form (synchronous, no reduction), the lesson and exercise 04.4-04.5.

**How a tensor is split.** Every parameter is split along dim 0 into chunks of ``ceil(rows / N)`` rows,
rank ``r`` owning chunk ``r`` (FSDP2's ``Shard(0)``; the last ranks may own fewer rows or none). A
collective over several tensors packs them side by side: the input of a reduce-scatter is an ``[N, S]``
matrix whose row ``r`` holds chunk ``r`` of every tensor, each padded to ``ceil(rows / N)`` rows, so one
collective serves many tensors of uneven sizes (:func:`pack_for_reduce_scatter`,
:func:`pack_for_all_gather`, :func:`copy_out_all_gather`). The padding lives only in these transient
buffers: what a rank keeps is its exact shard, and :mod:`refimpl.parallel.zero_planner` predicts its bytes.

Gradients are averaged over the ranks (sum, then divide by N), as ``DistributedDataParallel`` does, so a
loss that is the mean over the rank's tokens gives the mean over the global batch. Every communication
goes through :mod:`refimpl.comm.ops`, so :class:`refimpl.comm.tracer.CommTracer` sees it.

Assumption, as for DDP without ``find_unused_parameters``: every rank uses the same parameters in a step
(collectives are issued in the order gradients arrive, which must be the same everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.parallel.memory import StateMemory, state_bytes, storage_bytes
from refimpl.parallel.zero_planner import shard_rows
from refimpl.precision import MixedPrecisionPolicy

__all__ = [
    "FullyShardedDataParallel",
    "ShardSpec",
    "ShardedOptimizer",
    "allreduce_gradients",
    "copy_out_all_gather",
    "fp16_divide_factors",
    "install_unit_hooks",
    "pack_for_all_gather",
    "pack_for_reduce_scatter",
    "reshard_",
    "shard_of",
    "sharded_step",
    "unpack_reduce_scatter",
    "unshard_",
]


# ----------------------------------------------------------------------------------------------------------
# How a tensor is cut into N shards, and how many tensors share one collective
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """Where ``rank``'s shard of a tensor of ``shape`` lies: rows ``[start, end)`` of dim 0.

    ``chunk`` rows per rank (``ceil(rows / N)``), so ``padded_numel = chunk * row_numel`` is what each rank
    contributes to a collective and ``numel`` (possibly 0) what it keeps.
    """

    shape: torch.Size
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if len(self.shape) == 0:
            raise ValueError("0-d parameters cannot be sharded along dim 0; reshape them to [1]")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return self.shape[1:].numel()

    @property
    def chunk(self) -> int:
        return -(-self.rows // self.world_size)

    @property
    def start(self) -> int:
        return shard_rows(self.rows, self.rank, self.world_size)[0]

    @property
    def end(self) -> int:
        return shard_rows(self.rows, self.rank, self.world_size)[1]

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.end - self.start, *self.shape[1:]))

    @property
    def numel(self) -> int:
        return (self.end - self.start) * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.row_numel

    def rows_of(self, rank: int) -> tuple[int, int]:
        return shard_rows(self.rows, rank, self.world_size)


def shard_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``rank``'s rows of ``full``: a view (it shares memory with ``full``)."""
    return full[spec.start : spec.end]


def pack_for_all_gather(shards: Sequence[torch.Tensor], specs: Sequence[ShardSpec]) -> torch.Tensor:
    """This rank's all-gather input: its shards side by side, each padded to ``chunk`` rows. ``[S]``."""
    total = sum(s.padded_numel for s in specs)
    out = shards[0].new_zeros(total) if shards else torch.zeros(0)
    offset = 0
    for shard, spec in zip(shards, specs, strict=True):
        out[offset : offset + spec.numel].copy_(shard.reshape(-1))
        offset += spec.padded_numel
    return out


def copy_out_all_gather(
    gathered: torch.Tensor, specs: Sequence[ShardSpec], fulls: Sequence[torch.Tensor]
) -> None:
    """Scatter an all-gather output ``[N * S]`` into the full tensors ``fulls`` (written in place).

    Row ``r`` of ``gathered.view(N, S)`` is rank ``r``'s packed shards: tensor ``i`` sits at the same
    offset in every row, its first ``rows_of(r)`` rows valid, the rest padding.
    """
    n = specs[0].world_size if specs else 1
    rows_by_rank = gathered.view(n, -1)  # [N, S]
    offset = 0
    for spec, full in zip(specs, fulls, strict=True):
        dst = full.view(spec.rows, spec.row_numel)  # [rows, row_numel]
        for r in range(n):
            start, end = spec.rows_of(r)
            block = rows_by_rank[r, offset : offset + (end - start) * spec.row_numel]
            dst[start:end].copy_(block.view(end - start, spec.row_numel))
        offset += spec.padded_numel


def pack_for_reduce_scatter(grads: Sequence[torch.Tensor], specs: Sequence[ShardSpec]) -> torch.Tensor:
    """The reduce-scatter input ``[N, S]``: row ``r`` holds chunk ``r`` of every gradient, zero-padded."""
    n = specs[0].world_size if specs else 1
    total = sum(s.padded_numel for s in specs)
    out = grads[0].new_zeros(n, total) if grads else torch.zeros(n, 0)
    offset = 0
    for grad, spec in zip(grads, specs, strict=True):
        rows = grad.reshape(spec.rows, spec.row_numel)  # [rows, row_numel]
        for r in range(n):
            start, end = spec.rows_of(r)
            out[r, offset : offset + (end - start) * spec.row_numel].copy_(rows[start:end].reshape(-1))
        offset += spec.padded_numel
    return out


def unpack_reduce_scatter(reduced: torch.Tensor, specs: Sequence[ShardSpec]) -> list[torch.Tensor]:
    """This rank's gradient shards (views into the reduce-scatter output ``[S]``), padding dropped."""
    out, offset = [], 0
    for spec in specs:
        out.append(reduced[offset : offset + spec.numel].view(spec.local_shape))
        offset += spec.padded_numel
    return out


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _buckets(items: Sequence, sizes: Sequence[int], limit: int) -> list[list]:
    """Consecutive items in buckets of about ``limit`` elements (one oversized item is a bucket alone)."""
    out: list[list] = []
    current: list = []
    filled = 0
    for item, size in zip(items, sizes, strict=True):
        if current and filled + size > limit:
            out.append(current)
            current, filled = [], 0
        current.append(item)
        filled += size
    if current:
        out.append(current)
    return out


def fp16_divide_factors(world_size: int) -> tuple[int, int]:
    """``(pre, post)`` with ``pre * post = N``, ``pre`` the smallest power of two >= ``sqrt(N)``: FSDP2
    divides fp16 gradients by ``pre`` before the sum and by ``post`` after it, so neither the summands
    underflow nor the sum overflows fp16's range (``_get_gradient_divide_factors`` in torch)."""
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return pre, world_size // pre


def reduce_scatter_mean(
    grads: Sequence[torch.Tensor], specs: Sequence[ShardSpec], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Mean over the ranks of this rank's shard of each gradient: one reduce-scatter for all of them.

    The collective runs in the gradients' dtype: sum, then divide by N (exact at N = 2, 4 in fp32 and
    bf16). In fp16 the division is split around the sum (:func:`fp16_divide_factors`), as FSDP2 does.
    """
    n = specs[0].world_size
    packed = pack_for_reduce_scatter(grads, specs)  # [N, S]
    reduced = packed.new_empty(packed.shape[1])  # [S]
    if n > 1:
        pre, post = fp16_divide_factors(n) if packed.dtype == torch.float16 else (1, n)
        if pre != 1:
            packed.div_(pre)
        ops.reduce_scatter_tensor(reduced, packed.view(-1), group=group)
        if post != 1:
            reduced.div_(post)
    else:
        reduced.copy_(packed[0])
    return unpack_reduce_scatter(reduced, specs)


def all_gather_into(
    shards: Sequence[torch.Tensor], specs: Sequence[ShardSpec], fulls: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
) -> None:
    """Write every rank's shards into ``fulls``: one all-gather for all of them."""
    n = specs[0].world_size
    packed = pack_for_all_gather(shards, specs)  # [S]
    gathered = packed.new_empty(n * packed.numel())  # [N * S]
    if n > 1:
        ops.all_gather_into_tensor(gathered, packed, group=group)
    else:
        gathered.copy_(packed)
    copy_out_all_gather(gathered, specs, fulls)


def allreduce_gradients(
    params: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None = None
) -> None:
    """Stage 0, plain data parallelism: average every ``.grad`` over the ranks with one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    _, n = _world(process_group)
    if not grads or n == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # [Psi]
    ops.all_reduce(flat, group=process_group)
    flat.div_(n)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sharded_step(
    params: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """One ZeRO step, tensor by tensor: the lesson that :class:`ShardedOptimizer` does in buckets.

    ``shards[i]`` is this rank's rows of ``params[i]`` (a view, see :func:`shard_of`) and ``optimizer``
    steps the shards. Each local gradient ``params[i].grad`` is reduce-scattered: the shard receives the
    mean over ranks of its rows. The optimizer steps the shards, and each parameter's rows are all-gathered
    back into the full parameter on every rank. Parameters without a gradient are skipped.
    """
    rank, n = _world(process_group)
    stepped = []
    for p, shard in zip(params, shards, strict=True):
        if p.grad is None:
            continue
        spec = ShardSpec(p.shape, rank, n)
        shard.grad = reduce_scatter_mean([p.grad], [spec], process_group)[0].clone()
        stepped.append((p, shard, spec))
    optimizer.step()
    with torch.no_grad():
        for p, shard, spec in stepped:
            all_gather_into([shard], [spec], [p.detach()], process_group)
            shard.grad = None


def unshard_(
    fulls: Sequence[torch.Tensor], shards: Sequence[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """ZeRO-3 before a unit runs: give the full tensors ``fulls`` (storage freed) every rank's rows again.

    The storage of each full tensor is re-allocated in place (``untyped_storage().resize_``) and filled
    through ``.data``, which leaves the version counter alone: tensors that autograd saved in the forward
    pass (the parameter, or views of it such as ``weight.t()``) see the new values and stay valid.
    """
    rank, n = _world(process_group)
    for f in fulls:
        _alloc(f)
    specs = [ShardSpec(f.shape, rank, n) for f in fulls]
    all_gather_into([s.detach() for s in shards], specs, [f.data for f in fulls], process_group)


def reshard_(fulls: Sequence[torch.Tensor]) -> None:
    """ZeRO-3 after a unit ran: free the memory of the full tensors, keep the tensors (storage size 0)."""
    for f in fulls:
        _free(f)


def install_unit_hooks(
    units: Sequence[nn.Module], fulls: Sequence[Sequence[torch.Tensor]],
    shards: Sequence[Sequence[torch.Tensor]], process_group: dist.ProcessGroup | None = None, *,
    prefetch: bool = False,
) -> list:
    """ZeRO-3's schedule around units that run one after the other: the lesson behind
    :class:`FullyShardedDataParallel`, synchronous and without the gradient reduction.

    ``units[u]`` runs ``u``-th in forward; ``fulls[u]`` are its full parameters (registered in its modules,
    storage freed) and ``shards[u]`` this rank's rows of them. Hooks make each step:

    * before unit ``u``'s forward: gather it (:func:`unshard_`), and with ``prefetch`` unit ``u + 1`` too;
    * after its forward: free it (:func:`reshard_`), and register a hook on its output for the backward;
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
            unshard_(fulls[u], shards[u], process_group)
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


def _is_sharded_state(value: object, shard: torch.Tensor) -> bool:
    """An optimizer state entry with one value per element of the shard (a moment), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


# ----------------------------------------------------------------------------------------------------------
# Stages 1 and 2: the sharded optimizer
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def clip_sharded_grad_norm_(grads: list[torch.Tensor], max_norm: float, *, device: torch.device,
                            group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    """Clip by the global norm when each rank holds a disjoint shard of the gradients.

    ||g||^2 = sum over ranks of the local sums of squares (one all-reduce); then every shard is scaled by
    min(1, max_norm / (||g|| + 1e-6)), the rule of ``torch.nn.utils.clip_grad_norm_``. Returns ||g||.
    """
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    if world_size > 1:
        ops.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any ``torch.optim`` optimizer (Rajbhandari et al. 2020; chapter 04).

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` behaves like the wrapped
    optimizer on the full parameters of a data-parallel model, but each rank builds the inner optimizer
    (``self.optimizer``) over *views of its rows* of every parameter, so it keeps state for ``1/N`` of
    them. Do not all-reduce the gradients yourself: ``step()`` averages them.

    * ``stage=1``: the full gradients stay where backward put them; ``step()`` reduce-scatters them,
      steps the shards, all-gathers the updated rows into the parameters.
    * ``stage=2``: a hook reduce-scatters the gradients during backward, in buckets of about
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
        process_group: dist.ProcessGroup | None = None,
        *,
        stage: int = 1,
        bucket_numel: int = 2**20,
        **optimizer_kwargs: object,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer implements ZeRO stages 1 and 2, got stage={stage!r}; "
                             "stage 3 is FullyShardedDataParallel")
        self.process_group = process_group
        self.rank, self.world_size = _world(process_group)
        self.stage = stage
        self.bucket_numel = bucket_numel
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
        for group, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in inner.items():
                if key != "params":
                    group.setdefault(key, value)

    # -- construction ----------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        shards = []
        for p in group["params"]:
            if not p.is_contiguous():
                raise ValueError("ShardedOptimizer needs contiguous parameters (a shard is a view of rows)")
            spec = ShardSpec(p.shape, self.rank, self.world_size)
            self._specs[p] = spec
            self._shards[p] = shard_of(p.detach(), spec)  # a leaf view: stepping it updates p in place
            shards.append(self._shards[p])
            if self.stage == 2 and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        inner = {k: v for k, v in group.items() if k != "params"} | {"params": shards}
        if hasattr(self, "optimizer"):
            self.optimizer.add_param_group(inner)
        else:
            self._inner_groups.append(inner)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``param`` (the tensor the inner optimizer steps)."""
        return self._shards[param]

    # -- gradients -------------------------------------------------------------------------------------

    def _reduce(self, params: list[torch.Tensor]) -> None:
        """Reduce-scatter ``params``' gradients; add the mean of this rank's rows to the shards' grads."""
        for bucket in _buckets(params, [self._specs[p].padded_numel for p in params], self.bucket_numel):
            specs = [self._specs[p] for p in bucket]
            local = reduce_scatter_mean([p.grad for p in bucket], specs, self.process_group)
            for p, g in zip(bucket, local, strict=True):
                shard = self._shards[p]
                shard.grad = g.clone() if shard.grad is None else shard.grad.add_(g)

    def _on_grad_ready(self, param: torch.Tensor) -> None:  # stage 2, inside backward
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

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter the full gradients into the shards (``step`` calls it if needed)."""
        if self.stage == 1 and not self._grads_reduced:
            self._reduce([p for p in self.params if p.grad is not None])
            self._grads_reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm.

        The norm of the whole (averaged) gradient from the shards: each rank sums the squares of its
        rows, one all-reduce adds the sums. Same rule as ``torch.nn.utils.clip_grad_norm_``.
        """
        self.reduce_gradients()
        grads = [s.grad for s in self._shards.values() if s.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, device=self.params[0].device,
                                       group=self.process_group, world_size=self.world_size)

    # -- the step --------------------------------------------------------------------------------------

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
        sizes = [self._specs[p].padded_numel for p in stepped]
        for bucket in _buckets(stepped, sizes, self.bucket_numel):
            all_gather_into([self._shards[p] for p in bucket], [self._specs[p] for p in bucket],
                            [p.detach() for p in bucket], self.process_group)
        if self.stage == 1:
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
                    all_gather_into([value], [self._specs[p]], [full], self.process_group)
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
        """Load a consolidated state (:meth:`state_dict`, or a plain optimizer's); keep this rank's rows."""
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
        """Parameter, gradient and optimizer-state bytes this rank holds (:mod:`refimpl.parallel.memory`)."""
        return state_bytes(module if module is not None else self.params, self)


# ----------------------------------------------------------------------------------------------------------
# Stage 3: the fully sharded module
# ----------------------------------------------------------------------------------------------------------


def _free(t: torch.Tensor) -> None:
    """Release a tensor's memory but keep the tensor (autograd may hold it): its storage shrinks to 0."""
    if t.untyped_storage().nbytes() != 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


@dataclass(eq=False)
class _ShardedParam:
    """One parameter under stage 3: where it is registered, its shard, and its (usually freed) full tensor."""

    registrations: list[tuple[nn.Module, str]]
    spec: ShardSpec
    sharded: nn.Parameter  # this rank's rows, [end - start, ...]: what the optimizer steps
    unsharded: nn.Parameter  # the full tensor; its storage is allocated only while the unit is gathered


@dataclass(eq=False)
class FSDPUnit:
    """A unit of stage 3: the parameters gathered together (one transformer block, or the root's rest)."""

    name: str
    module: nn.Module
    params: list[_ShardedParam]
    gathered: bool = False
    pending: tuple | None = None  # an async all-gather in flight: (work, output buffer)
    ready: int = 0  # trainable parameters whose gradient arrived in this backward
    reduced: bool = False
    hooks: list = field(default_factory=list)

    @property
    def trainable(self) -> list[_ShardedParam]:
        return [p for p in self.params if p.sharded.requires_grad]


class FullyShardedDataParallel(nn.Module):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded over the ranks (chapter 04).

    ``FullyShardedDataParallel(model)`` makes every submodule of a type in ``unit_types`` (default: the
    course's ``TransformerBlock``) a unit and puts the remaining parameters in the root unit. Each
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

    **Mixed precision** (``mp_policy``, a :class:`refimpl.precision.MixedPrecisionPolicy`; chapter 05),
    as FSDP2's ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` does it: the
    shards stay fp32 (the master weights; the optimizer and its state see only them). Each shard is cast
    to ``param_dtype`` *before* the all-gather (half the bytes in bf16/fp16) and the unit computes in
    ``param_dtype``; its gradients ``g`` (in ``param_dtype``) are cast to ``reduce_dtype``, reduce-
    scattered in it as ``sum_r g_r / N`` (fp16: ``sum_r (g_r / pre) / post`` with ``pre * post = N``,
    :func:`fp16_divide_factors`), cast to fp32 and added to the shard's fp32 ``.grad``. Floating-point
    buffers and inputs are left alone (the course's GPT takes token ids).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        unit_types: tuple[type[nn.Module], ...] | None = None,
        prefetch: bool = False,
        reshard_after_forward: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        super().__init__()
        if unit_types is None:
            from refimpl.model import TransformerBlock

            unit_types = (TransformerBlock,)
        self.module = module
        self.process_group = process_group
        self.rank, self.world_size = _world(process_group)
        # FSDP2's MixedPrecisionPolicy: gather and compute in param_dtype, reduce in reduce_dtype
        self.param_dtype = None if mp_policy is None else mp_policy.param_dtype
        self.reduce_dtype = None if mp_policy is None else mp_policy.reduce_dtype
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.units = self._build_units(module, unit_types)
        self._forward_order: list[FSDPUnit] = []  # units in the order this step's forward ran them
        self._last_order: list[FSDPUnit] = list(self.units[1:])  # ... and the previous step's
        self._callback_queued = False
        root = self.units[0]
        for unit in self.units[1:]:
            unit.hooks.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            unit.hooks.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        for unit in self.units:
            for sp in unit.trainable:
                sp.unsharded.register_post_accumulate_grad_hook(self._make_grad_ready(unit))
        self._root = root

    # -- construction ----------------------------------------------------------------------------------

    def _build_units(self, module: nn.Module, unit_types: tuple[type[nn.Module], ...]) -> list[FSDPUnit]:
        unit_modules: dict[str, nn.Module] = {"": module}  # unit name -> its module ("" is the root)
        owner: dict[int, str] = {}  # id(module) -> the unit it belongs to

        def walk(m: nn.Module, prefix: str, unit: str) -> None:
            if m is not module and unit == "" and isinstance(m, unit_types):  # outermost match only
                unit = prefix
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
        for p, registrations in regs.items():
            units = units_of[p]
            unit = units.pop() if len(units) == 1 else ""  # shared by two units: the root holds it
            spec = ShardSpec(p.shape, self.rank, self.world_size)
            sharded = nn.Parameter(shard_of(p.detach(), spec).clone(), requires_grad=p.requires_grad)
            dtype = self.param_dtype if self.param_dtype is not None and p.is_floating_point() else p.dtype
            unsharded = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
            _free(unsharded)
            sp = _ShardedParam(registrations=registrations, spec=spec, sharded=sharded, unsharded=unsharded)
            params_by_unit[unit].append(sp)
            for m, name in registrations:
                m._parameters[name] = sharded
        return [FSDPUnit(name=name or "<root>", module=unit_modules[name], params=params_by_unit[name])
                for name in unit_modules]

    # -- gather and free -------------------------------------------------------------------------------

    def _start_gather(self, unit: FSDPUnit) -> None:
        if unit.gathered or unit.pending is not None or not unit.params:
            return
        specs = [sp.spec for sp in unit.params]
        # Cast before the all-gather (FSDP2 does the same): a bf16/fp16 all-gather moves half the bytes.
        shards = [sp.sharded.detach().to(sp.unsharded.dtype) for sp in unit.params]
        packed = pack_for_all_gather(shards, specs)  # [S]
        gathered = packed.new_empty(self.world_size * packed.numel())  # [N * S]
        work = None
        if self.world_size > 1:
            work = ops.all_gather_into_tensor(gathered, packed, group=self.process_group, async_op=True)
        else:
            gathered.copy_(packed)
        unit.pending = (work, gathered)

    def unshard(self, unit: FSDPUnit) -> None:
        """Make the unit's full parameters available (wait for a prefetch, or all-gather now)."""
        if unit.gathered:
            return
        self._start_gather(unit)
        if unit.pending is None:  # a unit without parameters
            unit.gathered = True
            return
        work, gathered = unit.pending
        unit.pending = None
        if work is not None:
            work.wait()
        for sp in unit.params:
            _alloc(sp.unsharded)
        # Write through .data: the same storage autograd saved, without bumping the version counter.
        specs = [sp.spec for sp in unit.params]
        copy_out_all_gather(gathered, specs, [sp.unsharded.data for sp in unit.params])
        unit.gathered = True

    def reshard(self, unit: FSDPUnit) -> None:
        """Free the unit's full parameters (the shards stay)."""
        if unit.pending is not None:  # a prefetch that was not used: finish it to keep ranks in step
            self.unshard(unit)
        for sp in unit.params:
            _free(sp.unsharded)
        unit.gathered = False

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
            self.unshard(unit)
            self._use(unit, "unsharded")
            if self.prefetch:
                following = self._neighbour(unit, +1)
                if following is not None:
                    self._start_gather(following)
        return hook

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
            self.unshard(unit)
            if self.prefetch:
                previous = self._neighbour(unit, -1)
                if previous is not None:
                    self._start_gather(previous)

        torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _make_grad_ready(self, unit: FSDPUnit):
        def hook(param: torch.Tensor) -> None:
            self._queue_final_callback()
            unit.ready += 1
            if unit.ready == len(unit.trainable):
                self._reduce(unit)
        return hook

    def _reduce(self, unit: FSDPUnit) -> None:
        """Reduce-scatter the unit's gradients into the shards' ``.grad``; free the full ones and the unit."""
        with_grad = [sp for sp in unit.trainable if sp.unsharded.grad is not None]
        if with_grad:
            specs = [sp.spec for sp in with_grad]
            grads = [sp.unsharded.grad for sp in with_grad]
            if self.reduce_dtype is not None:
                grads = [g.to(self.reduce_dtype) for g in grads]
            local = reduce_scatter_mean(grads, specs, self.process_group)
            for sp, g in zip(with_grad, local, strict=True):
                g = g.to(sp.sharded.dtype)  # fp32 gradient shards for the fp32 master shards
                sp.sharded.grad = g.clone() if sp.sharded.grad is None else sp.sharded.grad.add_(g)
                sp.unsharded.grad = None
        unit.reduced = True
        if len(unit.trainable) == len(unit.params):
            # Every operation that reads these parameters has run: it produced their gradients. A frozen
            # parameter may still be read later (for its input's gradient): then wait for the end.
            self.reshard(unit)

    def _finish_backward(self) -> None:
        """End of backward: reduce units some of whose parameters got no gradient; free every unit."""
        self._callback_queued = False
        for unit in self.units:
            pending = any(sp.unsharded.grad is not None for sp in unit.trainable)
            if pending and not unit.reduced:
                self._reduce(unit)
            self.reshard(unit)
            unit.ready, unit.reduced = 0, False

    # -- forward ---------------------------------------------------------------------------------------

    def forward(self, *args: object, **kwargs: object) -> object:
        if self._forward_order:
            self._last_order = self._forward_order
        self._forward_order = []
        root = self._root
        self.unshard(root)
        self._use(root, "unsharded")
        if self.prefetch:
            following = self._neighbour(root, +1)
            if following is not None:
                self._start_gather(following)
        try:
            output = self.module(*args, **kwargs)
        finally:
            self._use(root, "sharded")
        if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output)):
            self._register_pre_backward(root, output)
        else:  # no backward will come (evaluation): free everything now
            for unit in self.units:
                self.reshard(unit)
        return output

    # -- utilities -------------------------------------------------------------------------------------

    def sharded_parameters(self) -> list[nn.Parameter]:
        return [sp.sharded for u in self.units for sp in u.params]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (from the shards, one all-reduce); return the norm before."""
        grads = [p.grad for p in self.sharded_parameters() if p.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, device=self.sharded_parameters()[0].device,
                                       group=self.process_group, world_size=self.world_size)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, by its name in the wrapped module, on every rank. Collective."""
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            if not unit.params:
                continue
            specs = [sp.spec for sp in unit.params]
            outs = [sp.sharded.new_empty(sp.spec.shape) for sp in unit.params]
            all_gather_into([sp.sharded.detach() for sp in unit.params], specs, outs, self.process_group)
            for sp, t in zip(unit.params, outs, strict=True):
                full[id(sp.sharded)] = t
        return {name: full[id(p)] for name, p in self.module.named_parameters()}

    def gathered_bytes(self) -> StateMemory:
        """Bytes of *full* tensors this rank holds now: gathered parameters and all-gathers in flight
        (weights) and full gradients not yet reduce-scattered (grads); the shards are not counted.
        :func:`refimpl.parallel.zero_planner.zero3_peak_gathered_bytes` bounds its peak over a step."""
        sps = [sp for u in self.units for sp in u.params]
        in_flight = [u.pending[1] for u in self.units if u.pending is not None]
        seen: set = set()
        weights = storage_bytes([sp.unsharded for sp in sps] + in_flight, exclude=seen)
        grads = storage_bytes([sp.unsharded.grad for sp in sps], exclude=seen)
        return StateMemory(weights=weights, grads=grads, optimizer=0)

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> StateMemory:
        """Bytes this rank holds now in parameters (shards, gathered units and all-gathers in flight),
        gradients (shards and full gradients not yet reduced) and optimizer state."""
        sps = [sp for u in self.units for sp in u.params]
        in_flight = [u.pending[1] for u in self.units if u.pending is not None]  # prefetched all-gathers
        return state_bytes(
            self.sharded_parameters(), optimizer,
            extra_params=[sp.unsharded for sp in sps] + in_flight,
            extra_grads=[sp.unsharded.grad for sp in sps],
        )


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
