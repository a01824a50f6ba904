"""Checks of chapter 09's exercises (``exercises/09_mixture_of_experts.py``); see exercises/grading.py.

Tasks 1-5 in one process, every reference computed here on its own (loops, Python's ``sorted``, float64),
not by refimpl (tasks 6 and 7 run on ranks: ``exercises.checks.ch09_ranks``):

* ``load_balancing_loss``: exact on scores that are binary fractions (every step of the formula is exact
  there, in any order) and on a uniform router (``coeff`` itself); on random softmax and sigmoid scores,
  value and gradient (``scores.grad``) against the float64 formula and its float64 autograd, within
  ``FACTOR`` x the spread of an fp32 evaluation in another order; zero for ``coeff = 0`` and for no token.
* ``expert_capacity`` and ``capacity_keep``: ``C`` against ``ceil`` of the exact rational ``k T / E * cf``
  (cases where rounding down differs); which assignments fit against a per-expert ``sorted`` by (score
  descending, token), on random scores, on scores with ties, at several capacities and dropless; one case
  puts ~32 tied assignments on each expert, where an unstable sort (torch's CPU sort reorders equal keys
  beyond 16 of them) keeps the wrong ones.
* ``sort_by_expert`` and ``combine``: the order and counts against ``sorted`` of the kept assignment ids,
  with dropped (-1) assignments, an expert nobody chose, one token, no kept assignment, no token;
  ``ValueError`` for an id >= E. The combine against a float64 loop (its plan built here, not by
  ``sort_by_expert``), with fp32, bf16 and fp64 expert outputs, without and with dropped assignments; for
  fp32 also the gradients of ``y`` and ``weights``.
* ``rank_splits`` and ``expert_major_order``: an expert-parallel group of 2, 3 and 4 ranks simulated:
  each rank sorts its tokens' assignments, splits them per owner, the blocks are delivered rank-major
  as ``all_to_all_single`` would, and after the learner's permutation every local expert must hold exactly
  the rows one device's stable sort gives it (source rank, then token order). Uneven splits, a rank
  without tokens, experts nobody chose (zero splits).
* ``route`` and ``update_expert_bias``: seven routers (softmax and sigmoid, k = 1, 2, 3, ``normalize_topk``
  None, True and False, an expert bias that changes the choice, bf16 tokens, a gate with and without a
  bias): the ids exactly against the top k of the float64 selection scores (the grader's data keep the
  k-th and (k+1)-th choice ``MARGIN`` apart), the scores and the combine weights against float64 within
  ``ROUTER_FACTOR`` x the spread of fp32 in two other orders, the gate's gradient through the weights
  against float64 autograd within the same; a renormalised k = 1 weight exactly 1.
  The bias update bit for bit against ``b + fp32(rate) sign(mean - load)`` (one rounding), with loads at
  the mean (no move), a non-integral mean, one expert with every token, rate 0.

``FACTOR`` and ``ROUTER_FACTOR`` bound the floating-point results (stated beside them). ``MUTANTS``
(in ch09_mutants) holds plausible wrong implementations, several per task; ``CORRECT`` independent right
ones.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from exercises.checks.ch09_mutants import (
    ALLTOALL,
    BALANCE,
    CAPACITY,
    CORRECT,
    DISPATCH,
    EXCHANGE,
    EXPERT_GRADS,
    MUTANTS,
    ROUTER,
)
from exercises.checks.ch09_ranks import check_exchange, check_expert_grads
from exercises.grading import Task, load_module
from refimpl.parallel.expert_parallel.dispatch import SortPlan

FACTOR = 4.0  # stated: an fp32 result may be this many times further from float64 than the spread, the
# larger of an fp32 evaluation in another order and one fp32 ulp of the value (an fp32 result cannot be
# closer than its own rounding). Measured worst ratio error / spread over 200 seeds, ATEN_CPU_CAPABILITY
# default and avx512, refimpl's and CORRECT's answers: the loss 1.56, its gradient 1.0, combine 0.98 (fp32 and
# bf16 outputs), its gradients 1.0: a 2.5x margin over the worst; the wrong answers are above 1e3 x.
ROUTER_FACTOR = 10.0  # stated: the same rule for route (task 5): its scores, combine weights and the gate's
# gradient against float64, the spread the larger of fp32 in two other orders (tokens reversed and shuffled,
# features reversed) and one fp32 ulp. Measured worst ratio error / spread over 1000 seeds of the seven
# routers, refimpl's and CORRECT's answers (equal): ATEN_CPU_CAPABILITY avx2 scores 2.75, weights 3.02, the
# gate's gradient 3.82; default 2.2, 2.2, 4.8: a 2.1x margin over the worst (1000 seeds x 7 routers sample a
# tail that FACTOR's 200 seeds did not); the wrong answers are above 1e3 x.
EPS32 = torch.finfo(torch.float32).eps
SIGMOID_HINT = " (sigmoid scores are first normalised per token)"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _distinct_ids(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    """``[t, k]`` random distinct experts per token (what a top-k gives)."""
    return _with_drops(t, k, e, seed, drop=0.0)


def _within(got: torch.Tensor, ref64: torch.Tensor, variants: list[torch.Tensor]) -> tuple[float, float]:
    """(|got - ref|, the tolerance FACTOR x spread) as the max over elements."""
    err = float((got.double() - ref64).abs().max()) if ref64.numel() else 0.0
    spread = max((float((v.double() - ref64).abs().max()) for v in variants), default=0.0)
    floor = EPS32 * float(ref64.abs().max()) if ref64.numel() else 0.0
    return err, FACTOR * max(spread, floor)


# ---- 1: the load-balancing loss ----------------------------------------------------------------------------


def _balance64(scores: torch.Tensor, ids: torch.Tensor, coeff: float, score_func: str) -> torch.Tensor:
    """The formula in float64, by counting: coeff E sum_i (count_i / (T k)) (sum_t p_ti / T)."""
    t, e = scores.shape
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    counts = [0] * e
    for i in ids.flatten().tolist():
        counts[i] += 1
    total = sum(counts[i] / ids.numel() * probs[:, i].sum() / t for i in range(e))
    return coeff * e * total


def _balance_other_order(scores: torch.Tensor, ids: torch.Tensor, coeff: float, score_func: str):
    """The same in fp32 by another route (a matmul of f and P, coeff first): the spread's other order."""
    t, e = scores.shape
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = torch.nn.functional.one_hot(ids.flatten(), e).to(scores.dtype).mean(0)
    return (coeff * e) * (f @ (probs.sum(0) / t))


def _as_scalar(value: object, where: str) -> torch.Tensor:
    if not (isinstance(value, torch.Tensor) and value.dim() == 0):
        raise AssertionError(f"load_balancing_loss({where}) returned {type(value).__name__} of shape "
                             f"{tuple(getattr(value, 'shape', ()))}; want a 0-d tensor")
    return value


def _balance_hint(got: float, want: float, e: int, k: int) -> str:
    if want and math.isclose(got * e, want, rel_tol=1e-4):
        return " (Hint: E times too small: the loss is alpha E sum f P, so that a uniform router gives alpha)"
    if want and math.isclose(got, k * want, rel_tol=1e-4):
        return f" (Hint: {k} = k times too large: f_i divides by the T k assignments, not the T tokens)"
    return ""


def check_balance(path: str) -> None:
    loss_fn = load_module(path).load_balancing_loss
    # exact: binary fractions, every product and sum exact whatever the order
    scores = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.5, 0.125, 0.125],
                           [0.125, 0.125, 0.5, 0.25], [0.5, 0.125, 0.25, 0.125]])
    ids = torch.tensor([[0, 1], [1, 0], [2, 3], [0, 2]])
    f = [Fraction(sum(int(x == i) for x in ids.flatten().tolist()), 8) for i in range(4)]
    p = [sum(Fraction(scores[t, i].item()) for t in range(4)) / 4 for i in range(4)]
    want = float(Fraction(1, 2) * 4 * sum(a * b for a, b in zip(f, p, strict=True)))
    got = float(_as_scalar(loss_fn(scores, ids, 0.5, "softmax"), "4 tokens, 4 experts, top 2, coeff 0.5"))
    assert got == want, (f"load_balancing_loss on scores that are binary fractions (4 tokens, 4 experts, top "
                         f"2, coeff 0.5) = {got!r}, want {want!r} exactly{_balance_hint(got, want, 4, 2)}")
    uniform = float(loss_fn(torch.full((4, 4), 0.25), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), 0.5,
                            "softmax"))
    assert uniform == 0.5, (f"a perfectly uniform router (every score 1/E, every expert the same load) gives "
                            f"{uniform!r}, want coeff = 0.5{_balance_hint(uniform, 0.5, 4, 2)}")
    for seed, (t, e, k, coeff, func) in enumerate(((37, 6, 2, 0.01, "softmax"), (29, 8, 3, 0.1, "sigmoid"),
                                                   (1, 5, 1, 1.0, "softmax"), (50, 4, 2, 0.5, "sigmoid"))):
        logits = torch.randn(t, e, generator=_gen(seed)) * 2
        s = (logits.softmax(-1) if func == "softmax" else logits.sigmoid()).requires_grad_()
        ids = torch.topk(s.detach(), k).indices
        where = f"{func} scores, T={t}, E={e}, k={k}, coeff={coeff}"
        loss = _as_scalar(loss_fn(s, ids, coeff, func), where)
        s64 = s.detach().double().requires_grad_()
        ref = _balance64(s64, ids, coeff, func)
        ref.backward()
        s32 = s.detach().clone().requires_grad_()
        other = _balance_other_order(s32, ids, coeff, func)
        other.backward()
        err, tol = _within(loss.detach(), ref.detach(), [other.detach()])
        assert loss.dtype == s.dtype, (f"load_balancing_loss({where}) is {loss.dtype}; want the scores' "
                                       f"{s.dtype}")
        assert err <= tol, (f"load_balancing_loss({where}) = {loss.item():.7g}, want {ref.item():.7g} "
                            f"(|error| {err:.2g} > tolerance {tol:.2g})"
                            f"{_balance_hint(loss.item(), ref.item(), e, k)}"
                            f"{SIGMOID_HINT if func == 'sigmoid' else ''}")
        assert loss.requires_grad, f"load_balancing_loss({where}) has no gradient: it must flow through P"
        loss.backward()
        err, tol = _within(s.grad, s64.grad, [s32.grad])
        assert err <= tol, (f"the gradient of load_balancing_loss({where}) with respect to the scores is off "
                            f"by {err:.2g} (tolerance {tol:.2g}): it is coeff E f_i / T through P, none "
                            f"through f")
    zeros = {"coeff = 0": (torch.rand(5, 4), _distinct_ids(5, 2, 4, 0), 0.0),
             "no token (T = 0)": (torch.zeros(0, 4), torch.zeros(0, 2).long(), 0.1)}
    for name, (sc, ii, coeff) in zeros.items():
        got = _as_scalar(loss_fn(sc, ii, coeff, "softmax"), name)
        assert got.item() == 0.0, f"load_balancing_loss with {name} = {got.item()!r}, want 0"


# ---- 2: capacity -------------------------------------------------------------------------------------------

_CAPACITIES = [(12, 2, 8, 1.0), (12, 2, 8, 1.25), (10, 1, 4, 1.0), (64, 2, 8, 2.0), (7, 3, 5, 0.5),
               (10, 2, 4, 1.1), (1, 1, 8, 1.0), (16, 2, 8, None)]


def _keep_reference(ids: torch.Tensor, scores: torch.Tensor, capacity: int | None) -> list[list[bool]]:
    t, k = ids.shape
    keep = [[True] * k for _ in range(t)]
    if capacity is None:
        return keep
    for i in range(scores.shape[1]):
        mine = [(tt, j) for tt in range(t) for j in range(k) if ids[tt, j] == i]
        ranked = sorted(mine, key=lambda a: (-scores[a[0], i].item(), a[0]))
        for tt, j in ranked[capacity:]:
            keep[tt][j] = False
    return keep


def check_capacity(path: str) -> None:
    mod = load_module(path)
    for t, k, e, cf in _CAPACITIES:
        want = None if cf is None else math.ceil(Fraction(k * t, e) * Fraction(cf))
        got = mod.expert_capacity(t, k, e, cf)
        where = f"expert_capacity(num_tokens={t}, top_k={k}, num_experts={e}, capacity_factor={cf})"
        assert got == want and (want is None or type(got) is int), (
            f"{where} = {got!r}, want {want!r}"
            + (" (None: dropless)" if cf is None else f" = ceil({k} x {t} / {e} x {cf}), an int"))
    cases = []
    for seed, (t, k, e) in enumerate(((40, 2, 8), (30, 3, 6), (25, 1, 4))):
        logits = torch.randn(t, e, generator=_gen(10 + seed), requires_grad=True)
        scores = logits.softmax(-1)                                 # in the graph, as the router's are
        cases.append((f"random softmax scores, T={t}, k={k}, E={e}", torch.topk(scores.detach(), k).indices,
                      scores))
    tied = (torch.rand(24, 6, generator=_gen(20)) * 4).floor() / 4  # scores 0, 0.25, 0.5, 0.75: many ties
    cases.append(("scores with ties, T=24, k=2, E=6", _distinct_ids(24, 2, 6, 21), tied))
    # ~32 assignments per expert in 4 levels of score: torch's sort on the CPU keeps equal keys in order for
    # up to 16 keys whether asked to or not, and reorders them beyond (measured, torch 2.13): only a case
    # with more than 16 assignments to one expert tells a stable sort from an unstable one
    crowded = (torch.rand(48, 3, generator=_gen(22)) * 4).floor() / 4
    cases.append(("scores with ties, 48 tokens over 3 experts, k=2", _distinct_ids(48, 2, 3, 23), crowded))
    for where, ids, scores in cases:
        for capacity in (1, 3, 5, 100, None) if ids.shape[0] < 48 else (5, 13, 21, None):
            got = mod.capacity_keep(ids, scores, capacity)
            want = _keep_reference(ids, scores, capacity)
            shape = tuple(getattr(got, "shape", ()))
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bool and shape == tuple(ids.shape), (
                f"capacity_keep({where}, capacity={capacity}) returned {type(got).__name__} "
                f"{getattr(got, 'dtype', '')} of shape {shape}; want a bool tensor of shape "
                f"{tuple(ids.shape)}")
            if got.tolist() == want:
                continue
            t, j = next((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])
                        if bool(got[t, j]) != want[t][j])
            i = int(ids[t, j])
            rivals = sum(int(ids[u, m]) == i for u in range(ids.shape[0]) for m in range(ids.shape[1]))
            raise AssertionError(
                f"capacity_keep({where}, capacity={capacity}): token {t}'s choice {j} (expert {i}, score "
                f"{scores[t, i].item():.4g}, one of {rivals} assignments to that expert) is "
                f"{'kept' if bool(got[t, j]) else 'dropped'}; it must be "
                f"{'kept' if want[t][j] else 'dropped'}: each expert keeps its capacity highest scores "
                f"(ties: the earlier token)")


# ---- 3: sort by expert, and combine ------------------------------------------------------------------------


def _with_drops(t: int, k: int, e: int, seed: int, *, dead: int | None = None,
                drop: float = 0.2) -> torch.Tensor:
    """``[t, k]`` distinct experts per token, never ``dead``, about ``drop`` of them set to -1 (dropped)."""
    g = _gen(seed)
    pool = [i for i in range(e) if i != dead]
    ids = torch.tensor([[pool[i] for i in torch.randperm(len(pool), generator=g)[:k].tolist()]
                        for _ in range(t)], dtype=torch.long).view(t, k)
    mask = torch.rand(ids.shape, generator=g) < drop
    return torch.where(mask, torch.full_like(ids, -1), ids)


def _plan(ids: torch.Tensor, e: int) -> tuple[list[int], list[int]]:
    """The sort from its definition: kept assignment ids sorted by (expert, id); counts per expert."""
    flat = ids.flatten().tolist()
    order = sorted((a for a, i in enumerate(flat) if i >= 0), key=lambda a: (flat[a], a))
    return order, [flat.count(i) for i in range(e)]


def _sort_plan(ids: torch.Tensor, e: int) -> SortPlan:
    order, counts = _plan(ids, e)
    return SortPlan(order=torch.tensor(order, dtype=torch.long),
                    counts=torch.tensor(counts, dtype=torch.long), top_k=ids.shape[1],
                    num_tokens=ids.shape[0])


def _check_sort(sort_by_expert) -> None:
    cases = [("T=23, k=3, E=7, a fifth of the assignments dropped, expert 4 never chosen",
              _with_drops(23, 3, 7, 1, dead=4), 7),
             ("T=16, k=2, E=4, nothing dropped", _distinct_ids(16, 2, 4, 2), 4),
             ("one token, k=1, E=3", torch.tensor([[2]]), 3),
             ("every assignment dropped", torch.full((3, 2), -1), 5),
             ("no token", torch.zeros(0, 2, dtype=torch.long), 4)]
    for where, ids, e in cases:
        plan = sort_by_expert(ids, e)
        order, counts = _plan(ids, e)
        for name in ("order", "counts", "top_k", "num_tokens"):
            assert hasattr(plan, name), (f"sort_by_expert({where}) returned {type(plan).__name__} without "
                                         f".{name}")
        got = plan.order.tolist()
        assert plan.order.dtype == torch.long and plan.counts.dtype == torch.long, (
            f"sort_by_expert({where}): order and counts must be int64, got {plan.order.dtype}, "
            f"{plan.counts.dtype}")
        assert len(got) == len(order), (
            f"sort_by_expert({where}): order holds {len(got)} assignments, want the {len(order)} kept ones "
            f"(ids of -1 are left out)")
        assert got == order, (
            f"sort_by_expert({where}): order {got[:12]}..., want {order[:12]}... (assignment ids t k + j, by "
            f"expert, each expert's in increasing id: a stable sort)")
        assert plan.counts.tolist() == counts, (f"sort_by_expert({where}): counts {plan.counts.tolist()}, "
                                                f"want {counts}")
        assert (plan.top_k, plan.num_tokens) == (ids.shape[1], ids.shape[0]), (
            f"sort_by_expert({where}): top_k, num_tokens = {plan.top_k}, {plan.num_tokens}, want "
            f"{ids.shape[1]}, {ids.shape[0]}")
    try:
        sort_by_expert(torch.tensor([[0, 5]]), 5)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"sort_by_expert with an id >= num_experts raised {type(exc).__name__}; want "
                             f"ValueError") from None
    raise AssertionError("sort_by_expert with an id >= num_experts (5 of 5 experts) must raise ValueError")


def _combine64(y: torch.Tensor, w: torch.Tensor, plan: SortPlan, *, reverse: bool = False) -> torch.Tensor:
    """The definition, a loop over the sorted rows (float64 for float64 inputs; reverse: j = k-1 .. 0)."""
    out = [torch.zeros(y.shape[-1], dtype=y.dtype) for _ in range(plan.num_tokens)]
    rows = dict(zip(plan.order.tolist(), range(plan.order.numel()), strict=True))
    for t in range(plan.num_tokens):
        for j in (reversed(range(plan.top_k)) if reverse else range(plan.top_k)):
            if t * plan.top_k + j in rows:
                out[t] = out[t] + w[t, j] * y[rows[t * plan.top_k + j]]
    return torch.stack(out) if out else y.new_zeros(0, y.shape[-1])


def _check_combine(combine) -> None:
    h = 12
    cases = [("fp32 expert outputs, nothing dropped, T=15, k=3", _distinct_ids(15, 3, 5, 30), torch.float32),
             ("fp32 expert outputs, with dropped assignments, T=19, k=3", _with_drops(19, 3, 6, 31),
              torch.float32),
             ("bf16 expert outputs, with dropped assignments, T=19, k=2", _with_drops(19, 2, 6, 32),
              torch.bfloat16),
             ("fp64 expert outputs, T=9, k=2", _with_drops(9, 2, 4, 33), torch.float64),
             ("k=1, T=11", _with_drops(11, 1, 4, 34), torch.float32)]
    for seed, (where, ids, dtype) in enumerate(cases):
        plan = _sort_plan(ids, int(ids.max()) + 1 if ids.numel() else 1)
        a = plan.order.numel()
        y = (torch.randn(a, h, generator=_gen(40 + seed)) * 3).to(dtype).requires_grad_()
        w = torch.rand(ids.shape, generator=_gen(50 + seed)).softmax(-1).requires_grad_()
        out = combine(y, w, plan)
        want_dtype = torch.promote_types(dtype, torch.float32)
        assert isinstance(out, torch.Tensor) and out.dtype == want_dtype and out.shape == (ids.shape[0], h), (
            f"combine({where}) returned {getattr(out, 'dtype', type(out).__name__)} of shape "
            f"{tuple(getattr(out, 'shape', ()))}; want {want_dtype} of shape {(ids.shape[0], h)} (the "
            f"products and the sum in fp32, fp64 for fp64 outputs)")
        y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = _combine64(y64, w64, plan)
        other = _combine64(y.detach().to(want_dtype), w.detach().to(want_dtype), plan, reverse=True)
        err, tol = _within(out.detach(), ref.detach(), [other])
        if want_dtype == torch.float64:  # fp64 results: one fp64 ulp of the value is the floor
            tol = FACTOR * max(float((other - ref.detach()).abs().max()),
                               torch.finfo(torch.float64).eps * float(ref.detach().abs().max()))
        assert err <= tol, (f"combine({where}) is off by {err:.3g} (tolerance {tol:.2g}) against sum_j w_tj "
                            f"y_(t k + j) in float64: is each row put back at its assignment plan.order[p], "
                            f"and weighed in {want_dtype}?")
        if dtype != torch.float32:
            continue
        g = torch.randn(out.shape, generator=_gen(60 + seed))
        out.backward(g)
        ref.backward(g.double())
        y32, w32 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        _combine64(y32, w32, plan, reverse=True).backward(g)  # fp32, the other order: the spread
        assert y.grad is not None and w.grad is not None, (
            f"combine({where}): no gradient reached {'y' if y.grad is None else 'weights'}")
        for name, got, want, other in (("y", y.grad, y64.grad, y32.grad),
                                       ("weights", w.grad, w64.grad, w32.grad)):
            err, tol = _within(got, want, [other])
            assert err <= tol, (f"combine({where}): the gradient of {name} is off by {err:.3g} (tolerance "
                                f"{tol:.2g})")


def check_dispatch(path: str) -> None:
    mod = load_module(path)
    _check_sort(mod.sort_by_expert)
    _check_combine(mod.combine)


# ---- 4: the all-to-all's splits and the expert-major order -------------------------------------------------


def check_all_to_all(path: str) -> None:
    mod = load_module(path)
    for n, local, tokens in ((2, 2, [9, 13]), (3, 1, [7, 0, 11]), (4, 2, [10, 5, 0, 8])):
        e = n * local
        where = f"an expert-parallel group of {n} ranks, {local} expert(s) each, tokens per rank {tokens}"
        sent, counts = [], []
        for r, t in enumerate(tokens):  # each rank sorts its assignments; expert e - 1 is never chosen
            ids = _with_drops(t, 2, e, 70 + r, dead=e - 1) if t else torch.zeros(0, 2, dtype=torch.long)
            order, c = _plan(ids, e)
            rows = torch.tensor([[r, a // 2, int(ids.flatten()[a])] for a in order], dtype=torch.long)
            sent.append(rows.view(-1, 3))
            counts.append(torch.tensor(c, dtype=torch.long))
        for r in range(n):
            got = mod.rank_splits(counts[r], n)
            want = [int(counts[r][q * local:(q + 1) * local].sum()) for q in range(n)]
            assert list(got) == want, (
                f"rank_splits({counts[r].tolist()}, {n}) = {got}, want {want}: rank q owns the block of "
                f"experts [q E/N, (q+1) E/N) ({where})")
        for q in range(n):  # what rank q receives, rank-major, and the counts it was told
            blocks, recv = [], torch.zeros(n, local, dtype=torch.long)
            for r in range(n):
                start = int(counts[r][:q * local].sum())
                blocks.append(sent[r][start:start + int(counts[r][q * local:(q + 1) * local].sum())])
                recv[r] = counts[r][q * local:(q + 1) * local]
            received = torch.cat(blocks)
            idx = mod.expert_major_order(recv.clone())
            r_total = received.shape[0]
            assert isinstance(idx, torch.Tensor) and idx.dtype == torch.long and \
                sorted(idx.tolist()) == list(range(r_total)), (
                    f"expert_major_order(recv={recv.tolist()}) must be an int64 permutation of the {r_total} "
                    f"received rows, got {getattr(idx, 'dtype', type(idx).__name__)} "
                    f"{str(idx.tolist())[:60]}")
            got = received[idx]
            want = [row for j in range(local) for r in range(n)
                    for row in sent[r].tolist() if row[2] == q * local + j]
            if got.tolist() != want:
                p = next(p for p, (a, b) in enumerate(zip(got.tolist(), want, strict=True)) if a != b)
                raise AssertionError(
                    f"expert_major_order(recv={recv.tolist()}) on rank {q} of {where}: row {p} holds rank "
                    f"{got[p, 0].item()}'s token {got[p, 1].item()} for expert {got[p, 2].item()}, want rank "
                    f"{want[p][0]}'s token {want[p][1]} for expert {want[p][2]} (expert-major: every row of "
                    f"local expert 0, rank by rank, then expert 1's)")
    try:
        mod.rank_splits(torch.ones(6, dtype=torch.long), 4)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"rank_splits of 6 experts over 4 ranks raised {type(exc).__name__}; want "
                             f"ValueError") from None
    raise AssertionError("rank_splits of 6 experts over 4 ranks must raise ValueError")


# ---- 5: the router -----------------------------------------------------------------------------------------

# (what, T, h, E, k, score_func, normalize_topk, with the expert bias, x's dtype, gate with a bias)
_ROUTES = [("softmax, k=2, normalize_topk=None", 37, 16, 8, 2, "softmax", None, False, torch.float32, True),
           ("softmax, k=1, normalize_topk=None (Switch)", 29, 16, 6, 1, "softmax", None, False, torch.float32,
            False),
           ("sigmoid, k=3, normalize_topk=None, an expert bias", 41, 12, 8, 3, "sigmoid", None, True,
            torch.float32, True),
           ("softmax, k=2, normalize_topk=False, an expert bias", 31, 16, 8, 2, "softmax", False, True,
            torch.float32, True),
           ("sigmoid, k=1, normalize_topk=None", 23, 8, 4, 1, "sigmoid", None, False, torch.float32, True),
           ("sigmoid, k=1, normalize_topk=True", 17, 8, 4, 1, "sigmoid", True, False, torch.float32, True),
           ("bf16 tokens, softmax, k=2, normalize_topk=None", 33, 16, 8, 2, "softmax", None, False,
            torch.bfloat16, True)]
MARGIN = 1e-4  # the grader's data: selection scores of the k-th and (k+1)-th choice (and within the top k)
# at least this far apart in float64, ~1000 fp32 ulps of a score <= 1 plus a bias: the choice is the same
# in any precision that computes the logits in fp32


def _router64(x, weight, bias, k, func, renorm, expert_bias, *, dtype=torch.float64, order=None):
    """The router from its definition, in ``dtype``: (ids from float64 selection scores, weights, scores).
    ``order`` (a permutation of the tokens): the spread's other orders, the logits summed over the features
    in reverse order and the tokens taken in that order (the gate's gradient is a sum over the tokens)."""
    xd, wd = x.to(dtype), weight.to(dtype)
    if order is not None:
        xp = xd[order]
        z = sum(xp[:, j:j + 1] * wd[:, j] for j in reversed(range(xd.shape[1])))
        if bias is not None:
            z = z + bias.to(dtype)
        z = z[torch.argsort(order)]
    else:
        z = xd @ wd.t() + (0 if bias is None else bias.to(dtype))
    s = z.softmax(-1) if func == "softmax" else z.sigmoid()
    select = s.detach().double() + (0 if expert_bias is None else expert_bias.double())
    ranked = select.sort(-1, descending=True).values
    gaps = ranked[:, :-1] - ranked[:, 1:]
    if order is None and float(gaps[:, :k].min()) < MARGIN:
        raise RuntimeError("grader: two selection scores closer than MARGIN; no unique choice")
    ids = torch.topk(select, k).indices
    w = s.gather(1, ids)
    return ids, (w / w.sum(-1, keepdim=True) if renorm else w), s


def _check_route(route) -> None:
    from torch import nn

    for seed, (what, t, h, e, k, func, norm, with_bias, dtype, gate_bias) in enumerate(_ROUTES):
        g = _gen(80 + seed)
        gate = nn.Linear(h, e, bias=gate_bias)
        with torch.no_grad():
            gate.weight.copy_(torch.randn(e, h, generator=g) * 0.4)
            if gate_bias:
                gate.bias.copy_(torch.randn(e, generator=g) * 0.5)
        x = torch.randn(t, h, generator=g).to(dtype)
        eb = (torch.randn(e, generator=g) * (0.1 if func == "softmax" else 0.3)) if with_bias else None
        renorm = k > 1 if norm is None else norm
        params = [gate.weight] + ([gate.bias] if gate_bias else [])
        p64 = [q.detach().double().requires_grad_() for q in params]
        ids64, w64, s64 = _router64(x, p64[0], p64[1] if gate_bias else None, k, func, renorm, eb)
        others = []  # fp32 in two other orders: (parameters, weights, scores)
        for order in (torch.arange(t).flip(0), torch.randperm(t, generator=g)):
            p32 = [q.detach().clone().requires_grad_() for q in params]
            others.append((p32, *_router64(x, p32[0], p32[1] if gate_bias else None, k, func, renorm, eb,
                                           dtype=torch.float32, order=order)[1:]))
        where = f"route({what}, T={t}, E={e})"
        out = route(x, gate, k, score_func=func, normalize_topk=norm,
                    expert_bias=None if eb is None else eb.clone())
        assert isinstance(out, tuple) and len(out) == 3, (
            f"{where} returned {type(out).__name__}; want the tuple (expert_ids, weights, scores)")
        ids, w, s = out
        for name, got, want_dtype, shape in (("expert_ids", ids, torch.long, (t, k)),
                                             ("weights", w, torch.float32, (t, k)),
                                             ("scores", s, torch.float32, (t, e))):
            assert isinstance(got, torch.Tensor) and got.dtype == want_dtype and tuple(got.shape) == shape, (
                f"{where}: {name} is {getattr(got, 'dtype', type(got).__name__)} of shape "
                f"{tuple(getattr(got, 'shape', ()))}; want {want_dtype} of shape {shape}"
                + (" (the logits in fp32 whatever x's dtype)" if name != "expert_ids" else ""))
        if not torch.equal(ids, ids64):
            tok = next(i for i in range(t) if not torch.equal(ids[i], ids64[i]))
            hint = ""
            if eb is not None and ids[tok].tolist() == torch.topk(s64[tok].detach(), k).indices.tolist():
                hint = " (Hint: those are the top scores without the bias: choose by scores + expert_bias)"
            raise AssertionError(f"{where}: token {tok} chose experts {ids[tok].tolist()}, want "
                                 f"{ids64[tok].tolist()} (the top {k} of scores + bias, best first){hint}")
        err, tol = _within(s.detach(), s64.detach(), [o[2].detach() for o in others])
        tol *= ROUTER_FACTOR / FACTOR
        assert err <= tol, (f"{where}: scores are off by {err:.2g} from float64 (tolerance {tol:.2g}): "
                            f"{func} of logits computed in fp32 (x and the gate taken to fp32 first)")
        if renorm and k == 1:  # s / s: exactly 1, and no gradient to check
            assert bool((w == 1).all()), f"{where}: renormalised weights of one expert must be 1, got {w[:3]}"
            continue
        err, tol = _within(w.detach(), w64.detach(), [o[1].detach() for o in others])
        tol *= ROUTER_FACTOR / FACTOR
        if err > tol:
            hint = ""
            raw = s64.detach().gather(1, ids64)
            alternatives = [(raw / raw.sum(-1, keepdim=True), "renormalised; here the weights are the raw "
                             "scores (normalize_topk=False, or None at k = 1)") if not renorm else
                            (raw, "renormalise: divide the k weights by their sum")]
            if eb is not None:
                biased = raw + eb.double()[ids64]
                alternatives.append((biased / biased.sum(-1, keepdim=True) if renorm else biased,
                                     "the bias steers the choice only; the weights are the scores alone"))
            if k == 1 and bool((w == 1).all()):
                hint = (" (Hint: all 1: renormalised at k = 1, so the router gets no gradient from the task; "
                        "normalize_topk=None renormalises only when top_k > 1, Switch keeps the raw score)")
            for alt, why in alternatives:
                if not hint and float((w.detach().double() - alt).abs().max()) < 1e-5:
                    hint = f" (Hint: {why})"
            raise AssertionError(f"{where}: weights are off by {err:.2g} from float64 (tolerance {tol:.2g}); "
                                 f"want the chosen scores{', renormalised' if renorm else ''}{hint}")
        assert w.requires_grad, f"{where}: the weights carry no gradient: keep them in the gate's graph"
        up = torch.randn(t, k, generator=g)
        (w * up).sum().backward()
        (w64 * up.double()).sum().backward()
        for _, w32, _ in others:
            (w32 * up).sum().backward()
        for i, (q, q64, name) in enumerate(zip(params, p64, ("weight", "bias"), strict=False)):
            assert q.grad is not None, f"{where}: no gradient reached the gate's {name}"
            err, tol = _within(q.grad, q64.grad, [o[0][i].grad for o in others])
            tol *= ROUTER_FACTOR / FACTOR
            assert err <= tol, (f"{where}: the gradient of the gate's {name} through the weights is off by "
                                f"{err:.2g} (tolerance {tol:.2g})")


_LOADS = [("int64 loads, mean 7 (three experts at the mean)", torch.tensor([10, 3, 7, 7, 0, 12, 7, 10]),
           1e-3),
          ("float loads, mean 5/3", torch.tensor([1.0, 2.0, 2.0]), 0.01),
          ("one expert took everything", torch.tensor([0, 0, 40, 0]), 0.25),
          ("rate 0", torch.tensor([5, 1, 2]), 0.0)]


def _check_bias_update(update_expert_bias) -> None:
    for seed, (what, load, rate) in enumerate(_LOADS):
        bias = torch.randn(load.numel(), generator=_gen(90 + seed)) * 0.01
        mean = load.double().mean()
        step = float(torch.tensor(rate, dtype=torch.float32)) * torch.sign(mean - load.double())
        want = (bias.double() + step).float()  # one rounding, as b + rate * (+-1 or 0) in fp32
        got = update_expert_bias(bias.clone(), load.clone(), rate)
        where = f"update_expert_bias({what}, rate={rate})"
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == bias.shape, (
            f"{where} returned {getattr(got, 'dtype', type(got).__name__)} of shape "
            f"{tuple(getattr(got, 'shape', ()))}; want the new bias, fp32 of shape {tuple(bias.shape)}")
        if torch.equal(got, want):
            continue
        hint = ""
        if torch.equal(got, (bias.double() - step).float()):
            hint = (" (Hint: the wrong sign: an expert above the mean load must become less attractive, "
                    "its bias go down)")
        moved = ", ".join(f"{v:+.3g}" for v in (got.double() - bias.double()).tolist())
        raise AssertionError(f"{where}: loads {load.tolist()} moved the bias by [{moved}], want "
                             f"[{', '.join(f'{v:+.3g}' for v in step.tolist())}] "
                             f"(rate x sign(mean load - load): a fixed step, none at the mean){hint}")


def check_router(path: str) -> None:
    mod = load_module(path)
    _check_route(mod.route)
    _check_bias_update(mod.update_expert_bias)


TASKS = [
    Task(name=BALANCE, points=3, check=check_balance),
    Task(name=CAPACITY, points=3, check=check_capacity),
    Task(name=DISPATCH, points=3, check=check_dispatch),
    Task(name=ALLTOALL, points=3, check=check_all_to_all),
    Task(name=ROUTER, points=3, check=check_router),
    Task(name=EXCHANGE, points=4, check=check_exchange),
    Task(name=EXPERT_GRADS, points=3, check=check_expert_grads),
]

__all__ = ["CORRECT", "MUTANTS", "TASKS"]
