"""The training state as shards: parameters, optimizer moments, RNG; save and load it (chapter 09).

What a checkpoint holds: the model's parameters and persistent buffers and the optimizer state *as each
rank holds them* (full tensors, ZeRO-1/2 optimizer shards, FSDP parameter shards), the optimizer's
hyperparameters, the loss scaler, the step (the learning-rate schedule and the data position are pure
functions of it in refimpl), and each rank's RNG states. Tensors are named globally with flat ranges, so
a checkpoint written at one data-parallel size or ZeRO stage loads at another.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from refimpl.checkpoint.checkpointer import Checkpointer
from refimpl.checkpoint.files import CheckpointReader
from refimpl.checkpoint.folder import CheckpointInfo
from refimpl.checkpoint.format import CheckpointError, FlatShard

log = logging.getLogger(__name__)


def capture_rng_state() -> dict:
    """Python ``random``, NumPy's global generator, torch CPU and (when initialised) every CUDA device."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
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


def _zero():
    from refimpl.parallel import zero

    return zero


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / refimpl's data-parallel wrappers (their names must not leak into the file)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or (
            type(model).__module__ == "refimpl.parallel.data_parallel" and hasattr(model, "module")):
        model = model.module
    return model


def parameter_shards(model: nn.Module) -> dict[str, FlatShard]:
    """``{"model/<name>": FlatShard}`` of every parameter and persistent buffer, as this rank holds it.

    A plain (or data-parallel) model holds full tensors; a :class:`FullyShardedDataParallel` holds rows
    ``[start, end)`` of each parameter, the flat range ``[start * row_numel, end * row_numel)``.
    """
    model = _unwrap(model)
    out: dict[str, FlatShard] = {}
    if isinstance(model, _zero().FullyShardedDataParallel):
        module = model.module
        order = {(id(m), attr): f"{prefix}.{attr}" if prefix else attr
                 for prefix, m in module.named_modules() for attr in m._parameters}
        index = {key: i for i, key in enumerate(order)}
        for unit in model.units:
            for sp in unit.params:
                name = order[min(((id(m), a) for m, a in sp.registrations), key=index.__getitem__)]
                out[name] = FlatShard(sp.sharded, tuple(sp.spec.shape), sp.spec.start * sp.spec.row_numel)
    else:
        module = model
        out = {name: FlatShard.full(p) for name, p in model.named_parameters()}
    persistent = set(module.state_dict(keep_vars=True))
    out |= {name: FlatShard.full(b) for name, b in module.named_buffers() if name in persistent}
    return {f"model/{name}": shard for name, shard in sorted(out.items())}


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor: pass to ``find_latest_valid`` to reject another model."""
    return {name: shard.global_shape for name, shard in parameter_shards(model).items()}


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                     ) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, str, FlatShard]]]:
    """The optimizer that holds the state, and for each tensor it steps (in its order): name and placement."""
    by_id = {id(s.tensor): (name.removeprefix("model/"), s) for name, s in parameter_shards(model).items()}
    inner, where = optimizer, {}
    if isinstance(optimizer, _zero().ShardedOptimizer):  # state keyed by views of this rank's rows
        inner = optimizer.optimizer
        for p in optimizer.params:
            name, full = by_id[id(p)]
            view = optimizer.shard(p)
            if view.numel() and view.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                raise CheckpointError(f"the optimizer shard of {name!r} is not a view of the parameter")
            offset = view.storage_offset() - p.storage_offset()
            where[id(view)] = (name, FlatShard(view, full.global_shape, offset))
    else:
        where = by_id
    slots = []
    for group in inner.param_groups:
        for t in group["params"]:
            if id(t) not in where:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of the model")
            name, placement = where[id(t)]
            slots.append((t, name, placement))
    return inner, slots


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, FlatShard]:
    """``{"optimizer/<param>/<key>": FlatShard}``: per-element state (moments) placed like its parameter's
    shard, other tensors (the step count) whole."""
    inner, slots = _optimizer_slots(model, optimizer)
    out = {}
    for t, name, placement in slots:
        for key, value in inner.state.get(t, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name}/{key} is a {type(value).__name__}, "
                                      "not a tensor")
            per_element = value.shape == t.shape
            out[f"optimizer/{name}/{key}"] = (FlatShard(value, placement.global_shape, placement.offset)
                                              if per_element else FlatShard.full(value))
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


def _load_optimizer(reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer,
                    groups: list[dict] | None) -> None:
    inner, slots = _optimizer_slots(model, optimizer)
    keys_of: dict[str, list[str]] = {}
    for entry in reader.manifest["entries"]:
        if entry.startswith("optimizer/"):
            name, key = entry.removeprefix("optimizer/").rsplit("/", 1)
            keys_of.setdefault(name, []).append(key)
    state: dict[int, dict] = {}
    for index, (t, name, placement) in enumerate(slots):
        for key in keys_of.get(name, []):
            entry = f"optimizer/{name}/{key}"
            shape = tuple(reader.entry(entry)["shape"])
            if shape == placement.global_shape and shape:  # per element: this rank's range
                value = reader.read(entry, placement.offset, t.numel()).view(t.shape)
            else:
                value = reader.read(entry).view(shape)
            state.setdefault(index, {})[key] = value
    # Cast as Optimizer.load_state_dict would (moments to the parameter's device and dtype, the step count
    # stays a CPU float unless capturable/fused), but fill the state in place: a ZeRO optimizer shares
    # this dict with its wrapper, and load_state_dict would replace it.
    group_of = [g for g in inner.param_groups for _ in g["params"]]
    inner.state.clear()
    for index, entries in state.items():
        t, group = slots[index][0], group_of[index]
        on_device = group.get("capturable") or group.get("fused")
        inner.state[t] = {
            k: (v.to(t.device) if on_device else v) if k == "step"
            else v.to(t.device, t.dtype if v.is_floating_point() else v.dtype)
            for k, v in entries.items()
        }
    if groups is not None:
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"{reader.folder}: {len(groups)} optimizer parameter groups saved, the "
                                  f"optimizer has {len(optimizer.param_groups)}")
        for target in {id(o): o for o in (optimizer, inner)}.values():
            for g, saved in zip(target.param_groups, groups, strict=True):
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in g})


def load_training_state(checkpointer: Checkpointer, info: CheckpointInfo, *, model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                        restore_rng: bool = True) -> dict:
    """Load what :func:`save_training_state` saved into this rank's model/optimizer/scaler, at any world
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
