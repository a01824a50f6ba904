"""Mixed precision (chapter 05): the loss scaler against torch.amp.GradScaler, its state, the policy, master
weights, low-precision gradient reduction, and overflow agreement across ranks."""

from __future__ import annotations

import io

import pytest
import torch

from refimpl.config import ModelConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.precision import (
    DynamicLossScaler,
    LossScaleError,
    LossScalerConfig,
    MasterWeights,
    MixedPrecision,
    MixedPrecisionPolicy,
    ScalerState,
    update_scale,
)
from tests.support.timeouts import SPAWN_TIMEOUT_S

# Steps whose gradients hold an inf or a NaN; 3-5 overflow three times in a row, 30-31 twice.
OVERFLOWS = {3: "inf", 4: "nan", 5: "-inf", 17: "nan", 30: "inf", 31: "inf", 44: "nan"}


def gradient_sequence(steps: int = 60, seed: int = 0) -> list[torch.Tensor]:
    """Per-step gradients over six orders of magnitude, with the overflows of OVERFLOWS injected."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(10, generator=g) * 10.0 ** torch.randint(-6, 3, (1,), generator=g).item()
        if t in OVERFLOWS:
            x[t % 10] = float(OVERFLOWS[t])
        out.append(x)
    return out


def drive(scaler, grads: list[torch.Tensor]):
    """Feed the same gradients through ``scaler`` (GradScaler or ours); record its every decision."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.1)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(True))
    scales, skipped, unscaled = [], [], []
    for g in grads:
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()  # grad = S * g, computed by autograd
        scaler.unscale_(opt)
        unscaled.append(p.grad.clone())
        n = len(steps)
        scaler.step(opt)
        skipped.append(len(steps) == n)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped, unscaled, p.detach().clone()


@pytest.mark.numerics
@pytest.mark.parametrize("factors", [(2.0, 0.5, 5), (3.0, 0.25, 4), (1.5, 0.7, 3)])
def test_scaler_makes_gradscalers_decisions(factors):
    growth, backoff, interval = factors
    grads = gradient_sequence()
    kwargs = dict(init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    theirs = drive(torch.amp.GradScaler("cpu", **kwargs), grads)
    ours = drive(DynamicLossScaler(**kwargs, hysteresis=1, min_scale=0.0, max_consecutive_skips=None), grads)
    assert ours[0] == theirs[0], "scale after each step"
    assert ours[1] == theirs[1], "skipped steps"
    assert [t for t, s in enumerate(ours[1]) if s] == sorted(OVERFLOWS)
    for a, b in zip(ours[2], theirs[2], strict=True):  # unscaled gradients, bit for bit (NaN where NaN)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.equal(ours[3], theirs[3])
    assert len(set(ours[0])) > 3  # the scale really moved both ways


def test_negative_control_a_different_rule_is_caught():
    grads = gradient_sequence()
    kwargs = dict(init_scale=2.0**10, growth_interval=5)
    theirs = drive(torch.amp.GradScaler("cpu", **kwargs), grads)
    ours = drive(DynamicLossScaler(**kwargs, hysteresis=2, min_scale=0.0, max_consecutive_skips=None), grads)
    assert ours[1] == theirs[1] and ours[0] != theirs[0]  # same skips, different scales: hysteresis shows


def test_hysteresis_and_min_scale():
    config = LossScalerConfig(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    state = ScalerState(8.0, 0, 2)
    trace = []
    for found_inf in [True, False, True, True, True, False, False, False, True]:
        state = update_scale(state, found_inf, config)
        trace.append(tuple(state))
    assert trace == [
        (8.0, 0, 1),  # first overflow: one unit of hysteresis spent, the scale stays
        (8.0, 1, 1),
        (4.0, 0, 0),  # hysteresis exhausted: back off
        (2.0, 0, -1),  # and again on every further overflow ...
        (2.0, 0, -2),  # ... but never below min_scale
        (2.0, 1, -2),
        (2.0, 2, -2),
        (4.0, 0, 2),  # growth_interval finite steps: grow, hysteresis refilled
        (4.0, 0, 1),
    ]


def test_growth_that_would_overflow_float32_keeps_the_scale():
    config = LossScalerConfig(init_scale=2.0**127, growth_interval=1, max_consecutive_skips=None)
    assert update_scale(ScalerState(2.0**127, 0, 1), False, config).scale == 2.0**127


def test_consecutive_skips_abort_with_a_clear_message():
    scaler = DynamicLossScaler(init_scale=4.0, max_consecutive_skips=3)
    p = torch.nn.Parameter(torch.zeros(2))
    for step in range(3):
        p.grad = torch.tensor([float("nan"), 1.0])
        assert scaler.unscale_([p])
        if step < 2:
            scaler.update()
    with pytest.raises(LossScaleError, match="3 consecutive steps") as info:
        scaler.update()
    assert isinstance(info.value, FloatingPointError)  # the trainer already turns those into exit status 2
    # a finite step in between resets the count
    scaler = DynamicLossScaler(init_scale=4.0, max_consecutive_skips=2)
    for g in [float("nan"), 1.0, float("nan"), 1.0]:
        p.grad = torch.tensor([g, 1.0])
        scaler.unscale_([p])
        scaler.update()
    assert scaler.num_skipped == 2 and scaler.consecutive_skips == 0


def test_state_dict_round_trips():
    grads = gradient_sequence()
    kwargs = dict(init_scale=2.0**10, growth_interval=4, hysteresis=2, min_scale=0.0,
                  max_consecutive_skips=None)
    reference = drive(DynamicLossScaler(**kwargs), grads)

    first = DynamicLossScaler(**kwargs)
    head = drive(first, grads[:31])  # stop between the two overflows of steps 30 and 31
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = DynamicLossScaler()  # default config: the checkpoint's config must win
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert second.state_dict() == first.state_dict()
    assert second.state.hysteresis_tracker == first.state.hysteresis_tracker == 1
    tail = drive(second, grads[31:])
    assert head[0] + tail[0] == reference[0] and head[1] + tail[1] == reference[1]


def test_state_dict_mid_step_and_misuse_raise():
    scaler = DynamicLossScaler()
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    scaler.unscale_([p])
    with pytest.raises(RuntimeError, match="middle of a step"):
        scaler.state_dict()
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_([p])
    scaler.update()
    with pytest.raises(RuntimeError, match="needs unscale_"):
        scaler.update()
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16 gradients"):
        scaler.unscale_([half])


def test_policy_from_name():
    fp32, bf16, fp16 = (MixedPrecisionPolicy.from_name(n) for n in ("fp32", "bf16", "fp16"))
    assert (fp32.compute_dtype, bf16.compute_dtype, fp16.compute_dtype) == (
        torch.float32, torch.bfloat16, torch.float16)
    assert all(p.param_dtype == torch.float32 == p.reduce_dtype for p in (fp32, bf16, fp16))
    assert (fp32.loss_scaling, bf16.loss_scaling, fp16.loss_scaling) == (False, False, True)
    assert fp32.make_scaler() is None and bf16.make_scaler() is None
    assert isinstance(fp16.make_scaler(init_scale=4.0), DynamicLossScaler)
    lin = torch.nn.Linear(4, 4)
    for policy, expected in ((fp32, torch.float32), (bf16, torch.bfloat16), (fp16, torch.float16)):
        with policy.autocast("cpu"):
            assert lin(torch.randn(2, 4)).dtype == expected
    master = MixedPrecisionPolicy.from_name("bf16", master_weights=True, reduce_dtype="bf16")
    assert master.param_dtype == master.reduce_dtype == torch.bfloat16 and master.master_weights
    assert MixedPrecisionPolicy.from_name("fp8") == bf16  # fp8: bf16 autocast, the fp8 GEMMs in the linears
    with pytest.raises(ValueError, match="unknown precision"):
        MixedPrecisionPolicy.from_name("fp4")
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.float16, compute_dtype=torch.bfloat16)


def test_fp16_step_skips_on_nan_and_leaves_everything_unchanged():
    model = torch.nn.Linear(3, 2)
    mp = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), model, device="cpu", init_scale=2.0**8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(4, 3)).float().sum()
    mp.backward(loss)
    model.bias.grad[0] = float("nan")
    assert mp.step(opt, grad_clip=1.0) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert mp.scale == 2.0**7 and opt.state == {}  # backed off; AdamW never ran
    opt.zero_grad()
    with mp.autocast():
        loss = model(torch.randn(4, 3)).float().sum()
    mp.backward(loss)
    assert mp.step(opt, grad_clip=1.0) is True
    assert not torch.equal(before[0], model.weight)
    state = mp.state_dict()
    assert state["policy"] == "fp16" and state["scaler"]["num_skipped"] == 1
    fresh = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), torch.nn.Linear(3, 2), device="cpu")
    fresh.load_state_dict(state)
    assert fresh.scale == mp.scale == 2.0**7 and fresh.scaler.state_dict() == state["scaler"]
    bf16 = MixedPrecision.from_name("bf16", torch.nn.Linear(3, 2), device="cpu")
    assert bf16.scaler is None and bf16.scale == 1.0 and bf16.state_dict()["scaler"] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_weights_are_the_original_fp32_weights_bit_for_bit(dtype):
    torch.manual_seed(0)
    model = GPT(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, max_seq_len=16))
    with torch.no_grad():  # biases 0 and LayerNorm weights 1 are exact in 16 bits: random values everywhere
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + 1.0 / 3.0)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    inexact = [n for n, w in original.items() if not torch.equal(w.to(dtype).float(), w)]
    assert len(inexact) == len(original), f"weights exact in {dtype} would hide a cast before the copy"
    mw = MasterWeights(model, dtype)
    for name, master in mw.master.named_parameters():
        assert master.dtype == torch.float32 and torch.equal(master, original[name]), name
    for name, p in model.named_parameters():
        assert p.dtype == dtype and torch.equal(p, original[name].to(dtype)), name


def test_master_weights_keep_updates_fp16_weights_would_lose():
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    mw = MasterWeights(model, torch.float16)
    assert model.weight.dtype == torch.float16 and mw.master.weight.dtype == torch.float32
    opt = torch.optim.SGD(mw.master.parameters(), lr=1e-4)
    for _ in range(10):  # each update is 1e-4, under half of fp16's spacing at 1.0 (2^-10 ~ 9.8e-4)
        model.weight.grad = torch.ones_like(model.weight)
        mw.copy_grads_to_master()
        assert model.weight.grad is None and mw.master.weight.grad.dtype == torch.float32
        opt.step()
        mw.copy_master_to_model()
        naive = torch.ones(1, dtype=torch.float16) - torch.tensor(1e-4, dtype=torch.float16)
        assert naive.item() == 1.0  # the same update applied to the fp16 weight vanishes
    assert mw.master.weight[0, 0].item() == pytest.approx(1 - 1e-3, abs=1e-6)
    assert model.weight[0, 0].item() == torch.tensor(1 - 1e-3).half().item() != 1.0


def test_master_weights_training_keeps_tied_weights_tied():
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, max_seq_len=16)
    model = GPT(config)
    mp = MixedPrecision(MixedPrecisionPolicy.from_name("bf16", master_weights=True), model, device="cpu")
    master = mp.optimizer_module
    assert master.output_layer.weight is master.embedding.word_embeddings.weight
    assert model.output_layer.weight is model.embedding.word_embeddings.weight
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 16))
    losses = []
    for _ in range(5):
        loss = lm_loss(model(x), x)
        mp.backward(loss)
        assert mp.step(opt, grad_clip=1.0)
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for m, p in mp.master.pairs():
        assert torch.equal(p, m.to(torch.bfloat16))


# -------------------------------------------------------------------------------------------------------
# Two ranks: overflow agreement, low-precision reduction, the DDP hook


def _two_rank_worker(ctx) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from refimpl import precision
    from refimpl.comm import CommTracer, ops
    from refimpl.parallel.data_parallel import (
        ddp_comm_hook,
        fp32_accumulating_comm_hook,
        low_precision_all_reduce_,
        reduce_gradients_,
    )

    out: dict = {}
    rank = ctx.rank
    # 0. the gradient reduction lives in data parallelism's comm module only: no shim in refimpl.precision
    out["one home for the reduction"] = not any(
        hasattr(precision, f.__name__)
        for f in (low_precision_all_reduce_, reduce_gradients_, ddp_comm_hook, fp32_accumulating_comm_hook))
    # 1. A gradient that overflows on rank 1 only. Agreed: both skip. Not agreed: only rank 1 does.
    for agree in (True, False):
        scaler = DynamicLossScaler(init_scale=2.0**8, agree_across_ranks=agree)
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        if rank == 1:
            p.grad[2] = float("inf")
        out[f"found_inf agree={agree}"] = scaler.unscale_([p])
        scaler.update()
        out[f"scale agree={agree}"] = scaler.get_scale()

    # 2. low_precision_all_reduce_: round(sum_r round(x_r / n)), the sum in fp32, rounded once; half the bytes
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1001, generator=g) * 1e-3 for _ in range(ctx.world_size)]
    mine = xs[rank].clone()
    with CommTracer() as tracer:
        low_precision_all_reduce_(mine, comm_dtype=torch.bfloat16)
    expected = torch.stack([(x / ctx.world_size).bfloat16().float() for x in xs]).sum(0).bfloat16().float()
    out["lp exact"] = torch.equal(mine, expected)
    # two bf16 roundings (u = 2^-8), of the inputs and of the mean: |error| <= 2u(1 + u) mean_r |x_r|
    bound = 2**-7 * (1 + 2**-7) * torch.stack(xs).abs().mean(0)
    out["lp error within two roundings"] = bool(((mine - sum(xs) / ctx.world_size).abs() <= bound).all())
    out["lp ran"] = [(e.op, e.nbytes) for e in tracer.select()]
    with CommTracer() as tracer:
        ops.all_reduce(xs[rank].clone())
    out["fp32 ran"] = [(e.op, e.nbytes) for e in tracer.select()]

    # 3. DDP with our hook == reduce_gradients_ with a bf16 policy == the formula, per element
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, max_seq_len=16)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    model = GPT(config)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    ddp.register_comm_hook(state=None, hook=ddp_comm_hook(torch.bfloat16))
    lm_loss(ddp(x), x).backward()
    manual = GPT(config)
    lm_loss(manual(x), x).backward()
    reduce_gradients_(manual.parameters(), MixedPrecisionPolicy.from_name("fp32", reduce_dtype="bf16"))
    out["ddp hook == reduce_gradients_"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), manual.parameters(), strict=True))
    # ... and chapter 03's DataParallelBucket with our hook (it divides by 2 first, exactly; the hook sums)
    from refimpl.parallel.data_parallel import DataParallelBucket

    bucketed = DataParallelBucket(GPT(config), bucket_cap_mb=0.01,
                                  comm_hook=fp32_accumulating_comm_hook(torch.bfloat16))
    lm_loss(bucketed(x), x).backward()
    bucketed.finish_gradient_synchronization()
    out["bucket hook == reduce_gradients_"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(bucketed.module.parameters(), manual.parameters(),
                                                    strict=True))

    # 4. fp16 data parallelism where, as under ZeRO, rank r owns and checks parameters r, r + 2, ...; a NaN
    #    appears on rank 1 only (after the gradient all-reduce) at step 2: both ranks skip that step
    model = GPT(config)
    mp = MixedPrecision(MixedPrecisionPolicy.from_name("fp16"), model, device=ctx.device)
    params = list(model.parameters())
    owner = [i % ctx.world_size for i in range(len(params))]
    owned = [p for p, o in zip(params, owner, strict=True) if o == rank]
    opt = torch.optim.AdamW(owned, lr=1e-2)
    stepped, snapshots = [], []
    for step in range(4):
        with mp.autocast():
            loss = lm_loss(model(x), x)
        mp.backward(loss)
        reduce_gradients_(params, mp.policy)
        if rank == 1 and step == 2:
            owned[0].grad.view(-1)[0] = float("nan")
        stepped.append(mp.step(opt, params=owned))
        opt.zero_grad()
        for p, o in zip(params, owner, strict=True):  # each owner sends its updated parameters
            dist.broadcast(p.data, src=o)
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in params]))
    out["skipped step changed nothing"] = torch.equal(snapshots[2], snapshots[1])
    out["stepped"] = stepped
    out["scale"] = mp.scale
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    other = flat.clone()
    dist.broadcast(other, src=0)
    out["weights equal rank 0"] = torch.equal(flat, other)
    return out


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_two_ranks_agree_on_overflow_and_reduce_in_low_precision():
    r0, r1 = run_ranks(_two_rank_worker, 2, timeout_s=SPAWN_TIMEOUT_S)
    assert r0["found_inf agree=True"] and r1["found_inf agree=True"]
    assert r0["scale agree=True"] == r1["scale agree=True"] == 2.0**7
    # negative control: without the all-reduce of the flag the ranks part ways
    assert (r0["found_inf agree=False"], r1["found_inf agree=False"]) == (False, True)
    assert r0["scale agree=False"] != r1["scale agree=False"]

    assert r0["one home for the reduction"] and r1["one home for the reduction"]
    assert r0["lp exact"] and r1["lp exact"]
    assert r0["lp error within two roundings"] and r1["lp error within two roundings"]
    # measured payloads (the tensors handed to the ops): 1001 elements padded to 2 chunks of 501
    assert r0["fp32 ran"] == r1["fp32 ran"] == [("all_reduce", 4 * 1001)]
    assert r0["lp ran"] == r1["lp ran"] == [("all_to_all", 2 * 1002), ("all_gather", 2 * 1002)]

    assert r0["ddp hook == reduce_gradients_"] and r1["ddp hook == reduce_gradients_"]
    assert r0["bucket hook == reduce_gradients_"] and r1["bucket hook == reduce_gradients_"]

    assert r0["stepped"] == r1["stepped"] == [True, True, False, True]
    assert r0["scale"] == r1["scale"] == 2.0**15
    assert r0["weights equal rank 0"] and r1["weights equal rank 0"]
    assert r0["skipped step changed nothing"] and r1["skipped step changed nothing"]
