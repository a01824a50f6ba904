"""refimpl/support.py: each refused combination, its reason, and the nearest configuration that passes.

Every row of the support table is checked here by a configuration it refuses and a neighbour (one option
changed back) that no row refuses, so a row that never fires, or that fires too widely, fails; the three
places that ask the table (the trainer's options, parallelize, the planner) refuse with the row's words.
"""

from __future__ import annotations

import pytest

from refimpl.config import ConfigError, ModelConfig, ParallelConfig
from refimpl.distributed import ParallelDims
from refimpl.model import GPT
from refimpl.parallel.parallelize import parallelize
from refimpl.planner import run_memory_per_rank
from refimpl.support import SUPPORT_TABLE, check_supported, describe_support_table, refusals
from refimpl.train import RunOptions

# row name -> (a configuration it refuses, the nearest one that passes)
CASES = {
    "sp-without-tp": (dict(sequence_parallel=True), dict(sequence_parallel=True, tp=2)),
    "zero3-reshard-zbh1": (dict(pp=2, zero_stage=3, pp_schedule="zbh1", zero3_reshard_per_microbatch=True),
                           dict(pp=2, zero_stage=3, pp_schedule="zbh1")),
    "zero3-reshard-without-zero3-pp": (dict(zero_stage=3, zero3_reshard_per_microbatch=True),
                                       dict(pp=2, zero_stage=3, zero3_reshard_per_microbatch=True)),
    "hsdp-without-zero3": (dict(dp=4, dp_replicate=2, zero_stage=1),
                           dict(dp=4, dp_replicate=2, zero_stage=3)),
    "fp8-scaling-without-fp8": (dict(fp8_scaling="rowwise"), dict(fp8_scaling="rowwise", precision="fp8")),
    "fp8-zero3-rowwise": (dict(precision="fp8", fp8_scaling="rowwise", zero_stage=3),
                          dict(precision="fp8", fp8_scaling="rowwise", zero_stage=2)),
    "pipeline-options-without-pp": (dict(microbatches=4), dict(microbatches=4, pp=2)),
    "virtual-stages-without-interleaving": (dict(pp=2, virtual_stages=2),
                                            dict(pp=2, virtual_stages=2, pp_schedule="interleaved")),
}


def test_every_row_has_a_case_and_names_are_unique():
    names = [row.name for row in SUPPORT_TABLE]
    assert len(set(names)) == len(names) and set(names) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_row_refuses_its_case_and_lets_the_neighbour_through(name):
    refused, neighbour = (ParallelConfig(**kw) for kw in CASES[name])
    assert [row.name for row in refusals(refused)] == [name]
    (row,) = [r for r in SUPPORT_TABLE if r.name == name]
    with pytest.raises(ConfigError) as info:
        check_supported(refused)
    assert str(info.value) == row.message()
    assert refusals(neighbour) == [], [r.name for r in refusals(neighbour)]
    check_supported(neighbour)


def test_several_refusals_are_all_said():
    config = ParallelConfig(dp=2, zero_stage=2, dp_replicate=2, microbatches=2)
    assert [r.name for r in refusals(config)] == ["hsdp-without-zero3", "pipeline-options-without-pp"]
    with pytest.raises(ConfigError, match="without ZeRO-3.*; and micro-batches or virtual stages with pp"):
        check_supported(config)


def test_the_trainer_parallelize_and_the_planner_refuse_in_the_rows_words():
    message = next(r for r in SUPPORT_TABLE if r.name == "zero3-reshard-zbh1").message()
    with pytest.raises(ConfigError) as trainer:
        RunOptions(pp=2, zero_stage=3, pp_schedule="zbh1", zero3_reshard_per_microbatch=True)
    config = ModelConfig(vocab_size=64, max_seq_len=8, num_layers=2, hidden_size=16, num_attention_heads=2)
    with pytest.raises(ConfigError) as parallel:
        parallelize(GPT(config, seed=0), ParallelDims(dp=1, pp=2),
                    ParallelConfig(dp=1, pp=2, zero_stage=3, pp_schedule="zbh1",
                                   zero3_reshard_per_microbatch=True))
    with pytest.raises(ConfigError) as planner:
        run_memory_per_rank(config, ParallelDims(dp=2, pp=2), micro_batch=1, seq_len=8, zero_stage=3,
                            pp_schedule="zbh1", zero3_reshard_per_microbatch=True)
    assert str(trainer.value) == str(parallel.value) == str(planner.value) == message


def test_the_table_is_printed_row_by_row():
    text = describe_support_table()
    for row in SUPPORT_TABLE:
        assert f"  {row.name}\n" in text + "\n"
        assert " ".join(row.message().split()) in " ".join(text.split())


def test_list_layouts_prints_the_table_and_exits_0(capsys):
    from refimpl.train import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--list-layouts"])
    assert done.value.code in (0, None)
    assert capsys.readouterr().out.strip() == describe_support_table()
