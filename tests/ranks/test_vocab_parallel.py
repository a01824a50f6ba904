"""The vocabulary-parallel embedding, tied head and cross entropy (chapter 06), at tp 2 and 4.

Checked against one device (weights sharded from it) and against PyTorch's ``loss_parallel`` on DTensor
logits sharded on the class dim. The loss's arithmetic differs from ``F.cross_entropy`` (the sum-exp is
summed per shard, then across ranks), so its tolerance is ``FACTOR`` x the spread measured in the same run:
the largest difference of ``F.cross_entropy`` in float32 from the same computation in float64. The lookup
is exact (one non-zero term per token) and is compared bitwise. Negative controls: the loss with any one of
its three all-reduces dropped, and the tied head without ``f`` (copy-to-region), fail the same checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.comm import CommTracer, ops
from refimpl.distributed.placement import Box
from refimpl.measure import SavedTensorMeter
from refimpl.parallel.tensor_parallel import vocab_parallel
from refimpl.parallel.tensor_parallel.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from tests.support.folded import run_folded
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0  # stated: our error from float64 may be this many times F.cross_entropy's own float32 error
TIMEOUT = SPAWN_TIMEOUT_S // 2  # a rank function alone (the collectives: TIMEOUT / 2)
# one spawn of a tp size's 7 or 11 rank functions (tests/support/folded.py): SPAWN_TIMEOUT_S
FOLD_TIMEOUT = 2 * SPAWN_TIMEOUT_S + 30  # a test: the module's two spawns run in the first test's setup
LEAD = (3, 7)  # odd leading dims
IGNORE = -100
EMBEDDING_DIM, SEQ = 6, 8
EMBEDDING = [(2, 12), (2, 11), (4, 12), (4, 10)]  # (t, vocab)
REDUCE_SCATTER = [(2, 11, 1), (2, 12, 3), (4, 10, 1)]  # (t, vocab, batch)
TIED = [(2, 11), (4, 10)]  # (t, vocab)


def _logits_and_target(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same logits [3, 7, V], targets [3, 7] (four ignored) and per-token weights on every rank."""
    g = torch.Generator().manual_seed(1234)
    logits = 3 * torch.randn(*LEAD, vocab, generator=g)
    target = torch.randint(0, vocab, LEAD, generator=g)
    target.view(-1)[[0, 5, 11, 20]] = IGNORE
    weight = torch.rand(LEAD, generator=g) + 0.5
    return logits.to(device), target.to(device), weight.to(device)


def _reference(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor):
    """``F.cross_entropy`` on the full logits: per-token loss and the gradient of ``sum(w * loss)``."""
    z = logits.clone().requires_grad_()
    loss = F.cross_entropy(z.flatten(0, -2), target.flatten(), reduction="none",
                           ignore_index=IGNORE).view(target.shape)
    (loss * weight).sum().backward()
    return loss.detach(), z.grad


def _ours(shard: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, **kw):
    z = shard.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(z, target, tp_group=None, ignore_index=IGNORE, **kw)
    (loss * weight).sum().backward()
    return loss.detach(), z.grad


def _loss_parallel(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, t: int):
    """PyTorch's own: DTensor logits [N, V] sharded on the class dim, under ``loss_parallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh(logits.device.type, (t,))
    dz = distribute_tensor(logits.flatten(0, -2), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(dz, target.flatten(), reduction="none", ignore_index=IGNORE)
        (loss.full_tensor() * weight.flatten()).sum().backward()
    return loss.full_tensor().view(target.shape).detach(), dz.grad.to_local().view(*target.shape, -1)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _loss_rank(ctx, vocab: int, drop: int | None) -> dict:
    """Our loss on my shard against float32 / float64 F.cross_entropy and DTensor's loss_parallel;
    ``drop``: the index of the forward all-reduce skipped (negative control), None for the real one."""
    torch.set_num_threads(1)
    t, r = dist.get_world_size(), dist.get_rank()
    logits, target, weight = _logits_and_target(vocab, ctx.device)
    cols = slice(r * vocab // t, (r + 1) * vocab // t)
    ref32, gref32 = _reference(logits, target, weight)
    ref64, gref64 = _reference(logits.double(), target, weight.double())
    out = {"spread_loss": _err(ref32, ref64), "spread_grad": _err(gref32[..., cols], gref64[..., cols])}
    real_all_reduce, calls = ops.all_reduce, []
    if drop is not None:
        def all_reduce(tensor, *args, **kw):
            calls.append(tensor.shape)
            return None if len(calls) - 1 == drop else real_all_reduce(tensor, *args, **kw)
        ops.all_reduce = all_reduce
    try:
        with CommTracer() as tracer:
            loss, grad = _ours(logits[..., cols], target, weight)
    finally:
        ops.all_reduce = real_all_reduce
    out["err_loss"], out["err_grad"] = _err(loss, ref64), _err(grad, gref64[..., cols])
    if drop is not None:
        return out
    ignored = target == IGNORE
    out["ignored_zero"] = bool((loss[ignored] == 0).all() and (grad[ignored] == 0).all())
    out["comm"] = {k: (v.count, v.nbytes) for k, v in tracer.summary().items()}
    tp_loss, tp_grad = _loss_parallel(logits, target, weight, t)
    out["err_torch_loss"], out["err_torch_grad"] = _err(tp_loss, ref64), _err(tp_grad, gref64[..., cols])
    out["ours_vs_torch_loss"] = _err(loss, tp_loss)
    # peak bytes: what autograd keeps for backward (refimpl.measure) and the largest tensor any op makes,
    # in the loss's forward and backward alone
    holder = nn.Module()
    holder.layers = nn.ModuleList()
    losses = {
        "ours": (logits[..., cols], lambda z: vocab_parallel_cross_entropy(z, target, tp_group=None)),
        "full": (logits, lambda z: F.cross_entropy(z.flatten(0, -2), target.flatten(), reduction="none")),
    }
    for name, (z, loss_fn) in losses.items():
        z = z.clone().requires_grad_()
        with SavedTensorMeter(holder) as meter, _LargestOutput() as largest:
            loss = loss_fn(z)
        with _LargestOutput() as largest_backward:
            loss.sum().backward()
        out[f"saved_float32_{name}"] = sum(d.get("float32", 0) for d in meter.report.activations.values())
        out[f"largest_{name}"] = max(largest.numel, largest_backward.numel)
    return out


class _LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor (elements) any aten op returns while active."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return result


@pytest.mark.numerics
@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_and_loss_parallel(t, folds):
    vocab = 24  # 12 or 6 columns per rank
    n = LEAD[0] * LEAD[1]
    for r, out in enumerate(folds[t]["loss", vocab, None]):
        assert out["spread_loss"] > 0 and out["spread_grad"] > 0, out  # the rule is not vacuous
        for who in ("err", "err_torch"):
            assert out[f"{who}_loss"] <= FACTOR * out["spread_loss"], (r, who, out)
            assert out[f"{who}_grad"] <= FACTOR * out["spread_grad"], (r, who, out)
        assert out["ours_vs_torch_loss"] <= 2 * FACTOR * out["spread_loss"], (r, out)
        assert out["ignored_zero"], r
        # forward: MAX of the max, SUM of the target logit, SUM of the sum-exp, each [3, 7] float32
        assert out["comm"] == {"all_reduce": (3, 3 * n * 4)}, (r, out["comm"])
        # no rank holds [..., V]: the softmax shard [..., V/t] is what backward keeps and the largest tensor
        assert out["saved_float32_ours"] == n * vocab // t * 4, out
        assert out["saved_float32_full"] >= n * vocab * 4, out  # log_softmax [..., V] (+ nll's total weight)
        assert out["largest_ours"] == n * vocab // t and out["largest_full"] == n * vocab, out


@pytest.mark.numerics
@pytest.mark.timeout(FOLD_TIMEOUT)
def test_dropping_any_of_the_three_all_reduces_fails(folds):
    for drop in range(3):  # 0: the max, 1: the target logit, 2: the sum-exp
        outs = folds[2]["loss", 24, drop]
        assert any(o["err_loss"] > FACTOR * o["spread_loss"] for o in outs), (drop, outs)


def _embedding_rank(ctx, vocab: int, dim: int) -> dict:
    """Sharded from one nn.Embedding: lookup and weight gradient bitwise, padding never read, traffic."""
    torch.set_num_threads(1)
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = nn.Embedding(vocab, dim).to(ctx.device)
    tokens = torch.randint(0, vocab, (3, 5), device=ctx.device)
    grad_out = torch.randn(3, 5, dim, device=ctx.device)
    emb = VocabParallelEmbedding.from_embedding(full, tp_group=None, pad_vocab=True)
    with torch.no_grad():
        emb.weight[emb.num_real_rows:] = float("nan")  # padding: must never be read
    with CommTracer() as tracer:
        y = emb(tokens)
        tracer.step()
        (y * grad_out).sum().backward()
    (full(tokens) * grad_out).sum().backward()
    real, rows = emb.num_real_rows, slice(emb.vocab_start_index, emb.vocab_end_index)
    box = emb.local_shards()["weight"].box
    return {
        "out": torch.equal(y, full(tokens).detach()),
        "grad": torch.equal(emb.weight.grad[:real], full.weight.grad[rows]),
        "pad_grad_zero": bool((emb.weight.grad[real:] == 0).all()),
        "box": box == Box.chunk((vocab, dim), 0, r, t),
        "comm": [{k: (v.count, v.nbytes) for k, v in s.items()} for s in (tracer.summary(step=0),
                                                                           tracer.summary(step=1))],
    }


@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize(("t", "vocab"), EMBEDDING)
def test_vocab_parallel_embedding_equals_nn_embedding_bitwise(t, vocab, folds):
    dim = EMBEDDING_DIM
    for r, out in enumerate(folds[t]["embedding", vocab]):
        assert out["out"] and out["grad"] and out["pad_grad_zero"] and out["box"], (r, out)
        assert out["comm"] == [{"all_reduce": (1, 3 * 5 * dim * 4)}, {}], (r, out["comm"])


def _reduce_scatter_rank(ctx, vocab: int, dim: int, batch: int, seq: int) -> dict:
    """Sequence parallelism's embedding: my s/t positions of the lookup plus the positions, one
    reduce-scatter forward and one all-gather backward; the token and position gradients bitwise."""
    from refimpl.parallel.tensor_parallel import scatter_to_sequence_parallel_region

    torch.set_num_threads(1)
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full, pos = nn.Embedding(vocab, dim).to(ctx.device), nn.Embedding(seq, dim).to(ctx.device)
    tokens = torch.randint(0, vocab, (batch, seq), device=ctx.device)
    grad_out = torch.randn(batch, seq, dim, device=ctx.device)
    mine = slice(r * seq // t, (r + 1) * seq // t)
    positions = torch.arange(seq, device=ctx.device)
    emb = VocabParallelEmbedding.from_embedding(full, tp_group=None, pad_vocab=True,
                                                reduce_scatter_embeddings=True)
    pos_ours = nn.Embedding.from_pretrained(pos.weight.detach().clone(), freeze=False)
    with CommTracer() as tracer:
        y = emb(tokens, pos_ours(positions))  # [b, s/t, h]
        tracer.step()
        (y * grad_out[:, mine]).sum().backward()
    ref = full(tokens) + pos(positions)  # [b, s, h]
    (ref * grad_out).sum().backward()
    # what the all-reduce-then-scatter path held: at b = 1 the contiguous split is a view of the whole sum
    old = VocabParallelEmbedding.from_embedding(full, tp_group=None, pad_vocab=True)
    old_y = scatter_to_sequence_parallel_region(old(tokens, pos.weight.detach()), None)
    real, rows = emb.num_real_rows, slice(emb.vocab_start_index, emb.vocab_end_index)
    return {
        "out": torch.equal(y, ref[:, mine].detach()),
        "grad": torch.equal(emb.weight.grad[:real], full.weight.grad[rows]),
        "position grad": torch.equal(pos_ours.weight.grad, pos.weight.grad),
        "storage": (y.untyped_storage().nbytes(), old_y.untyped_storage().nbytes(), y.numel() * 4),
        "comm": [{k: (v.count, v.nbytes) for k, v in s.items()} for s in (tracer.summary(step=0),
                                                                           tracer.summary(step=1))],
    }


@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize(("t", "vocab", "batch"), REDUCE_SCATTER)
def test_reduce_scatter_embeddings_is_the_sequence_shard_of_the_lookup_bitwise(t, vocab, batch, folds):
    dim, seq = EMBEDDING_DIM, SEQ
    payload = batch * seq * dim * 4
    for r, out in enumerate(folds[t]["reduce_scatter", vocab, batch]):
        assert out["out"] and out["grad"] and out["position grad"], (r, out)
        assert out["comm"] == [{"reduce_scatter": (1, payload)}, {"all_gather": (1, payload)}], (r, out)
        ours, old, shard = out["storage"]
        assert ours == shard, (r, out["storage"])  # the output is the shard itself
        if batch == 1:  # negative control: the all-reduce path's split kept the whole [1, s, h] alive
            assert old == t * shard, (r, out["storage"])


def test_group_of_one_is_plain_embedding_and_cross_entropy_and_odd_vocab_is_refused():
    torch.manual_seed(0)
    full = nn.Embedding(11, 4)
    emb = VocabParallelEmbedding.from_embedding(full, tp_group=None)
    tokens = torch.randint(0, 11, (2, 3))
    with CommTracer() as tracer:
        assert torch.equal(emb(tokens), full(tokens))
        logits, target, _ = _logits_and_target(11, torch.device("cpu"))
        loss = vocab_parallel_cross_entropy(logits, target, tp_group=None, ignore_index=IGNORE)
    assert tracer.events == []
    assert loss.shape == LEAD and bool((loss[target == IGNORE] == 0).all())
    assert emb.local_shards()["weight"].box.is_full
    with pytest.raises(ValueError, match="does not match logits"):
        vocab_parallel_cross_entropy(logits, target[0], tp_group=None)


def _refused_rank(ctx) -> str:
    try:
        VocabParallelEmbedding(11, 4, tp_group=None)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(FOLD_TIMEOUT)
def test_a_vocabulary_that_does_not_divide_is_refused_without_pad_vocab(folds):
    msgs = folds[2]["refused"]
    assert all("11 does not divide by the tensor-parallel size 2" in m and "\n" not in m for m in msgs), msgs


def _tied_rank(ctx, vocab: int, dim: int, with_f: bool) -> dict:
    """A tied model, one device vs vocab-parallel: embed, a fixed tanh layer, logits = h @ E^T, the loss."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    full = nn.Embedding(vocab, dim)
    mix = torch.randn(dim, dim) / dim**0.5
    tokens, target = torch.randint(0, vocab, (3, 5)), torch.randint(0, vocab, (3, 5))
    target[0, 1] = IGNORE

    def one_device(dtype):
        w = full.weight.detach().to(dtype).requires_grad_()
        logits = torch.tanh(F.embedding(tokens, w) @ mix.to(dtype)) @ w.T
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum", ignore_index=IGNORE)
        loss.backward()
        return w.grad

    g32, g64 = one_device(torch.float32), one_device(torch.float64)
    emb = VocabParallelEmbedding.from_embedding(full, tp_group=None, pad_vocab=True)
    real_f = vocab_parallel.copy_to_tensor_parallel_region
    if not with_f:  # negative control: the head without f, so dh is not summed over the ranks
        vocab_parallel.copy_to_tensor_parallel_region = lambda x, group: x
    try:
        logits = emb.lm_logits(torch.tanh(emb(tokens) @ mix))
        loss = vocab_parallel_cross_entropy(logits, target, tp_group=None, ignore_index=IGNORE,
                                            vocab_size=vocab)
        loss.sum().backward()
    finally:  # the fold's next call on this rank gets the real f
        vocab_parallel.copy_to_tensor_parallel_region = real_f
    rows = slice(emb.vocab_start_index, emb.vocab_end_index)
    real = emb.num_real_rows
    return {"spread": _err(g32[rows], g64[rows]), "err": _err(emb.weight.grad[:real], g64[rows]),
            "pad_zero": bool((emb.weight.grad[real:] == 0).all())}


@pytest.mark.numerics
@pytest.mark.timeout(FOLD_TIMEOUT)
@pytest.mark.parametrize(("t", "vocab"), TIED)
def test_tied_embedding_and_head_accumulate_into_one_shard(t, vocab, folds):
    for r, out in enumerate(folds[t]["tied", vocab, True]):
        assert out["spread"] > 0 and out["err"] <= FACTOR * out["spread"], (r, out)
        assert out["pad_zero"], (r, out)
    broken = folds[t]["tied", vocab, False]
    assert any(o["err"] > FACTOR * o["spread"] for o in broken), broken


def _save_rank(ctx, folder: str) -> None:
    from refimpl.checkpoint import CheckpointConfig, Checkpointer, save_training_state

    torch.manual_seed(0)
    emb = VocabParallelEmbedding.from_embedding(nn.Embedding(11, 5), tp_group=None, pad_vocab=True)
    save_training_state(Checkpointer(CheckpointConfig(folder=folder)), 1, model=emb)


@pytest.mark.timeout(FOLD_TIMEOUT)
def test_saved_at_tp2_padded_loads_bitwise_into_a_plain_embedding(folds):
    from refimpl.checkpoint import CheckpointConfig, Checkpointer, load_training_state

    tmp_path = folds["saved"]
    torch.manual_seed(0)
    reference = nn.Embedding(11, 5)
    plain = nn.Embedding(11, 5)
    with torch.no_grad():
        plain.weight.fill_(float("nan"))
    ck = Checkpointer(CheckpointConfig(folder=str(tmp_path)))
    load_training_state(ck, ck.find_latest_valid(), model=plain, restore_rng=False)
    assert torch.equal(plain.weight, reference.weight)


def _calls(t: int, folder: str) -> dict:
    """Every rank function of this module at tp ``t``, by key (tests/support/folded.py: one spawn per t)."""
    calls: dict = {("loss", 24, None): (_loss_rank, (24, None))}
    if t == 2:
        calls |= {("loss", 24, drop): (_loss_rank, (24, drop)) for drop in range(3)}
        calls |= {"refused": (_refused_rank, ()), "save": (_save_rank, (folder,))}
    calls |= {("embedding", v): (_embedding_rank, (v, EMBEDDING_DIM)) for tt, v in EMBEDDING if tt == t}
    calls |= {("reduce_scatter", v, b): (_reduce_scatter_rank, (v, EMBEDDING_DIM, b, SEQ))
              for tt, v, b in REDUCE_SCATTER if tt == t}
    calls |= {("tied", v, f): (_tied_rank, (v, 8, f)) for tt, v in TIED if tt == t for f in (True, False)}
    return calls


@pytest.fixture(scope="module")
def folds(tmp_path_factory) -> dict:
    """``{t: {key: per-rank results}}`` for t = 2 and 4, and ``"saved"``: the folder of the tp 2 save."""
    folder = tmp_path_factory.mktemp("vocab_saved")
    out: dict = {t: run_folded(t, _calls(t, str(folder)), timeout_s=SPAWN_TIMEOUT_S) for t in (2, 4)}
    out["saved"] = folder
    return out
