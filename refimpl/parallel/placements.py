"""One placement per parameter: where each tensor a rank holds lies across the ranks, and the one gradient
norm and the one gradient reduction that read it (chapter 12).

Every technique of ``refimpl.parallel.parallelize`` changes *where* a parameter lives, and the gradient
path must know it: which part of the global tensor this rank holds, over which ranks the others are, over
which ranks its gradient is summed. Megatron-LM keeps that in tensor attributes
(``param.sequence_parallel``, ``param.allreduce``); a wrapper that replaces parameters (ZeRO-3's shards)
loses them. Here it is one record per parameter *name* (the plain GPT's), a ``Placement``, built by
``record_placements`` from what the modules declare (their ``local_shards()`` boxes, their
``sequence_parallel_parameters()``) as each step of ``parallelize`` is applied, and held by its result:

* ``box``: this rank's elements of the global tensor (``refimpl.distributed.placement.Box``);
* ``sharded_over``: the groups whose ranks hold *disjoint* parts of it (``tp`` for a Megatron shard,
  ``dp x cp`` for a ZeRO row shard, ``pp`` for a stage's tensor: the other pipeline ranks hold other
  tensors);
* ``replicated_over``: the groups whose ranks hold the *same* elements (a LayerNorm over ``tp``, every
  ZeRO-0 parameter over ``dp x cp``; the last stage's copy of a tied embedding over ``pp``; an HSDP shard
  over ``dp_replicate``, the shard groups' counterparts);
* ``reduce_over``: the groups its gradient is reduced over (``dp x cp``: averaged over the data-parallel
  replicas; ``tp``: summed, a sequence-parallel parameter that saw ``s/t`` tokens);
* ``primary``: False for a copy another rank counts (the tied embedding's last-stage copy).

The groups are named as the mesh names them (``refimpl.distributed.mesh.group_name``: its axes joined by
`` x ``), the names ``metrics.jsonl`` and the planner give the bytes each group sends. Under expert
parallelism (chapter 09) an expert tensor is sharded over ``ep`` (rows of its ``[E, ...]`` box),
replicated over ``edp`` (the expert-data-parallel ranks, ``dp x cp / ep``) and its gradient reduced over
``edp``; ``dp x cp`` is then the product ``ep x edp`` of the same ranks (``FACTORS``).

The global gradient norm (``clip_grad_norm_``) counts every element of the model once:
``||g||^2 = sum over ranks of sum_{counted} ||g_i||^2``, where a tensor is counted on a rank when it is
primary and the rank is coordinate 0 of every replicated axis the sum is all-reduced over, and the sum is
all-reduced over the axes anything is sharded over, in the order ``NORM_AXES`` (Megatron's
``get_grad_norm_fp32``). The rule needs independent axes: when some placement names ``ep`` or
``edp``, a placement over ``dp x cp`` is read as over both (a dense replica is replicated over both, a
ZeRO row shard of it sharded over both), so a dense element is counted once, not ``ep`` times. Then
``g <- g min(1, max_norm / (||g|| + 1e-6))``, ``clip_grad_norm_``'s rule;
with no sharded axis it *is* ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.group_info import group_rank_size
from refimpl.distributed.mesh import group_name
from refimpl.distributed.placement import Box

__all__ = ["AXES", "DP", "DP_REPLICATE", "DP_SHARD", "EDP", "EP", "FACTORS", "NORM_AXES", "HeldGradient",
           "Placement", "clip_grad_norm_", "record_placements",
           "reduce_gradients", "scale_to_max_norm_", "sum_of_squares"]

DP, DP_SHARD, DP_REPLICATE = group_name("dp", "cp"), group_name("dp_shard", "cp"), group_name("dp_replicate")
EP, EDP = group_name("ep"), group_name("edp")
AXES = ("pp", "tp", DP, DP_SHARD, DP_REPLICATE, EP, EDP)
"""The groups a placement names: ``dp x cp`` is the data-parallel group; under HSDP ZeRO-3 shards over
``dp_shard x cp`` (a shard group) and replicates over ``dp_replicate``; under expert parallelism ``ep``
and ``edp`` (the expert view of the dp x cp ranks)."""
NORM_AXES = AXES  # the order the norm's partial sums are all-reduced in
FACTORS = {DP: (EP, EDP)}
"""``dp x cp`` as independent groups when a placement names them (the expert view, ``dp x cp = ep x edp``)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one tensor this rank holds lies across the ranks (module docstring)."""

    box: Box
    sharded_over: tuple[str, ...] = ()
    replicated_over: tuple[str, ...] = ()
    reduce_over: tuple[str, ...] = ()
    primary: bool = True

    def __post_init__(self) -> None:
        for axis in (*self.sharded_over, *self.replicated_over, *self.reduce_over):
            if axis not in AXES:
                raise ValueError(f"unknown group {axis!r}: a placement names the groups {AXES}")
        if set(self.sharded_over) & set(self.replicated_over):
            raise ValueError(f"an axis cannot both shard and replicate a tensor: {self}")

    def along(self, axis: str, *, sharded: bool, reduced: bool = False) -> Placement:
        """This placement with one more axis: the tensor split over it (``sharded``) or whole on each of
        its ranks, and its gradient reduced over it (``reduced``)."""
        return replace(self, sharded_over=self.sharded_over + ((axis,) if sharded else ()),
                       replicated_over=self.replicated_over + (() if sharded else (axis,)),
                       reduce_over=self.reduce_over + ((axis,) if reduced else ()))

    def narrowed(self, inner: Box, axis: str) -> Placement:
        """The rows ``inner`` (a box of this tensor's *local* shape) that this rank keeps of it, the others
        kept by the other ranks of ``axis``: ZeRO-1/2's optimizer shard of a replicated tensor."""
        return replace(self, box=self.box.within(inner),
                       sharded_over=self.sharded_over + (axis,),
                       replicated_over=tuple(a for a in self.replicated_over if a != axis))


@dataclass(frozen=True, eq=False)
class HeldGradient:
    """A gradient this rank holds at the optimizer step, with the placement of its elements."""

    name: str
    grad: torch.Tensor
    placement: Placement


def record_placements(boxes: Mapping[str, Box], *, tp: bool = False,
                      sequence_parallel: Sequence[str] = (), pp: bool = False,
                      tied_copy: str | None = None) -> dict[str, Placement]:
    """The placements of tensor- and pipeline-parallel parameters, by name, from the boxes the modules
    declare (``module_shards``): under ``tp`` a box that is not the whole tensor is a Megatron shard
    (sharded over ``tp``), a whole one is replicated over it (and summed over it when named in
    ``sequence_parallel``); under ``pp`` every tensor is the stage's own (sharded over ``pp``) but
    ``tied_copy``, a copy of a tensor the first stage holds (replicated over ``pp``, not primary)."""
    out = {}
    for name, box in boxes.items():
        p = Placement(box=box)
        if tp:
            p = p.along("tp", sharded=not box.is_full, reduced=name in sequence_parallel)
        if pp:
            p = p.along("pp", sharded=name != tied_copy)
            if name == tied_copy:
                p = replace(p, primary=False)
        out[name] = p
    return out


def sum_of_squares(grads: Sequence[torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """``sum_i ||g_i||^2`` in float32 (a 0-dim tensor on ``device``)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    return sq


def scale_to_max_norm_(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule); return
    ``norm``."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def _rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` in an axis's group; None is an axis of one rank (not torch's default group)."""
    return (0, 1) if group is None else group_rank_size(group)


def _counted(p: Placement, reduced: set[str], ranks: Mapping[str, int]) -> bool:
    return p.primary and all(ranks.get(a, 0) == 0 for a in p.replicated_over if a in reduced)


def _factored(held: Sequence[HeldGradient]) -> list[HeldGradient]:
    """``held`` with ``dp x cp`` read as its ``FACTORS`` when some placement names one of them."""
    named = {a for h in held for a in (*h.placement.sharded_over, *h.placement.replicated_over)}
    parts = {axis: factors for axis, factors in FACTORS.items() if named & set(factors)}
    if not parts:
        return list(held)

    def split(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for a in axes for f in parts.get(a, (a,))))

    return [HeldGradient(h.name, h.grad, replace(h.placement, sharded_over=split(h.placement.sharded_over),
                                                 replicated_over=split(h.placement.replicated_over)))
            for h in held]


@torch.no_grad()
def clip_grad_norm_(held: Sequence[HeldGradient], max_norm: float, *,
                    groups: Mapping[str, dist.ProcessGroup | None], device: torch.device) -> torch.Tensor:
    """Clip this rank's gradients by the norm of the whole model's gradient, each element counted once
    (module docstring); return that norm. ``groups``: the process group of each axis (None or absent: an
    axis of one rank).
    Collective over the groups of the axes anything is sharded over (every rank of them must call it)."""
    held = _factored(held)
    axes = {a for h in held for a in h.placement.sharded_over}
    if not axes:  # every gradient whole on this rank: torch's own norm (of the gradients themselves)
        grads = [h.grad for h in held]
        return scale_to_max_norm_(grads, torch.nn.utils.get_total_norm(grads), max_norm)
    ranks = {a: _rank_size(groups.get(a))[0] for a in AXES}
    sq = sum_of_squares([h.grad for h in held if _counted(h.placement, axes, ranks)], device=device)
    for a in NORM_AXES:
        group = groups.get(a)
        if a in axes and _rank_size(group)[1] > 1:
            ops.all_reduce(sq, group=group)
    return scale_to_max_norm_([h.grad for h in held], sq.sqrt(), max_norm)


@torch.no_grad()
def reduce_gradients(held: Sequence[HeldGradient], axis: str, group: dist.ProcessGroup | None) -> int:
    """Sum over ``axis``'s ``group`` the gradients whose placement reduces over it (one all-reduce each,
    in the order held): the sequence-parallel sum over ``tp``. Returns how many were reduced."""
    if _rank_size(group)[1] == 1:
        return 0
    todo = [h.grad for h in held if axis in h.placement.reduce_over]
    for g in todo:
        ops.all_reduce(g, group=group)
    return len(todo)


def names_of(module: nn.Module) -> dict[torch.Tensor, str]:
    """``{parameter: its first name}`` in ``module`` (a tied parameter under its first name)."""
    return {p: name for name, p in reversed(list(module.named_parameters()))}
