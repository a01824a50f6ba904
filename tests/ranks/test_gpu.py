"""What only CUDA and NCCL show; marked ``gpu``: deselected unless ``REFIMPL_TEST_GPU=1`` and
CUDA is there (tests/conftest.py). Run on a GPU box::

    REFIMPL_TEST_GPU=1 .venv/bin/python -m pytest -q -m gpu tests/ranks/test_gpu.py

* ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM) at the trainer's linear shapes, in the layouts and scales
  ``refimpl.precision.fp8.scaled_mm`` passes (``a`` row-major, ``b`` column-major, fp32 scales 0-d or
  ``[M, 1]`` / ``[1, N]``), tensorwise and rowwise, and a ``refimpl.precision.fp8.Float8Linear``'s
  three GEMMs forward and backward (tokens not a multiple of 16: the padded weight gradient) against the
  same function on the CPU, whose kernel is the exact fp32 product of the dequantized operands;
* ``torch._grouped_mm`` (``refimpl.parallel.expert_parallel.experts.GroupedExperts``) at the MoE
  trainer's shapes, uneven and empty experts, forward and backward, against the per-expert loop;
* the trainer at world size = the visible GPUs under NCCL (``run_ranks(..., backend="nccl")``: rank r on
  ``cuda:r``) for dp, tp, pp, cp and ep, whose losses and first-step gradients (before clipping and AdamW)
  equal a one-device run on ``cuda:0`` within the numerics rule (tests/support/one_device.py: ``FACTOR x`` the
  spread of two one-device summation orders, measured here, on the GPU), gradients x 2 failing; every step's
  record holds that step's GPU peaks (``peak_memory_bytes <= peak_reserved_bytes``).

Tolerance of the fp8 GEMMs (not a loss comparison, so not the order spread: both sides multiply the same
fp8 numbers): Higham's bound for a dot product of ``k`` terms, ``|computed - exact| <= k u sum|a_i b_i|``,
with the accumulator's unit roundoff ``u = 2^-14``: DeepSeek-V3 (section 3.3.2) found that Hopper's fp8
tensor cores keep about 14 bits while accumulating; ``k`` is the whole contraction, as if the partial sum
were never promoted to fp32 (``use_fast_accum=True``; without it cuBLAS promotes now and then, which only
lowers the error); plus one ulp of the output dtype (``2^-8`` relative in bf16). A planted factor 2 exceeds
it (the negative control below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from refimpl.launch import run_ranks
from refimpl.measure import order_tolerance
from refimpl.train import build_parser, config_from_args, options_from_args, train
from tests.support import timeouts
from tests.support.one_device import (
    assert_gradients_like_one_device,
    assert_trains_like_one_device,
    first_step_gradients,
)

pytestmark = pytest.mark.gpu

# the one spawn timeout x 3: NCCL's start and CUDA's kernels compiled in every rank; it was 600 s
SPAWN_TIMEOUT_S = 3 * timeouts.SPAWN_TIMEOUT_S
FACTOR = 4.0
STEPS = 4
ACCUMULATOR_U = 2.0**-14  # DeepSeek-V3 3.3.2: Hopper's fp8 MMA keeps about 14 bits while accumulating
# The trainer's default model: hidden 128, MLP 512, fused qkv 384 (the first and last linear stay bf16);
# tokens per forward: 16 sequences x 128 on one rank. (M, K, N) of y = x W^T for each fp8 linear.
LINEAR_SHAPES = [(2048, 128, 384), (2048, 128, 128), (2048, 128, 512), (2048, 512, 128)]


def _world() -> int:
    return torch.cuda.device_count()


def _need_fp8() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"fp8 needs compute capability 8.9, this GPU is {torch.cuda.get_device_capability()}")


# ---------------------------------------------------------------- torch._scaled_mm

def _gemm_bound(abs_product: torch.Tensor, k: int) -> torch.Tensor:
    """The module docstring's bound, elementwise: ``(k u + 2^-8) sum|a b|`` (``abs_product``: float64)."""
    return (k * ACCUMULATOR_U + 2.0**-8) * abs_product.double()


def _operands(m: int, k: int, n: int, scaling: str, device: torch.device):
    from refimpl.precision.fp8 import E4M3
    from refimpl.precision.fp8.scaling import cast_to_float8

    g = torch.Generator().manual_seed(m + 7 * k + 13 * n)
    x = torch.randn(m, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device)
    a = cast_to_float8(x, E4M3, scaling=scaling, contraction_dim=1)          # [M, K], scale [M, 1] or 0-d
    b = cast_to_float8(w, E4M3, scaling=scaling, contraction_dim=1)          # [N, K], scale [N, 1] or 0-d
    return a, b


def _dequantized(t) -> torch.Tensor:
    return t.data.double() * t.inverse_scale.double()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mkn", LINEAR_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fast_accum", [True, False], ids=["fast-accum", "fp32-promotion"])
def test_scaled_mm_at_the_trainers_shapes(mkn, scaling, fast_accum):
    """``refimpl.precision.fp8.scaled_mm`` on CUDA (the layouts and scales of the module docstring) within
    the bound of the exact product of the same fp8 operands; negative control: the result times 2 is
    not."""
    from refimpl.precision.fp8 import scaled_mm

    _need_fp8()
    m, k, n = mkn
    a, b = _operands(m, k, n, scaling, torch.device("cuda"))
    exact = _dequantized(a) @ _dequantized(b).t()                             # float64 [M, N]
    bound = _gemm_bound(_dequantized(a).abs() @ _dequantized(b).abs().t(), k)
    for out_dtype in (torch.bfloat16, torch.float32):
        y = scaled_mm(a, b.t(), out_dtype=out_dtype, use_fast_accum=fast_accum)
        assert y.shape == (m, n) and y.dtype == out_dtype and y.is_cuda
        over = ((y.double() - exact).abs() - bound).max().item()
        assert over <= 0, f"{mkn} {scaling} -> {out_dtype}: {over:.3e} beyond the bound"
    planted = ((2 * y.double() - exact).abs() - bound).max().item()
    assert planted > 0, "the bound is too loose to see a factor 2"  # the same check must fail


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_forward_and_backward_on_cuda_match_the_cpu(recipe):
    """The three GEMMs of a Float8Linear (2040 tokens: the weight gradient pads to 2048) on CUDA against
    the same call on the CPU (exact fp32 products of the same fp8 bytes), each within the bound."""
    from refimpl.precision.fp8 import Float8Config, float8_linear

    _need_fp8()
    m, k, n = 2040, 128, 512
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    grad = torch.randn(m, n, generator=g) / n**0.5
    config = Float8Config.recipe(recipe)
    results = {}
    for device in ("cpu", "cuda"):
        xd, wd = (t.detach().to(device).requires_grad_() for t in (x, w))  # leaves on each device
        y = float8_linear(xd, wd, config=config)
        y.backward(grad.to(device))
        results[device] = [t.detach().cpu().double() for t in (y, xd.grad, wd.grad)]
    # |x| |W|^T, |g| |W|, |g|^T |x| (float64), widened by the fp8 rounding of the operands (e5m2: 2^-3)
    widen = (1 + 2.0**-3) ** 2
    products = [(x.abs() @ w.abs().t(), k), (grad.abs() @ w.abs(), n), (grad.abs().t() @ x.abs(), m)]
    for name, cpu, cuda, (product, terms) in zip(("y", "dx", "dW"), results["cpu"], results["cuda"], products,
                                                 strict=True):
        bound = _gemm_bound(product.double() * widen, terms)
        over = ((cuda - cpu).abs() - bound).max().item()
        assert over <= 0, f"{recipe} {name}: {over:.3e} beyond the bound"


# ---------------------------------------------------------------- torch._grouped_mm

@pytest.mark.parametrize("mode", ["bf16", "fp32", "fp32-under-bf16-autocast"])
def test_grouped_mm_at_the_moe_trainers_shapes(mode):
    """GroupedExperts (one ``_grouped_mm`` per projection) against its per-expert loop on the same GPU,
    forward and backward: the grouped result's distance to a float64 run within FACTOR x the loop's (the
    numerics rule); uneven counts and an empty expert; bf16 weights, fp32 ones, and fp32 ones under bf16
    autocast (``--precision bf16``: the layer casts for the kernel itself); negative control: experts 0 and
    2 swapped fail."""
    from refimpl.parallel.expert_parallel.experts import GroupedExperts

    dim, hidden, experts = 128, 512, 4  # the trainer's defaults: the MLP width 4 x 128
    counts = [700, 0, 1201, 147]  # 2048 rows routed to 4 experts: uneven, one empty
    x = torch.randn(sum(counts), dim, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(sum(counts), dim, generator=torch.Generator().manual_seed(2))

    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    autocast = mode.endswith("autocast")

    def run(device: str, dtype: torch.dtype, *, loop: bool = False, swap: bool = False) -> list[torch.Tensor]:
        layer = GroupedExperts(dim=dim, hidden=hidden, num_experts=experts,
                               generator=torch.Generator().manual_seed(0), device=device, dtype=dtype)
        if swap:
            with torch.no_grad():
                for w in (layer.w1, layer.w3, layer.w2):
                    w[[0, 2]] = w[[2, 0]].clone()
        xd = x.detach().to(device, dtype).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast and dtype != torch.float64):
            assert loop or layer.uses_grouped_mm(xd), "the grouped path is not taken"
            y = layer.forward_loop(xd, counts) if loop else layer(xd, counts)
        y.backward(grad.to(device, y.dtype))
        return [t.detach().double().cpu() for t in (y, xd.grad, layer.w1.grad, layer.w2.grad)]

    exact = run("cpu", torch.float64, loop=True)
    grouped, loop, swapped = run("cuda", dtype), run("cuda", dtype, loop=True), run("cuda", dtype, swap=True)
    for name, e, gr, lo, sw in zip(("y", "dx", "dw1", "dw2"), exact, grouped, loop, swapped, strict=True):
        spread = float((lo - e).abs().max())
        assert spread > 0, f"{name}: the loop equals float64: no yardstick"
        assert float((gr - e).abs().max()) <= FACTOR * spread, (name, float((gr - e).abs().max()), spread)
        assert float((sw - e).abs().max()) > FACTOR * spread, f"{name}: swapped experts pass"


# ---------------------------------------------------------------- the trainer under NCCL

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--lr", "1e-2",
        "--warmup-steps", "2", "--log-every", "100", "--checkpoint-every", "0", "--steps", str(STEPS)]
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]
# name -> (flags at world size W, the one-device reference); dp = W / (tp x pp x cp) in each
LAYOUTS = {
    "dp": ([], "dense"),
    "tp2": (["--tp", "2"], "dense"),
    "pp2": (["--pp", "2"], "dense"),
    "cp2": (["--cp", "2"], "dense"),
    "ep2": ([*MOE, "--ep", "2"], "moe"),
}
REFERENCES = {"dense": [], "moe": MOE}


def _args(corpus: dict, out: Path, world: int, *flags: str):
    return build_parser().parse_args([*TINY, "--batch-size", str(4 * world), "--data", str(corpus["corpus"]),
                                      "--cache-dir", str(corpus["cache"]), "--out", str(out), *flags])


def _one_device(ctx, corpus: dict, root: str, world: int) -> dict:
    """On ``cuda:0``, one process: per reference the whole batch at once and one sequence per micro-batch
    (the two summation orders), losses and first-step gradients."""
    assert ctx.device == torch.device("cuda", 0), ctx.device
    out = {}
    for ref, flags in REFERENCES.items():
        for order, extra in (("batch", []), ("micro", ["--micro-batch-size", "1"])):
            args = _args(corpus, Path(root) / f"one-{ref}-{order}", world, *flags, *extra)
            grads: dict = {}
            records = train(config_from_args(args), ctx, options_from_args(args),
                            gradient_probe=first_step_gradients(grads))
            out[ref, "fp32", order] = [r["loss"] for r in records]
            out[ref, "grads", "fp32", order] = grads
    return out


def _layouts(ctx, corpus: dict, root: str, world: int) -> dict:
    """Every layout at world size ``world`` under NCCL, this rank on ``cuda:LOCAL_RANK``."""
    where = (ctx.backend, ctx.device)
    assert where == ("nccl", torch.device("cuda", ctx.local_rank)), where
    out = {}
    for name, (flags, _) in LAYOUTS.items():
        grads: dict = {}
        args = _args(corpus, Path(root) / name, world, *flags)
        records = train(config_from_args(args), ctx, options_from_args(args),
                        gradient_probe=first_step_gradients(grads))
        out[name] = [r["loss"] for r in records]
        out[name, "grads"] = grads
        out[name, "memory"] = [(r["peak_memory_bytes"], r["peak_reserved_bytes"]) for r in records]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> dict:
    world = _world()
    if world < 2 or world % 2:
        pytest.skip(f"the layouts need an even number of GPUs >= 2, {world} visible")
    root = tmp_path_factory.mktemp("gpu")
    one = run_ranks(_one_device, 1, corpus, str(root), world, backend="nccl", timeout_s=SPAWN_TIMEOUT_S)[0]
    ranks = run_ranks(_layouts, world, corpus, str(root), world, backend="nccl", timeout_s=SPAWN_TIMEOUT_S)
    return {"one": one, "ranks": ranks, "world": world}


def _reference(one: dict, ref: str) -> dict:
    """tests/support/one_device.py's keys for one reference."""
    return {(p, o): one[ref, p, o] for p, o in (("fp32", "batch"), ("fp32", "micro"))} | {
        ("grads", "fp32", o): one[ref, "grads", "fp32", o] for o in ("batch", "micro")}


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_trainer_under_nccl_trains_like_one_gpu(trained, name):
    ref = _reference(trained["one"], LAYOUTS[name][1])
    order_tolerance(ref, "fp32", factor=FACTOR)  # a yardstick exists: the two orders differ on the GPU
    ranks = trained["ranks"]
    assert_trains_like_one_device([r[name] for r in ranks], ref, "fp32", factor=FACTOR,
                                  name=f"{name} at {trained['world']} GPUs")
    assert_gradients_like_one_device([r[name, "grads"] for r in ranks], ref, "fp32", factor=FACTOR,
                                     name=f"{name} at {trained['world']} GPUs", control=2.0)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_every_steps_record_holds_that_steps_gpu_peaks(trained):
    for rank, out in enumerate(trained["ranks"]):
        for name in LAYOUTS:
            for step, (allocated, reserved) in enumerate(out[name, "memory"]):
                assert isinstance(reserved, int) and 0 < allocated <= reserved, (rank, name, step)


# ---------------------------------------------------------------- host syncs, counted by CUDA itself


def _syncs_per_step(ctx, corpus: dict, root: str) -> list[int]:
    """One GPU, the dp layout: the synchronizing CUDA calls of each step, as CUDA's own sync debug mode
    reports them (``torch.cuda.set_sync_debug_mode("warn")``: a warning per call that waits for the
    device), steps 1 on (step 0 also warms up the allocator and cuBLAS)."""
    import warnings

    from refimpl.train.hooks import TrainHooks

    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # one warning per call, not per place
        hooks = TrainHooks(before_step=lambda step, setup: marks.append(len(caught)))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            args = _args(corpus, Path(root) / "syncs", 1)
            train(config_from_args(args), ctx, options_from_args(args), hooks=hooks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [b - a for a, b in zip(marks[1:], marks[2:], strict=False)]


def test_a_steps_host_syncs_on_a_gpu_are_within_the_device_lints_budget(tmp_path, corpus):
    """The device lint counts, on CPU, the calls that would make the host wait
    (tests/ranks/cli/lane2/test_device_lint.py: at most ``SYNC_BUDGET`` per step for dp); CUDA counts the real
    ones, and they stay within it."""
    from tests.ranks.cli.lane2.test_device_lint import SYNC_BUDGET

    steps = run_ranks(_syncs_per_step, 1, corpus, str(tmp_path), backend="nccl", timeout_s=SPAWN_TIMEOUT_S)[0]
    assert steps and max(steps) <= SYNC_BUDGET, steps
