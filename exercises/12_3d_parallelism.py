"""Exercises of chapter 12: the 3D layout, as arithmetic.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=12`` (or
``python -m exercises.grade 12``) to see your score per task:

1. ``rank_coordinates`` and ``axis_groups``: where a rank sits on the ``(pp, dp, cp, tp)`` grid and which
   ranks form its group along some axes (Narayanan et al. 2021, section 3.3: tensor parallelism innermost,
   pipeline outermost; chapter 12, section 1);
2. ``state_bytes_per_gpu``: the bytes of weights, gradients and optimizer state one GPU holds for a model
   of ``N`` parameters laid out as ``dp x cp x tp x pp`` with ZeRO stage 0-3 and mixed-precision AdamW
   (Rajbhandari et al. 2020; chapter 12, section 4);
3. ``gradient_average_group`` and ``counted_in_grad_norm``: over which ranks a rank's gradients are
   averaged, and which of the gradients a rank holds enter the global gradient norm once (Megatron-LM's
   ``get_grad_norm_fp32``; chapters 06, 08 and 10).

Everything is integer or float arithmetic in one process. You may use ``StateMemory`` (the data
type of the answer of task 2); do not import ``refimpl.distributed.mesh`` or ``refimpl.planner`` (that is the
answer).
"""

from __future__ import annotations

from refimpl.measure.state import StateMemory

# ---- 1: the rank grid --------------------------------------------------------------------------------------


def rank_coordinates(rank: int, *, dp: int, cp: int, tp: int, pp: int) -> tuple[int, int, int, int]:
    """``(pp_i, dp_i, cp_i, tp_i)`` of ``rank`` on the grid of shape ``(pp, dp, cp, tp)`` in row-major
    order: ``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``.

    Contract: the inverse of that formula for every rank ``0 .. pp*dp*cp*tp - 1``; a rank outside that
    range raises ``ValueError``. Trap: the innermost axis (``tp``) varies fastest, so ranks ``0 .. tp-1``
    share every coordinate but ``tp_i``.
    """
    raise NotImplementedError("rank_coordinates: peel tp off first (divmod), then cp, then dp; pp is left")


def axis_groups(axes: tuple[str, ...], *, dp: int, cp: int, tp: int, pp: int) -> list[tuple[int, ...]]:
    """Every group of ranks along ``axes`` (names from ``"pp", "dp", "cp", "tp"``, e.g. ``("tp",)`` or
    ``("dp", "cp")``): the ranks that agree in every coordinate NOT in ``axes``.

    Contract: each group a tuple of ranks ascending; the groups sorted by their first rank; together they
    hold every rank exactly once; a group has the product of the ``axes``' degrees as its size. Unknown or
    repeated axis names raise ``ValueError``.
    """
    raise NotImplementedError("axis_groups: fix the other coordinates, let the axes' coordinates run")


# ---- 2: model state per GPU --------------------------------------------------------------------------------


def state_bytes_per_gpu(num_params: float, *, dp: int, cp: int, tp: int, pp: int,
                        zero_stage: int) -> StateMemory:
    """``StateMemory(weights, grads, optimizer)`` in bytes on one GPU, mixed-precision AdamW (the paper's
    accounting, fractional: do not round): bf16 weights (2 bytes per parameter), bf16 gradients (2) and the
    fp32 master weights plus Adam's two moments (``K = 12``) for the GPU's share of the parameters.

    Tensor and pipeline parallelism give each GPU ``1 / (tp * pp)`` of the parameters (assume they split
    evenly). ZeRO shards over the ranks that hold the same parameters, the ``dp x cp`` group (context
    parallelism replicates the weights as data parallelism does): stage 1 shards the optimizer state, stage
    2 also the gradients, stage 3 also the weights. ``zero_stage`` outside 0-3 raises ``ValueError``.
    """
    raise NotImplementedError("state_bytes_per_gpu: 2 + 2 + 12 bytes per parameter of the GPU's share")


# ---- 3: gradients under a composed layout --------------------------------------------------------------


def gradient_average_group(rank: int, *, dp: int, cp: int, tp: int, pp: int) -> tuple[int, ...]:
    """The ranks (ascending, ``rank`` among them) whose gradients of ``rank``'s parameters are averaged
    with ``rank``'s after backward, on the grid of task 1 with ZeRO 0-2 (no expert parallelism).

    Contract: the averaging runs over exactly the ranks that hold a replica of the same parameter shards
    and see different tokens; ranks that hold other shards or other layers are never in it. Graded against
    the process group the trainer averages over.
    """
    raise NotImplementedError("gradient_average_group: which axes replicate the weights?")


def counted_in_grad_norm(name: str, *, stage: int, pp: int, tp_rank: int, tp: int, tied: bool) -> bool:
    """Whether this rank adds the squares of its gradient of parameter ``name`` to its partial sum of the
    global gradient norm ``||g||^2`` (the partial sums are then all-reduced over the tp and pp groups; ZeRO
    0, so the dp x cp replicas hold the same, already averaged, gradients and are not summed).

    ``name`` is the parameter's name in the plain GPT (``refimpl.models.GPT.named_parameters()``, e.g.
    ``"layers.3.mlp.dense_4h_to_h.bias"``), held by pipeline stage ``stage`` of ``pp`` on tensor-parallel
    rank ``tp_rank`` of ``tp``, with Megatron's column-, row- and vocabulary-parallel layers (chapter 06).
    ``tied``: the output layer reuses the word embedding; under ``pp > 1`` the last stage then holds a copy
    of ``"embedding.word_embeddings.weight"`` (under that name) whose gradient is summed with the first
    stage's.

    Contract: every element of the model's gradient enters the norm exactly once over all ranks. Graded
    by the norm refimpl's trainer computes from random gradients at a composed layout.
    """
    raise NotImplementedError("counted_in_grad_norm: which gradients does another rank also hold?")


__all__ = ["StateMemory", "axis_groups", "counted_in_grad_norm", "gradient_average_group", "rank_coordinates",
           "state_bytes_per_gpu"]
