"""Tensor parallelism by plan on any module: the refusals and the one-rank identity (chapters 06 and 12).

``apply_tensor_parallel(module, plan, tp_group=None)`` (no process group: one rank) must refuse a plan
that cannot be what the user meant, by name and before anything is replaced: a pattern that matches no
module (a misspelt plan would leave layers whole), a module two patterns match, a style on the wrong module
type, a value that is not a style, and a model without a plan that declares none. On one rank every style
is the module's own arithmetic, bitwise, under the module's own name. The 2-rank semantics (chunks, the
fused-qkv negative control, torch's ``parallelize_module``) are proven in
``tests/ranks/test_bring_your_own_model.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refimpl.parallel.declarations import MissingDeclaration
from refimpl.parallel.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
    apply_tensor_parallel,
    match_plan,
    param_split,
    sequence_parallel_names,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(12, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 12, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = {"tok": VocabParallel(), "blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel(),
        "blocks.*.norm": SequenceParallel(), "head": ColwiseParallel()}


def test_one_rank_is_the_module_itself_under_its_names():
    ids = torch.randint(0, 12, (2, 5))
    plain = Net()
    want = plain(ids)
    names = [n for n, _ in plain.named_parameters()]
    model = apply_tensor_parallel(Net(), PLAN, tp_group=None)
    assert torch.equal(model(ids), want)
    assert [n for n, _ in model.named_parameters()] == names
    assert type(model.blocks[0].up).__name__ == "ColumnParallelLinear"
    assert sequence_parallel_names(model) == []  # one rank: nothing to sum


@pytest.mark.parametrize(("plan", "error", "words"), [
    ({"blocks.*.upp": ColwiseParallel()}, ValueError, "matches no module"),
    ({"blocks.*.up": ColwiseParallel(), "blocks.0.up": RowwiseParallel()}, ValueError, "two patterns"),
    ({"blocks.*.norm": ColwiseParallel()}, TypeError, "ColwiseParallel takes an nn.Linear, got LayerNorm"),
    ({"tok": RowwiseParallel()}, TypeError, "got Embedding"),
    ({"head": "colwise"}, TypeError, "not a style"),
])
def test_a_plan_that_cannot_be_meant_is_refused_by_name(plan, error, words):
    model = Net()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(error, match=words) as raised:
        apply_tensor_parallel(model, plan, tp_group=None)
    assert "\n" not in str(raised.value)
    if error is ValueError:  # refused before anything was replaced
        assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_patterns_match_atom_by_atom_like_torch():
    matched = match_plan(Net(), {"blocks.*.up": ColwiseParallel(), "*": VocabParallel()})
    assert matched == {"blocks.*.up": ["blocks.0.up", "blocks.1.up"], "*": ["tok", "blocks", "head"]}


def test_param_split_reads_the_plan_without_building():
    assert param_split(PLAN, "blocks.1.up.weight").dim == 0
    assert param_split(PLAN, "blocks.1.down.weight").dim == 1
    assert param_split(PLAN, "blocks.1.down.bias").dim is None
    assert param_split(PLAN, "blocks.0.norm.bias").sequence_parallel_gradient
    assert param_split(PLAN, "tok.weight").padded
    assert param_split({}, "head.weight").dim is None  # no style: replicated


def test_a_model_without_a_plan_is_refused_saying_what_to_declare():
    with pytest.raises(MissingDeclaration, match="tensor parallelism needs the model to declare "
                                                 "tensor_parallel_plan") as raised:
        apply_tensor_parallel(Net(), tp_group=None)
    assert "ColwiseParallel()" in str(raised.value) and isinstance(raised.value, TypeError)
    with pytest.raises(ValueError, match="options of its styles"):
        apply_tensor_parallel(Net(), PLAN, tp_group=None, sequence_parallel=True)
