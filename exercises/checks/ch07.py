"""Checks of chapter 07's exercises (``exercises/07_context_parallel.py``); see exercises/grading.py.

All in one process (the ring is simulated by looping over the blocks each rank would hold):

* ``merge_partial_attention``: the keys of an attention are cut into three blocks of uneven length, each
  block's ``(o, lse)`` computed in float64 (refimpl's ``block_attention``) and rounded to float32, so
  only the merge rounds; merged from the empty partial ``(0, -inf)`` in two different orders and
  associations, the result must be SDPA over all keys (in float64) and ``logsumexp`` of all scores,
  within ``FACTOR`` x the spread measured in the same run (SDPA / ``logsumexp`` in float32 against
  float64 on the same inputs). Cases: ordinary scores, scores of about 300 (``e^lse`` overflows float32)
  and one block far above the others.
* ``zigzag_split``: bit for bit against the chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp`` picked by index
  (not by refimpl), at cp = 1..4, dims 0, 1, 2 and -2; ``ValueError`` for a length that does not divide
  by ``2 cp`` (6 tokens at cp = 2 divides by cp, not by 2 cp).
* ``ring_attention_step``: a ring of cp = 2 and 4 ranks simulated, the contiguous and the zig-zag layouts,
  causal and not, the steps in ring order and reversed: every rank applies the step to each of its query
  chunks and each chunk of the K/V block it holds at that step, with the position (diagonal / past /
  future) from the chunks' global order. The gathered result must be SDPA of the whole sequence
  (``is_causal``) in float64 and its ``logsumexp``, within ``FACTOR`` x the spread; ``q, k, v`` unchanged;
  an unknown position is a ``ValueError``. Also on scores of about ``1e4`` (every score shifted by
  ``HIGH``: the softmax unchanged, ``e^S`` overflows float32 unless each row's maximum is taken out).

The ring forward and backward on real ranks and Ulysses' all-to-alls: ``exercises.checks.ch07_ranks``.

``FACTOR`` covers the worst ratio error / spread measured for refimpl's answers and for the independent
right ones in ``ch07_mutants.CORRECT`` (stated beside it). ``MUTANTS`` holds plausible wrong
implementations, several per task (tests/course/cli/test_exercises.py grades each and expects its task alone
to fail).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# several plausible wrong implementations per task, and an independent right one (not refimpl's)
from exercises.checks.ch07_mutants import (
    CORRECT,
    MERGE,
    MUTANTS,
    RING,
    RING_BACKWARD,
    SPLIT,
    STEP,
    ULYSSES,
)
from exercises.checks.ch07_ranks import check_ring, check_ring_backward, check_ulysses
from exercises.grading import Task, load_module
from refimpl.parallel.context_parallel.ring_attention import block_attention

FACTOR = 8.0  # stated: an answer may be this many times further from float64 than SDPA in float32 is;
# measured worst over 40 seeds, ATEN_CPU_CAPABILITY default and avx2: 3.97 (the ring of CORRECT's
# e^(lse - max) merge), 3.13 (refimpl), the merge alone 2.29: a 2x margin over the worst. The large-score
# step (20 seeds, both capabilities): 2.28. The ranks' ring (ch07_ranks, 20 seeds, default capability):
# forward 2.63, backward 5.15 (CORRECT's dK on scores of 1e4, where Q's component of 1e4 sqrt(d) scales
# dS's rounding), refimpl 2.21: a 1.55x margin over the worst there
B, A, D = 2, 2, 8  # batch, heads, head dim
CHUNK = 3          # tokens per chunk of the simulated ring (odd on purpose)
HIGH = 1e4         # the large-score cases: every score + HIGH (e^S overflows float32 without the max)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5                  # [b, a, s_q, s_k]
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _references(q, k, v, causal: bool) -> dict[str, tuple[torch.Tensor, float]]:
    """Per output: (float64 reference, |float32 - float64| spread) of SDPA and of the rows' logsumexp."""
    out = {}
    for name, fn in (("out", lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal)),
                     ("lse", lambda q_, k_, _v: torch.logsumexp(_scores(q_, k_, causal), dim=-1))):
        r32, r64 = fn(q, k, v), fn(q.double(), k.double(), v.double())
        spread = _err(r32, r64)
        if not spread > 0:  # the grader's own rule would be vacuous
            raise RuntimeError(f"grader: {name} in float32 equals float64; no spread to derive a tolerance")
        out[name] = (r64, spread)
    return out


def _compare(got: tuple, refs: dict, shapes: tuple, where: str, hint: str = "") -> None:
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"{where}: return (out, lse), got {type(got).__name__}")
    for name, value, shape in zip(("out", "lse"), got, shapes, strict=True):
        assert isinstance(value, torch.Tensor) and tuple(value.shape) == shape, (
            f"{where}: {name} has shape {tuple(getattr(value, 'shape', ()))}, want {shape}")
        assert value.dtype == torch.float32, f"{where}: {name} is {value.dtype}, want float32"
        if not torch.isfinite(value).all():
            raise AssertionError(f"{where}: {name} is not finite; e^lse overflows float32 for scores of "
                                 "a few hundred: weigh by e^(lse_i - lse) or subtract the larger lse first")
        want, spread = refs[name]
        err = _err(value, want)
        assert err <= FACTOR * spread, (
            f"{where}: {name} is {err:.3g} from the float64 reference, more than {FACTOR:g} x {spread:.3g} "
            f"(its float32 error measured here){hint}")


# ---- task 1: the merge -------------------------------------------------------------------------------------


def _merge_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, A, n, D, generator=g) for n in (5, 12, 12))
    lopsided = k.clone()
    lopsided[:, :, 9:] *= 40.0  # the last block's scores dwarf the others' (for some rows, not all)
    high_q, high_k = q.clone(), k.clone()
    high_q[..., 0], high_k[..., 0] = 1000.0, 0.85  # every score + 850/sqrt(8) ~ 300.5: e^lse overflows
    return [("ordinary scores", q, k, v), ("scores of about 300", high_q, high_k, v),
            ("one block far above the others", q, lopsided, v)]


def check_merge(path: str) -> None:
    merge = load_module(path).merge_partial_attention
    cuts = [(0, 4), (4, 9), (9, 12)]  # three key blocks of uneven length
    for what, q, k, v in _merge_cases():
        refs = _references(q, k, v, causal=False)
        blocks = [tuple(t.float() for t in block_attention(q.double(), k[:, :, a:b].double(),
                                                           v[:, :, a:b].double(), scale=D ** -0.5,
                                                           diagonal=False))
                  for a, b in cuts]  # each block exact to float32's rounding: only the merge errs
        saved = [(o.clone(), lse.clone()) for o, lse in blocks]
        empty = (torch.zeros_like(blocks[0][0]), torch.full_like(blocks[0][1], float("-inf")))
        shapes = (tuple(q.shape), tuple(q.shape[:3]))
        pair = merge(*blocks[1], *blocks[0])
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], torch.Tensor):
            mean = (blocks[0][0] + blocks[1][0]) / 2
            if pair[0].shape == mean.shape and _err(pair[0], mean) < 1e-5:
                raise AssertionError(f"{what}: the merge of two blocks is the mean of their outputs; weigh "
                                     "each by e^(lse_i - lse), its share of the softmax's denominator")
        state = empty                                              # ((empty + 1) + 2) + 3
        for o, lse in blocks:
            state = merge(*state, o, lse)
        _compare(state, refs, shapes, f"{what}, blocks merged in order from the empty partial")
        right = merge(*blocks[2], *pair)                           # 3 + (2 + 1): another order and grouping
        _compare(right, refs, shapes, f"{what}, blocks merged as 3 + (2 + 1)")
        for (o, lse), (o0, lse0) in zip(blocks, saved, strict=True):
            assert torch.equal(o, o0) and torch.equal(lse, lse0), f"{what}: the merge modified its inputs"


# ---- task 2: the zig-zag split -----------------------------------------------------------------------------


def _want_split(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    c = x.shape[dim] // (2 * cp)
    late = 2 * cp - 1 - rank
    index = [*range(rank * c, (rank + 1) * c), *range(late * c, (late + 1) * c)]
    return x.index_select(dim, torch.tensor(index))


def check_split(path: str) -> None:
    split = load_module(path).zigzag_split
    cases = [((24,), 0, 4), ((2, 12, 3), 1, 2), ((2, 12, 3), 1, 3), ((3, 2, 16, 4), 2, 4),
             ((3, 2, 16, 4), -2, 2), ((2, 6, 5), 1, 1), ((2, 4, 10), -1, 1)]
    for shape, dim, cp in cases:
        x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        before = x.clone()
        for rank in range(cp):
            got = split(x, dim=dim, cp_rank=rank, cp_size=cp)
            want = _want_split(x, dim, rank, cp)
            where = f"x of shape {shape}, dim={dim}, cp_size={cp}, cp_rank={rank}"
            assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
                f"{where}: got shape {tuple(getattr(got, 'shape', ()))}, want {tuple(want.shape)}")
            if not torch.equal(got, want):
                s = x.shape[dim]
                contiguous = x.narrow(dim, rank * s // cp, s // cp)
                hint = (": that is the contiguous split, under a causal mask the last rank does cp times the "
                        "first one's work" if torch.equal(got, contiguous) else "")
                # x is an arange: along dim, with the other indices 0, the value is position * stride
                got_pos, want_pos = ((t.movedim(dim, -1).reshape(-1, t.shape[dim])[0] // x.stride(dim)).long()
                                     .tolist() for t in (got, want))
                raise AssertionError(f"{where}: got the positions {got_pos}, want {want_pos} (chunks {rank} "
                                     f"and {2 * cp - 1 - rank} of {2 * cp}){hint}")
        assert torch.equal(x, before), f"x of shape {shape}: zigzag_split modified its input"
    for length, cp in ((6, 2), (10, 3)):  # 6 divides by cp = 2 but not by 2 cp = 4
        try:
            split(torch.zeros(2, length), dim=1, cp_rank=0, cp_size=cp)
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
            raise AssertionError(f"zigzag_split of {length} tokens at cp_size={cp} raised "
                                 f"{type(exc).__name__}; want ValueError ({length} is not a multiple of "
                                 f"2 cp = {2 * cp})") from None
        raise AssertionError(f"zigzag_split of {length} tokens at cp_size={cp} must raise ValueError: "
                             f"{length} does not cut into 2 cp = {2 * cp} equal chunks")


# ---- task 3: one ring step, the ring simulated -------------------------------------------------------------


def _owned(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """The global chunks a rank holds (chunks of CHUNK tokens in both layouts: contiguous holds two)."""
    if layout == "contiguous":
        return (2 * rank, 2 * rank + 1)
    return (rank, 2 * cp - 1 - rank)


def _position(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or k_chunk < q_chunk:
        return "past"
    return "diagonal" if k_chunk == q_chunk else "future"


def _check_state(state: object, want: list[tuple[int, ...]]) -> None:
    shapes = [tuple(getattr(t, "shape", ())) for t in state] if isinstance(state, tuple) else []
    if shapes != want:
        raise AssertionError(f"ring_attention_step returned {type(state).__name__} of shapes {shapes}; want "
                             f"(out, lse) of shapes {want}, the running state's")


def _simulate(step, q, k, v, *, cp: int, layout: str, causal: bool, reverse: bool):
    """The ring on one process: per rank, the step for every (own query chunk, held key chunk) pair."""
    chunk = lambda t, i: t[:, :, i * CHUNK:(i + 1) * CHUNK]  # noqa: E731 - [b, a, CHUNK, d]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    for rank in range(cp):
        for i in _owned(rank, cp, layout):
            state = (torch.zeros_like(chunk(q, i)), torch.full(q.shape[:2] + (CHUNK,), float("-inf")))
            steps = range(cp)[::-1] if reverse else range(cp)
            for s in steps:                                    # at step s the rank holds rank (r - s)'s block
                for j in _owned((rank - s) % cp, cp, layout):
                    state = step(chunk(q, i), chunk(k, j), chunk(v, j), *state,
                                 position=_position(i, j, causal), scale=D ** -0.5)
                    _check_state(state, [tuple(chunk(q, i).shape), tuple(chunk(lse, i).shape)])
            chunk(out, i).copy_(state[0])
            lse[:, :, i * CHUNK:(i + 1) * CHUNK] = state[1]
    return out, lse


def check_step(path: str) -> None:
    step = load_module(path).ring_attention_step
    g = torch.Generator().manual_seed(11)
    plain_ok: list[str] = []
    for causal, cp, high in ((False, 2, False), (False, 4, False), (True, 2, False), (True, 4, False),
                             (False, 2, True), (True, 4, True)):
        s = 2 * cp * CHUNK
        q, k, v = (torch.randn(B, A, s, D, generator=g) for _ in range(3))
        if high:  # q_0 k_0 / sqrt(D) = HIGH for every pair: the softmax unchanged, e^S overflows float32
            q[..., 0], k[..., 0] = HIGH * D ** 0.5, 1.0
        saved = [t.clone() for t in (q, k, v)]
        refs = _references(q, k, v, causal)
        for layout in ("contiguous", "zigzag"):
            for reverse in (False, True):
                where = (f"{'causal' if causal else 'no mask'}, {layout}, cp = {cp}, steps in "
                         f"{'reverse ' if reverse else ''}ring order"
                         f"{', scores of about 1e4' if high else ''}")
                got = _simulate(step, q, k, v, cp=cp, layout=layout, causal=causal, reverse=reverse)
                hint = "" if not (causal and plain_ok) else (
                    "; the same ring without a mask is right, so look at the mask: on the diagonal "
                    "query t sees keys 0..t, a future block adds nothing")
                _compare(got, refs, (tuple(q.shape), tuple(q.shape[:3])), where, hint)
                if not causal and not high:
                    plain_ok.append(where)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), saved, strict=True)), (
            "ring_attention_step modified q, k or v")
    x = torch.zeros(1, 1, CHUNK, D)
    try:
        step(x, x, x, x, x[..., 0], position="striped", scale=1.0)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"position='striped' raised {type(exc).__name__}; want ValueError") from None
    raise AssertionError("position='striped' must raise ValueError (diagonal, past or future only)")


TASKS = [
    Task(name=MERGE, points=3, check=check_merge),
    Task(name=SPLIT, points=2, check=check_split),
    Task(name=STEP, points=4, check=check_step),
    Task(name=RING, points=4, check=check_ring),
    Task(name=RING_BACKWARD, points=4, check=check_ring_backward),
    Task(name=ULYSSES, points=3, check=check_ulysses),
]

__all__ = ["CORRECT", "MUTANTS", "TASKS"]
