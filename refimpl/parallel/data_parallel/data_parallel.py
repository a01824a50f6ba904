"""Bucketed, overlapped data parallelism (chapter 03): DDP's design, the real one beside the naive one.

Gradients are packed into buckets of about ``bucket_cap_mb`` (``.bucket``), in reverse order of
registration (the order backward produces them), and each bucket's all-reduce is launched asynchronously by
a gradient hook as soon as its last gradient is final, so communication overlaps the rest of backward;
``no_sync()`` skips it for gradient accumulation, ``finish_gradient_synchronization()`` waits for every
bucket before ``optimizer.step()``. Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training" (VLDB). The maths (why the mean of the per-rank gradients is the global gradient) is in
the package docstring, ``refimpl.parallel.data_parallel``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from refimpl.comm import ops
from refimpl.comm.device_clock import StampList
from refimpl.comm.tracer import now
from refimpl.distributed.placement import LocalShard, module_shards
from refimpl.parallel.data_parallel.bucket import _Bucket, build_buckets
from refimpl.parallel.data_parallel.data_parallel_communications import (
    CommHook,
    _check_same_parameters,
    _group_size,
    all_reduce_mean_,
    allreduce_hook,
    broadcast_module,
)
from refimpl.parallel.data_parallel.timeline import SyncTimeline

__all__ = ["DataParallelBucket"]


class DataParallelBucket(nn.Module):
    """Bucketed, overlapped data parallelism in the manner of PyTorch DDP (Li et al. 2020; chapter 03).

    ``DataParallelBucket(module, bucket_cap_mb=25, group=None)``. At construction the ranks check
    that they wrap the same trainable parameters and rank 0's parameters and buffers are broadcast. The
    trainable parameters (``module.parameters()``, so a tied weight appears once) are laid out in reverse
    registration order in flat gradient buffers (one per dtype/device), cut every ``bucket_cap_mb``
    megabytes (``assign_buckets``: exactly ``ceil(gradient bytes / cap)`` buckets; a cap smaller than
    a tensor splits the tensor over several buckets).

    During a synchronised backward a ``register_post_accumulate_grad_hook`` on each parameter marks its
    gradient final; when a bucket's last gradient is final its gradients are copied (divided by the world
    size) into its buffer and its all-reduce is launched asynchronously, buckets strictly in index order
    so that every rank issues the same collectives in the same order (gloo and NCCL match collectives by
    order). At the end of the autograd pass the buckets still waiting (their parameters were unused in
    this step) are launched too, with the gradient the parameter has (e.g. from earlier micro-batches) or
    zeros. ``finish_gradient_synchronization`` waits for every bucket and writes the averaged
    gradients back into ``.grad``; call it before clipping and ``optimizer.step()``.

    Choices, and why:

    * **Tied weights** are one leaf tensor; autograd sums all its uses before accumulating, so its hook
      fires once per backward and its bucket launches only with the complete gradient. A second hook call
      for the same parameter in one synchronised backward (reentrant checkpointing, two ``backward()``
      calls after one forward) raises, as DDP does, instead of sending a partial gradient.
    * **Activation checkpointing** leaves the gradients bit for bit as they were (tested with both
      ``use_reentrant`` flavours). Should a nested (reentrant) backward end the pass before a gradient
      outside it is final, that gradient's hook raises rather than leave its bucket sent without it.
    * **Frozen parameters** (``requires_grad=False`` at construction) get no bucket and no hook.
    * **Unused parameters**: their bucket is launched at the end of backward (or in ``finish``) with
      zeros, so the collectives match on every rank. With ``find_unused_parameters=False`` (the default,
      one all-reduce per bucket and nothing else) every trainable parameter ends with a gradient, zero
      where no rank used it. With ``find_unused_parameters=True`` one extra all-reduce per step of a
      used-flag per parameter lets a parameter that *no* rank used keep ``.grad`` as it was (``None``), as
      DDP(find_unused_parameters=True) does, so AdamW skips it (no weight decay) exactly as on one device.
    * **The no-sync flag is read by forward**, like DDP: ``with model.no_sync(): loss = model(x)``, then
      ``loss.backward()`` accumulates locally. A backward whose forward ran with sync on synchronises even
      inside ``no_sync`` (wasted communication: chapter 03's trap). A forward with sync on while an
      earlier synchronisation was never finished finishes it first.
    * **Copies, not views**: gradients are copied into the bucket and back (DDP's default,
      ``gradient_as_bucket_view=False``); buffers take one extra gradient's worth of memory.

    ``ignore``: names of parameters the wrapper leaves alone (no bucket, no broadcast), as DDP's
    ``_set_params_and_buffers_to_ignore_for_model``: an expert-parallel rank's experts, which are not
    replicas over the group and whose gradients another reduction averages (chapter 09).

    ``average_gradients=False`` sums instead of averaging (for losses normalised by the global token
    count); ``comm_hook`` replaces the all-reduce (``low_precision_hook``). ``.module`` is the wrapped
    model and ``parameters()`` yields its parameters in its order. ``last_timeline`` is the
    ``SyncTimeline`` of the last synchronisation.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25,
        group: Any = None,
        *,
        average_gradients: bool = True,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
        ignore: Collection[str] = (),
    ) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.world_size = _group_size(group)
        self.average_gradients = average_gradients
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook: CommHook = comm_hook or allreduce_hook
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.require_backward_grad_sync = True

        self.ignored = frozenset(ignore)  # reduced elsewhere (DDP's parameters to ignore): the experts
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in self.ignored]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _check_same_parameters(self._params, self._names, group)
        broadcast_module(module, group, exclude=self.ignored)
        self._buckets = self._build_buckets()
        self._param_buckets: list[list[int]] = [[] for _ in self._params]
        for b, bucket in enumerate(self._buckets):
            for i in bucket.params:
                self._param_buckets[i].append(b)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                         for i, p in enumerate(self._params)]
        self._armed = False  # the last forward ran with sync on: its backward synchronises
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)  # got a gradient since the last synchronisation
        self._next = 0  # the next bucket to launch
        self._callback_queued = False
        self.timeline: SyncTimeline | None = None
        self.last_timeline: SyncTimeline | None = None

    # ------------------------------------------------------------------------------------ layout
    def _build_buckets(self) -> list[_Bucket]:
        return build_buckets(self._params, self.bucket_cap_bytes)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def grad_bytes(self) -> int:
        """Bytes of all trainable gradients: what one synchronisation reduces."""
        return sum(p.numel() * p.element_size() for p in self._params)

    def bucket_bytes(self) -> list[int]:
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    def bucket_param_names(self) -> list[list[str]]:
        """The (qualified) names of the parameters each bucket holds a part of, in launch order."""
        return [[self._names[i] for i in b.params] for b in self._buckets]

    def local_shards(self) -> dict[str, LocalShard]:
        """What this rank holds (the checkpoint reads it, chapter 11): the wrapped module's tensors, every
        one whole (a replica), by their names in the wrapped module: the wrapper adds no name."""
        return module_shards(self.module)

    # ------------------------------------------------------------------------------------ training API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards run inside accumulate gradients locally; their backward does not communicate."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._armed and (self._next > 0 or any(self._ready)):
            self.finish_gradient_synchronization()  # a synchronised backward was never finished
        self._arm(self.require_backward_grad_sync and torch.is_grad_enabled())
        out = self.module(*args, **kwargs)
        if self._armed and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._stamp_backward_start)
        return out

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not launched yet, wait for all, write the reduced gradients into ``.grad``.

        A no-op when the last forward ran inside ``no_sync`` (nothing to synchronise).
        """
        if not self._armed:
            return
        timeline = self.timeline
        assert timeline is not None
        timeline.wait_start = now()
        while self._next < len(self._buckets):
            self._launch(self._next)
        used: list[bool] | None = None
        if self.find_unused_parameters:
            device = self._params[0].device if self._params else torch.device("cpu")
            flags = torch.tensor(self._used, dtype=torch.int32, device=device)
            ops.all_reduce(flags, group=self.group)  # after the buckets: the same order everywhere
            used = [bool(v) for v in flags.tolist()]
        with torch.no_grad():
            for b, bucket in enumerate(self._buckets):
                assert bucket.pending is not None
                bucket.pending.wait()
                bucket.pending = None
                if timeline.done.raw(b) is None:  # the callback may trail wait(); raw: no synchronize
                    timeline.done[b] = now()
                for piece in bucket.pieces:
                    if used is not None and not used[piece.param]:
                        continue  # no rank used it: leave .grad as it is (None), as DDP does
                    p = self._params[piece.param]
                    if p.grad is None:
                        p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                    src = bucket.buffer[piece.bucket_offset : piece.bucket_offset + piece.length]
                    p.grad.view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(src)
        timeline.wait_end = now()
        self.last_timeline = timeline
        self._armed = False
        self._used = [False] * len(self._params)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (before wrapping the same module again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------------------------ machinery
    def _arm(self, armed: bool) -> None:
        self._armed = armed
        if not armed:
            return
        self._ready = [False] * len(self._params)
        self._next = 0
        self._callback_queued = False  # a backward that raised never ran its end-of-backward callback
        for bucket in self._buckets:
            bucket.missing = len(bucket.params)
            bucket.pending = None
        n = len(self._buckets)
        self.timeline = SyncTimeline(launch=StampList([None] * n), done=StampList([None] * n))

    def _stamp_backward_start(self, grad: torch.Tensor) -> None:
        if self.timeline is not None and self.timeline.backward_start is None:
            self.timeline.backward_start = now()

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter ``index``: its ``.grad`` is final for this backward."""
        self._used[index] = True
        if not self._armed:
            return
        if self._ready[index]:
            raise RuntimeError(
                f"DataParallelBucket: the gradient of {self._names[index]!r} was accumulated twice in one "
                "synchronised backward (two backward() calls after one forward, or reentrant activation "
                "checkpointing); its bucket may already be on the wire. Run one backward per forward, or the "
                "extra ones inside no_sync()."
            )
        self._ready[index] = True
        assert self.timeline is not None
        self.timeline.grad_ready.append(now())
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if any(b < self._next for b in self._param_buckets[index]):
            raise RuntimeError(
                f"DataParallelBucket: the gradient of {self._names[index]!r} became final after its bucket "
                "was sent: the end-of-backward callback ran early (a nested backward, e.g. reentrant "
                "checkpointing, finished before the outer pass). Use use_reentrant=False."
            )
        for b in self._param_buckets[index]:
            self._buckets[b].missing -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].missing == 0:
            self._launch(self._next)

    def _end_of_backward(self) -> None:
        """Autograd calls this once the pass is over: launch what unused parameters held back."""
        self._callback_queued = False
        if not self._armed:
            return
        assert self.timeline is not None
        self.timeline.backward_end = now()
        while self._next < len(self._buckets):
            self._launch(self._next)

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        for piece in bucket.pieces:
            dst = bucket.buffer[piece.bucket_offset : piece.bucket_offset + piece.length]
            grad = self._params[piece.param].grad
            if grad is None:
                dst.zero_()
                continue
            dst.copy_(grad.view(-1)[piece.param_offset : piece.param_offset + piece.length])
        timeline = self.timeline
        assert timeline is not None
        timeline.launch[b] = now()
        bucket.pending = all_reduce_mean_(bucket.buffer, self.group, average=self.average_gradients,
                                          comm_hook=self.comm_hook)
        self._next = b + 1
        with contextlib.suppress(AttributeError, RuntimeError):  # a Work without a future: no stamp

            def stamp(_: Any, b: int = b) -> None:
                if timeline.done.raw(b) is None:
                    timeline.done[b] = now()

            bucket.pending.work.get_future().add_done_callback(stamp)
