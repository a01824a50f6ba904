"""``parallelize`` on a model that is not refimpl's (chapter 12, "bring your own model"): the trainer's one
entry point takes any model that declares its plans, not only the course GPT.

``DeclaredLM`` is a user's own transformer (its own names: ``tok``, ``blocks``, ``attn.q/k/v/out``,
``ffn.up/down``, ``norm1/norm2``, an untied ``lm_head``; RMSNorm, RoPE, GELU MLP) that DECLARES, as methods
of its class, what each technique reads (``refimpl.parallel.declarations``): ``tensor_parallel_plan``,
``shard_units``, ``pipeline_stages`` and ``context_parallel_modules`` (its attention's ``core_attention`` and
its RoPE module's ``position_ids``). One 4-rank spawn runs it through ``parallelize`` +
``Parallelized.build_optimizer`` + the trainer's step (refimpl/train/step.py: the forward and
``Parallelized.loss`` per micro-batch, or ``pipeline.step``; the wrapper's gradient synchronisation;
``finish_gradients``; the mixed-precision driver's checked step with the optimizer setup's clipping) at:

1. ``dp 2 x tp 2``, sequence parallelism, ZeRO-1 (the plan's styles with ``sequence_parallel=True``,
   ``SequenceParallel()`` on the norms);
2. ``dp 4``, ZeRO-3, activation checkpointing of every block (and ZeRO-3 without it, beside);
3. ``pp 2 x dp 2``, 1F1B over 2 micro-batches, ZeRO-0 (the user's ``pipeline_stages``);
4. ``cp 2 x dp 2``, ring attention (zig-zag), ZeRO-0 (RoPE at the tokens' global positions).

**What is compared.** The gradients the optimizer receives, read as the trainer's gradient probe reads them
(``refimpl.train.gradients.gradient_shards``: ``parameter_shards(state_module)``, and under ZeRO-1/2 the
optimizer's ``local_state_shards()``) in the mixed-precision driver's ``after_unscale``, assembled to whole
tensors from every rank's boxes; the global gradient norm the optimizer setup's placements give
(``refimpl.parallel.placements.clip_grad_norm_`` over ``held_gradients()``); and the loss (the mean of
the ``dp x cp`` ranks' losses), against one device running the global batch at once.

**Tolerances** (the numerics rule). None of the four layouts does one device's arithmetic (TP multiplies by
blocks and reduces partial sums, the data-parallel average adds 2 or 4 ranks' gradients in gloo's order,
the pipeline's micro-batches are summed in another order, ring attention merges blocks by their
log-sum-exp): the loss, each gradient tensor and the norm must lie within ``FACTOR = 4`` x the one-device
float32 run's distance from the float64 run of the same model and batch, measured in this module, per
tensor (element-wise max), with a floor of 1 ulp (float32) of the tensor's largest element
(tests/ranks/test_bring_your_own_model.py's rule and reasoning: 2x for the two runs' own distances from exact
arithmetic, 2x for the layout's roundings). Bitwise where the arithmetic is the same: every rank that holds
the same elements of a gradient (replicas over ``dp``/``tp``/``cp``) holds the same bits, and ZeRO-3 with
activation checkpointing gives the bits of ZeRO-3 without it.

Measured (2 cores, AVX2 / ``ATEN_CPU_CAPABILITY=default``), the worst ratio to the tolerance over the
loss, the norm and every gradient on every rank: dp2 x tp2 SP ZeRO-1 0.43 (``blocks.1.ffn.up.bias``) /
0.34; dp4 ZeRO-3 + checkpointing 0.25 (the loss, 1 ulp off against the 4-ulp floor) / 0.25; pp2 x dp2 1F1B
0.25 (the loss) / 0.27 (``blocks.1.attn.v.weight``); cp2 x dp2 ring 0.36 (``blocks.0.norm2.weight``) /
0.38 (``blocks.1.attn.k.weight``).

**Negative controls**: the sequence-parallel layout with a plan that leaves ``SequenceParallel()`` off
``blocks.*.norm1``: each tp rank's norm1 gradient is then the partial sum over its ``s/t`` tokens, never
summed over tp (the placements do not know it): the tp ranks disagree on it and it misses the tolerance by
2e5-4e5 x, while every other tensor still meets it. And context parallelism with the RoPE module left out
of ``context_parallel_modules()``: each cp rank rotates its zig-zag chunks by local positions; the loss
misses its tolerance by about 1e3 x, the gradients by up to 8e5 x.

The pipeline stage defines ``full_names()`` besides the documented ``full_name(name)``:
``PipelineModule.named_parameters_full`` (which ``parallelize`` and ``build_optimizer`` call) reads it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.config import OptimConfig
from refimpl.distributed import ParallelDims
from refimpl.launch import run_ranks
from refimpl.parallel.activation_checkpoint import checkpointed_blocks
from refimpl.parallel.declarations import ContextParallelModules
from refimpl.parallel.parallelize import parallelize
from refimpl.parallel.placements import clip_grad_norm_
from refimpl.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, VocabParallel
from refimpl.train.gradients import gradient_shards
from tests.ranks.test_bring_your_own_model import user_pipeline_stages
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0  # x the one-device float32-vs-float64 distance (module docstring)
VOCAB, HIDDEN, HEADS, LAYERS, FFN = 64, 32, 4, 2, 64
BATCH, SEQ = 4, 8  # the global batch; ring attention cuts a sequence into 2 cp = 4 chunks
WORLD = 4
OPTIM = OptimConfig(grad_clip=1.0)  # clipping on: the optimizer setup's sharded norm runs in the step


# -- the user's model: its own names, and its declarations -------------------------------------------------

class Rotary(nn.Module):
    """RoPE (rotate-half form) over ``[b, heads, s, d]``; ``position_ids(seq_len, device)`` gives the
    positions of the tokens attention sees (context parallelism replaces it on the instance)."""

    def __init__(self, base: float = 10000.0) -> None:
        super().__init__()
        self.base = base

    def position_ids(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.arange(seq_len, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        inv = self.base ** -(torch.arange(half, dtype=x.dtype, device=x.device) / half)
        angle = positions.to(x.dtype)[:, None] * inv  # [s, d/2]
        cos, sin = angle.cos(), angle.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal self-attention, separate q, k, v projections; the heads inferred from the projections' width
    and the sequence from their output (a tensor-parallel rank's ``heads / t`` heads, a sequence-parallel
    rank's gathered sequence)."""

    def __init__(self, dim: int, heads: int, rope: Rotary) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.rope = rope  # shared by every block

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x) for proj in (self.q, self.k, self.v))
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        positions = self.rope.position_ids(s, x.device)
        y = self.core_attention(self.rope(q, positions), self.rope(k, positions), v)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, rope: Rotary) -> None:
        super().__init__()
        # eps fixed: RMSNorm's default is the dtype's epsilon, which would make float64 another model
        self.norm1, self.attn = nn.RMSNorm(dim, eps=1e-6), Attention(dim, heads, rope)
        self.norm2, self.ffn = nn.RMSNorm(dim, eps=1e-6), FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class DeclaredLM(nn.Module):
    """The user's transformer and the four declarations ``parallelize`` reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.rope = Rotary()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN, HEADS, FFN, self.rope) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def tensor_parallel_plan(self, *, tp_size: int, sequence_parallel: bool, pad_vocab: bool) -> dict:
        for what, size in (("heads", HEADS), ("MLP width", FFN), ("vocabulary", VOCAB)):
            if size % tp_size:  # pad_vocab: an untied head cannot pad, so it changes nothing here
                raise ValueError(f"DeclaredLM: {what} {size} does not divide by tp {tp_size}")
        sp = sequence_parallel and tp_size > 1
        plan: dict = {"tok": VocabParallel(sequence_parallel=sp)}
        plan |= {f"blocks.*.attn.{p}": ColwiseParallel(sequence_parallel=sp) for p in ("q", "k", "v")}
        plan |= {"blocks.*.attn.out": RowwiseParallel(sequence_parallel=sp),
                 "blocks.*.ffn.up": ColwiseParallel(sequence_parallel=sp),
                 "blocks.*.ffn.down": RowwiseParallel(sequence_parallel=sp),
                 "lm_head": ColwiseParallel(sequence_parallel=sp)}  # the logits shard [b, s, V/t]
        if sp:  # replicated, run on s/t tokens: their gradients summed over tp
            plan |= {name: SequenceParallel() for name in ("blocks.*.norm1", "blocks.*.norm2", "norm")}
        return plan

    def shard_units(self) -> tuple[type[nn.Module], ...]:
        return (Block,)

    def pipeline_stages(self, *, pp_rank: int, pp_size: int, virtual_stages: int,
                        balance: str) -> dict[int, nn.Module]:
        """The user's stages of tests/ranks/test_bring_your_own_model.py (the same attribute names)."""
        return user_pipeline_stages(self, pp_rank=pp_rank, pp_size=pp_size, virtual_stages=virtual_stages,
                                    balance=balance)

    def context_parallel_modules(self) -> ContextParallelModules:
        return ContextParallelModules(attention=[b.attn for b in self.blocks], positions=[self.rope])


class NoSequenceParallelNorm1(DeclaredLM):
    """The negative control: the plan forgets ``SequenceParallel()`` on ``blocks.*.norm1``."""

    def tensor_parallel_plan(self, **kwargs: object) -> dict:
        plan = super().tensor_parallel_plan(**kwargs)
        del plan["blocks.*.norm1"]
        return plan


class NoPositions(DeclaredLM):
    """The second negative control: context parallelism without the RoPE module declared, so each cp rank
    rotates its tokens by their local positions ``[0, s/cp)``."""

    def context_parallel_modules(self) -> ContextParallelModules:
        return ContextParallelModules(attention=[b.attn for b in self.blocks])


# -- the layouts ---------------------------------------------------------------------------------------------

LAYOUTS = {  # name -> (degrees, technique options, model class)
    "dp2-tp2-sp-zero1": (dict(dp=2, tp=2), dict(sequence_parallel=True, zero_stage=1), DeclaredLM),
    "dp4-zero3-ac": (dict(dp=4), dict(zero_stage=3, activation_checkpointing="all"), DeclaredLM),
    "pp2-dp2-1f1b-zero0": (dict(dp=2, pp=2), dict(pp_schedule="1f1b", microbatches=2), DeclaredLM),
    "cp2-dp2-ring-zero0": (dict(dp=2, cp=2), dict(cp_method="ring"), DeclaredLM),
}
EXTRA = {  # beside the layouts: the bitwise partner of checkpointing, and the negative control
    "dp4-zero3": (dict(dp=4), dict(zero_stage=3), DeclaredLM),
    "control-no-sp-norm1": (dict(dp=2, tp=2), dict(sequence_parallel=True, zero_stage=1),
                            NoSequenceParallelNorm1),
    "control-cp-local-positions": (dict(dp=2, cp=2), dict(cp_method="ring"), NoPositions),
}
APPLIED = {
    "dp2-tp2-sp-zero1": ["tensor parallel", "data parallel"],
    "dp4-zero3-ac": ["activation checkpointing", "data parallel"],
    "pp2-dp2-1f1b-zero0": ["pipeline split", "data parallel"],
    "cp2-dp2-ring-zero0": ["context parallel", "data parallel"],
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _step(ctx, degrees: dict, options: dict, model_cls: type[DeclaredLM]) -> dict:
    """One training step of ``model_cls`` under the layout, as refimpl/train/step.py runs it; what the
    optimizer received (after the step's reductions and unscaling, before clipping)."""
    dims = ParallelDims(**degrees)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    model = model_cls()
    par = parallelize(model, groups, dims.config(**options))
    opt = par.build_optimizer(OPTIM)
    ids, labels = (t.chunk(dims.dp)[groups.coords.dp] for t in _batch())  # this dp rank's sequences
    ids, labels = par.split_batch(ids), par.split_batch(labels)  # cp: this rank's part of the sequence
    mp = par.mp
    if par.pipeline is not None:
        m = options["microbatches"]
        with mp.autocast():
            loss = par.pipeline.step(ids, labels, num_microbatches=m,
                                     loss_fn=lambda logits, y: par.loss(logits, y) / m,
                                     scale_loss=None if mp.scaler is None else mp.scaler.scale)
    else:
        with mp.autocast():
            logits = par.forward(ids)
        loss = par.loss(logits, labels)
        mp.backward(loss)
        loss = loss.detach()
    if par.sync is not None:
        par.sync.finish_gradient_synchronization()
    opt.finish_gradients()
    seen: dict = {}

    def probe() -> None:  # the trainer's gradient probe (refimpl.train.gradients), copied before clipping
        held = gradient_shards(SimpleNamespace(state_module=par.state_module, optimizer=opt.optimizer))
        seen["grads"] = [(n, s.box.offsets, s.box.global_shape, s.tensor.detach().clone().numpy())
                         for n, s in sorted(held.items())]
        if opt.clip_fn is not None:  # the norm the step clips by: the placements', each element once
            norm = clip_grad_norm_(opt.held_gradients(), math.inf, groups=par.groups(), device=ids.device)
        else:  # nothing sharded: MixedPrecision.step clips by torch's norm of the parameters' gradients
            norm = torch.nn.utils.get_total_norm([p.grad for p in opt.grad_params if p.grad is not None])
        seen["norm"] = float(norm)  # max_norm inf: the gradients x 1, unchanged

    opt.step(mp, grad_clip=OPTIM.grad_clip, after_unscale=probe)  # unscale, clip, AdamW, zero_grad
    mean = loss.detach().clone()
    if par.group is not None:  # the dp x cp ranks' equal shares of the global batch
        dist.all_reduce(mean, group=par.group)
        mean /= dist.get_world_size(par.group)
    seen["loss"] = mean.item()
    seen["applied"] = list(par.applied)
    seen["checkpointed"] = checkpointed_blocks(model, (Block,))  # the user's blocks, wherever they run
    core = model.blocks[0].attn.core_attention  # context parallelism: functools.partial(ring_attention)
    seen["core_attention"] = getattr(getattr(core, "func", core), "__name__", "")
    return seen


def _worker(ctx) -> dict:
    return {name: _step(ctx, *spec) for name, spec in {**LAYOUTS, **EXTRA}.items()}


# -- the references and the checks (this process) -------------------------------------------------------

def _one_device(dtype: torch.dtype) -> dict:
    model = DeclaredLM().to(dtype)
    ids, labels = _batch()
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad.detach().numpy().astype(np.float64) for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
    return {"loss": loss.item(), "grads": grads, "norm": norm}


def _assemble(ranks: list[dict], layout: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Whole gradients from every rank's boxes (written in reverse rank order: where boxes overlap, the
    lowest rank's bits), and the tensors whose overlapping boxes differ in any bit (replicas that disagree).
    A tensor some element of which no rank holds is an assertion error."""
    whole: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    disagree: set[str] = set()
    for out in reversed(ranks):
        for name, offsets, global_shape, grad in out[layout]["grads"]:
            if name not in whole:
                whole[name] = np.zeros(global_shape, dtype=np.float64)
                covered[name] = np.zeros(global_shape, dtype=bool)
            where = tuple(slice(o, o + n) for o, n in zip(offsets, grad.shape, strict=True))
            held = covered[name][where]
            if (whole[name][where][held] != grad[held]).any():
                disagree.add(name)
            whole[name][where], covered[name][where] = grad, True
    missing = sorted(n for n, c in covered.items() if not c.all())
    assert not missing, f"{layout}: no rank holds some elements of {missing}"
    return whole, sorted(disagree)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference()


def _reference() -> dict:
    """One device, the global batch at once, in float32 and float64, and the tolerances of the docstring."""
    one32, one64 = _one_device(torch.float32), _one_device(torch.float64)

    def tol(a: float | np.ndarray, b: float | np.ndarray) -> float:
        ulp = float(np.spacing(np.float32(np.abs(b).max())))
        return FACTOR * max(float(np.abs(np.asarray(a, dtype=np.float64) - b).max()), ulp)

    spread = {n: float(np.abs(g - one64["grads"][n]).max()) for n, g in one32["grads"].items()}
    assert all(0 < s < 1e-5 for s in spread.values()), spread  # float32 rounding: not zero, not a bug
    return {"one": one32, "loss_tol": tol(one32["loss"], one64["loss"]),
            "norm_tol": tol(one32["norm"], one64["norm"]),
            "grad_tol": {n: tol(g, one64["grads"][n]) for n, g in one32["grads"].items()}}


def _ratios(whole: dict[str, np.ndarray], loss: float, norm: float, ref: dict) -> dict[str, float]:
    """``|run - one device| / tolerance`` for the loss, the norm and every gradient tensor."""
    one = ref["one"]
    assert sorted(whole) == sorted(one["grads"]), sorted(set(whole) ^ set(one["grads"]))
    out = {"loss": abs(loss - one["loss"]) / ref["loss_tol"],
           "norm": abs(norm - one["norm"]) / ref["norm_tol"]}
    out |= {n: float(np.abs(whole[n] - one["grads"][n]).max()) / t for n, t in ref["grad_tol"].items()}
    return out


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_parallelize_applies_each_technique_to_the_users_model(runs):
    """Each layout applied what its config asks, through the model's declarations: the steps of ORDER,
    every block checkpointed under "all", ring attention in the declared attention modules."""
    for out in runs:
        for layout, applied in APPLIED.items():
            assert out[layout]["applied"] == applied, (layout, out[layout]["applied"])
        assert out["dp4-zero3-ac"]["checkpointed"] == list(range(LAYERS))
        assert out["dp4-zero3"]["checkpointed"] == []
        assert out["cp2-dp2-ring-zero0"]["core_attention"] == "ring_attention"
        assert out["dp4-zero3"]["core_attention"] == "core_attention"  # the user's own, elsewhere


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_step_under_parallelize_equals_one_device(runs, reference, layout):
    """The loss, the gradient norm and every gradient the optimizer receives, whole, within ``FACTOR`` x
    the one-device float32-vs-float64 distance of one device's; the ranks that hold the same elements of a
    gradient hold the same bits; every rank computes the same loss and norm."""
    whole, disagree = _assemble(runs, layout)
    assert disagree == [], f"{layout}: replicas hold different gradients of {disagree}"
    assert len({out[layout]["loss"] for out in runs}) == 1, [out[layout]["loss"] for out in runs]
    for rank, out in enumerate(runs):
        ratios = _ratios(whole, out[layout]["loss"], out[layout]["norm"], reference)
        worst = max(ratios, key=ratios.get)
        assert ratios[worst] <= 1, f"{layout} rank {rank}: {worst} off one device by {ratios[worst]:.2f} x"


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_activation_checkpointing_under_zero3_is_bitwise(runs):
    """ZeRO-3 with every block checkpointed gives the loss and the gradients' bits of ZeRO-3 without: the
    recomputation repeats the same kernels on the same inputs (the gathers included)."""
    for out in runs:
        ac, plain = out["dp4-zero3-ac"], out["dp4-zero3"]
        assert ac["loss"] == plain["loss"]
        assert [(n, o) for n, o, _, _ in ac["grads"]] == [(n, o) for n, o, _, _ in plain["grads"]]
        assert all(np.array_equal(a[3], b[3]) for a, b in zip(ac["grads"], plain["grads"], strict=True))


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_a_plan_without_sequence_parallel_on_a_norm_fails(runs, reference):
    """Negative control: ``SequenceParallel()`` left off ``blocks.*.norm1`` under sequence parallelism.
    Each tp rank's norm1 gradient is the partial sum over its ``s/t`` tokens: the tp ranks disagree on it,
    and tp rank 0's misses the tolerance by orders of magnitude; every other tensor still meets it."""
    whole, disagree = _assemble(runs, "control-no-sp-norm1")
    norm1 = [f"blocks.{i}.norm1.weight" for i in range(LAYERS)]
    assert disagree == norm1, disagree
    ratios = _ratios(whole, runs[0]["control-no-sp-norm1"]["loss"], 0.0, reference)
    for name in norm1:
        assert ratios[name] > 1e3, (name, ratios[name])
    assert max(r for n, r in ratios.items() if n not in (*norm1, "norm")) <= 1, ratios


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)
def test_context_parallel_without_the_declared_positions_fails(runs, reference):
    """Negative control: ``context_parallel_modules()`` without the RoPE module. Ring attention still
    runs, but each cp rank rotates its zig-zag chunks as if they started the sequence: the loss and the
    gradients miss the tolerance by orders of magnitude."""
    whole, _ = _assemble(runs, "control-cp-local-positions")
    out = runs[0]["control-cp-local-positions"]
    ratios = _ratios(whole, out["loss"], out["norm"], reference)
    assert ratios["loss"] > 100, ratios["loss"]
    assert max(ratios.values()) > 1e4, max(ratios.values())
