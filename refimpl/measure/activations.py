"""Activations measured: the bytes autograd saves for backward, per transformer block and dtype (chapter 05).

Backward needs tensors from the forward pass: a linear layer keeps its input, GELU its input, LayerNorm
its input and statistics, attention Q, K, V and its output. Those *saved tensors* are the activation
memory (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", which
``refimpl.planner.activation_bytes_per_layer`` counts for our block). ``SavedTensorMeter`` counts
what autograd keeps through ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is attributed
to the block whose forward saved it, tensors sharing storage are counted once (Q, K and V are views of one
QKV output), and parameters, as well as autocast's low-precision copies of them, are counted apart: they
do not grow with the batch. A block checkpointed by
``refimpl.parallel.activation_checkpoint.apply_activation_checkpointing`` saves only its input.

A storage is known by its identity (``storage_key``, the ``StorageImpl`` itself), not its address:
ZeRO-3 frees a gathered weight by shrinking its storage to 0 bytes (the tensors autograd saved stay valid)
and the allocator hands the address to the next activation, which an address key would take for the weight
seen before. A parameter is any ``nn.Parameter`` autograd saves, the model's or one a wrapper put in the
model for the forward: ZeRO-3's gathered full weights (``FullyShardedDataParallel``'s ``sp.unsharded``,
FSDP2's alike) are parameters (``nn.Parameter``) that ``model.parameters()`` does not list (it yields the
shards), so a LayerNorm's gathered weight, saved as itself, is a weight, not an activation
(tests/planner/ranks/test_planner_zero3.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["OUTSIDE", "SavedTensorMeter", "SavedTensorReport", "measure_saved_activations", "storage_key",
           "transformer_blocks"]

OUTSIDE = "outside blocks"  # embedding, final LayerNorm, output layer, loss


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """``model.layers``, the transformer blocks of the course GPT (TypeError if there is none)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no ModuleList `layers` of transformer blocks")
    return layers


def _bytes_by_dtype() -> dict[str, int]:
    return defaultdict(int)


@dataclass
class SavedTensorReport:
    """Bytes saved for backward, by owner (``"block 0"``, ..., ``OUTSIDE``) and dtype.

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


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: its ``StorageImpl`` (``untyped_storage()._cdata``), the same while
    ZeRO-3 resizes it to 0 bytes and back, and unique while the storage lives (a meter keeps the storages
    it counted alive, or drops a key when its storage dies). An address (``data_ptr``) is neither: 0 while
    freed, and reused by the next allocation."""
    return t.untyped_storage()._cdata


def _is_parameter(t: torch.Tensor, param_storages: set[int]) -> bool:
    """A parameter or a view of one: storage ``param_storages`` (``storage_key``) holds, or any
    ``nn.Parameter`` (ZeRO-3's gathered full weights, which the module's ``parameters()`` do not list)."""
    return isinstance(t, nn.Parameter) or storage_key(t) in param_storages


_LOOKUPS = ("EmbeddingBackward", "IndexBackward", "IndexSelectBackward", "GatherBackward")
"""Ops that read rows of one tensor by integer indices: one input to autograd, yet what they return is an
activation (a lookup of the tokens), not a copy of the weight (RoPE's Llama form has no position embedding
to add to the lookup, so the embedding's output reaches the first block through such a chain)."""


def _is_weight(t: torch.Tensor, param_storages: set[int]) -> bool:
    """A parameter (``_is_parameter``), a view of one, or a chain of one-input ops (cast, transpose)
    from one (autocast); an index lookup (``_LOOKUPS``) ends the chain as an activation."""
    if _is_parameter(t, param_storages):
        return True
    node = t.grad_fn
    while node is not None:
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1 or node.name().startswith(_LOOKUPS):
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
    ``model.layers``), de-duplicated by storage identity (``storage_key``; the storages counted are
    kept alive while measuring, so no identity is reused); see ``SavedTensorReport``. Parameters are
    those of ``model`` and any other ``nn.Parameter`` saved (module docstring: ZeRO-3's gathered weights).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.report = SavedTensorReport()
        self._owner = OUTSIDE
        self._seen: set[int] = set()
        self._keep: list[torch.Tensor] = []  # hold storages so an identity cannot be reused while measuring
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._param_storages: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.report.count += 1
        storage = t.untyped_storage()
        key = storage_key(t)
        if storage.nbytes() == 0 or key in self._seen:  # empty, or a view of a storage already counted
            return t
        self._seen.add(key)
        self._keep.append(t)
        dtype = str(t.dtype).removeprefix("torch.")
        target = self.report.weights if _is_weight(t, self._param_storages) else self.report.activations
        target[self._owner][dtype] += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._param_storages = {storage_key(p) for p in self.model.parameters()}
        for i, block in enumerate(transformer_blocks(self.model)):
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
    """Run ``forward()`` (a closure calling ``model``) under a ``SavedTensorMeter``; its report."""
    with SavedTensorMeter(model) as meter:
        forward()
    return meter.report
