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
(:func:`refimpl.distributed.placement.module_shards`). torch's own ``DistributedDataParallel`` is unwrapped
(its ``.module``). An optimizer that steps something other than the model's local tensors (ZeRO-1/2) has
``local_state_shards()``: ``(parameter, the tensor its inner optimizer steps, that tensor's box inside the
parameter's local tensor)`` triples, and ``inner_optimizer``, the optimizer that holds the state; the
checkpoint composes the two boxes (``parameter_box.within(inner_box)``), so ZeRO-1 over a tensor-parallel
shard is one more box, not one more branch.
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
from refimpl.checkpoint.format import CheckpointError
from refimpl.distributed.placement import Box, LocalShard, module_shards

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


def parameter_shards(model: nn.Module) -> dict[str, LocalShard]:
    """``{"model/<name>": LocalShard}`` of every parameter and persistent buffer, as this rank holds it.

    What the modules declare (:func:`~refimpl.distributed.placement.module_shards`): a plain or data-
    parallel model holds full tensors, a :class:`~refimpl.parallel.zero.FullyShardedDataParallel` the row
    box ``[start, end) x ...`` of each parameter.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):  # torch's wrapper: its module's names
        model = model.module
    return {f"model/{name}": shard for name, shard in sorted(module_shards(model).items())}


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor: pass to ``find_latest_valid`` to reject another model."""
    return {name: shard.global_shape for name, shard in parameter_shards(model).items()}


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                     ) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, str, Box]]]:
    """The optimizer that holds the state, and for each tensor it steps (in its order): the parameter's
    name and the box of the global parameter that tensor holds."""
    by_id = {id(s.tensor): (name.removeprefix("model/"), s.box)
             for name, s in parameter_shards(model).items()}
    declare = getattr(optimizer, "local_state_shards", None)
    inner, where = optimizer, by_id
    if callable(declare):  # e.g. ZeRO-1/2: the inner optimizer steps a box of each parameter's local tensor
        inner, where = optimizer.inner_optimizer, {}
        for param, stepped, box in declare():
            if id(param) not in by_id:
                raise CheckpointError("the optimizer holds a parameter that is not a parameter of the model")
            name, param_box = by_id[id(param)]
            where[id(stepped)] = (name, param_box.within(box))
    slots = []
    for group in inner.param_groups:
        for t in group["params"]:
            if id(t) not in where:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of the model")
            name, box = where[id(t)]
            if tuple(t.shape) != box.shape:
                raise CheckpointError(f"the optimizer steps a {tuple(t.shape)} tensor for {name!r}, whose "
                                      f"declared box has shape {box.shape}")
            slots.append((t, name, box))
    return inner, slots


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, LocalShard]:
    """``{"optimizer/<param>/<key>": LocalShard}``: per-element state (moments) in the box of the tensor
    it belongs to, other tensors (the step count) whole."""
    inner, slots = _optimizer_slots(model, optimizer)
    out = {}
    for t, name, box in slots:
        for key, value in inner.state.get(t, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {name}/{key} is a {type(value).__name__}, "
                                      "not a tensor")
            per_element = value.dim() > 0 and value.shape == t.shape
            out[f"optimizer/{name}/{key}"] = LocalShard(value, box) if per_element else LocalShard.full(value)
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
    state: dict[int, dict] = {}
    for index, (_, name, box) in enumerate(slots):
        for key in keys_of.get(name, []):
            entry = f"optimizer/{name}/{key}"
            shape = tuple(reader.entry(entry)["shape"])
            # per element (a moment): this rank's box of it; else (the step count) the whole tensor
            value = reader.read(entry, box) if shape == box.global_shape and shape else reader.read(entry)
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
                g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                          if k in g and k not in _HOW_NOT_WHAT})


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
