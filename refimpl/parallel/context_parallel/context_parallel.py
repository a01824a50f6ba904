"""A model with its sequence split across the ``cp`` ranks: ``apply_context_parallel`` (chapter 07).

Everything in the model but attention acts on each token alone, so under context parallelism each rank
runs the whole model on its part of the sequence, ``[b, s/cp]`` tokens, and only attention looks across the
ranks: ``refimpl.parallel.context_parallel.ring_attention.ring_attention`` (Liu et al. 2023; K/V blocks
round a ring) or ``refimpl.parallel.context_parallel.ulysses.ulysses_attention`` (Jacobs et al. 2023;
all-to-alls from sequence shards to head shards and back). Two things must follow the split:

* the **tokens**: ``split_for_context_parallel`` gives each rank its part of the inputs and the labels
  (``layout`` ``"zigzag"``, rank ``i`` holding chunks ``i`` and ``2cp-1-i`` of ``2cp`` for causal balance,
  or ``"contiguous"``; Ulysses needs contiguous, its all-to-all concatenates the ranks' parts in order);
* the **positions**: the embedding's ``position_ids`` returns the global positions of the rank's tokens
  (``refimpl.parallel.context_parallel.sequence_layout.sequence_positions``), not ``[0, s/cp)``.

Which modules those are, the model declares (``context_parallel_modules()``,
``refimpl.parallel.declarations.ContextParallelModules``): the attention modules whose
``core_attention(q, k, v)`` is replaced, the modules whose ``position_ids(seq_len, device)`` is replaced,
and, for Ulysses' check before any step, each attention's heads on this rank.

The loss of a rank is the mean over its ``b s/cp`` tokens; every rank holds as many, so the mean of those
means over the ``dp x cp`` group, the group the data-parallel wrapper averages gradients over
(``refimpl.distributed.mesh.LOSS_AXES``), is the mean over the global batch (chapter 03's rule).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from refimpl.config import CP_METHODS
from refimpl.parallel.context_parallel.context_parallel_communications import Group, cp_rank, cp_size
from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.parallel.context_parallel.sequence_layout import Layout, sequence_positions, split_sequence
from refimpl.parallel.context_parallel.ulysses import ulysses_attention
from refimpl.parallel.declarations import declared

__all__ = ["METHODS", "apply_context_parallel", "split_for_context_parallel"]

Method = Literal["ring", "ulysses"]
METHODS = CP_METHODS


def _layout_of(method: Method, layout: Layout | None) -> Layout:
    if method not in METHODS:
        raise ValueError(f"context-parallel method must be one of {METHODS}, got {method!r}")
    if method == "ulysses":
        if layout not in (None, "contiguous"):
            raise ValueError("Ulysses gathers the ranks' parts in order: it needs layout='contiguous'")
        return "contiguous"
    return layout or "zigzag"


def _positions(seq_len: int, device: torch.device, *, rank: int, size: int, layout: Layout) -> torch.Tensor:
    """The global positions of this rank's ``seq_len`` tokens (``seq_len = s/cp``)."""
    return sequence_positions(seq_len=seq_len * size, cp_rank=rank, cp_size=size, layout=layout).to(device)


def apply_context_parallel(model: nn.Module, *, cp_group: Group, method: Method = "ring",
                           layout: Layout | None = None) -> nn.Module:
    """Make ``model`` run on this rank's part of the sequence over ``cp_group``, in place; returns it.

    Each declared attention module's ``core_attention`` becomes ring attention (``layout`` ``"zigzag"`` by
    default, or ``"contiguous"``) or Ulysses (contiguous; the heads, after tensor parallelism the local
    ones, must divide by cp); each declared position module's ``position_ids`` the global positions. Feed
    it the tokens of ``split_for_context_parallel``. Composes with ``refimpl.parallel.
    tensor_parallel.apply_tensor_parallel`` (applied before it: attention then runs on the local heads).
    """
    layout = _layout_of(method, layout)
    n, r = cp_size(cp_group), cp_rank(cp_group)
    if n == 1:
        return model
    modules = declared(model, "context_parallel_modules")()
    for heads in modules.heads or ():
        if method == "ulysses" and heads % n:
            raise ValueError(f"Ulysses gives each of the cp = {n} ranks whole heads: {heads} attention heads "
                             f"(per tensor-parallel rank) do not divide by {n}")
    attention = (functools.partial(ring_attention, cp_group=cp_group, causal=True, layout=layout)
                 if method == "ring"
                 else functools.partial(ulysses_attention, cp_group=cp_group, causal=True))
    for module in modules.attention:
        module.core_attention = attention
    for module in modules.positions:
        module.position_ids = functools.partial(_positions, rank=r, size=n, layout=layout)
    return model


def split_for_context_parallel(tokens: torch.Tensor, *, cp_group: Group, method: Method = "ring",
                               layout: Layout | None = None) -> torch.Tensor:
    """This rank's part of ``tokens`` ``[b, s]`` (inputs or labels): ``[b, s/cp]`` by the layout of
    ``apply_context_parallel`` with the same ``method`` and ``layout``."""
    layout = _layout_of(method, layout)
    n = cp_size(cp_group)
    if n == 1:
        return tokens
    return split_sequence(tokens, dim=1, cp_rank=cp_rank(cp_group), cp_size=n, layout=layout)  # [b, s/cp]
