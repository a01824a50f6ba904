"""Tensor parallelism applied by plan: ``apply_tensor_parallel`` (chapters 06 and 12).

Shoeybi et al. 2019, "Megatron-LM" (section 3, figure 3); Korthikanti et al. 2022 (sequence parallelism,
figure 5). ``apply_tensor_parallel(module, plan, tp_group=...)`` replaces, in place, every submodule whose
name matches a pattern of ``plan`` by its style's parallel form (``.styles``), as torch's
``parallelize_module`` does. Every rank of ``tp_group`` must hold the same full module before the call
(same seed or checkpoint): each keeps its block of every sharded weight. The replaced module keeps its
name and holds its shard as ``weight`` (and ``bias``), so optimizers, state dicts and the user's code find
it where they did, and it declares its box (``local_shards``) under the plain module's names, so a
checkpoint saved at one tensor-parallel size loads at another (chapter 11) and ``full_state_dict``
assembles the plain state.

Without a plan the module's own declaration is used (``tensor_parallel_plan``,
``refimpl.parallel.declarations``): the course GPT declares its plan in
``refimpl/models/gpt_sharding.py`` (heads split by Megatron's per-head fused qkv, parallel MLP,
vocabulary-parallel embedding and head, sequence parallelism on the norms).

Matching is torch's: a pattern and a name are split at the dots and matched atom by atom (fnmatch), so
``"layers.*.mlp.up"`` matches ``layers.0.mlp.up`` and not ``layers.0.moe.mlp.up``. A pattern that matches
nothing is a ``ValueError`` (a misspelt plan would silently leave layers whole); a matched module of the
wrong type a ``TypeError``. The styles apply in the plan's order, each to its matches in module order.
Under tensor parallelism the model returns logits shards ``[b, s, V/t]``: ``tp_lm_loss`` takes the
loss on them without building ``[b, s, V]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn

from refimpl.comm import ops
from refimpl.distributed.placement import module_shards
from refimpl.nn.loss import lm_loss
from refimpl.parallel.declarations import declared
from refimpl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tensor_parallel.styles import ParallelStyle, ParamSplit
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_size
from refimpl.parallel.tensor_parallel.vocab_parallel import vocab_parallel_cross_entropy

__all__ = ["apply_tensor_parallel", "full_state_dict", "fused_qkv_per_head", "match_plan", "param_split",
           "tp_lm_loss"]


def _matches(pattern: str, name: str) -> bool:
    """torch's rule: as many atoms as the pattern, each matched by fnmatch."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(n, a) for a, n in zip(atoms, parts, strict=True))


def match_plan(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, list[str]]:
    """The module names each pattern of ``plan`` matches, in module order; ``ValueError`` for a pattern
    that matches nothing or a name two patterns match, ``TypeError`` for a value that is not a style."""
    names = [n for n, _ in module.named_modules() if n]
    matched: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"the plan maps {pattern!r} to {style!r}, not a style (ColwiseParallel(), "
                            "RowwiseParallel(), SequenceParallel(), VocabParallel(), ...)")
        matched[pattern] = [n for n in names if _matches(pattern, n)]
        if not matched[pattern]:
            raise ValueError(f"the tensor-parallel plan's pattern {pattern!r} matches no module of "
                             f"{type(module).__name__} (names look like {names[:3]})")
        for n in matched[pattern]:
            if n in owner:
                raise ValueError(f"{n!r} is matched by two patterns of the plan: {owner[n]!r} and "
                                 f"{pattern!r}")
            owner[n] = pattern
    return matched


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


@torch.no_grad()
def apply_tensor_parallel(module: nn.Module, plan: Mapping[str, ParallelStyle] | None = None, *,
                          tp_group: Group, sequence_parallel: bool = False,
                          pad_vocab: bool = False, tp_comm_overlap: bool = False) -> nn.Module:
    """Replace ``module``'s submodules matched by ``plan`` by their parallel forms over ``tp_group``, in
    place (module docstring); returns ``module``. ``tp_comm_overlap``: every sequence-parallel column and
    row layer then runs its collective as a ring overlapped with its matmul (``.collective_matmul``).

    ``plan`` None: the module's declaration ``tensor_parallel_plan(tp_size=t, sequence_parallel=...,
    pad_vocab=...)``; a plan given says sequence parallelism and padding in its styles' own options.
    """
    t = group_size(tp_group)
    if plan is None:
        plan = declared(module, "tensor_parallel_plan")(tp_size=t, sequence_parallel=sequence_parallel,
                                                        pad_vocab=pad_vocab)
    elif sequence_parallel or pad_vocab:
        raise ValueError("with a plan, sequence parallelism and vocabulary padding are options of its styles "
                         "(ColwiseParallel(sequence_parallel=True), VocabParallel(pad_vocab=True), ...)")
    for pattern, names in match_plan(module, plan).items():
        for name in names:
            _set_submodule(module, name, plan[pattern].apply(module.get_submodule(name), tp_group=tp_group,
                                                             root=module))
    if tp_comm_overlap:
        _overlap_sequence_parallel_linears(module)
    return module


def _overlap_sequence_parallel_linears(module: nn.Module) -> None:
    """Turn on ``tp_comm_overlap`` in every sequence-parallel column and row layer of ``module``; none is a
    ``ValueError`` (the flag would change nothing)."""
    found = [m for m in module.modules()
             if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.sequence_parallel]
    if not found:
        raise ValueError("tp_comm_overlap overlaps the sequence-parallel linears' collectives: it needs "
                         "sequence parallelism over tp > 1 (no sequence-parallel column or row layer here)")
    for layer in found:
        layer.tp_comm_overlap = True


def param_split(plan: Mapping[str, ParallelStyle], name: str) -> ParamSplit:
    """What ``plan`` does to the parameter ``name`` of the plain module (``"layers.0.mlp.up.weight"``):
    the style of the longest matched module prefix says (``ParallelStyle.split``); replicated when
    none matches. Reads names only: the planner uses it on a meta-device model."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        for pattern, style in plan.items():
            if _matches(pattern, prefix):
                return style.split(".".join(parts[cut:]))
    return ParamSplit()


def fused_qkv_per_head(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The rows of a fused qkv weight ``[3h, h]`` or bias ``[3h]`` from nanoGPT's order ``[3, a, d]`` (all q,
    all k, all v) to Megatron's per-head ``[a, 3, d]`` (``refimpl.models.CausalSelfAttention``), a copy:
    after it a contiguous row block of ``3h/t`` rows is q, k and v of ``a/t`` whole heads, the shard a
    ``ColumnParallelLinear`` takes (the fused-qkv trap of chapter 06)."""
    three_h = tensor.shape[0]
    if three_h % (3 * num_heads):
        raise ValueError(f"a fused qkv of {three_h} rows is not 3 x {num_heads} heads x head_dim")
    d = three_h // (3 * num_heads)
    rest = tensor.shape[1:]
    # [3h, ...] -> [3, a, d, ...] -> [a, 3, d, ...] -> [3h, ...]
    return tensor.reshape(3, num_heads, d, *rest).transpose(0, 1).reshape(three_h, *rest).clone()


def tp_lm_loss(logits_shard: torch.Tensor, labels: torch.Tensor, *, tp_group: Group, vocab_size: int,
               num_tokens: int | None = None) -> torch.Tensor:
    """``refimpl.models.lm_loss`` on the logits shard ``[b, s, V/t]`` (padded columns masked): the sum
    of the per-token losses of ``vocab_parallel_cross_entropy``, divided by ``num_tokens``."""
    if group_size(tp_group) == 1 and logits_shard.shape[-1] == vocab_size:
        return lm_loss(logits_shard, labels, num_tokens=num_tokens)
    per_token = vocab_parallel_cross_entropy(logits_shard.float(), labels, tp_group=tp_group,
                                             vocab_size=vocab_size)  # [b, s]
    return per_token.sum() / (labels.numel() if num_tokens is None else num_tokens)


@torch.no_grad()
def full_state_dict(model: nn.Module, tp_group: Group) -> dict[str, torch.Tensor]:
    """The plain model's state (every tensor whole, in the plain model's names and shapes) on every rank
    of ``tp_group``.

    Each rank writes the boxes it declares (``refimpl.distributed.placement.module_shards``) into a
    zero tensor of the global shape; one all-reduce (sum) per sharded tensor assembles them (the boxes of
    a tensor are disjoint over the group), replicated tensors are taken as they are. A box declared over
    a view of the parameter (``ColwiseParallel(chunks=k)``: ``[k, n, ...]`` of the plain ``[k n, ...]``)
    comes back in the plain shape, its leading dims merged. Collective.
    """
    out: dict[str, torch.Tensor] = {}
    t = group_size(tp_group)
    held = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, shard in module_shards(model).items():
        if shard.box.shape == shard.box.global_shape:
            full = shard.tensor.detach().clone()
        else:
            full = torch.zeros(shard.box.global_shape, dtype=shard.tensor.dtype, device=shard.tensor.device)
            full[shard.box.slices()] = shard.tensor
            if t > 1:
                ops.all_reduce(full, group=tp_group)
        local = held.get(name)
        out[name] = full if local is None or local.dim() == full.dim() else full.reshape(-1, *local.shape[1:])
    return out
