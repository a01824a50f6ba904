"""Configuration validates itself on construction, with messages that say what to change (chapter 01)."""

from __future__ import annotations

import dataclasses

import pytest

from refimpl.config import ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig


def test_defaults_are_valid():
    cfg = TrainConfig()
    assert cfg.model.hidden_size % cfg.model.num_attention_heads == 0
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size  # None becomes 4h
    assert cfg.model.head_dim * cfg.model.num_attention_heads == cfg.model.hidden_size
    assert cfg.data.seq_len <= cfg.model.max_seq_len
    assert cfg.data.accumulation_steps(1) == 1
    d = cfg.to_dict()
    assert d["model"]["hidden_size"] == cfg.model.hidden_size and d["steps"] == cfg.steps


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().hidden_size = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(256)  # type: ignore[misc]  # positional arguments are refused


def test_explicit_ffn_size_is_kept():
    assert ModelConfig(hidden_size=32, num_attention_heads=2, ffn_hidden_size=50).ffn_hidden_size == 50


def test_heads_not_dividing_hidden_size_names_both_numbers():
    with pytest.raises(ConfigError) as info:
        ModelConfig(hidden_size=130, num_attention_heads=4)
    message = str(info.value)
    assert "130" in message and "4" in message
    assert "hidden_size" in message and "num_attention_heads" in message
    # Negative control: a dividing head count is accepted.
    assert ModelConfig(hidden_size=130, num_attention_heads=5).head_dim == 26


@pytest.mark.parametrize(
    "field", ["vocab_size", "num_layers", "hidden_size", "num_attention_heads", "max_seq_len"]
)
@pytest.mark.parametrize("value", [0, -1])
def test_model_non_positive_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{field: value})


def test_model_non_integer_fields():
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig(num_layers=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig(num_layers=True)  # a bool is not a layer count


def test_model_non_positive_ffn_size():
    with pytest.raises(ConfigError, match="ffn_hidden_size"):
        ModelConfig(ffn_hidden_size=0)


@pytest.mark.parametrize("field", ["seq_len", "global_batch_size", "micro_batch_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_data_non_positive_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        DataConfig(**{field: value})


def test_optim_and_train_non_positive_fields():
    with pytest.raises(ConfigError, match="lr"):
        OptimConfig(lr=0.0)
    with pytest.raises(ConfigError, match="warmup_steps"):
        OptimConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match="grad_clip"):
        OptimConfig(grad_clip=0.0)
    assert OptimConfig(grad_clip=None).grad_clip is None
    with pytest.raises(ConfigError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match="log_every"):
        TrainConfig(log_every=0)


def test_global_batch_not_divisible_by_dp_size():
    data = DataConfig(global_batch_size=16)
    with pytest.raises(ConfigError) as info:
        data.per_rank_batch(3)
    assert "16" in str(info.value) and "3" in str(info.value)
    with pytest.raises(ConfigError):
        data.accumulation_steps(3)
    assert data.per_rank_batch(4) == 4  # negative control


def test_micro_batch_not_dividing_per_rank_batch():
    data = DataConfig(global_batch_size=16, micro_batch_size=3)
    with pytest.raises(ConfigError, match="micro_batch_size=3"):
        data.accumulation_steps(2)  # per-rank batch 8 is not a multiple of 3
    with pytest.raises(ConfigError):
        data.accumulation_steps(1)  # 16 is not either
    assert DataConfig(global_batch_size=16, micro_batch_size=4).accumulation_steps(2) == 2


def test_seq_len_longer_than_max_seq_len():
    with pytest.raises(ConfigError) as info:
        TrainConfig(model=ModelConfig(max_seq_len=64), data=DataConfig(seq_len=65))
    assert "65" in str(info.value) and "64" in str(info.value)
    TrainConfig(model=ModelConfig(max_seq_len=64), data=DataConfig(seq_len=64))  # the boundary is fine


@pytest.mark.parametrize("global_batch", [1, 2, 6, 8, 12, 16, 24, 48])
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [None, 1, 2, 3, 4])
def test_accumulation_steps_arithmetic(global_batch, dp, micro):
    data = DataConfig(global_batch_size=global_batch, micro_batch_size=micro)
    valid = global_batch % dp == 0 and (micro is None or (global_batch // dp) % micro == 0)
    if not valid:
        with pytest.raises(ConfigError):
            data.accumulation_steps(dp)
        return
    accumulation = data.accumulation_steps(dp)
    effective_micro = micro or global_batch // dp
    assert effective_micro * accumulation * dp == global_batch  # global = micro x accum x dp
    assert data.per_rank_batch(dp) == effective_micro * accumulation
    if micro is None:
        assert accumulation == 1  # no micro batch size: no accumulation


def test_micro_batches_is_one_rule_for_accumulation_and_the_pipeline():
    from refimpl.config import micro_batches

    assert micro_batches(per_rank_batch=8, micro_batch_size=None) == 1  # one forward of the whole batch
    assert micro_batches(per_rank_batch=8, micro_batch_size=2) == 4  # gradient accumulation
    assert micro_batches(per_rank_batch=8, micro_batch_size=None, pp=4) == 4  # one per stage
    assert micro_batches(per_rank_batch=8, micro_batch_size=1, pp=4) == 8  # the micro-batch size decides
    assert micro_batches(per_rank_batch=8, micro_batch_size=None, pp=4, microbatches=2) == 2
    assert micro_batches(per_rank_batch=8, micro_batch_size=None, microbatches=2) == 1  # no pipeline: ignored
