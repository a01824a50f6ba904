"""Tensor-parallel styles: what a plan maps a module name to (chapters 06 and 12).

A model (ours or the user's) declares its tensor-parallel plan as ``{module-name pattern: style}`` and
``refimpl.parallel.tensor_parallel.apply.apply_tensor_parallel`` replaces each matched module by the
style's parallel form, as torch's ``parallelize_module`` does with ``ColwiseParallel()`` /
``RowwiseParallel()`` (same semantics, local tensors instead of DTensors; Shoeybi et al. 2019, Korthikanti
et al. 2022 for sequence parallelism). On the ``t`` ranks of the group, rank ``r``:

* ``ColwiseParallel`` (an ``nn.Linear`` ``[out, in]``): keeps output rows ``[r out/t, (r+1) out/t)``
  of the weight and bias; the input is whole (``f``: identity forward, all-reduce of its gradient), the
  output ``[..., out/t]``. ``chunks = k``: the output is ``k`` stacked projections (a fused ``q|k|v``:
  ``k = 3``), each split that way, so rank ``r`` holds rows ``[j out/k + r out/(k t), ...)`` of every chunk
  ``j``. ``sequence_parallel``: the input is this rank's ``[b, s/t, in]``, all-gathered in front.
* ``RowwiseParallel`` (an ``nn.Linear``): keeps input columns ``[r in/t, (r+1) in/t)``; the input is
  sharded on its last dim, the output all-reduced (``g``; under ``sequence_parallel`` reduce-scattered to
  ``[b, s/t, out]``) and the bias, whole, added once.
* ``SequenceParallel`` (any module, e.g. a LayerNorm or RMSNorm): the module runs on this rank's
  ``s/t`` tokens, so the gradients of its replicated parameters are partial sums over the group: the
  module declares them (``sequence_parallel_parameters()``), and the optimizer setup sums them.
* ``VocabParallel`` (an ``nn.Embedding`` ``[V, h]``): rows ``[r V/t, (r+1) V/t)`` (``pad_vocab``: of
  the table padded to ``t ceil(V/t)`` rows); the partial lookups all-reduced (``sequence_parallel``:
  reduce-scattered along the sequence).
* ``TiedVocabParallelOutput`` (the output layer of a tied embedding): the logits shard ``[b, s, V/t]``
  on the embedding's own shard, named by ``embedding``.

Each style also says what it does to each parameter without building anything (``split``:
``ParamSplit``), which the planner reads on a meta-device model. A model's own style (a module of
its own that needs a parallel form) implements the same two methods.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, TypeVar, runtime_checkable

from torch import nn

from refimpl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tensor_parallel.tp_communications import Group, group_size
from refimpl.parallel.tensor_parallel.vocab_parallel import TiedVocabParallelHead, VocabParallelEmbedding

__all__ = ["ColwiseParallel", "ParallelStyle", "ParamSplit", "RowwiseParallel", "SequenceParallel",
           "TiedVocabParallelOutput", "VocabParallel"]

_M = TypeVar("_M", bound=nn.Module)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamSplit:
    """What tensor parallelism does to one parameter: ``dim`` the dim the ranks split (None: replicated),
    ``padded`` a rank holds ``ceil(n/t)`` rows there (the vocabulary), ``sequence_parallel_gradient`` its
    gradient is a partial sum over the group (sequence parallelism)."""

    dim: int | None = None
    padded: bool = False
    sequence_parallel_gradient: bool = False


REPLICATED = ParamSplit()


@runtime_checkable
class ParallelStyle(Protocol):
    """What a plan maps a module name to: ``apply`` returns the module's parallel form (``root``: the
    module the plan is applied to, for styles that refer to another module), ``split`` says what it does to
    the parameter ``name`` (relative to the module)."""

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module: ...

    def split(self, name: str) -> ParamSplit: ...


def _sp(style: object, tp_group: Group) -> bool:
    """Sequence parallelism is on for a style that asks for it over more than one rank."""
    return bool(getattr(style, "sequence_parallel", False)) and group_size(tp_group) > 1


def _expect(module: nn.Module, kind: type[_M], style: object) -> _M:
    """``module``, which ``style`` takes only as a ``kind`` (else a ``TypeError``)."""
    if not isinstance(module, kind):
        raise TypeError(f"{type(style).__name__} takes an nn.{kind.__name__}, got {type(module).__name__}")
    return module


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColwiseParallel:
    """An ``nn.Linear`` split by output rows (module docstring); ``chunks``: stacked projections."""

    chunks: int = 1
    sequence_parallel: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        linear = _expect(module, nn.Linear, self)
        return ColumnParallelLinear.from_linear(linear, tp_group=tp_group, chunks=self.chunks,
                                                sequence_parallel=_sp(self, tp_group))

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowwiseParallel:
    """An ``nn.Linear`` split by input columns, its output reduced (module docstring)."""

    sequence_parallel: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        linear = _expect(module, nn.Linear, self)
        return RowParallelLinear.from_linear(linear, tp_group=tp_group,
                                             sequence_parallel=_sp(self, tp_group))

    def split(self, name: str) -> ParamSplit:
        if name == "weight":
            return ParamSplit(dim=1)
        return ParamSplit(sequence_parallel_gradient=self.sequence_parallel)


def _declare_all(self: nn.Module) -> tuple[str, ...]:
    """Every parameter of the module: it runs on this rank's ``s/t`` tokens (``SequenceParallel``)."""
    return tuple(n for n, _ in self.named_parameters())


@functools.cache
def _sequence_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with ``sequence_parallel_parameters()``: the module's class after ``SequenceParallel``
    (its name, forward and parameters unchanged; the way FSDP2 gives a module its own subclass)."""
    return type(f"SequenceParallel{cls.__name__}", (cls,), {"sequence_parallel_parameters": _declare_all})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceParallel:
    """A module that runs on this rank's ``s/t`` tokens: its parameters' gradients are summed over tp."""

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        if group_size(tp_group) > 1 and not hasattr(module, "sequence_parallel_parameters"):
            # the ignore: mypy checks type[Module] as Hashable against Module's unbound __hash__
            module.__class__ = _sequence_parallel_class(type(module))  # type: ignore[arg-type]
        return module

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(sequence_parallel_gradient=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabParallel:
    """An ``nn.Embedding`` split by vocabulary rows (module docstring)."""

    sequence_parallel: bool = False
    pad_vocab: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        embedding = _expect(module, nn.Embedding, self)
        return VocabParallelEmbedding.from_embedding(
            embedding, tp_group=tp_group, pad_vocab=self.pad_vocab,
            reduce_scatter_embeddings=_sp(self, tp_group))

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0, padded=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TiedVocabParallelOutput:
    """The output layer tied to the ``VocabParallel`` embedding named ``embedding`` (the name in the
    module the plan is applied to, after the embedding's own style)."""

    embedding: str
    sequence_parallel: bool = False

    def apply(self, module: nn.Module, *, tp_group: Group, root: nn.Module) -> nn.Module:
        table = root.get_submodule(self.embedding)
        if not isinstance(table, VocabParallelEmbedding):
            raise TypeError(f"TiedVocabParallelOutput: {self.embedding!r} is a {type(table).__name__}, not a "
                            "VocabParallelEmbedding: put its VocabParallel style before this one in the plan")
        return TiedVocabParallelHead(table, sequence_parallel=_sp(self, tp_group))

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0, padded=True)
