"""A model's ``pipeline_stages`` declaration under ZB-V's V placement (chapter 08): a user's model whose
declaration takes no ``placement=``, or that ignores it and hands back the loop placement's stages, is
refused by name when ``PipelineModule`` is built (no ranks: the constructor alone decides)."""

from __future__ import annotations

import pytest
from torch import nn

from refimpl.config import ModelConfig
from refimpl.models import GPT
from refimpl.parallel.pipeline_parallel.pipeline_parallel import PipelineModule

CONFIG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, max_seq_len=16, vocab_size=64)


class NoPlacement(nn.Module):
    """A user's model that declares its stages the way the loop placement asks for them only."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CONFIG, seed=0)

    def pipeline_stages(self, *, pp_rank: int, pp_size: int, virtual_stages: int, balance: str):
        return self.gpt.pipeline_stages(pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                                        balance=balance)


class IgnoresPlacement(NoPlacement):
    """Takes ``placement=`` but answers with the loop placement's stages."""

    def pipeline_stages(self, *, pp_rank: int, pp_size: int, virtual_stages: int, balance: str,  # type: ignore[override]
                        placement: str = "loop"):
        return super().pipeline_stages(pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                                       balance=balance)


def _build(model: nn.Module, schedule: str, pp_rank: int = 0) -> PipelineModule:
    return PipelineModule(model, pp_group=None, pp_rank=pp_rank, pp_size=2, schedule=schedule,
                          virtual_stages=2)


def test_our_gpt_takes_the_v_and_rank_0_holds_both_ends():
    assert _build(GPT(CONFIG, seed=0), "zbv").stage_ids == [0, 3]
    assert _build(GPT(CONFIG, seed=0), "zbv", pp_rank=1).stage_ids == [1, 2]


def test_a_declaration_without_placement_is_refused_by_name_under_the_v_only():
    with pytest.raises(ValueError, match="takes no placement="):
        _build(NoPlacement(), "zbv")
    assert _build(NoPlacement(), "interleaved").stage_ids == [0, 2]  # the loop placement: as before


def test_stages_on_the_wrong_ranks_are_refused():
    with pytest.raises(ValueError, match=r"stages \[0, 2\]; the 'v' placement puts \[0, 3\] there"):
        _build(IgnoresPlacement(), "zbv")
