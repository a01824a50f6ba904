"""Activation checkpointing of transformer blocks, and a meter of the bytes saved for backward (chapter 05).

Backward needs tensors from the forward pass: a linear layer keeps its input, GELU its input, LayerNorm
its input and statistics, attention Q, K, V and its output. Those *saved tensors* are the activation
memory. Checkpointing a block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps
only the block's input and runs the block's forward again during backward to rebuild the rest: memory
for compute. We use ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; the non-reentrant
version stops recomputing as soon as the last tensor backward needs is rebuilt ("early stop"), so the
block's last matrix multiply is not run again.

:func:`apply_activation_checkpointing` turns it on per block without changing the module tree (parameter
names, ``state_dict`` and optimizer groups stay the same). :class:`SavedTensorMeter` counts what autograd
keeps, per block and per dtype, through ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor
is attributed to the block whose forward saved it, tensors sharing storage are counted once (Q, K and V
are views of one QKV output), and parameters, as well as autocast's low-precision copies of them, are
counted apart: they do not grow with the batch. :mod:`refimpl.activation_planner` predicts the same bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

OUTSIDE = "outside blocks"  # embedding, final LayerNorm, output layer, loss


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


def _blocks(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no ModuleList `layers` of transformer blocks")
    return layers


def apply_activation_checkpointing(
    model: nn.Module, blocks: str | Iterable[int] | Callable[[int], bool] = "all"
) -> list[int]:
    """Checkpoint the transformer blocks ``model.layers[i]`` selected by ``blocks``; return their indices.

    ``blocks``: ``"all"``, ``"none"``, indices (negative ones count from the end), or ``fn(i) -> bool``
    (e.g. ``lambda i: i % 2 == 0`` for every other block). Blocks not selected are left plain (an earlier
    call's checkpointing of them is undone), so the call states the whole selection.
    """
    layers = _blocks(model)
    n = len(layers)
    if blocks == "all":
        chosen = set(range(n))
    elif blocks == "none":
        chosen = set()
    elif callable(blocks):
        chosen = {i for i in range(n) if blocks(i)}
    else:
        chosen = set()
        for i in blocks:
            if not -n <= i < n:
                raise IndexError(f"block {i} out of range for a model with {n} blocks")
            chosen.add(i % n)
    for i, block in enumerate(layers):
        (checkpoint_block if i in chosen else uncheckpoint_block)(block)
    return sorted(chosen)


def parse_block_selection(spec: str) -> str | list[int] | Callable[[int], bool]:
    """A command-line selection of blocks: ``all``, ``none``, ``every-N`` (blocks 0, N, 2N, ...) or
    comma-separated indices such as ``0,2,-1``; the result goes to :func:`apply_activation_checkpointing`."""
    spec = spec.strip().lower()
    if spec in ("all", "none"):
        return spec
    if spec.startswith("every-"):
        step = spec.removeprefix("every-")
        if not step.isdigit() or int(step) < 1:
            raise ValueError(f"bad block selection {spec!r}: every-N needs a positive N, e.g. every-2")
        return lambda i: i % int(step) == 0
    try:
        return [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"bad block selection {spec!r}: use all, none, every-N, or indices like 0,2,-1") from None


def checkpointed_blocks(model: nn.Module) -> list[int]:
    return [i for i, b in enumerate(_blocks(model)) if is_checkpointed(b)]


# --------------------------------------------------------------------------------------------------------
# Measuring saved tensors


def _bytes_by_dtype() -> dict[str, int]:
    return defaultdict(int)


@dataclass
class SavedTensorReport:
    """Bytes saved for backward, by owner (``"block 0"``, ..., :data:`OUTSIDE`) and dtype.

    ``activations[owner][dtype]`` counts each storage once; ``weights`` counts parameters and autocast's
    low-precision copies of them, which backward also keeps but which do not scale with the batch.
    ``count`` is the number of pack calls (saved tensors before de-duplication).
    """

    activations: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_bytes_by_dtype))
    weights: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_bytes_by_dtype))
    count: int = 0

    def block_bytes(self, i: int) -> int:
        return sum(self.activations.get(f"block {i}", {}).values())

    def per_block(self) -> list[int]:
        blocks = sorted(int(k.split()[1]) for k in self.activations if k.startswith("block "))
        return [self.block_bytes(i) for i in range(max(blocks) + 1)] if blocks else []

    @property
    def total(self) -> int:
        """All activation bytes (blocks and outside), weights excluded."""
        return sum(sum(d.values()) for d in self.activations.values())

    @property
    def weight_total(self) -> int:
        return sum(sum(d.values()) for d in self.weights.values())


def _is_weight(t: torch.Tensor, param_storages: set[int]) -> bool:
    """A parameter, a view of one, or a chain of one-input ops (cast, transpose) from one (autocast)."""
    if t.untyped_storage().data_ptr() in param_storages:
        return True
    node = t.grad_fn
    while node is not None:
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the end of the chain
        if variable is not None:
            return isinstance(variable, nn.Parameter)
    return False


class SavedTensorMeter:
    """Record every tensor autograd saves during a forward pass of ``model``::

        with SavedTensorMeter(model) as meter:
            loss = lm_loss(model(x), y)       # forward only is measured; backward may run later
        meter.report.per_block()              # bytes per transformer block

    Tensors are attributed to the block whose forward is running (forward pre/post hooks on
    ``model.layers``), de-duplicated by storage; see :class:`SavedTensorReport`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.report = SavedTensorReport()
        self._owner = OUTSIDE
        self._seen: set[int] = set()
        self._keep: list[torch.Tensor] = []  # hold storages so an address cannot be reused while measuring
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._param_storages: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.report.count += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._seen:  # empty, or a view of a storage already counted
            return t
        self._seen.add(ptr)
        self._keep.append(t)
        dtype = str(t.dtype).removeprefix("torch.")
        target = self.report.weights if _is_weight(t, self._param_storages) else self.report.activations
        target[self._owner][dtype] += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        for i, block in enumerate(_blocks(self.model)):
            self._handles.append(block.register_forward_pre_hook(self._enter_block(i)))
            self._handles.append(block.register_forward_hook(self._leave_block))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._keep.clear()

    def _enter_block(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._owner = f"block {i}"

        return hook

    def _leave_block(self, module: nn.Module, args: Any, output: Any) -> None:
        self._owner = OUTSIDE


def measure_saved_activations(model: nn.Module, forward: Callable[[], Any]) -> SavedTensorReport:
    """Run ``forward()`` (a closure calling ``model``) under a :class:`SavedTensorMeter`; its report."""
    with SavedTensorMeter(model) as meter:
        forward()
    return meter.report
