"""What tensor parallelism does to each parameter of the plain GPT, declared by name (chapter 06).

:func:`~refimpl.parallel.tensor_parallel.transformer.apply_tensor_parallel` replaces submodules of
:class:`refimpl.models.GPT` (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism); this
file says, for a parameter name as the plain model's ``named_parameters()`` gives it (e.g.
``layers.3.self_attention.query_key_value.weight``), what that replacement does to it, without building
anything, so the planner can count a rank's bytes from a meta-device model:

* :func:`shard_dim`: the dim along which the ``t`` ranks split it. The rule is the replacing module's
  type (:data:`PARALLEL_STYLE`, keyed by the submodule's own name): a :class:`ColumnParallelLinear` splits
  its ``[out, in]`` weight and its ``[out]`` bias by rows (dim 0), a :class:`RowParallelLinear` its weight by
  columns (dim 1) and keeps its bias whole, a :class:`VocabParallelEmbedding` splits the ``[V, h]`` table by
  rows (dim 0). Everything else (LayerNorms, the position embedding) is replicated: None.
* :func:`padded_rows`: a vocab-parallel table holds ``ceil(V/t)`` rows per rank (the padding rows of
  :mod:`~refimpl.parallel.tensor_parallel.vocab_parallel`); every other split is exact.
* :func:`sequence_parallel_gradient`: under sequence parallelism, a replicated parameter applied to this
  rank's ``s/t`` tokens, so that its gradient is a partial sum that is summed over the tensor-parallel
  group after backward (:func:`~refimpl.parallel.tensor_parallel.layers.allreduce_sequence_parallel_grads`):
  the blocks' LayerNorms, the final LayerNorm (:data:`SEQUENCE_PARALLEL_MODULES`) and the row-parallel
  biases. The position embedding is not one: its gradient is the all-gathered whole on every rank.

``tests/test_tp_plan.py`` checks every name against the runtime itself (the boxes its modules declare, the
local shapes, the sequence-parallel declarations on 2 ranks). A new block type declares its submodules here.
"""

from __future__ import annotations

__all__ = ["COLUMN", "PARALLEL_STYLE", "ROW", "SEQUENCE_PARALLEL_MODULES", "VOCAB", "padded_rows",
           "parallel_style", "sequence_parallel_gradient", "shard_dim"]

COLUMN, ROW, VOCAB = "column", "row", "vocab"

PARALLEL_STYLE: dict[str, str] = {  # the plain GPT's submodule -> the tensor-parallel module replacing it
    "query_key_value": COLUMN,  # ColumnParallelLinear: a/t heads' q, k, v
    "dense": ROW,  # the attention projection: RowParallelLinear
    "dense_h_to_4h": COLUMN,
    "dense_4h_to_h": ROW,
    "word_embeddings": VOCAB,  # VocabParallelEmbedding
    "output_layer": COLUMN,  # untied: ColumnParallelLinear [V/t, h]; tied: the vocab-parallel table itself
}

SEQUENCE_PARALLEL_MODULES = ("input_layernorm", "post_attention_layernorm", "final_layernorm")


def _split(name: str) -> tuple[str, str]:
    """``(submodule's own name, parameter's own name)`` of a dotted parameter name."""
    path, _, leaf = name.rpartition(".")
    if not path:
        raise ValueError(f"{name!r} is not a parameter name of a submodule (expected 'module.weight')")
    return path.rpartition(".")[2], leaf


def parallel_style(name: str, *, tie_word_embeddings: bool) -> str | None:
    """``COLUMN``, ``ROW``, ``VOCAB`` or None (kept as it is): what replaces the submodule holding the
    parameter ``name``. A tied output layer multiplies by the vocab-parallel table: ``VOCAB``."""
    module, _ = _split(name)
    style = PARALLEL_STYLE.get(module)
    return VOCAB if style is not None and module == "output_layer" and tie_word_embeddings else style


def shard_dim(name: str, *, tie_word_embeddings: bool) -> int | None:
    """The dim along which tensor parallelism splits parameter ``name`` of the plain GPT, None when every
    rank holds it whole (module docstring): 0 for a column-parallel weight and bias, the word embedding
    and the output layer (tied: the same table; untied: column-parallel), 1 for a row-parallel weight."""
    style, leaf = parallel_style(name, tie_word_embeddings=tie_word_embeddings), _split(name)[1]
    if style == ROW:
        return 1 if leaf == "weight" else None
    return None if style is None else 0


def padded_rows(name: str, *, tie_word_embeddings: bool) -> bool:
    """True when a rank holds ``ceil(n/t)`` rows of the ``n`` of ``name`` (the vocab-parallel table,
    padding rows included); a split that is not padded needs ``n`` to divide by ``t``."""
    return parallel_style(name, tie_word_embeddings=tie_word_embeddings) == VOCAB


def sequence_parallel_gradient(name: str) -> bool:
    """True for a replicated parameter that sees ``s/t`` tokens per rank under sequence parallelism (its
    gradient is summed over the tensor-parallel group): the LayerNorms' weights and biases and the
    row-parallel biases."""
    module, leaf = _split(name)
    return module in SEQUENCE_PARALLEL_MODULES or (PARALLEL_STYLE.get(module) == ROW and leaf == "bias")
