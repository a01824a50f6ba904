"""Data parallelism: every rank holds the whole model, trains on its own shard of the global batch, and
the gradients are averaged across ranks before the optimizer step (chapter 03).

**Why averaging is exact.** Let the global batch of ``N`` tokens be cut into ``W`` equal shards ``S_r``, and
let rank ``r`` compute the mean loss over its shard, ``L_r = (W/N) sum_{t in S_r} l_t``. The loss of the
global batch is ``L = (1/N) sum_t l_t = (1/W) sum_r L_r``, and the gradient is linear, so

    grad L = (1/W) sum_r grad L_r            (the mean of the per-rank gradients).

One all-reduce of the gradients followed by a division by ``W`` therefore gives every rank the gradient of
the whole global batch, and identical replicas that apply identical updates stay identical. With shards
of *unequal* token counts the per-rank means must not be averaged; normalise each rank's summed loss by the
global token count ``N`` instead (``refimpl.model.lm_loss(num_tokens=N)``) and sum the gradients
(``average_gradients=False``). Gradient accumulation is the same sum over ``A`` micro-batches in time:
global batch = micro-batch x ``A`` x ``W``, each micro-batch loss divided by ``A``.

**Sum or mean.** Both wrappers *average* by default, like ``torch.nn.parallel.DistributedDataParallel``
(so a loop written for DDP keeps its loss normalisation), and, like DDP, divide each gradient by ``W``
*before* the sum: the values on the wire keep the magnitude of one gradient, which matters for the fp16
hook. For ``W`` a power of two the division is exact, so dividing before or after gives the same bits.

**Cost.** A ring all-reduce of ``G`` bytes sends ``2 (W-1)/W * G`` bytes per rank; a step of data
parallelism all-reduces every gradient once: ``G = 4 x parameters`` bytes in fp32.

Two implementations, the naive one beside the real one (Li et al. 2020, "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training", VLDB):

* :class:`DataParallelNaive`: after ``backward()`` one blocking all-reduce per parameter tensor. Correct,
  but it pays the latency of one collective per tensor and communicates only once compute has stopped.
* :class:`DataParallelBucket`: gradients are packed into buckets of about ``bucket_cap_mb``, in reverse
  order of registration (the order backward produces them), and each bucket's all-reduce is launched
  asynchronously by a gradient hook as soon as its last gradient is final, so communication overlaps the
  rest of backward. ``finish_gradient_synchronization()`` waits for them before ``optimizer.step()``.

Every collective goes through :mod:`refimpl.comm.ops`, so a :class:`~refimpl.comm.tracer.CommTracer`
sees the traffic, and every synchronised backward leaves a :class:`SyncTimeline` to draw the overlap.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.comm.tracer import now

__all__ = [
    "CommHook",
    "DataParallelBucket",
    "DataParallelNaive",
    "PendingReduce",
    "SyncTimeline",
    "allreduce_hook",
    "assign_buckets",
    "broadcast_module",
    "low_precision_hook",
    "num_buckets",
    "sync_bucket",
    "sync_gradients_naive",
]


# ----------------------------------------------------------------------------------------------- helpers
def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _global_rank_of_first(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


@torch.no_grad()
def broadcast_module(module: nn.Module, process_group: Any = None) -> None:
    """Copy the first rank's parameters and buffers to every rank of ``process_group`` (all replicas equal).

    Frozen parameters are copied too: the replicas must be identical, not only their trainable part.
    """
    src = _global_rank_of_first(process_group)
    for t in [*module.parameters(), *module.buffers()]:
        ops.broadcast(t.data, src=src, group=process_group)


def _check_same_parameters(params: Sequence[nn.Parameter], names: Sequence[str], group: Any) -> None:
    """Fail loudly, not with a hang, when ranks wrap different models (their buckets would not match)."""
    device = params[0].device if params else torch.device("cpu")
    sig = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.int64, device=device)
    world = _group_size(group)
    gathered = [torch.empty_like(sig) for _ in range(world)]
    ops.all_gather(gathered, sig, group=group)
    seen = [tuple(int(v) for v in g.tolist()) for g in gathered]
    if len(set(seen)) > 1:
        table = ", ".join(f"rank {r}: {n} tensors / {e:,} elements" for r, (n, e) in enumerate(seen))
        raise ValueError(f"the ranks wrap different trainable parameters ({table}); every rank must build "
                         f"the same model and freeze the same parameters (first names: {list(names)[:3]})")


def assign_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Which parameters each bucket holds (a part of), buckets in launch order.

    The gradients are laid out in one flat buffer in **reverse** registration order (the last parameter
    first: backward produces it first) and the buffer is cut every ``cap_numel`` elements. A parameter that
    straddles a cut belongs to both buckets; one larger than the cap spans several. So there are exactly
    ``ceil(sum(numels) / cap_numel)`` buckets and each but the last holds exactly ``cap_numel`` elements.
    Returns, per bucket, the indices (into ``numels``) of the parameters it holds, in buffer order.

    >>> assign_buckets([3, 5, 2], cap_numel=4)   # flat buffer: p2 p2 p1 p1 | p1 p1 p1 p0 | p0 p0
    [[2, 1], [1, 0], [0]]

    Unlike DDP, which never splits a tensor (its buckets close once they *reach* the cap, so a tensor
    larger than the cap gets a bucket of its own), the cut is exact: the number of buckets, the bytes per
    bucket and hence the number of all-reduces per step are a formula of the cap alone.
    """
    if cap_numel < 1:
        raise ValueError(f"the bucket cap must hold at least one element, got {cap_numel}")
    buckets: list[list[int]] = []
    offset = 0
    for i in reversed(range(len(numels))):
        start, end = offset, offset + int(numels[i])
        offset = end
        if end == start:
            continue
        for b in range(start // cap_numel, (end - 1) // cap_numel + 1):
            while len(buckets) <= b:
                buckets.append([])
            buckets[b].append(i)
    return buckets


def num_buckets(grad_bytes: int, cap_bytes: int) -> int:
    """The formula the bucketed wrapper follows: ``ceil(gradient bytes / cap)`` (one dtype)."""
    return math.ceil(grad_bytes / cap_bytes)


@torch.no_grad()
def sync_gradients_naive(module: nn.Module, process_group: Any = None, *, average: bool = True) -> None:
    """One blocking all-reduce per trainable parameter: ``.grad`` becomes the mean (or sum) over ranks.

    A parameter without a gradient contributes zeros (and gets one): every rank must issue the same
    collectives in the same order, whatever its own backward used.
    """
    world = _group_size(process_group)
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if average:
            p.grad.div_(world)
        ops.all_reduce(p.grad, group=process_group)


@torch.no_grad()
def sync_bucket(tensors: Sequence[torch.Tensor], process_group: Any = None, *, average: bool = True) -> None:
    """Average (or sum) ``tensors`` over the ranks with **one** all-reduce: flatten, reduce, copy back.

    The step from the naive sync to buckets: one collective of ``sum(sizes)`` elements instead of one per
    tensor, so the latency is paid once (all tensors must share a dtype and device).
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if average:
        flat.div_(_group_size(process_group))
    ops.all_reduce(flat, group=process_group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


# ------------------------------------------------------------------------------------ communication hooks
@dataclass
class PendingReduce:
    """An in-flight reduction of a bucket: ``wait()`` returns when the bucket's buffer holds the result."""

    work: Any  # a torch.distributed.Work or refimpl's TracedWork
    finish: Callable[[], Any] | None = None  # e.g. decompress the wire tensor back into the fp32 buffer

    def wait(self) -> None:
        self.work.wait()
        if self.finish is not None:
            self.finish()


CommHook = Callable[[torch.Tensor, Any], PendingReduce]
"""``hook(buffer, process_group) -> PendingReduce``: launch the *sum* over ranks of a bucket's buffer
(already divided by the world size when averaging), asynchronously; the result must end up in ``buffer``.
The counterpart of DDP's ``register_comm_hook``."""


def allreduce_hook(buffer: torch.Tensor, process_group: Any) -> PendingReduce:
    """The default: an async sum all-reduce of the bucket in its own dtype."""
    return PendingReduce(ops.all_reduce(buffer, group=process_group, async_op=True))


def low_precision_hook(dtype: torch.dtype = torch.bfloat16) -> CommHook:
    """All-reduce a copy of the bucket cast to ``dtype`` (fp16 or bf16): half the bytes of fp32 on the wire.

    The gradients themselves stay fp32: they are accumulated in fp32 (over micro-batches, in ``.grad``),
    divided by the world size in fp32 *before* the cast (so fp16 does not overflow), and the reduced result
    is written back into the fp32 buffer. Only the values on the wire, and the additions the collective
    does between hops, are in ``dtype``: each rounding costs a relative error of at most ``2^-p`` for
    ``p`` significant bits (bf16: p = 8, 0.4 %; fp16: p = 11, 0.05 %), about ``W`` roundings per value, the
    same trade as DDP's ``bf16_compress_hook`` / ``fp16_compress_hook``.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_precision_hook takes torch.float16 or torch.bfloat16, got {dtype}")

    def hook(buffer: torch.Tensor, process_group: Any) -> PendingReduce:
        wire = buffer.to(dtype)
        work = ops.all_reduce(wire, group=process_group, async_op=True)
        return PendingReduce(work, functools.partial(buffer.copy_, wire))

    hook.__name__ = hook.__qualname__ = f"low_precision_hook({str(dtype).removeprefix('torch.')})"
    return hook


# --------------------------------------------------------------------------------------------- the naive
class DataParallelNaive(nn.Module):
    """Data parallelism in its simplest form: equal start, then one all-reduce per gradient (chapter 03).

    At construction rank 0's parameters and buffers are broadcast. After ``loss.backward()`` call
    :meth:`finish_gradient_synchronization`: every trainable parameter's gradient (zeros where a parameter
    got none, so that every rank issues the same collectives) is divided by the world size and summed over
    the ranks, one blocking all-reduce per tensor. Nothing overlaps: communication starts when backward
    has ended, and a model of ``P`` tensors pays ``P`` collective latencies per step.
    """

    def __init__(self, module: nn.Module, process_group: Any = None, *, average_gradients: bool = True):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.average_gradients = average_gradients
        self.world_size = _group_size(process_group)
        broadcast_module(module, process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """After ``loss.backward()``: each gradient becomes the rank mean (:func:`sync_gradients_naive`)."""
        sync_gradients_naive(self.module, self.process_group, average=self.average_gradients)


# ------------------------------------------------------------------------------------------- the bucketed
@dataclass
class SyncTimeline:
    """What one synchronised backward did when, in ``time.perf_counter`` seconds (the tracer's clock).

    ``launch[b]`` / ``done[b]``: when bucket ``b``'s reduction was launched and seen complete (a callback
    on the collective's future, so it is the completion, not the later ``wait()``); ``grad_ready``: the
    time of every gradient hook; ``backward_start`` / ``backward_end``: the first gradient reaching the
    model's output and the end of the autograd pass; ``wait_start`` / ``wait_end``: the call to
    ``finish_gradient_synchronization``.
    """

    launch: list[float | None]
    done: list[float | None]
    grad_ready: list[float] = field(default_factory=list)
    backward_start: float | None = None
    backward_end: float | None = None
    wait_start: float | None = None
    wait_end: float | None = None

    def _intervals(self, not_before: float = -math.inf) -> list[tuple[float, float]]:
        spans = sorted((max(a, not_before), b) for a, b in zip(self.launch, self.done, strict=True)
                       if a is not None and b is not None and b > max(a, not_before))
        merged: list[tuple[float, float]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    def comm_seconds(self) -> float:
        """Wall time during which at least one bucket's reduction was in flight."""
        return sum(b - a for a, b in self._intervals())

    def exposed_seconds(self) -> float:
        """The part of :meth:`comm_seconds` after backward ended: communication that nothing hides."""
        end = self.backward_end if self.backward_end is not None else -math.inf
        return sum(b - a for a, b in self._intervals(not_before=end))

    def exposed_fraction(self) -> float:
        total = self.comm_seconds()
        return self.exposed_seconds() / total if total > 0 else 0.0


@dataclass
class _Piece:
    """The part of parameter ``param`` (elements ``[param_offset, +length)``) that lives in a bucket."""

    param: int
    param_offset: int
    length: int
    bucket_offset: int


@dataclass
class _Bucket:
    buffer: torch.Tensor  # a slice of a flat gradient buffer
    pieces: list[_Piece]
    params: list[int]
    missing: int = 0  # gradients of this bucket not final yet in the current backward
    pending: PendingReduce | None = None


class DataParallelBucket(nn.Module):
    """Bucketed, overlapped data parallelism in the manner of PyTorch DDP (Li et al. 2020; chapter 03).

    ``DataParallelBucket(module, bucket_cap_mb=25, process_group=None)``. At construction the ranks check
    that they wrap the same trainable parameters and rank 0's parameters and buffers are broadcast. The
    trainable parameters (``module.parameters()``, so a tied weight appears once) are laid out in reverse
    registration order in flat gradient buffers (one per dtype/device), cut every ``bucket_cap_mb``
    megabytes (:func:`assign_buckets`: exactly ``ceil(gradient bytes / cap)`` buckets; a cap smaller than
    a tensor splits the tensor over several buckets).

    During a synchronised backward a ``register_post_accumulate_grad_hook`` on each parameter marks its
    gradient final; when a bucket's last gradient is final its gradients are copied (divided by the world
    size) into its buffer and its all-reduce is launched asynchronously, buckets strictly in index order
    so that every rank issues the same collectives in the same order (gloo and NCCL match collectives by
    order). At the end of the autograd pass the buckets still waiting (their parameters were unused in
    this step) are launched too, with the gradient the parameter has (e.g. from earlier micro-batches) or
    zeros. :meth:`finish_gradient_synchronization` waits for every bucket and writes the averaged
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

    ``average_gradients=False`` sums instead of averaging (for losses normalised by the global token
    count); ``comm_hook`` replaces the all-reduce (:func:`low_precision_hook`). ``.module`` is the wrapped
    model and ``parameters()`` yields its parameters in its order. ``last_timeline`` is the
    :class:`SyncTimeline` of the last synchronisation.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25,
        process_group: Any = None,
        *,
        average_gradients: bool = True,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
    ) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self.world_size = _group_size(process_group)
        self.average_gradients = average_gradients
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook: CommHook = comm_hook or allreduce_hook
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.require_backward_grad_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        _check_same_parameters(self._params, self._names, process_group)
        broadcast_module(module, process_group)
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
        order = list(reversed(range(len(self._params))))
        runs: list[list[int]] = []  # consecutive parameters (reverse order) of one dtype and device
        for i in order:
            key = (self._params[i].dtype, self._params[i].device)
            if runs and (self._params[runs[-1][0]].dtype, self._params[runs[-1][0]].device) == key:
                runs[-1].append(i)
            else:
                runs.append([i])
        buckets: list[_Bucket] = []
        for run in runs:
            first = self._params[run[0]]
            cap = max(1, self.bucket_cap_bytes // first.element_size())
            total = sum(self._params[i].numel() for i in run)
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
            local = [_Bucket(buffer=flat[s : min(s + cap, total)], pieces=[], params=[])
                     for s in range(0, total, cap)]
            offset = 0
            for i in run:
                n = self._params[i].numel()
                pos = offset
                while pos < offset + n:
                    b = pos // cap
                    end = min(offset + n, (b + 1) * cap)
                    local[b].pieces.append(_Piece(param=i, param_offset=pos - offset, length=end - pos,
                                                  bucket_offset=pos - b * cap))
                    if not local[b].params or local[b].params[-1] != i:
                        local[b].params.append(i)
                    pos = end
                offset += n
            buckets.extend(local)
        return buckets

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

        A no-op when the last forward ran inside :meth:`no_sync` (nothing to synchronise).
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
            ops.all_reduce(flags, group=self.process_group)  # after the buckets: the same order everywhere
            used = [bool(v) for v in flags.tolist()]
        with torch.no_grad():
            for b, bucket in enumerate(self._buckets):
                assert bucket.pending is not None
                bucket.pending.wait()
                bucket.pending = None
                if timeline.done[b] is None:  # the future's callback may trail wait() by a moment
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
        self.timeline = SyncTimeline(launch=[None] * n, done=[None] * n)

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
            src = grad.view(-1)[piece.param_offset : piece.param_offset + piece.length]
            if self.average_gradients:
                torch.div(src, self.world_size, out=dst)
            else:
                dst.copy_(src)
        timeline = self.timeline
        assert timeline is not None
        timeline.launch[b] = now()
        bucket.pending = self.comm_hook(bucket.buffer, self.process_group)
        self._next = b + 1
        with contextlib.suppress(AttributeError, RuntimeError):  # a Work without a future: no stamp

            def stamp(_: Any, b: int = b) -> None:
                if timeline.done[b] is None:
                    timeline.done[b] = now()

            bucket.pending.work.get_future().add_done_callback(stamp)
