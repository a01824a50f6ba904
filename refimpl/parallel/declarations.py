"""What a model declares so that ``refimpl.parallel.parallelize.parallelize`` can apply each technique
(chapter 12, "bring your own model"; torchtitan's ``models/llama3/sharding.py`` is the pattern).

The techniques never import a model: they take any ``nn.Module`` and read what it declares. A declaration is
a method (or attribute) of the model; each is needed only by the technique that reads it, and a model
without it gets that technique refused by name, saying what to declare (``MissingDeclaration``),
never an ``AttributeError`` from deep inside:

* ``tensor_parallel_plan(*, tp_size, sequence_parallel, pad_vocab) -> dict[str, style]``: module-name
  patterns (fnmatch, one pattern atom per name atom: ``"layers.*.mlp.up"``) to the styles of
  ``refimpl.parallel.tensor_parallel.styles`` (tensor parallelism, chapter 06). It may refuse sizes
  that do not divide (heads, MLP width, vocabulary) with a ``ValueError`` naming them.
* ``shard_units() -> tuple[type[nn.Module], ...]``: the module types ZeRO-3 shards and gathers as one
  unit and activation checkpointing recomputes as one (the transformer block; chapters 04 and 05).
* ``context_parallel_modules() -> ContextParallelModules``: the attention modules whose ``core_attention``
  context parallelism replaces and the modules whose ``position_ids`` give the global positions (chapter 07).
* ``pipeline_stages(*, pp_rank, pp_size, virtual_stages, balance) -> dict[int, nn.Module]``: the stage
  modules this pipeline rank runs (chapter 08); for ZB-V also ``placement="v"`` (rank ``r`` holds stages
  ``r`` and ``2 pp - 1 - r``: ``refimpl.parallel.pipeline_parallel.stage_rank``).
* MoE layers need no method: expert parallelism finds them by type (``ExpertParallelLayer``: any
  module with ``shard_experts``, ``expert_parallel_parameters`` and ``expert_unit``; chapter 09).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

__all__ = ["DECLARATIONS", "ContextParallelModules", "ExpertParallelLayer", "MissingDeclaration", "declared",
           "moe_layers"]

DECLARATIONS = {
    "tensor_parallel_plan": ("tensor parallelism", "a method tensor_parallel_plan(*, tp_size, "
                             "sequence_parallel, pad_vocab) returning {module-name pattern: style}, e.g. "
                             "{'layers.*.mlp.up': ColwiseParallel(), "
                             "'layers.*.mlp.down': RowwiseParallel()}"),
    "shard_units": ("ZeRO-3 or activation checkpointing", "a method shard_units() returning the block "
                    "types, e.g. (MyBlock,), or pass unit_types= yourself"),
    "context_parallel_modules": ("context parallelism", "a method context_parallel_modules() returning "
                                 "ContextParallelModules(attention=[...], positions=[...])"),
    "pipeline_stages": ("pipeline parallelism", "a method pipeline_stages(*, pp_rank, pp_size, "
                        "virtual_stages, balance) returning {stage index: stage module}"),
}
"""Each declaration: the technique that reads it and what to write (the refusal's text)."""


class MissingDeclaration(TypeError):
    """A technique was asked of a model that does not declare how it applies (module docstring)."""


def declared(model: nn.Module, name: str) -> Callable[..., Any]:
    """The model's declaration ``name`` (a bound method), or ``MissingDeclaration`` saying which
    technique needs it and what to declare."""
    found = getattr(model, name, None)
    if callable(found):
        return found
    technique, what = DECLARATIONS[name]
    raise MissingDeclaration(f"{technique} needs the model to declare {name}: {type(model).__name__} has "
                             f"none; add {what} (README, 'Bring your own model')")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextParallelModules:
    """What context parallelism replaces (chapter 07): ``attention``, modules with a ``core_attention(q, k,
    v)`` over ``[b, heads, s, d]`` blocks (causal), ``positions``, modules with a ``position_ids(seq_len,
    device)`` giving the positions of the tokens they see (learned position embeddings, RoPE tables), and
    ``heads``."""

    attention: Sequence[nn.Module]
    positions: Sequence[nn.Module] = ()
    heads: Sequence[int] | None = None
    """Each attention module's heads on this rank (Ulysses' check before any step); None: checked at the
    first call."""


@runtime_checkable
class ExpertParallelLayer(Protocol):
    """An MoE layer (chapter 09), found by this type in ``model.modules()`` (``moe_layers``): expert
    parallelism keeps this rank's experts (``shard_experts``), the placements and the expert-data-parallel
    reduction read ``expert_parallel_parameters()`` (names relative to the layer), ZeRO-3 shards
    ``expert_unit()`` as a unit of its own over the expert-data-parallel group, and ``parallelize`` sets
    ``sp_group`` (sequence parallelism: the layer routes this tp rank's ``s/t`` tokens) and ``cp_group``
    (its balance loss counts whole sequences)."""

    num_experts: int
    sp_group: Any
    cp_group: Any

    def shard_experts(self, ep_group: Any) -> None: ...

    def expert_parallel_parameters(self) -> list[str]: ...

    def expert_unit(self) -> nn.Module: ...


def moe_layers(model: nn.Module) -> list[ExpertParallelLayer]:
    """The MoE layers of ``model`` (any wrapper of it), in module order; [] for a dense model."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelLayer)]
