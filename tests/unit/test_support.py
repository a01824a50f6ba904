"""refimpl/support.py: each refused combination, its reason, and the nearest configuration that passes.

Every row of the support table is checked here by a configuration it refuses and a neighbour (one option
changed back) that no row refuses, so a row that never fires, or that fires too widely, fails; the three
places that ask the table (the trainer's options, parallelize, the planner) refuse with the row's words.
The shapes a layout needs (``refimpl.support.shape_refusals``, which the planner's search and the
trainer's preflight both ask) refuse exactly the layouts whose cuts torch's own split makes uneven.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from refimpl.config import DEEPSEEK_V3, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from refimpl.distributed import ParallelDims
from refimpl.models import GPT
from refimpl.parallel.parallelize import parallelize
from refimpl.planner import evaluate_layout, run_memory_per_rank
from refimpl.support import SUPPORT_TABLE, check_supported, describe_support_table, refusals, shape_refusals
from refimpl.train import RunOptions
from refimpl.train.layout import check_shapes

# row name -> (a configuration it refuses, the nearest one that passes)
CASES = {
    "sp-without-tp": (dict(sequence_parallel=True), dict(sequence_parallel=True, tp=2)),
    "tp-comm-overlap-without-sp": (dict(tp=2, tp_comm_overlap=True),
                                   dict(tp=2, sequence_parallel=True, tp_comm_overlap=True)),
    "tp-comm-overlap-fp8": (dict(tp=2, sequence_parallel=True, tp_comm_overlap=True, precision="fp8"),
                            dict(tp=2, sequence_parallel=True, tp_comm_overlap=True, precision="bf16")),
    "tp-comm-overlap-zero-bubble": (dict(tp=2, sequence_parallel=True, tp_comm_overlap=True, pp=2,
                                         pp_schedule="zbh1"),
                                    dict(tp=2, sequence_parallel=True, tp_comm_overlap=True, pp=2)),
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
    "zbv-two-chunks": (dict(pp=2, pp_schedule="zbv"), dict(pp=2, pp_schedule="zbv", virtual_stages=2)),
    "zbv-fp8": (dict(pp=2, pp_schedule="zbv", virtual_stages=2, precision="fp8"),
                dict(pp=2, pp_schedule="zbh1", precision="fp8")),
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
        RunOptions(parallel=ParallelConfig(pp=2, zero_stage=3, pp_schedule="zbh1",
                                           zero3_reshard_per_microbatch=True))
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


def test_the_layout_planner_refuses_in_the_rows_words():
    # python -m refimpl.plan's estimate of one layout (its search skips what this refuses)
    config = ModelConfig(vocab_size=64, max_seq_len=8, num_layers=2, hidden_size=16, num_attention_heads=2)
    message = next(r for r in SUPPORT_TABLE if r.name == "hsdp-without-zero3").message()
    for stage in (0, 1, 2):
        with pytest.raises(ConfigError) as planner:
            evaluate_layout(config, dp=4, tp=1, pp=1, seq_len=8, global_batch=4, zero_stage=stage,
                            dp_replicate=2)
        assert str(planner.value) == message
    assert evaluate_layout(config, dp=4, tp=1, pp=1, seq_len=8, global_batch=4, zero_stage=3,
                           dp_replicate=2).dp_replicate == 2  # the neighbour


def _splits_evenly(size: int, parts: int) -> bool:
    """Whether a tensor of ``size`` rows cut into ``parts`` pieces gives equal pieces (torch's own split,
    not a modulo: the oracle the rules are checked against)."""
    return len({len(piece) for piece in torch.arange(size).tensor_split(parts)}) == 1


def _shapes_split(model: ModelConfig, config: ParallelConfig, s: int) -> bool:
    """Every cut the layout makes is even: tp's heads, MLP columns, vocabulary rows and (sp) tokens;
    cp's 2 cp (ring) or cp (Ulysses) sequence chunks, Ulysses' heads per tp rank over cp, and (sp) each
    cp rank's tokens over tp."""
    tp, cp, heads = config.tp, config.cp, model.num_attention_heads
    cuts = [(heads, tp), (model.ffn_hidden_size, tp), (model.vocab_size, tp)]
    cuts += [(s, tp)] * config.sequence_parallel
    cuts += [(s, 2 * cp if config.cp_method == "ring" else cp)]
    cuts += [(heads // tp, cp)] * (config.cp_method == "ulysses")
    cuts += [(s // cp, tp)] * config.sequence_parallel
    return all(_splits_evenly(size, parts) for size, parts in cuts)


# each rule of shape_refusals by a phrase of its sentence
SHAPE_RULES = ("attention heads (each", "MLP width", "vocabulary entries", "splits the sequence over",
               "cuts each sequence", "whole heads", "context-parallel rank's")


def test_the_shapes_refuse_exactly_the_layouts_whose_cuts_are_uneven():
    """shape_refusals (the planner's search and the trainer's preflight ask it) refuses exactly where
    torch's split of some tensor the layout cuts gives unequal pieces, over a grid where each of its rules
    is the only one that fires somewhere, and where none does."""
    alone, passed = {rule: 0 for rule in SHAPE_RULES}, 0
    for (heads, ffn, vocab), tp, cp, s, sp, method in itertools.product(
            [(4, 64, 256), (6, 96, 256), (4, 66, 256), (4, 64, 250), (12, 192, 240)], [1, 2, 3, 4],
            [1, 2, 3], [24, 36, 40, 64], [False, True], ["ring", "ulysses"]):
        if sp and tp == 1:
            continue  # refused by the support table (sp-without-tp), before any shape
        model = ModelConfig(vocab_size=vocab, num_layers=2, hidden_size=8 * heads, ffn_hidden_size=ffn,
                            num_attention_heads=heads, max_seq_len=64)
        config = ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp, cp_method=method)
        why = shape_refusals(model, config, seq_len=s)
        case = (heads, ffn, vocab, tp, cp, s, sp, method, why)
        assert bool(why) == (not _shapes_split(model, config, s)), case
        rules = [rule for rule in SHAPE_RULES for w in why if rule in w]
        assert len(rules) == len(why), why  # each sentence is one rule's
        if len(rules) == 1:
            alone[rules[0]] += 1
        passed += not why
    assert all(alone.values()) and passed, (alone, passed)


def test_the_trainers_preflight_raises_the_shape_rules_sentences():
    """The trainer refuses a layout the shapes do not split in shape_refusals' own words (one rule set:
    no second copy in the preflight), and lets the neighbour through."""
    model = ModelConfig(vocab_size=256, num_layers=2, hidden_size=48, num_attention_heads=6, max_seq_len=64)
    train = TrainConfig(model=model, data=DataConfig(seq_len=36, global_batch_size=1))
    bad = ParallelConfig(tp=4, cp=2, sequence_parallel=True, cp_method="ring")
    with pytest.raises(ConfigError) as refused:
        check_shapes(train, bad)
    assert str(refused.value) == "; and ".join(shape_refusals(model, bad, seq_len=36))
    assert "--tp 4 does not divide the 6 attention heads" in str(refused.value)
    check_shapes(train, ParallelConfig(tp=2, cp=3, sequence_parallel=True, cp_method="ring"))  # 36 = 6 x 6


MLA = dict(**DEEPSEEK_V3, vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=16,
           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize(("refused", "allowed"), [
    (dict(tp=2), dict(tp=1, pp=2)),
    (dict(cp=2), dict(cp=1, dp=2)),
])
def test_mla_under_tp_or_cp_is_refused_by_the_shape_rules_naming_the_flags(refused, allowed):
    """Multi-head latent attention (the DeepSeek-V3 form) is built for neither tensor nor context
    parallelism: refused at tp 2 and at cp 2 in a sentence naming the flags (the trainer's preflight raises
    it), its nearest layouts (pp, dp) let through, and the same layouts with multi-head attention too."""
    model = ModelConfig(**MLA)
    why = shape_refusals(model, ParallelConfig(**refused), seq_len=16)
    flag = "--tp 2" if "tp" in refused else "--cp 2"
    assert len(why) == 1 and why[0].startswith(flag) and "--ep/--pp/--dp" in why[0], why
    assert shape_refusals(model, ParallelConfig(**allowed), seq_len=16) == []
    mha = ModelConfig(**{**MLA, **{k: None for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                      "qk_rope_head_dim", "v_head_dim")},
                         "attention_type": "mha"})
    assert shape_refusals(mha, ParallelConfig(**refused), seq_len=16) == []  # the same layout, MHA: allowed
    with pytest.raises(ConfigError, match=flag):
        check_shapes(TrainConfig(model=model, data=DataConfig(seq_len=16, global_batch_size=4)),
                     ParallelConfig(**refused))


# row name -> (model fields over SMALL, a layout the planner does not model, the neighbour it predicts)
SMALL = dict(vocab_size=64, max_seq_len=8, num_layers=2, hidden_size=16, num_attention_heads=2)
NOT_MODELLED_CASES = {
    "moe-bytes": (dict(num_experts=2, top_k=1), dict(dp=2), dict(dp=2)),
    "moe-layout": (dict(num_experts=2, top_k=1), dict(dp=1, pp=2), dict(dp=1, pp=2)),
    "mla": (dict(DEEPSEEK_V3, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                 v_head_dim=4, num_experts=0, moe_shared_experts=0, moe_first_dense=0),
            dict(dp=2), dict(dp=2)),
    "fp16": ({}, dict(dp=2, precision="fp16"), dict(dp=2, precision="bf16")),
    "zbv": ({}, dict(dp=1, pp=2, pp_schedule="zbv", virtual_stages=2), dict(dp=1, pp=2, pp_schedule="zbh1")),
    "fp8-zbh1-rowwise": ({}, dict(dp=1, pp=2, pp_schedule="zbh1", precision="fp8", fp8_scaling="rowwise"),
                         dict(dp=1, pp=2, pp_schedule="zbh1", precision="fp8")),
    "fp8-pp-zero3": ({}, dict(dp=2, pp=2, precision="fp8", zero_stage=3),
                     dict(dp=2, pp=2, precision="fp8", zero_stage=2)),
    "tp-16-bit": ({}, dict(dp=1, tp=2, precision="bf16"), dict(dp=1, tp=2)),
    "pp-checkpointing-16-bit": ({}, dict(dp=1, pp=2, precision="bf16", activation_checkpointing="all"),
                                dict(dp=1, pp=2, activation_checkpointing="all")),
    "zbh1-sp": ({}, dict(dp=1, pp=2, tp=2, pp_schedule="zbh1", sequence_parallel=True),
                dict(dp=1, pp=2, tp=2, sequence_parallel=True)),
    "tp-comm-overlap": ({}, dict(dp=1, tp=2, sequence_parallel=True, tp_comm_overlap=True),
                        dict(dp=1, tp=2, sequence_parallel=True)),
    "zero3-no-reshard": ({}, dict(dp=2, zero_stage=3, reshard_after_forward=False), dict(dp=2, zero_stage=3)),
}


@pytest.mark.parametrize("name", sorted(NOT_MODELLED_CASES))
def test_each_not_modelled_row_refuses_its_case_in_its_words_and_predicts_the_neighbour(name):
    from refimpl.planner import predict_run
    from refimpl.support import NOT_MODELLED_TABLE

    assert sorted(row.name for row in NOT_MODELLED_TABLE) == sorted(NOT_MODELLED_CASES)
    fields, refused, neighbour = NOT_MODELLED_CASES[name]
    model = ModelConfig(**{**SMALL, **fields})
    (row,) = [r for r in NOT_MODELLED_TABLE if r.name == name]
    applies = [r.name for r in NOT_MODELLED_TABLE if r.applies(model, ParallelConfig(**refused))]
    assert applies == ["moe-bytes", name] if name == "moe-layout" else applies == [name]  # MoE: both
    with pytest.raises(ConfigError) as info:
        predict_run(model, ParallelConfig(**refused), seq_len=8, global_batch=4)
    reasons = [r.reason for r in NOT_MODELLED_TABLE if r.name in applies]
    assert str(info.value) == "predict_run: " + "; and ".join(reasons) and row.reason in reasons
    assert row.reason in " ".join(describe_support_table().split())
    if name not in ("moe-bytes", "moe-layout", "mla"):  # the model is not modelled: no neighbour layout
        assert predict_run(model, ParallelConfig(**neighbour), seq_len=8, global_batch=4).ranks


def test_the_data_parallel_term_refuses_fp8_gathers_under_pp_in_the_tables_words():
    """Called below ``predict_run`` (which checks the table first), the term refuses with the row's reason;
    its neighbour, the same unit under ZeRO-3 in fp32, is counted."""
    from refimpl.planner.run_terms import data_parallel_bytes
    from refimpl.support import not_modelled

    with pytest.raises(ConfigError) as info:
        data_parallel_bytes([[(4, 4)]], zero_stage=3, dp_cp=2, zero3_kept=True, fp8=[[True]])
    assert str(info.value) == not_modelled("fp8-pp-zero3")
    assert data_parallel_bytes([[(4, 4)]], zero_stage=3, dp_cp=2, zero3_kept=True)
