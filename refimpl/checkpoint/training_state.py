"""The training state as shards: parameters, optimizer moments, RNG; save and load it (chapter 11).

What a checkpoint holds: the model's parameters and persistent buffers and the optimizer state *as each
rank holds them* (full tensors, ZeRO-1/2 optimizer shards, FSDP parameter shards), the optimizer's
hyperparameters, the loss scaler, the step (the learning-rate schedule and the data position are pure
functions of it in refimpl), and each rank's RNG states. Tensors are named globally and every shard is a
box of its global tensor, so a checkpoint written at one data-parallel size, ZeRO stage or layout loads at
another.

**Who holds what is said by the wrappers, never guessed here.** A module (at any depth) with
``local_shards() -> dict[str, LocalShard]`` claims its subtree (ZeRO-3's row shards, a data-parallel
wrapper's replicas, later tensor-parallel column or row blocks); the rest of the model is held whole
(``refimpl.distributed.placement.module_shards``). torch's own ``DistributedDataParallel`` is unwrapped
(its ``.module``). An optimizer that steps something other than the model's local tensors (ZeRO-1/2) has
``local_state_shards()``: ``(parameter, the tensor its inner optimizer steps, that tensor's box inside the
parameter's local tensor)`` triples, and ``inner_optimizer``, the optimizer that holds the state; the
checkpoint composes the two boxes (``parameter_box.within(inner_box)``), so ZeRO-1 over a tensor-parallel
shard is one more box, not one more branch.

**torch's own sharding says it too.** A ``DTensor`` parameter (FSDP2's ``fully_shard``: ``Shard(0)`` on a
1-D mesh, dim 0 padded to a multiple of the world size for the all-gather) holds the box of its placements
(``refimpl.distributed.placement.dtensor_box``: chunks of ``ceil(N / W)`` rows, the padding never
saved); a plain ``torch.optim.AdamW`` on such parameters keeps DTensor moments of the same placements, saved
as the same boxes, and a 0-d plain ``step``, saved whole. Load writes the intersecting boxes into the local
tensors in place, and the moments come back as DTensors of the parameter's placements, so the same
checkpoint loads into ``fully_shard`` at another world size, into our ZeRO wrappers or into a plain model.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import numpy as np
import torch
from torch import nn

from refimpl.checkpoint.checkpointer import Checkpointer
from refimpl.checkpoint.files import CheckpointReader
from refimpl.checkpoint.folder import CheckpointInfo
from refimpl.checkpoint.format import CheckpointError
from refimpl.distributed.placement import (
    Box,
    LocalShard,
    dtensor_like,
    dtensor_shard,
    held_shard,
    is_dtensor,
    local_tensor,
    module_shards,
)

log = logging.getLogger(__name__)


class _ShardedOptimizer(Protocol):
    """An optimizer that steps a box of each parameter (e.g. ZeRO-1/2's): ``local_state_shards()`` gives
    ``(parameter, stepped tensor, box of the parameter's local tensor)`` triples, ``inner_optimizer`` the
    optimizer that holds the state."""

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer: ...

    def local_state_shards(self) -> list[tuple[torch.Tensor, torch.Tensor, Box]]: ...


def _declares_shards(optimizer: object) -> TypeGuard[_ShardedOptimizer]:
    """Whether ``optimizer`` says which box of each parameter it steps (``_ShardedOptimizer``)."""
    return callable(getattr(optimizer, "local_state_shards", None))


def capture_rng_state() -> dict:
    """Python ``random``, NumPy's global generator, torch CPU and (when initialised) every CUDA device."""
    legacy = np.random.get_state(legacy=True)  # numpy's default: the tuple of the global MT19937
    assert isinstance(legacy, tuple)  # (its stubs also allow the dict a non-legacy call returns)
    kind, keys, pos, has_gauss, cached = legacy
    version, internal, gauss = random.getstate()
    numpy_keys = torch.from_numpy(keys.astype(np.int64))
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, numpy_keys, int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


def parameter_shards(model: nn.Module) -> dict[str, LocalShard]:
    """``{"model/<name>": LocalShard}`` of every parameter and persistent buffer, as this rank holds it.

    What the modules declare (``refimpl.distributed.placement.module_shards``): a plain or data-
    parallel model holds full tensors, a ``refimpl.parallel.zero.FullyShardedDataParallel`` the row
    box ``[start, end) x ...`` of each parameter, torch's ``fully_shard`` the box of each DTensor's
    placements (its local tensor). A tensor-parallel layer of stacked projections split chunk by chunk
    (``ColwiseParallel(chunks=k)``, k > 1) holds ``k`` separate row blocks of its weight, which no single
    box names: refused, saying what to do instead.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):  # torch's wrapper: its module's names
        model = model.module
    chunked = [name for name, m in model.named_modules() if getattr(m, "chunks", 1) > 1]
    if chunked:
        k = model.get_submodule(chunked[0]).chunks
        raise ValueError(f"the checkpoint cannot save {chunked[0]}: a ColwiseParallel(chunks={k}) layer "
                         "holds separate row blocks of its weight, which one box cannot name; store the "
                         "fused rows per head (Megatron's [heads, 3, d] order, then chunks=1) or use "
                         "separate q, k, v layers")
    return {f"model/{name}": shard for name, shard in sorted(module_shards(model).items())}


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor: pass to ``find_latest_valid`` to reject another model."""
    return {name: shard.global_shape for name, shard in parameter_shards(model).items()}


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                     ) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, str, Box]]]:
    """The optimizer that holds the state, and for each tensor it steps (in its order): the parameter's
    name and the box of the global parameter that tensor holds. Tensors are matched by the identity of
    their local tensor (``refimpl.distributed.placement.local_tensor``: a DTensor parameter's
    ``_local_tensor`` is what ``parameter_shards`` holds)."""
    by_id = {id(s.tensor): (name.removeprefix("model/"), s.box)
             for name, s in parameter_shards(model).items()}
    inner, where = optimizer, by_id
    if _declares_shards(optimizer):  # e.g. ZeRO-1/2: the inner optimizer steps a box of each local tensor
        inner, where = optimizer.inner_optimizer, {}
        for param, stepped, box in optimizer.local_state_shards():
            if id(local_tensor(param)) not in by_id:
                raise CheckpointError("the optimizer holds a parameter that is not a parameter of the model")
            name, param_box = by_id[id(local_tensor(param))]
            where[id(local_tensor(stepped))] = (name, param_box.within(box))
    slots = []
    for group in inner.param_groups:
        for t in group["params"]:
            local = local_tensor(t)
            if id(local) not in where:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of the model")
            name, box = where[id(local)]
            if tuple(local.shape) != box.shape:
                raise CheckpointError(f"the optimizer steps a {tuple(local.shape)} tensor for {name!r}, "
                                      f"whose declared box has shape {box.shape}")
            slots.append((t, name, box))
    return inner, slots


def _moment_shard(value: torch.Tensor, box: Box, what: str) -> LocalShard:
    """A per-element state tensor (a moment) as the box ``box`` of the parameter it belongs to. A DTensor
    moment (``AdamW`` on ``fully_shard``'s parameters) says its box by its own placements, which must be
    the parameter's."""
    if not is_dtensor(value):
        return LocalShard(value, box)
    shard = dtensor_shard(value)
    if shard.box != box:
        raise CheckpointError(f"optimizer state {what} holds {shard.box}, its parameter {box}")
    return shard


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, LocalShard]:
    """``{"optimizer/<param>/<key>": LocalShard}``: per-element state (moments, the parameter's global
    shape) in the box of the tensor it belongs to, other tensors (the step count) as held
    (``refimpl.distributed.placement.held_shard``: a plain one whole)."""
    inner, slots = _optimizer_slots(model, optimizer)
    out = {}
    for t, name, box in slots:
        for key, value in inner.state.get(t, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name}/{key} is a {type(value).__name__}, "
                                      "not a tensor")
            per_element = value.dim() > 0 and value.shape == t.shape
            out[f"optimizer/{name}/{key}"] = (_moment_shard(value, box, f"{name}/{key}") if per_element
                                              else held_shard(value))
    return out


def _group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    def plain(v: Any) -> Any:
        return v.item() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, tuple) else v

    return [{k: plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_training_state(checkpointer: Checkpointer, step: int, *, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        extra: Mapping[str, Any] | None = None, config: Any = None) -> None:
    """Save everything a bitwise resume needs after ``step`` completed optimizer steps. Collective.

    ``extra`` (JSON) joins the manifest's state: put the data position there if it is not a function
    of the step. Each rank's RNG states go into its own file.
    """
    tensors = parameter_shards(model)
    state: dict[str, Any] = {"step": step}
    if optimizer is not None:
        tensors |= optimizer_shards(model, optimizer)
        state["optimizer_param_groups"] = _group_hyperparameters(optimizer)
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    state |= dict(extra or {})
    checkpointer.save(step, tensors, state=state, rank_state={"rng": capture_rng_state()}, config=config)


# Optimizer options that say how this machine runs the update, not what it computes: kept from the optimizer
# built here (a checkpoint saved on CPU ranks, foreach=False, resumes on GPUs with foreach, and back).
_HOW_NOT_WHAT = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _load_optimizer(reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: list[dict] | None) -> None:
    inner, slots = _optimizer_slots(model, optimizer)
    keys_of: dict[str, list[str]] = {}
    for entry in reader.manifest["entries"]:
        if entry.startswith("optimizer/"):
            name, key = entry.removeprefix("optimizer/").rsplit("/", 1)
            keys_of.setdefault(name, []).append(key)
    state: dict[int, dict[str, tuple[torch.Tensor, bool]]] = {}
    for index, (_, name, box) in enumerate(slots):
        for key in keys_of.get(name, []):
            entry = f"optimizer/{name}/{key}"
            shape = tuple(reader.entry(entry)["shape"])
            # per element (a moment): this rank's box of it; else (the step count) the whole tensor
            per_element = shape == box.global_shape and bool(shape)
            value = reader.read(entry, box) if per_element else reader.read(entry)
            state.setdefault(index, {})[key] = (value, per_element)
    # Fill the state in place, not by load_state_dict: a ZeRO optimizer shares this dict with its wrapper,
    # and load_state_dict would replace it.
    group_of = [g for g in inner.param_groups for _ in g["params"]]
    inner.state.clear()
    for index, entries in state.items():
        t, group = slots[index][0], group_of[index]
        on_device = bool(group.get("capturable") or group.get("fused"))
        inner.state[t] = {k: _restored(t, k, v, per_element=pe, on_device=on_device)
                          for k, (v, pe) in entries.items()}
    if groups is not None:
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{reader.folder}: {len(groups)} optimizer parameter groups saved, the "
                                  f"optimizer has {len(optimizer.param_groups)}")
        for target in {id(o): o for o in (optimizer, inner)}.values():
            for g, saved in zip(target.param_groups, groups, strict=True):
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                          if k in g and k not in _HOW_NOT_WHAT})


def _restored(t: torch.Tensor, key: str, value: torch.Tensor, *, per_element: bool,
              on_device: bool) -> torch.Tensor:
    """A state tensor read from the checkpoint, cast as ``Optimizer.load_state_dict`` would: the step count
    stays a CPU float unless capturable/fused, the rest goes to the parameter's device (floating point: to
    its dtype). The moments of a DTensor parameter become DTensors of its placements around this rank's box
    (``refimpl.distributed.placement.dtensor_like``), as ``AdamW`` makes them."""
    if key == "step":
        return value.to(t.device) if on_device else value
    local = local_tensor(t)
    value = value.to(local.device, t.dtype if value.is_floating_point() else value.dtype)
    return dtensor_like(t, value) if per_element and is_dtensor(t) else value


def load_training_state(checkpointer: Checkpointer, info: CheckpointInfo, *, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        restore_rng: bool = True) -> dict:
    """Load what ``save_training_state`` saved into this rank's model/optimizer/scaler, at any world
    size and sharding; restore this rank's RNG states; return the saved state (``state["step"]``, ...)."""
    reader = CheckpointReader(info.path, info.manifest)
    try:
        reader.load_into(parameter_shards(model))
        state = info.state
        if optimizer is not None:
            _load_optimizer(reader, model, optimizer, state.get("optimizer_param_groups"))
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        if restore_rng:
            objects = reader.rank_objects(checkpointer.rank)
            if objects is None:
                log.warning("rank %d: the checkpoint was written by %d ranks, no RNG state for this rank; "
                            "keeping the current seeding", checkpointer.rank, info.manifest["world_size"])
            else:
                restore_rng_state(objects["rng"])
        return state
    finally:
        reader.close()
