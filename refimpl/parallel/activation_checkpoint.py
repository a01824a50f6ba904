"""Activation checkpointing of transformer blocks (chapter 05).

Backward needs tensors from the forward pass: a linear layer keeps its input, GELU its input, LayerNorm
its input and statistics, attention Q, K, V and its output. Those *saved tensors* are the activation
memory. Checkpointing a block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps
only the block's input and runs the block's forward again during backward to rebuild the rest: memory
for compute. We use ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; the non-reentrant
version stops recomputing as soon as the last tensor backward needs is rebuilt ("early stop"), so the
block's last matrix multiply is not run again.

``apply_activation_checkpointing`` turns it on per block without changing the module tree (parameter
names, ``state_dict`` and optimizer groups stay the same). The blocks are the modules of the types the
model declares (``shard_units()``: the units ZeRO-3 gathers are the ones recomputed) or that the caller
names (``unit_types=``): any model, not only ours. What a block then saves is measured by
``refimpl.measure.activations.SavedTensorMeter`` and predicted by
``refimpl.planner.activation_bytes_per_layer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from refimpl.config import parse_block_selection
from refimpl.parallel.declarations import declared

__all__ = ["CheckpointedForward", "apply_activation_checkpointing", "checkpoint_block", "checkpoint_units",
           "checkpointed_blocks", "is_checkpointed", "parse_block_selection", "uncheckpoint_block"]


class CheckpointedForward:
    """Replaces ``block.forward``: the block's own forward under non-reentrant checkpointing.

    An object rather than a closure so that ``copy.deepcopy`` of the model checkpoints the copy's blocks.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False, **kwargs)


def checkpoint_block(block: nn.Module) -> nn.Module:
    """Checkpoint ``block`` in place: only its inputs are saved, the rest is recomputed in backward."""
    if not is_checkpointed(block):
        block.forward = CheckpointedForward(block)  # an instance attribute shadows the class's forward
    return block


def uncheckpoint_block(block: nn.Module) -> nn.Module:
    if is_checkpointed(block):
        del block.forward
    return block


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(block.__dict__.get("forward"), CheckpointedForward)


Units = tuple[type[nn.Module], ...]


def checkpoint_units(model: nn.Module, unit_types: Units | None = None) -> list[nn.Module]:
    """The blocks checkpointing chooses from, in module order: the submodules of a type in
    ``unit_types`` (None: the model's declared ``shard_units()``; a model without it is refused by name)."""
    if unit_types is None:
        unit_types = tuple(declared(model, "shard_units")())
    units = [m for m in model.modules() if isinstance(m, unit_types) and m is not model]
    if not units:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no submodule of the unit "
                         f"types {[t.__name__ for t in unit_types]}")
    return units


def apply_activation_checkpointing(
    model: nn.Module, blocks: str | Iterable[int] | Callable[[int], bool] = "all", *,
    unit_types: Units | None = None,
) -> list[int]:
    """Checkpoint the blocks of ``model`` (``checkpoint_units``: the modules of ``unit_types``, or of
    the types the model declares) selected by ``blocks``; return their indices.

    ``blocks``: ``"all"``, ``"none"``, indices (negative ones count from the end), or ``fn(i) -> bool``
    (e.g. ``lambda i: i % 2 == 0`` for every other block). Blocks not selected are left plain (an earlier
    call's checkpointing of them is undone), so the call states the whole selection.
    """
    layers = checkpoint_units(model, unit_types)
    n = len(layers)
    if blocks == "all":
        chosen = set(range(n))
    elif blocks == "none":
        chosen = set()
    elif callable(blocks):
        chosen = {i for i in range(n) if blocks(i)}
    elif isinstance(blocks, str):  # no other name: its characters are no block indices
        raise TypeError(f"blocks: 'all', 'none', indices or a function, got {blocks!r}")
    else:
        chosen = set()
        for i in blocks:
            if not -n <= i < n:
                raise IndexError(f"block {i} out of range for a model with {n} blocks")
            chosen.add(i % n)
    for i, block in enumerate(layers):
        (checkpoint_block if i in chosen else uncheckpoint_block)(block)
    return sorted(chosen)


def checkpointed_blocks(model: nn.Module, unit_types: Units | None = None) -> list[int]:
    """The indices of the checkpointed blocks (``checkpoint_units``)."""
    return [i for i, b in enumerate(checkpoint_units(model, unit_types)) if is_checkpointed(b)]
