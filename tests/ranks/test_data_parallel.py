"""Data parallelism (chapter 03): DataParallelNaive and DataParallelBucket against one device and torch DDP.

Every rank trains a model for STEPS AdamW steps on its shard of the same global batches; at the end its
parameters must equal those of (a) one device training the whole global batch and (b)
``torch.nn.parallel.DistributedDataParallel`` on the same shards. Because AdamW is nearly scale-invariant
(a gradient twice too large moves the parameters by almost the same step), the gradients of the first
step are compared too, before any optimizer step: a missing division by the world size is then an error
of 1.0 (relative), not of 1e-3.

Tolerances (docs/ARCHITECTURE.md, "Correctness and numerics"), all measured in the same run:
* **2 ranks: bit for bit** against DDP, and against **one device that cuts the global batch into 2
  micro-batches** (each loss divided by 2). Both divide each gradient by W = 2 (exact: a power of two)
  and add two numbers (commutative), so neither the bucket layout nor the place of the addition (a
  collective or ``.grad +=``) can change a bit.
* **4 ranks, and one device with one micro-batch: ``FACTOR x spread``**, where ``spread`` is the distance
  between two single-device runs that differ only in summation order: the global batch in one
  micro-batch and in ``W`` micro-batches (for the parameters ``||a - b|| / ||b - theta_0||``, the
  distance relative to how far the reference moved; for the gradients ``||g - g_ref|| / ||g_ref||``).
  Data parallelism *is* such a reordering (a sum per rank, then a sum over ranks in the ring's order), so
  it lands at about one spread. Measured (ATEN_CPU_CAPABILITY=default and avx2, this file's model): the
  4-rank distance to one device is 1.1 to 1.25 spreads for the parameters (spread 1.2e-5 to 1.3e-5) and
  about 1.0 for the gradients (spread 1.4e-7); 4 ranks vs DDP is 0.8 to 1.0 spread. ``FACTOR = 4`` leaves
  room for other CPUs and is still ~1e4 x below a missing synchronisation or a missing division (~1).

The multi-rank runs are batched: one spawn of 2 ranks and one of 4 compute every case, the tests assert on
their results.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from refimpl.comm.tracer import CommTracer
from refimpl.config import ModelConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.parallel.data_parallel import (
    DataParallelBucket,
    DataParallelNaive,
    assign_buckets,
    low_precision_hook,
    num_buckets,
)
from tests.support.timeouts import SPAWN_TIMEOUT_S

STEPS = 6
LR = 1e-3
FACTOR = 4  # x the summation-order spread measured in the same run (module docstring)
GLOBAL_BATCH = 8
SEQ = 16
MB = 2**20
def _gpt() -> nn.Module:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, max_seq_len=SEQ)
    return GPT(cfg, seed=0)  # tied embeddings: the output layer *is* the word embedding


class Ugly(nn.Module):
    """Frozen, tied, never-used and sometimes-used parameters in one model."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.frozen = nn.Linear(8, 8)
        self.hidden = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)  # used on odd steps only
        self.never = nn.Linear(8, 8)  # never used
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = self.frozen(self.embed(x)).tanh()
        h = self.hidden(h).tanh()
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


def _data(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, wrapper, data, rank: int, world: int, *, ugly: bool = False,
           accumulation: int = 1, trap: str | None = None, zero_fill: bool = False,
           tracer: CommTracer | None = None, counts: list[int] | None = None):
    """STEPS AdamW steps on this rank's shard; returns (parameters, losses)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1,
                            foreach=False)
    losses = []
    for step, batch in enumerate(data):
        shard = batch.chunk(world)[rank]
        micro = shard.shape[0] // accumulation
        total = 0.0
        for i in range(accumulation):
            x, y = shard[i * micro : (i + 1) * micro, :-1], shard[i * micro : (i + 1) * micro, 1:]
            last = i == accumulation - 1
            quiet = contextlib.nullcontext() if last or not hasattr(wrapper, "no_sync") else wrapper.no_sync()
            if trap == "no_sync_around_backward_only":
                out = wrapper(x, step % 2 == 1) if ugly else wrapper(x)
                with quiet:
                    loss = lm_loss(out, y) / accumulation
                    loss.backward()
            else:
                with quiet:
                    out = wrapper(x, step % 2 == 1) if ugly else wrapper(x)
                    loss = lm_loss(out, y) / (1 if trap == "no_division" else accumulation)
                    loss.backward()
            total += loss.item()
        losses.append(total)
        if hasattr(wrapper, "finish_gradient_synchronization"):
            wrapper.finish_gradient_synchronization()
        if zero_fill:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracer is not None:
            tracer.step()
        if counts is not None:
            counts.append(0)
    return [p.detach().clone() for p in model.parameters()], losses


def _single_bf16_wire(make, data, world: int) -> list[torch.Tensor]:
    """One device doing the bf16 wire's arithmetic by hand: per shard g / W cast to bf16, summed in bf16."""
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)
    for batch in data:
        parts = []
        for shard in batch.chunk(world):
            model.zero_grad(set_to_none=True)
            lm_loss(model(shard[:, :-1]), shard[:, 1:]).backward()
            parts.append([(p.grad / world).bfloat16() for p in params])
        for p, *shares in zip(params, *parts, strict=True):
            total = shares[0]
            for share in shares[1:]:
                total = total + share
            p.grad = total.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _single(make, data, **kw):
    model = make()
    return _train(model, model, data, 0, 1, **kw)


def _init(make) -> list[torch.Tensor]:
    return [p.detach().clone() for p in make().parameters()]


def _rel(a, b, init) -> float:
    """||a - b|| / ||b - init||: the difference relative to the distance the reference moved."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a, b, strict=True)).sqrt()
    den = sum(((y - z).double() ** 2).sum() for y, z in zip(b, init, strict=True)).sqrt()
    return (num / den).item()


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _grel(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over all gradients: the relative error of the whole gradient."""
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(grads, ref, strict=True)).sqrt()
    return (num / sum((y.double() ** 2).sum() for y in ref).sqrt()).item()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _single_grads(make, batch: torch.Tensor, micro_batches: int) -> list[torch.Tensor]:
    """One device's gradient of the mean loss over ``batch``, summed over ``micro_batches`` slices."""
    model = make()
    for x in batch.chunk(micro_batches):
        (lm_loss(model(x[:, :-1]), x[:, 1:]) / micro_batches).backward()
    return _grads(model)


class NoDivision(DataParallelBucket):
    """Negative control: the one-line bug of summing the gradients without dividing by the world size."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.average_gradients = False  # summed, not averaged: the step sees W times the gradient


class SkipSync(DataParallelBucket):
    """Negative control: a wrapper that never synchronises (each rank trains on its own shard)."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        return None


def _per_step(tracer: CommTracer, op: str = "all_reduce") -> list[tuple[int, int]]:
    return [(s.get(op).count, s.get(op).nbytes) if op in s else (0, 0)
            for s in (tracer.summary(step=k) for k in range(STEPS))]


def _ddp_comm_counter(ddp: DDP) -> list[int]:
    """Count DDP's bucket all-reduces with a comm hook that forwards to its default all-reduce; the
    caller appends 0 to the list to open each step's count."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state, bucket):
        calls[-1] += 1
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    return calls


# ------------------------------------------------------------------------------------------ the workers
def _cases(ctx, full: bool) -> dict:
    """Every multi-rank case, on one process group; returns plain numbers and booleans."""
    torch.manual_seed(0)
    rank, world = ctx.rank, ctx.world_size
    out: dict = {"world": world}
    gpt_data, ugly_data = _data(256), _data(32)
    gpt_init, ugly_init = _init(_gpt), _init(Ugly)

    # the reference, and the yardstick: one device with the global batch in 1 and in `world` micro-batches
    ref_params, _ = _single(_gpt, gpt_data)
    split_params, _ = _single(_gpt, gpt_data, accumulation=world)
    split_acc, _ = _single(_gpt, gpt_data, accumulation=2 * world)  # what 2 micro-batches per rank reorder
    out["spread"] = _rel(split_params, ref_params, gpt_init)
    out["spread_acc"] = _rel(split_acc, ref_params, gpt_init)

    # the gradients of the first step, before any optimizer step (AdamW would hide a wrong scale)
    grad_ref = _single_grads(_gpt, gpt_data[0], 1)
    grad_split = _single_grads(_gpt, gpt_data[0], world)
    out["grad_spread"] = _grel(grad_split, grad_ref)
    shard = gpt_data[0].chunk(world)[rank]
    for name, wrap in (("bucket", lambda m: DataParallelBucket(m, bucket_cap_mb=4 * 1024 / MB)),
                       ("naive", DataParallelNaive),
                       ("no division", lambda m: NoDivision(m, bucket_cap_mb=4 * 1024 / MB))):
        model = _gpt()
        dp = wrap(model)
        lm_loss(dp(shard[:, :-1]), shard[:, 1:]).backward()
        dp.finish_gradient_synchronization()
        grads = _grads(model)
        out[f"grads {name}"] = {"vs_single": _grel(grads, grad_ref),
                                "bitwise_split": _equal(grads, grad_split)}

    # GPT (tied embeddings) at several caps: 1 bucket, tensors split over buckets, a cap below most tensors
    caps = [25 * MB, 16 * 1024, 4 * 1024] if full else [16 * 1024]
    for cap in caps:
        model = _gpt()
        dp = DataParallelBucket(model, bucket_cap_mb=cap / MB)
        with CommTracer() as tracer:
            params, _ = _train(model, dp, gpt_data, rank, world, tracer=tracer)
        ddp_model = _gpt()
        ddp_params, _ = _train(ddp_model, DDP(ddp_model, bucket_cap_mb=cap / MB), gpt_data, rank, world)
        timeline = dp.last_timeline
        out[f"gpt cap={cap}"] = {
            "vs_single": _rel(params, ref_params, gpt_init),
            "bitwise_split": _equal(params, split_params),
            "vs_ddp": _rel(params, ddp_params, gpt_init),
            "bitwise_ddp": _equal(params, ddp_params),
            "per_step": _per_step(tracer),
            "buckets": dp.num_buckets,
            "grad_bytes": dp.grad_bytes,
            "cap_bytes": dp.bucket_cap_bytes,
            "bucket_bytes": dp.bucket_bytes(),
            "timeline_complete": all(t is not None for t in [*timeline.launch, *timeline.done,
                                                             timeline.backward_end]),
            "timeline": {k: getattr(timeline, k) for k in ("launch", "done", "grad_ready", "backward_start",
                                                          "backward_end", "wait_start", "wait_end")},
            "num_trainable": sum(1 for p in model.parameters() if p.requires_grad),
            "exposed_seconds": timeline.exposed_seconds(),
            "comm_seconds": timeline.comm_seconds(),
        }

    # frozen + tied + never-used + sometimes-used parameters, find_unused_parameters=True, vs DDP's same mode;
    # a cap of 100 bytes = 25 elements, smaller than every weight matrix
    ref_ugly, _ = _single(Ugly, ugly_data, ugly=True)
    split_ugly, _ = _single(Ugly, ugly_data, ugly=True, accumulation=world)
    out["spread_ugly"] = _rel(split_ugly, ref_ugly, ugly_init)
    for cap in ([25 * MB, 100] if full else [100]):
        model = Ugly()
        dp = DataParallelBucket(model, bucket_cap_mb=cap / MB, find_unused_parameters=True)
        with CommTracer() as tracer:
            params, _ = _train(model, dp, ugly_data, rank, world, ugly=True, tracer=tracer)
        ddp_model = Ugly()
        ddp = DDP(ddp_model, bucket_cap_mb=cap / MB, find_unused_parameters=True)
        ddp_params, _ = _train(ddp_model, ddp, ugly_data, rank, world, ugly=True)
        out[f"ugly cap={cap}"] = {
            "vs_single": _rel(params, ref_ugly, ugly_init),
            "bitwise_split": _equal(params, split_ugly),
            "vs_ddp": _rel(params, ddp_params, ugly_init),
            "bitwise_ddp": _equal(params, ddp_params),
            "never_grad_is_none": model.never.weight.grad is None,
            "frozen_unchanged": torch.equal(model.frozen.weight, Ugly().frozen.weight),
            "per_step": _per_step(tracer),
            "buckets": dp.num_buckets,
            "grad_bytes": dp.grad_bytes,
            "cap_bytes": dp.bucket_cap_bytes,
            "num_trainable": sum(1 for p in model.parameters() if p.requires_grad),
        }
    if not full:
        return out

    # the same model with find_unused_parameters=False: unused parameters get zero gradients
    model = Ugly()
    dp = DataParallelBucket(model, bucket_cap_mb=100 / MB)
    params, _ = _train(model, dp, ugly_data, rank, world, ugly=True)
    ref_zero, _ = _single(Ugly, ugly_data, ugly=True, zero_fill=True)
    split_zero, _ = _single(Ugly, ugly_data, ugly=True, zero_fill=True, accumulation=world)
    out["ugly zero-fill"] = {"vs_single_zero_filled": _rel(params, ref_zero, ugly_init),
                             "bitwise_split": _equal(params, split_zero),
                             "spread": _rel(split_zero, ref_zero, ugly_init)}

    # the naive wrapper: one all-reduce per trainable tensor
    model = _gpt()
    naive = DataParallelNaive(model)
    with CommTracer() as tracer:
        params, _ = _train(model, naive, gpt_data, rank, world, tracer=tracer)
    out["naive"] = {"vs_single": _rel(params, ref_params, gpt_init), "per_step": _per_step(tracer),
                    "bitwise_split": _equal(params, split_params),
                    "tensors": sum(1 for _ in model.parameters()),
                    "grad_bytes": sum(p.numel() * 4 for p in model.parameters())}

    # negative control: no synchronisation at all
    model = _gpt()
    params, _ = _train(model, SkipSync(model, bucket_cap_mb=16 * 1024 / MB), gpt_data, rank, world)
    out["skip_sync"] = {"vs_single": _rel(params, ref_params, gpt_init)}

    # gradient accumulation: 2 micro-batches per rank, no_sync around forward + backward of the first
    acc_cap = 16 * 1024
    model = _gpt()
    dp = DataParallelBucket(model, bucket_cap_mb=acc_cap / MB)
    with CommTracer() as tracer:
        params, _ = _train(model, dp, gpt_data, rank, world, accumulation=2, tracer=tracer)
    ddp_model = _gpt()
    ddp_params, _ = _train(ddp_model, DDP(ddp_model, bucket_cap_mb=acc_cap / MB), gpt_data, rank, world,
                           accumulation=2)
    out["accumulation"] = {"vs_single": _rel(params, ref_params, gpt_init),
                           "vs_ddp": _rel(params, ddp_params, gpt_init),
                           "bitwise_ddp": _equal(params, ddp_params),
                           "per_step": _per_step(tracer), "buckets": dp.num_buckets}

    # the trap: no_sync around backward only (the flag is read by forward) -> every micro-batch syncs
    model = _gpt()
    dp = DataParallelBucket(model, bucket_cap_mb=acc_cap / MB)
    with CommTracer() as tracer:
        params, _ = _train(model, dp, gpt_data, rank, world, accumulation=2,
                           trap="no_sync_around_backward_only", tracer=tracer)
    ddp_model = _gpt()
    ddp = DDP(ddp_model, bucket_cap_mb=acc_cap / MB)
    ddp_calls = _ddp_comm_counter(ddp)
    _train(ddp_model, ddp, gpt_data, rank, world, accumulation=2, trap="no_sync_around_backward_only",
           counts=ddp_calls)
    ddp_model2 = _gpt()
    ddp2 = DDP(ddp_model2, bucket_cap_mb=acc_cap / MB)
    ddp_calls_right = _ddp_comm_counter(ddp2)
    _train(ddp_model2, ddp2, gpt_data, rank, world, accumulation=2, counts=ddp_calls_right)
    out["trap_backward_only"] = {"vs_single": _rel(params, ref_params, gpt_init),
                                 "per_step": _per_step(tracer),
                                 "buckets": dp.num_buckets, "ddp_calls_trap": ddp_calls[:STEPS],
                                 "ddp_calls_right": ddp_calls_right[:STEPS]}

    # the trap: forgetting to divide by the accumulation steps -> the gradient is 2x the true one
    def grads_after_one_step(trap):
        model = _gpt()
        dp = DataParallelBucket(model)
        opt_free = [gpt_data[0]]
        shard = opt_free[0].chunk(world)[rank]
        for i in range(2):
            x, y = shard[i * (shard.shape[0] // 2) : (i + 1) * (shard.shape[0] // 2), :-1], \
                shard[i * (shard.shape[0] // 2) : (i + 1) * (shard.shape[0] // 2), 1:]
            with dp.no_sync() if i == 0 else contextlib.nullcontext():
                (lm_loss(dp(x), y) / (1 if trap else 2)).backward()
        dp.finish_gradient_synchronization()
        return [p.grad.clone() for p in model.parameters()]

    single = _gpt()
    lm_loss(single(gpt_data[0][:, :-1]), gpt_data[0][:, 1:]).backward()
    ref_grads = [p.grad for p in single.parameters()]
    right, wrong = grads_after_one_step(False), grads_after_one_step(True)
    out["trap_no_division"] = {
        "right": _grel(right, ref_grads),
        "wrong": _grel(wrong, ref_grads),
        "wrong_over_2x": _grel(wrong, [2 * g for g in ref_grads]),
        # the yardstick: one device, its global batch in 2 x world micro-batches (the same reordering)
        "spread": _grel(_single_grads(_gpt, gpt_data[0], 2 * world), ref_grads),
    }

    # bf16 on the wire: half the bytes, and a loss that stays close to the fp32 run
    model = _gpt()
    dp = DataParallelBucket(model, bucket_cap_mb=16 * 1024 / MB, comm_hook=low_precision_hook(torch.bfloat16))
    with CommTracer() as tracer:
        params16, losses16 = _train(model, dp, gpt_data, rank, world, tracer=tracer)
    model = _gpt()
    dp32 = DataParallelBucket(model, bucket_cap_mb=16 * 1024 / MB)
    params32, losses32 = _train(model, dp32, gpt_data, rank, world)
    out["bf16"] = {"per_step": _per_step(tracer), "grad_bytes": dp.grad_bytes,
                   "loss_gap": max(abs(a - b) for a, b in zip(losses16, losses32, strict=True)),
                   "bitwise_by_hand": _equal(params16, _single_bf16_wire(_gpt, gpt_data, world)),
                   "params_differ": not _equal(params16, params32),
                   "grads_fp32": all(p.grad is None or p.grad.dtype == torch.float32
                                     for p in model.parameters())}

    # activation checkpointing (both flavours) leaves the synchronised gradients bit for bit unchanged
    def grads_with_checkpointing(reentrant):
        model = _gpt()
        if reentrant is not None:
            for layer in model.layers:
                layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=reentrant)
        dp = DataParallelBucket(model, bucket_cap_mb=4 * 1024 / MB)
        x = gpt_data[0].chunk(world)[rank]
        lm_loss(dp(x[:, :-1]), x[:, 1:]).backward()
        dp.finish_gradient_synchronization()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads_with_checkpointing(None)
    out["checkpointing"] = {mode: _equal(plain, grads_with_checkpointing(mode)) for mode in (False, True)}

    # two backward passes after one forward: an error, not a partial gradient on the wire
    model = _gpt()
    dp = DataParallelBucket(model)
    x = gpt_data[0].chunk(world)[rank]
    loss = lm_loss(dp(x[:, :-1]), x[:, 1:])
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        out["double_backward_error"] = ""
    except RuntimeError as exc:
        out["double_backward_error"] = str(exc)
    dp.finish_gradient_synchronization()
    return out


def _worker(ctx, full: bool) -> dict:
    return _cases(ctx, full)


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_ranks(_worker, 2, True, timeout_s=SPAWN_TIMEOUT_S)[0]


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    return run_ranks(_worker, 4, False, timeout_s=SPAWN_TIMEOUT_S)[0]


# ------------------------------------------------------------------------------------ single-process tests
def test_assign_buckets_cuts_the_reversed_flat_buffer_exactly():
    assert assign_buckets([3, 5, 2], 4) == [[2, 1], [1, 0], [0]]
    assert assign_buckets([10], 3) == [[0]] * 4  # a cap below one tensor: the tensor spans 4 buckets
    assert assign_buckets([0, 4, 0], 4) == [[1]]  # empty tensors hold no place
    for numels, cap in [([7, 1, 12, 3], 5), ([1] * 9, 2), ([100, 1], 1000), ([64, 64, 64], 64)]:
        buckets = assign_buckets(numels, cap)
        assert len(buckets) == math.ceil(sum(numels) / cap) == num_buckets(4 * sum(numels), 4 * cap)
        flat = [i for i in reversed(range(len(numels))) for _ in range(numels[i])]  # reverse registration
        for b, members in enumerate(buckets):
            assert members == list(dict.fromkeys(flat[b * cap : (b + 1) * cap]))
    with pytest.raises(ValueError):
        assign_buckets([3], 0)


def test_whole_tensor_buckets_are_ddps_rule():
    """ZeRO's buckets (whole tensors) = torch DDP's own assignment routine fed the backward order."""
    assert assign_buckets([3, 5, 2], 4, whole_tensors=True) == [[2, 1], [0]]
    rng = random.Random(0)
    for _ in range(300):
        numels = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 9))]
        cap = rng.randint(1, 20)
        backward_order = list(reversed(range(len(numels))))  # DDP walks tensors as given; these label them
        tensors = [torch.zeros(numels[i]) for i in backward_order]
        ddp, _ = dist._compute_bucket_assignment_by_size(tensors, [4 * cap], [False] * len(numels),
                                                          backward_order)
        assert assign_buckets(numels, cap, whole_tensors=True) == ddp, (numels, cap)
    # negative control: the exact cut (tensors split) is not DDP's rule
    assert assign_buckets([3, 5, 2], 4) != [[2, 1], [0]]


# ---------------------------------------------------------------------------------------- two ranks
def _tol(spread: float) -> float:
    """FACTOR x a summation-order spread measured in the same run; a zero spread would make it vacuous."""
    assert spread > 0, "the two single-device runs agree bit for bit: no yardstick for the tolerance"
    return FACTOR * spread


@pytest.mark.numerics
@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S + 60)  # the first sets up both fixtures, each <= SPAWN_TIMEOUT_S
@pytest.mark.parametrize("world", [2, 4])
def test_gradients_before_the_step_equal_one_device(two_ranks, four_ranks, world):
    r = {2: two_ranks, 4: four_ranks}[world]
    tol = _tol(r["grad_spread"])
    for name in ("bucket", "naive"):
        g = r[f"grads {name}"]
        assert g["vs_single"] <= tol, (name, g, tol)
        if world == 2:  # g0/2 + g1/2 on the wire = one device's .grad after two micro-batches of loss/2
            assert g["bitwise_split"], (name, g)
    # negative control: summing without dividing by W is W x the gradient, an error of W - 1
    wrong = r["grads no division"]["vs_single"]
    assert abs(wrong - (world - 1)) < 1e-3 and wrong > 1000 * tol, (wrong, tol)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("cap", [25 * MB, 16 * 1024, 4 * 1024])
def test_gpt_two_ranks_equals_single_device_and_ddp_bitwise(two_ranks, cap):
    r = two_ranks[f"gpt cap={cap}"]
    assert r["bitwise_split"], r  # one device with the global batch in 2 micro-batches, bit for bit
    assert r["vs_single"] <= _tol(two_ranks["spread"]), r
    assert r["bitwise_ddp"], f"not bit-identical to DDP at 2 ranks: max diff {r['vs_ddp']:.3g}"


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("cap", [25 * MB, 16 * 1024, 4 * 1024])
def test_all_reduces_and_bytes_per_step_follow_the_formula(two_ranks, cap):
    r = two_ranks[f"gpt cap={cap}"]
    assert r["cap_bytes"] == cap
    expected = math.ceil(r["grad_bytes"] / cap)
    assert r["buckets"] == expected == num_buckets(r["grad_bytes"], cap)
    assert sum(r["bucket_bytes"]) == r["grad_bytes"]
    assert all(b == cap for b in r["bucket_bytes"][:-1])
    assert r["per_step"] == [(expected, r["grad_bytes"])] * STEPS


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_timeline_records_every_bucket(two_ranks):
    r = two_ranks[f"gpt cap={4 * 1024}"]
    assert r["timeline_complete"]
    t = r["timeline"]
    assert len(t["launch"]) == len(t["done"]) == r["buckets"] > 1
    assert len(t["grad_ready"]) == r["num_trainable"]  # one hook per tensor (the tied embedding once)
    assert t["backward_start"] <= min(t["grad_ready"]) and max(t["grad_ready"]) <= t["backward_end"]
    assert t["launch"] == sorted(t["launch"])  # buckets strictly in order, the same on every rank
    # every bucket is launched by a gradient hook, inside backward, and the first long before its end
    assert all(t["backward_start"] <= a <= t["backward_end"] for a in t["launch"])
    assert t["launch"][0] < t["grad_ready"][-1]
    assert all(a <= d for a, d in zip(t["launch"], t["done"], strict=True))
    assert t["backward_end"] <= t["wait_start"] <= t["wait_end"]
    # the exposed part is what completes after backward: none of it if every bucket finished before
    last_done = max(t["done"])
    assert (r["exposed_seconds"] == 0) == (last_done <= t["backward_end"]), (r["exposed_seconds"], t)
    assert 0 < r["comm_seconds"] <= last_done - t["launch"][0]


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("cap", [25 * MB, 100])
def test_frozen_tied_unused_parameters_two_ranks(two_ranks, cap):
    r = two_ranks[f"ugly cap={cap}"]
    assert r["bitwise_split"], r
    assert r["vs_single"] <= _tol(two_ranks["spread_ugly"]), r
    assert r["bitwise_ddp"], f"not bit-identical to DDP(find_unused_parameters=True): {r['vs_ddp']:.3g}"
    assert r["never_grad_is_none"] and r["frozen_unchanged"]
    # one all-reduce per bucket plus the used-flags (one int32 per trainable tensor)
    flags = 4 * r["num_trainable"]
    assert r["buckets"] == math.ceil(r["grad_bytes"] / r["cap_bytes"])
    assert r["per_step"] == [(r["buckets"] + 1, r["grad_bytes"] + flags)] * STEPS


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_unused_parameters_get_zero_gradients_without_find_unused(two_ranks):
    r = two_ranks["ugly zero-fill"]
    assert r["bitwise_split"], r
    assert r["vs_single_zero_filled"] <= _tol(r["spread"]), r


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_naive_equals_single_device_with_one_all_reduce_per_tensor(two_ranks):
    r = two_ranks["naive"]
    assert r["bitwise_split"] and r["vs_single"] <= _tol(two_ranks["spread"]), r
    assert r["per_step"] == [(r["tensors"], r["grad_bytes"])] * STEPS


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_negative_control_without_sync_fails_the_equivalence_check(two_ranks):
    diff, tol = two_ranks["skip_sync"]["vs_single"], _tol(two_ranks["spread"])
    assert diff > 1000 * tol, f"a wrapper that never synchronises passed the check (diff {diff:.3g})"


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_accumulation_with_no_sync_equals_single_device_and_ddp(two_ranks):
    r = two_ranks["accumulation"]
    assert r["vs_single"] <= _tol(two_ranks["spread_acc"]), r
    assert r["bitwise_ddp"], r["vs_ddp"]
    assert [c for c, _ in r["per_step"]] == [r["buckets"]] * STEPS  # the first micro-batch sent nothing


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_trap_no_sync_around_backward_only_syncs_every_micro_batch(two_ranks):
    r = two_ranks["trap_backward_only"]
    assert r["vs_single"] <= _tol(two_ranks["spread_acc"]), r  # still right, but twice the traffic
    assert [c for c, _ in r["per_step"]] == [2 * r["buckets"]] * STEPS
    # torch DDP behaves the same: its comm hook runs for both micro-batches. (Step 0 differs: DDP rebuilds
    # its buckets in gradient-ready order after the first synchronised backward, here mid-step.)
    trap, right = r["ddp_calls_trap"], r["ddp_calls_right"]
    assert all(t == 2 * g > 0 for t, g in zip(trap[1:], right[1:], strict=True)), (trap, right)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_trap_forgetting_to_divide_by_accumulation_doubles_the_gradient(two_ranks):
    r = two_ranks["trap_no_division"]
    tol = _tol(r["spread"])
    assert r["right"] <= tol and r["wrong_over_2x"] <= tol, r  # exactly twice the true gradient ...
    assert r["wrong"] > 1000 * tol, r  # ... which the gradient comparison sees at once


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_bf16_hook_halves_the_bytes_and_keeps_the_loss(two_ranks):
    r = two_ranks["bf16"]
    assert all(nbytes * 2 == r["grad_bytes"] for _, nbytes in r["per_step"])
    # the runs differ from fp32, and at 2 ranks they are bit for bit one device doing the wire's
    # arithmetic by hand (g / 2 in fp32, cast to bf16, one bf16 addition): the hook adds no other error
    assert r["params_differ"] and r["grads_fp32"] and r["loss_gap"] > 0
    assert r["bitwise_by_hand"], {k: v for k, v in r.items() if k != "per_step"}


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_activation_checkpointing_keeps_the_gradients(two_ranks):
    assert two_ranks["checkpointing"] == {False: True, True: True}


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_two_backwards_after_one_forward_raise(two_ranks):
    assert "accumulated twice" in two_ranks["double_backward_error"]


# ---------------------------------------------------------------------------------------- four ranks
@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_four_ranks_equal_single_device_and_ddp(four_ranks):
    for key, spread in ((f"gpt cap={16 * 1024}", "spread"), ("ugly cap=100", "spread_ugly")):
        r, tol = four_ranks[key], _tol(four_ranks[spread])
        assert r["vs_single"] <= tol, (key, r, tol)
        assert r["vs_ddp"] <= tol, (key, r, tol)  # reduction order differs with the bucket layout
    r = four_ranks[f"gpt cap={16 * 1024}"]
    assert r["per_step"] == [(math.ceil(r["grad_bytes"] / r["cap_bytes"]), r["grad_bytes"])] * STEPS
    assert four_ranks["ugly cap=100"]["never_grad_is_none"]
