"""refimpl's GPT run as a pipeline (chapter 08): every schedule's loss and gradients equal one device's on
the same micro-batch split, at p = 2 and 4, tied and untied embeddings: bitwise, but for a tied
embedding's gradient.

Each rank builds the same GPT, keeps its stages (``build_stages``) and runs its action list
(``run_schedule``); the gradients are gathered under the plain GPT's names. Every stage computes what
one device computes, in the same order over the micro-batches (ZB-H1's deferred ``dW = dY^T X`` is the
matmul autograd makes), so the losses and gradients are the same bits. The exception, a tied embedding:
one rank's sum over the micro-batches plus the other's is another order of summation than one device's;
its tolerance (the numerics rule) is ``FACTOR x spread``, ``spread`` the largest difference between two
one-device runs that accumulate the micro-batches in opposite orders, measured here. Negative controls:
without the tied-embedding exchange the embedding gradient misses the head's share; a stage that raises
fails the run at once (the others' receives time out), not hang.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from refimpl.config import ModelConfig
from refimpl.launch import RankFailed, run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.models.gpt_stages import build_stages
from refimpl.parallel.pipeline_parallel import SPLIT_BACKWARD, build_schedule, schedule_placement
from refimpl.parallel.pipeline_parallel.executor import run_schedule
from refimpl.parallel.pipeline_parallel.pipeline_communications import sync_tied_embeddings
from refimpl.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_gradients
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0
M, B, S = 4, 2, 8  # micro-batches, sequences per micro-batch, tokens per sequence
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2)]


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(num_layers=8, hidden_size=16, num_attention_heads=2, max_seq_len=S,
                       tie_word_embeddings=tied)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (M * B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # [M B, S] inputs and labels


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, labels, num_tokens=M * B * S)  # the micro-batch's share of the step mean


def _pipeline(pp: int, rank: int, name: str, v: int, tied: bool, *, sync_tied: bool = True,
              overlap: bool = False) -> dict:
    model = GPT(_config(tied), seed=0)
    placement = schedule_placement(name)  # ZB-V's V: stages r and 2 pp - 1 - r on rank r
    stages = build_stages(model, pp_rank=rank, pp_size=pp, virtual_stages=v, placement=placement)
    store = WeightGradStore() if name in SPLIT_BACKWARD else None
    if store is not None:
        for stage in stages.values():
            defer_weight_gradients(stage, store)
    inputs, labels = _batch()
    loss = run_schedule(build_schedule(name, pp_size=pp, num_microbatches=M, virtual_stages=v)[rank],
                        stages=stages, pp_group=None, pp_size=pp, inputs=inputs.chunk(M),
                        labels=labels.chunk(M), loss_fn=_loss, activation_shape=(B, S, 16),
                        activation_dtype=torch.float32, store=store, placement=placement, overlap=overlap)
    first, last = stages.get(0), stages.get(pp * v - 1)
    if sync_tied and tied and pp > 1 and (first is None) != (last is None):  # the V: both ends on rank 0
        weight = first.embedding.word_embeddings.weight if first is not None else last.output_layer.weight
        sync_tied_embeddings(weight, peer=pp - 1 if first is not None else 0, group=None)
    grads, seen = {}, set()
    for stage in stages.values():
        for local, full in stage.full_names().items():
            p = dict(stage.named_parameters())[local]
            if id(p) not in seen:  # the V's tied embedding: one tensor in two stages, under its first name
                grads[full] = p.grad.numpy().copy()  # numpy: tensors would travel as shared memory
            seen.add(id(p))
    dist.all_reduce(loss)  # only the last stage's rank holds it
    return {"loss": loss.item(), "grads": grads}


def _worker(ctx) -> dict:
    pp, out = ctx.world_size, {}
    for name, v in CASES:
        for tied in (False, True):
            out[name, tied] = _pipeline(pp, ctx.rank, name, v, tied)
        out[name, "overlap"] = _pipeline(pp, ctx.rank, name, v, True, overlap=True)
    out["no tied sync"] = _pipeline(pp, ctx.rank, "1f1b", 1, True, sync_tied=False)
    return out


def _one_device(tied: bool, order: list[int]) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the kernels' own split of a matmul can change its bits
    try:
        model = GPT(_config(tied), seed=0)
        inputs, labels = _batch()
        xs, ys = inputs.chunk(M), labels.chunk(M)
        total = torch.zeros(())
        for i in order:
            loss = _loss(model(xs[i]), ys[i])
            loss.backward()
            total += loss.detach()  # float32, in micro-batch order: as the last stage adds them
        return {"loss": total.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout_s=SPAWN_TIMEOUT_S)


def _merged(per_rank: list[dict], key) -> dict:
    grads: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for n, g in r[key]["grads"].items():
            grads.setdefault(n, torch.from_numpy(g))  # a tied weight: on two ranks, equal
    return grads


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_schedule_gives_one_device_loss_and_gradients(results, tied):
    pp, per_rank = results
    ref, other = _one_device(tied, list(range(M))), _one_device(tied, list(reversed(range(M))))
    spread = max(float((ref["grads"][n] - other["grads"][n]).abs().max()) for n in ref["grads"])
    assert spread > 0, "both orders give the same bits: no yardstick"
    tied_name = "embedding.word_embeddings.weight" if tied else None
    for name, _ in CASES:
        grads = _merged(per_rank, (name, tied))
        assert sorted(grads) == sorted(ref["grads"]), name  # every parameter, under its GPT name
        for n, g in grads.items():
            if n != tied_name:  # the same arithmetic in the same order: the same bits (ZB-H1's dW too)
                assert torch.equal(g, ref["grads"][n]), (name, n)
        if tied:  # one rank's sum over the micro-batches plus the other's: another order
            worst = float((grads[tied_name] - ref["grads"][tied_name]).abs().max())
            assert worst <= FACTOR * spread, f"{name} pp {pp}: {worst:.2e} > {FACTOR} x {spread:.2e}"
        for r in per_rank:
            assert r[name, tied]["loss"] == ref["loss"], (name, r[name, tied]["loss"], ref["loss"])
    if tied:  # both ends of the tied embedding hold the same bits after the exchange
        ends = [r[("1f1b", True)]["grads"]["embedding.word_embeddings.weight"] for r in (per_rank[0],
                                                                                           per_rank[-1])]
        assert np.array_equal(*ends)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_every_schedule_overlapping_its_transfers_computes_the_same_bits(results):
    """``run_schedule(..., overlap=True)`` waits for its transfers later (refimpl/parallel/pipeline_parallel/
    executor.py): when, not what, so the loss and every gradient are the bits of the default's run."""
    _, per_rank = results
    for r in per_rank:
        for name, _ in CASES:
            got, want = r[name, "overlap"], r[name, True]
            assert got["loss"] == want["loss"], name
            assert got["grads"].keys() == want["grads"].keys(), name
            assert all(np.array_equal(g, want["grads"][n]) for n, g in got["grads"].items()), name


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_negative_control_without_the_tied_exchange_the_embedding_gradient_is_wrong(results):
    pp, per_rank = results
    ref = _one_device(True, list(range(M)))
    got = torch.from_numpy(per_rank[0]["no tied sync"]["grads"]["embedding.word_embeddings.weight"])
    want = ref["grads"]["embedding.word_embeddings.weight"]
    assert float((got - want).abs().max()) > 1e3 * float(want.abs().max()) * 1e-6


def _raising_stage(ctx) -> None:
    model = GPT(_config(False), seed=0)
    stages = build_stages(model, pp_rank=ctx.rank, pp_size=ctx.world_size)
    if ctx.rank == 1:
        stages[1].forward = lambda x: (_ for _ in ()).throw(RuntimeError("stage 1 broke"))
    inputs, labels = _batch()
    run_schedule(build_schedule("1f1b", pp_size=ctx.world_size, num_microbatches=M)[ctx.rank], stages=stages,
                 pp_group=None, pp_size=ctx.world_size, inputs=inputs.chunk(M), labels=labels.chunk(M),
                 loss_fn=_loss, activation_shape=(B, S, 16), activation_dtype=torch.float32)


@pytest.mark.timeout(90)
def test_a_stage_that_raises_fails_the_run_fast():
    with pytest.raises(RankFailed, match="stage 1 broke"):
        run_ranks(_raising_stage, 2, timeout_s=60, collective_timeout_s=5)


def _stage_params(model: GPT, ranges: list[range]) -> list[int]:
    from refimpl.models.gpt_stages import GPTStage

    return [sum(p.numel() for p in GPTStage(model, stage=s, num_stages=len(ranges), layers=r,
                                            copy_tied=True).parameters())
            for s, r in enumerate(ranges)]


def test_split_by_layers_and_by_parameters_cover_the_blocks_and_parameters_is_the_best_split():
    import itertools

    from refimpl.models.gpt_stages import split_layers

    model = GPT(_config(True), seed=0)
    by_layers = split_layers(model, 3)
    assert [list(r) for r in by_layers] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    by_params = split_layers(model, 3, balance="parameters")
    assert [i for r in by_params for i in r] == list(range(8)) and all(len(r) for r in by_params)
    # brute force over every cut of 8 blocks into 3 non-empty runs: none has a smaller largest stage
    best = min(max(_stage_params(model, [range(0, a), range(a, b), range(b, 8)]))
               for a, b in itertools.combinations(range(1, 8), 2))
    assert max(_stage_params(model, by_params)) == best < max(_stage_params(model, by_layers))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_stages=9), "cannot fill 9 pipeline stages"),
    (dict(num_stages=2, balance="flops"), "balance must be"),
    (dict(num_stages=0), "positive integer"),
])
def test_splits_that_cannot_be_made_are_one_line_errors(kwargs, match):
    from refimpl.models.gpt_stages import split_layers

    with pytest.raises(ValueError, match=match):
        split_layers(GPT(_config(False), seed=0), **kwargs)
