"""Checkpoints of a model sharded by torch's own FSDP2 ``fully_shard`` (chapter 11).

``fully_shard`` holds each parameter as a DTensor placed ``Shard(0)`` on a 1-D mesh of ``W`` ranks: dim 0
is padded to a multiple of ``W`` for the all-gather, and each rank's local tensor is its unpadded chunk of
``ceil(N / W)`` rows (the last chunks smaller or empty). The checkpoint reads each DTensor's box from its
placements (``refimpl.distributed.placement.dtensor_box``), and that of the plain ``AdamW``'s DTensor
moments alike; load writes the intersecting boxes into the local tensors in place.

The model (``TinyLM``: an embedding, two blocks of named Linear layers, a head) has tensors whose dim 0
neither 2 nor 3 ranks divide (11 and 7 rows: 6, 5 and 4, 4, 3 and 4, 3 and 3, 3, 1) and one with fewer rows
than ranks (2 rows over 3: 1, 1, 0), so torch's padding matters. Two spawns and this process:

* 2 ranks train two AdamW steps under ``fully_shard`` and save; a fresh ``fully_shard`` model at 2 ranks
  loads it; both take one more step. The negative controls of the save run here.
* 3 ranks load it into ``fully_shard`` and take the same step; they load it again with a wrong box rule.
* this process loads it into a plain model and AdamW, in float32 and in float64, and takes the same step.

Saved and loaded state (parameters, ``exp_avg``, ``exp_avg_sq``, ``step``) is compared bit for bit with the
saving model's full tensors (``DTensor.full_tensor()``), and so is the next step at the same world size (the
same arithmetic). At 3 ranks and at 1 the next step sums the batch in another order: its loss, gradients and
parameters must lie within ``FACTOR`` times the error of the one-process float32 step against the float64
step from the same loaded state, measured in this run (see ``test_training_goes_on_from_the_checkpoint``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    expected_shapes,
    load_training_state,
    save_training_state,
)
from refimpl.distributed import placement
from refimpl.distributed.placement import Box, chunk_range, is_dtensor
from refimpl.launch import run_ranks
from tests.support.timeouts import SPAWN_TIMEOUT_S

VOCAB, DIM, HIDDEN, GATES = 11, 6, 7, 2
BATCH, SEQ = 6, 5  # 6 sequences: 3 per rank at 2 ranks, 2 at 3, 6 in one process
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
SAVED_STEP = 2
# The tolerance of the next step across world sizes, in units of the one-process float32 step's error
# against float64: each of two runs is about that far from exact arithmetic (other summation orders of the
# same terms), so their difference is within 2 x; 2 x more is the margin for the 2- and 3-rank reduction
# trees, which add one rounding per rank to the loss and the gradients.
FACTOR = 4.0


class Block(nn.Module):
    """``x + down(tanh(up(x))) * mean(sigmoid(gate(x)))``: Linear layers of 7 rows (neither 2 nor 3 divides
    them), 6 rows (both do) and 2 rows (fewer than 3 ranks: one rank holds none)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Linear(DIM, GATES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)


class TinyLM(nn.Module):
    """A transformer-shaped toy in plain PyTorch: embedding (11 rows), two blocks, a head (11 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(0, 1))  # [tokens, vocab]: a 3-D input would return a view of the GEMM


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sharded(seed: int) -> tuple[TinyLM, torch.optim.AdamW]:
    """``fully_shard`` on a 1-D mesh of all ranks (each block, then the root) and a plain AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _plain(seed: int, dtype: torch.dtype) -> tuple[TinyLM, torch.optim.AdamW]:
    model = _model(seed).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor: a DTensor gathered (collective), a plain one copied."""
    t = t.detach()
    return t.full_tensor() if is_dtensor(t) else t.clone()


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor, whole, under its checkpoint name."""
    out = {f"model/{n}": _full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            out[f"optimizer/{n}/{key}"] = _full(value)
    return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """One AdamW step on this rank's share of the global batch: the global mean loss, the full gradients
    (before the update) and the full parameters after it."""
    rank, world = _rank_world()
    tokens, targets = (t.chunk(world)[rank] for t in _batch(step))
    loss = F.cross_entropy(model(tokens), targets.flatten())
    loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.detach().clone()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return {"loss": loss, "grads": grads, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _boxes(model: nn.Module) -> dict[str, Box]:
    return {n: placement.dtensor_box(p) for n, p in model.named_parameters()}


def _load(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
          restore_rng: bool = True) -> None:
    checkpointer = Checkpointer(CheckpointConfig(folder=folder))
    info = checkpointer.find_latest_valid(expected=expected_shapes(model))
    assert info is not None and info.state["step"] == SAVED_STEP
    load_training_state(checkpointer, info, model=model, optimizer=optimizer, restore_rng=restore_rng)


# -- the wrong box rules of the negative controls -----------------------------------------------------------

def _rows_at_rank_times_own_rows(t: torch.Tensor) -> Box:
    """Wrong: rank ``r`` holds rows from ``r x`` (its own row count), as if every chunk were its size
    (right only when ``W`` divides the rows; ``fully_shard``'s chunks are ``ceil(N / W)``)."""
    local = t._local_tensor
    offsets = (dist.get_rank() * local.shape[0], *(0 for _ in local.shape[1:]))
    return Box(tuple(t.shape), offsets, tuple(local.shape))


def _local_as_whole(t: torch.Tensor) -> Box:
    """Wrong: each rank's local tensor taken for the whole tensor."""
    return Box.full(t._local_tensor.shape)


def _with_rule(rule, action) -> object:
    """Run ``action()`` with ``rule`` in place of ``placement.dtensor_box`` (this rank process only)."""
    right = placement.dtensor_box
    placement.dtensor_box = rule
    try:
        return action()
    finally:
        placement.dtensor_box = right


def _save_fails_with(rule, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    checkpointer = Checkpointer(CheckpointConfig(folder=folder))

    def save() -> None:
        save_training_state(checkpointer, SAVED_STEP, model=model, optimizer=optimizer)

    try:
        _with_rule(rule, save)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


# -- the ranks --------------------------------------------------------------------------------------------

def _at_2_ranks(ctx, folder: str) -> dict:
    """Train 2 steps under ``fully_shard``, save; a fresh ``fully_shard`` model loads; both step once more."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    model, optimizer = _sharded(seed=0)
    for step in range(SAVED_STEP):
        _step(model, optimizer, step)
    save_training_state(Checkpointer(CheckpointConfig(folder=folder)), SAVED_STEP, model=model,
                        optimizer=optimizer)
    out = {"saved": _full_state(model, optimizer), "boxes": _boxes(model)}
    twin, twin_optimizer = _sharded(seed=1)
    _load(folder, twin, twin_optimizer)
    out["twin"] = _full_state(twin, twin_optimizer)
    out["next"] = _step(model, optimizer, SAVED_STEP)
    out["twin_next"] = _step(twin, twin_optimizer, SAVED_STEP)
    out["wrong_offsets"] = _save_fails_with(_rows_at_rank_times_own_rows, f"{folder}-wrong-offsets", model,
                                            optimizer)
    out["local_as_whole"] = _save_fails_with(_local_as_whole, f"{folder}-local-as-whole", model, optimizer)
    mesh = model.embed.weight.device_mesh
    out["replicate"] = placement.dtensor_box(distribute_tensor(torch.ones(5, 2), mesh, [Replicate()]))
    try:
        placement.dtensor_box(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
        out["partial"] = "accepted"
    except ValueError as exc:
        out["partial"] = str(exc)
    return out


def _at_3_ranks(ctx, folder: str) -> dict:
    """Load into ``fully_shard`` at 3 ranks and step once; load again with the wrong offsets."""
    model, optimizer = _sharded(seed=2)
    _load(folder, model, optimizer)
    out = {"loaded": _full_state(model, optimizer), "boxes": _boxes(model)}
    out["next"] = _step(model, optimizer, SAVED_STEP)
    wrong, wrong_optimizer = _sharded(seed=2)
    _with_rule(_rows_at_rank_times_own_rows, lambda: _load(folder, wrong, wrong_optimizer))
    out["wrong"] = _full_state(wrong, wrong_optimizer)
    return out


# -- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def at_2(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("fully_shard") / "ckpt")
    results = run_ranks(_at_2_ranks, 2, folder, timeout_s=SPAWN_TIMEOUT_S)
    return {"folder": folder, "ranks": results, **results[0]}


@pytest.fixture(scope="module")
def at_3(at_2) -> list[dict]:
    return run_ranks(_at_3_ranks, 3, at_2["folder"], timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def at_1(at_2) -> dict:
    """This process (no process group): a plain float32 model + AdamW, and the float64 reference."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model, optimizer = _plain(seed=3, dtype=dtype)
        _load(at_2["folder"], model, optimizer, restore_rng=False)
        out[dtype] = {"loaded": _full_state(model, optimizer), "next": _step(model, optimizer, SAVED_STEP)}
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def _max_error(a: dict, b: dict) -> float:
    """The largest absolute difference over every element of ``a`` and ``b`` (same names), in float64."""
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


# -- tests ------------------------------------------------------------------------------------------------

@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 30)
def test_fully_shard_boxes_are_torchs_chunks_of_the_unpadded_rows(at_2, at_3):
    """Each DTensor's box is chunk ``r`` of ``ceil(N / W)`` rows (never the padded layout), 11 rows over 3
    ranks 4, 4, 3, 2 rows 1, 1, 0; a replica is the full box; a Partial is no box."""
    for world, ranks in ((2, at_2["ranks"]), (3, at_3)):
        for rank, result in enumerate(ranks):
            for name, box in result["boxes"].items():
                assert box == Box.chunk(box.global_shape, 0, rank, world), (world, rank, name, box)
    assert [r["boxes"]["embed.weight"].shape[0] for r in at_3] == [4, 4, 3]
    assert [r["boxes"]["blocks.0.gate.weight"].shape[0] for r in at_3] == [1, 1, 0]
    assert at_2["replicate"] == Box.full((5, 2))
    assert "holds no box" in at_2["partial"] and "Partial" in at_2["partial"]


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 30)
def test_fully_shard_checkpoint_loads_bitwise_at_2_and_3_ranks_and_in_a_plain_model(at_2, at_3, at_1):
    """Parameters and AdamW ``exp_avg``, ``exp_avg_sq``, ``step`` equal the saving model's full tensors."""
    saved = at_2["saved"]
    keys = {k.rsplit("/", 1)[1] for k in saved if k.startswith("optimizer/")}
    assert keys == {"exp_avg", "exp_avg_sq", "step"}
    assert all(float(v) == SAVED_STEP for k, v in saved.items() if k.endswith("/step"))
    assert _differing(saved, at_2["twin"]) == [], "fully_shard at 2 ranks"
    for rank, result in enumerate(at_3):
        assert _differing(saved, result["loaded"]) == [], f"fully_shard at 3 ranks, rank {rank}"
    assert _differing(saved, at_1[torch.float32]["loaded"]) == [], "plain model and AdamW"


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 30)
def test_training_goes_on_from_the_checkpoint(at_2, at_3, at_1):
    """The next step: bit for bit at the saving world size; within a measured tolerance at 3 ranks and 1.

    The tolerance of each quantity (loss, gradients before the update, parameters after it) is ``FACTOR``
    times the largest difference between the one-process float32 step and the float64 step taken from the
    same loaded state (the float64 one is the exact arithmetic to about 1e-16).
    """
    original = at_2["next"]
    assert torch.equal(original["loss"], at_2["twin_next"]["loss"])
    for what in ("grads", "params"):
        assert _differing(original[what], at_2["twin_next"][what]) == [], f"{what}, resumed at 2 ranks"
    one32, one64 = at_1[torch.float32]["next"], at_1[torch.float64]["next"]
    measured = {"loss": abs(float(one32["loss"]) - float(one64["loss"])),
                "grads": _max_error(one32["grads"], one64["grads"]),
                "params": _max_error(one32["params"], one64["params"])}
    assert all(0 < e < 1e-4 for e in measured.values()), measured  # a float32 error, not zero, not a bug
    for where, other in (("3 ranks", at_3[0]["next"]), ("1 process", one32)):
        errors = {"loss": abs(float(original["loss"]) - float(other["loss"])),
                  "grads": _max_error(original["grads"], other["grads"]),
                  "params": _max_error(original["params"], other["params"])}
        for what, error in errors.items():
            assert error <= FACTOR * measured[what], (f"{what} resumed at {where}: {error:.3g} > {FACTOR} x "
                                                     f"{measured[what]:.3g} (float32 vs float64)")


def _wrong_at_3(shape: tuple[int, ...]) -> bool:
    """Whether ``_rows_at_rank_times_own_rows`` misplaces a rank's rows of a tensor of ``shape`` at 3
    ranks: some rank holds rows and ``r x`` its row count is not its first row."""
    spans = [chunk_range(shape[0], r, 3) for r in range(3)]
    return any(end > start and r * (end - start) != start for r, (start, end) in enumerate(spans))


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 30)
def test_without_the_box_rule_the_checkpoint_fails(at_2, at_3):
    """Negative controls. Saving at 2 ranks with a rank's rows placed at ``r x`` its own row count leaves
    rows no rank holds; taking each local tensor for the whole tensor gives ranks that disagree on the
    shape: both refused. Loading at 3 ranks with the wrong offsets loads silently, and exactly the tensors
    whose chunks are uneven (11 and 7 rows: rank 2's rows start at 8 and 6, not 6 and 2) differ."""
    assert "held by no rank" in at_2["wrong_offsets"], at_2["wrong_offsets"]
    assert "says shape" in at_2["local_as_whole"], at_2["local_as_whole"]
    saved = at_2["saved"]
    expected = sorted(n for n, t in saved.items() if t.dim() > 0 and _wrong_at_3(tuple(t.shape)))
    assert any("embed" in n for n in expected) and any("gate" in n for n in saved)
    assert not any("gate" in n or "down" in n for n in expected)  # even, or 1, 1, 0: right by chance
    for rank, result in enumerate(at_3):
        assert _differing(saved, result["wrong"]) == expected, f"rank {rank}"
