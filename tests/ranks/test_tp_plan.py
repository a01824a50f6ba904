"""The GPT's declared tensor-parallel plan (``GPT.tensor_parallel_plan``, read by ``param_split``)
against the runtime (chapter 06).

On 2 ranks, ``apply_tensor_parallel`` with sequence parallelism on refimpl's GPT (tied, untied, and a
tied odd vocabulary that is padded) and, for every parameter under the plain model's name:

* the dim along which the rank's box (``local_shards``, ``module_shards``) is smaller than the whole
  is the plan's ``split.dim``, and the rank's tensor holds ``n/t`` (or, ``split.padded``, ``ceil(n/t)``)
  there;
* the parameters the runtime declares sequence-parallel (its modules' ``sequence_parallel_parameters()``
  or a parameter's ``sequence_parallel`` attribute) are exactly the plan's
  ``split.sequence_parallel_gradient`` ones;
* the planner's ``refimpl.planner.params_flops.param_shapes`` (a meta-device GPT read through the
  plan) are the rank's parameter shapes, in order.

Negative controls: a flipped plan (the attention projection declared column-parallel, the final LayerNorm
left out of the sequence-parallel ones, the vocabulary split without padding) is detected, by this test's
comparison and by the planner, which reads the same declaration.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from refimpl.config import ModelConfig
from refimpl.distributed.placement import module_shards
from refimpl.launch import run_ranks
from refimpl.models import GPT
from refimpl.models.gpt_sharding import GPTEmbeddingParallel
from refimpl.parallel.tensor_parallel import (
    ColwiseParallel,
    ParamSplit,
    apply_tensor_parallel,
    param_split,
)
from refimpl.planner import param_table as param_table_module
from refimpl.planner.params_flops import param_shapes
from tests.support.timeouts import SPAWN_TIMEOUT_S

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
    return run_ranks(_worker, T, timeout_s=SPAWN_TIMEOUT_S)


def _plan(case: str) -> dict:
    """The plan the GPT of ``case`` declares for T ranks, sequence parallelism on (a meta-device model)."""
    with torch.device("meta"):
        model = GPT(ModelConfig(**CFG, **CASES[case]))
    return model.tensor_parallel_plan(tp_size=T, sequence_parallel=True, pad_vocab=True)


def _disagreements(seen: dict, plan: dict) -> list[str]:
    """Where the plan and one rank's runtime differ (empty: they agree on every parameter)."""
    bad = []
    if [n for n, *_ in seen["params"]] != seen["plain names"]:
        bad.append("the tensor-parallel model's parameter names are not the plain model's")
    for name, local, whole, box in seen["params"]:
        split = [d for d in range(len(whole)) if box[d] != whole[d]]
        declared = param_split(plan, name)
        dim = declared.dim
        if split != ([] if dim is None else [dim]):
            bad.append(f"{name}: split along {split}, declared {dim}")
        want = [(-(-n // T) if declared.padded else n // T) if d == dim else n for d, n in enumerate(whole)]
        if list(local) != want:
            bad.append(f"{name}: holds {local}, declared {tuple(want)}")
    declared_sp = {n for n, *_ in seen["params"] if param_split(plan, n).sequence_parallel_gradient}
    if declared_sp != seen["sequence parallel"]:
        bad.append(f"sequence-parallel: runtime {sorted(seen['sequence parallel'] - declared_sp)} not "
                   f"declared, declared {sorted(declared_sp - seen['sequence parallel'])} not in the runtime")
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
    for rank, per_rank in enumerate(observed):
        seen = per_rank[case]
        # per block 2 LayerNorms' weight and bias and 2 row biases; the final LayerNorm's weight and bias
        assert len(seen["sequence parallel"]) == 6 * CFG["num_layers"] + 2
        assert _disagreements(seen, _plan(case)) == [], f"rank {rank}"
        assert _planner_disagreements(seen, case) == [], f"rank {rank}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UnpaddedEmbedding(GPTEmbeddingParallel):
    """A wrong declaration: the word table split without its padding rows."""

    def split(self, name: str) -> ParamSplit:
        return ParamSplit(dim=0) if name == "word_embeddings.weight" else ParamSplit()


def _flip(plan: dict, flip: str) -> dict:
    plan = dict(plan)
    if flip == "projection declared column-parallel":
        plan["layers.*.self_attention.dense"] = ColwiseParallel(sequence_parallel=True)
    elif flip == "final LayerNorm not sequence-parallel":
        del plan["final_layernorm"]
    else:
        plan["embedding"] = _UnpaddedEmbedding(sequence_parallel=True, pad_vocab=True)
    return plan


FLIPS = {"projection declared column-parallel": "untied",
         "final LayerNorm not sequence-parallel": "tied",
         "vocabulary split without padding": "tied, padded vocabulary"}


@pytest.mark.parametrize("flip", list(FLIPS))
def test_a_flipped_plan_is_detected(observed, flip, monkeypatch):
    case = FLIPS[flip]
    seen = observed[0][case]
    assert _disagreements(seen, _flip(_plan(case), flip))
    declared = GPT.tensor_parallel_plan
    monkeypatch.setattr(GPT, "tensor_parallel_plan", lambda self, **kw: _flip(declared(self, **kw), flip))
    param_table_module._splits.cache_clear()  # the planner reads the flipped declaration
    try:
        if flip != "final LayerNorm not sequence-parallel":  # shapes, not roles: the planner's shapes
            assert _planner_disagreements(seen, case)
    finally:
        param_table_module._splits.cache_clear()
