"""The tensor-parallel plan (:mod:`refimpl.parallel.tensor_parallel.plan`) against the runtime (chapter 06).

On 2 ranks, :func:`apply_tensor_parallel` with sequence parallelism on refimpl's GPT (tied, untied, and a
tied odd vocabulary that is padded) and, for every parameter under the plain model's name:

* the dim along which the rank's box (``local_shards``, :func:`module_shards`) is smaller than the whole
  is :func:`shard_dim`'s, and the rank's tensor holds ``n/t`` (or, :func:`padded_rows`, ``ceil(n/t)``) there;
* the parameters the runtime declares sequence-parallel (its modules' ``sequence_parallel_parameters()``
  or a parameter's ``sequence_parallel`` attribute) are exactly :func:`sequence_parallel_gradient`'s;
* the planner's :func:`~refimpl.planner.params_flops.param_shapes` (a meta-device GPT read through the
  plan) are the rank's parameter shapes, in order.

Negative controls: a flipped rule (the attention projection declared column-parallel, the final LayerNorm
left out of the sequence-parallel ones, the vocabulary split without padding) is detected.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from refimpl.config import ModelConfig
from refimpl.distributed.placement import module_shards
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.parallel.tensor_parallel import apply_tensor_parallel
from refimpl.parallel.tensor_parallel import plan as tp_plan
from refimpl.planner.params_flops import param_shapes

SPAWN_TIMEOUT = 120
T = 2
CFG = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "max_seq_len": 8}
CASES = {"tied": {"vocab_size": 50}, "untied": {"vocab_size": 50, "tie_word_embeddings": False},
         "tied, padded vocabulary": {"vocab_size": 51}}


def _declared_sequence_parallel(model) -> set[str]:
    """The runtime's sequence-parallel parameters, by name, in whichever form it declares them."""
    out = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    for prefix, module in model.named_modules():
        declare = getattr(module, "sequence_parallel_parameters", None)
        if callable(declare):
            out |= {f"{prefix}.{n}" if prefix else n for n in declare()}
    return out


def _worker(ctx) -> dict:
    out = {}
    for case, kw in CASES.items():
        plain = GPT(ModelConfig(**CFG, **kw))
        plain_names = [n for n, _ in plain.named_parameters()]
        model = apply_tensor_parallel(plain, tp_group=dist.group.WORLD, sequence_parallel=True,
                                      pad_vocab=True)
        boxes = module_shards(model)
        out[case] = {"plain names": plain_names,
                     "params": [(n, tuple(p.shape), boxes[n].box.global_shape, boxes[n].box.shape)
                                for n, p in model.named_parameters()],
                     "sequence parallel": _declared_sequence_parallel(model)}
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict]:
    return run_ranks(_worker, T, timeout_s=SPAWN_TIMEOUT)


def _disagreements(seen: dict, *, tied: bool) -> list[str]:
    """Where the plan and one rank's runtime differ (empty: they agree on every parameter)."""
    bad = []
    if [n for n, *_ in seen["params"]] != seen["plain names"]:
        bad.append("the tensor-parallel model's parameter names are not the plain model's")
    for name, local, whole, box in seen["params"]:
        split = [d for d in range(len(whole)) if box[d] != whole[d]]
        dim = tp_plan.shard_dim(name, tie_word_embeddings=tied)
        if split != ([] if dim is None else [dim]):
            bad.append(f"{name}: split along {split}, declared {dim}")
        pad = tp_plan.padded_rows(name, tie_word_embeddings=tied)
        want = [(-(-n // T) if pad else n // T) if d == dim else n for d, n in enumerate(whole)]
        if list(local) != want:
            bad.append(f"{name}: holds {local}, declared {tuple(want)}")
    declared = {n for n, *_ in seen["params"] if tp_plan.sequence_parallel_gradient(n)}
    if declared != seen["sequence parallel"]:
        bad.append(f"sequence-parallel: runtime {sorted(seen['sequence parallel'] - declared)} not declared, "
                   f"declared {sorted(declared - seen['sequence parallel'])} not in the runtime")
    return bad


def _planner_disagreements(seen: dict, case: str) -> list[str]:
    try:
        planned = param_shapes(ModelConfig(**CFG, **CASES[case]), tp=T)
    except ValueError as refused:  # a split the runtime makes, refused by the planner
        return [str(refused)]
    held = [local for _, local, *_ in seen["params"]]
    return [] if planned == held else [f"planner {planned} != runtime {held}"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_is_what_apply_tensor_parallel_does(observed, case):
    tied = CASES[case].get("tie_word_embeddings", True)
    for rank, per_rank in enumerate(observed):
        seen = per_rank[case]
        # per block 2 LayerNorms' weight and bias and 2 row biases; the final LayerNorm's weight and bias
        assert len(seen["sequence parallel"]) == 6 * CFG["num_layers"] + 2
        assert _disagreements(seen, tied=tied) == [], f"rank {rank}"
        assert _planner_disagreements(seen, case) == [], f"rank {rank}"


FLIPS = {
    "projection declared column-parallel": ("untied", "PARALLEL_STYLE", {**tp_plan.PARALLEL_STYLE,
                                                                         "dense": tp_plan.COLUMN}),
    "final LayerNorm not sequence-parallel": ("tied", "SEQUENCE_PARALLEL_MODULES",
                                              tp_plan.SEQUENCE_PARALLEL_MODULES[:2]),
    "vocabulary split without padding": ("tied, padded vocabulary", "PARALLEL_STYLE",
                                         {**tp_plan.PARALLEL_STYLE, "word_embeddings": tp_plan.COLUMN}),
}


@pytest.mark.parametrize("flip", list(FLIPS))
def test_a_flipped_rule_is_detected(observed, flip, monkeypatch):
    case, attr, value = FLIPS[flip]
    monkeypatch.setattr(tp_plan, attr, value)
    seen = observed[0][case]
    assert _disagreements(seen, tied=CASES[case].get("tie_word_embeddings", True))
    if attr == "PARALLEL_STYLE":  # the planner reads the plan: its shapes go wrong with it
        assert _planner_disagreements(seen, case)
