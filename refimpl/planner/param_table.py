"""The parameters one tensor-parallel rank holds, by name, read from the model and the runtime's plan
(chapters 01, 06 and 08).

``param_table`` builds the model a configuration describes on the meta device (``ModelConfig.build``:
shapes only, nothing allocated; read once per configuration), takes its ``named_parameters()`` (a tied weight
once, under its first name) and applies the tensor-parallel plan the model declares (``tensor_parallel_plan``,
read by ``refimpl.parallel.tensor_parallel.param_split``): a parameter split along dim ``d`` holds ``n/t``
there (the vocab-parallel table ``ceil(V/t)`` rows, its padding rows included), a replicated one is whole. No
position in a list is assumed:

* the groups the pipeline cuts at (``refimpl.parallel.pipeline_parallel.split_blocks``) are the
  model's own submodules by name: ``embedding.*``, ``layers.{i}.*``, ``final_layernorm.*``,
  ``output_layer.*`` (none when tied);
* the weights that enter a matrix multiply (``matmul``: what costs FLOPs and what autocast casts) are those
  of the model's ``nn.Linear`` modules, the output layer's included (tied: the word embedding);
* ``sequence_parallel_gradient``: the plan's replicated parameters that see ``s/t`` tokens under sequence
  parallelism (their gradients are all-reduced over the tensor-parallel group once per step); none at
  ``tp = 1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from refimpl.config import ModelConfig
from refimpl.parallel.declarations import declared
from refimpl.parallel.tensor_parallel import ParamSplit, param_split
from refimpl.planner.activations import check_tp

__all__ = ["ParamSpec", "ParamTable", "param_table"]

Shape = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter on one tensor-parallel rank: its plain-model ``name``, the rank's ``shape``, whether it
    is a linear layer's weight (``matmul``) and whether its gradient is summed over tp under sequence
    parallelism (``sequence_parallel_gradient``)."""

    name: str
    shape: Shape
    matmul: bool
    sequence_parallel_gradient: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class ParamTable:
    """A rank's parameters in ``named_parameters()`` order (``params``), grouped by the model's submodules
    (``output_layer`` empty when tied), and ``head``: the weight the output layer multiplies (the untied
    output layer's, or the tied word embedding)."""

    params: tuple[ParamSpec, ...]
    embedding: tuple[ParamSpec, ...]
    blocks: tuple[tuple[ParamSpec, ...], ...]
    final_layernorm: tuple[ParamSpec, ...]
    output_layer: tuple[ParamSpec, ...]
    head: ParamSpec


def _meta_model(config: ModelConfig) -> nn.Module:
    """The model ``config`` describes, shapes only (``ModelConfig.build`` on the meta device)."""
    with torch.device("meta"):
        return config.build()


@functools.lru_cache(maxsize=64)
def _model_params(config: ModelConfig) -> tuple[tuple[tuple[str, Shape, bool], ...], str]:
    """``(name, shape, matmul)`` of every parameter of a meta-device GPT, and the name of the output
    layer's weight (tied: the word embedding's)."""
    model = _meta_model(config)
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    named = list(model.named_parameters())
    head = next(n for n, p in named if p is model.get_submodule("output_layer").weight)
    return tuple((n, tuple(p.shape), id(p) in linear) for n, p in named), head


@functools.lru_cache(maxsize=64)
def _splits(config: ModelConfig, t: int) -> dict[str, ParamSplit]:
    """What the model's declared tensor-parallel plan (``tensor_parallel_plan``, sequence parallelism on,
    the vocabulary padded) does to each parameter on ``t`` ranks (``param_split``)."""
    model = _meta_model(config)
    if t == 1:
        return {n: ParamSplit() for n, _ in model.named_parameters()}
    plan = declared(model, "tensor_parallel_plan")(tp_size=t, sequence_parallel=True, pad_vocab=True)
    return {n: param_split(plan, n) for n, _ in model.named_parameters()}


def _check_tp(config: ModelConfig, t: int) -> None:
    check_tp(config, t)
    v = config.vocab_size
    if not config.tie_word_embeddings and v % t:
        raise ValueError(f"tensor parallelism: an untied output layer needs vocab_size={v} to divide by "
                         f"tp={t}")


def _local(name: str, shape: Shape, split: ParamSplit, *, t: int) -> Shape:
    """The part of a ``shape`` parameter one of ``t`` ranks holds (the plan's ``split``)."""
    dim = split.dim
    if dim is None:
        return shape
    n = shape[dim]
    if split.padded:
        return shape[:dim] + (-(-n // t),) + shape[dim + 1:]
    if n % t:
        raise ValueError(f"tensor parallelism: {name} has {n} along dim {dim}, which does not divide by "
                         f"tp={t}")
    return shape[:dim] + (n // t,) + shape[dim + 1:]


def param_table(config: ModelConfig, *, tp: int = 1) -> ParamTable:
    """The parameters of ``refimpl.models.GPT`` for ``config`` as one of ``tp`` tensor-parallel ranks
    holds them after ``refimpl.parallel.tensor_parallel.apply_tensor_parallel`` (module docstring).
    Heads or ``ffn_hidden_size`` that do not divide by ``tp``, or an untied output layer's vocabulary, are a
    ``ValueError``."""
    _check_tp(config, tp)
    named, head = _model_params(config)
    splits = _splits(config, tp)
    specs = tuple(ParamSpec(name=n, shape=_local(n, s, splits[n], t=tp), matmul=mm,
                            sequence_parallel_gradient=splits[n].sequence_parallel_gradient)
                  for n, s, mm in named)

    def under(prefix: str) -> tuple[ParamSpec, ...]:
        return tuple(p for p in specs if p.name.startswith(prefix))

    table = ParamTable(params=specs, embedding=under("embedding."),
                       blocks=tuple(under(f"layers.{i}.") for i in range(config.num_layers)),
                       final_layernorm=under("final_layernorm."), output_layer=under("output_layer."),
                       head=next(p for p in specs if p.name == head))
    grouped = table.embedding + sum(table.blocks, ()) + table.final_layernorm + table.output_layer
    if grouped != specs:  # a submodule the groups do not know would be lost to the pipeline's stages
        raise ValueError(f"parameters outside embedding, layers, final_layernorm, output_layer: "
                         f"{sorted(set(p.name for p in specs) - set(p.name for p in grouped))}")
    return table
