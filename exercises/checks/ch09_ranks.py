"""Chapter 09's checks on ranks: the count exchange with the uneven all-to-all, and the experts' gradients.

Both run on ``WORLD = 4`` gloo ranks (``refimpl.launch.run_ranks``, folded into one spawn by
``exercises.rank_batch``; each rank loads the graded file by path), in groups that are not the world,
so an answer that reads the world's rank or size, or makes its collectives over the world, computes the
wrong thing. All data are exact (integers, or integers over a power of two): results are compared bit for
bit, against answers every rank computes on its own from the seeds of every rank's data (no collective).

* count exchange and all-to-all: rank 0 alone is a group of one (``exchange_counts`` is ``counts`` as
  ``[1, E]``, the all-to-all the identity), ranks 1-3 an expert-parallel group of 3 (its group ranks 0, 1,
  2 are global ranks 1, 2, 3) with 2 experts each. Two routings: every rank's rows spread over all experts
  but the last (uneven splits, a rank with no row, an expert nobody chose), then every rank's rows bound
  for the next rank only (zero splits, a rank that receives nothing from itself). ``recv`` must be what
  each peer's routing says; the all-to-all's rows the peers' blocks in rank order (each row carries its
  sender and index); its backward, on a gradient whose rows carry their position, must give each sent row
  the gradient of the row it became (the reverse all-to-all).
* the experts' gradients: two layouts of the 4 ranks, ``dp 4 x ep 2`` (``edp 2``: edp groups {0, 2} and
  {1, 3}, ep groups {0, 1} and {2, 3}; ``N = 4``) and ``tp 2 x dp 2`` with ``ep 2`` over dp (``edp 1``;
  ``N = 2`` in a world of 4, the tensor-parallel pairs {0, 1} and {2, 3} seeing the same tokens). Each of
  ``N`` token shards has 8 tokens routed top-1 to 4 linear experts ``[3, 4]``, the loss ``L_q`` a mean over
  the shard's tokens; a rank's local gradients are the sums over its ep group's shards (what the
  all-to-all's backward leaves), and after the answer's reduction they must equal the gradient of
  ``1/N sum_q L_q``, computed here in float64 (exact: integers over 8, divided by 2 or 4).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from exercises.grading import load_module, probe_stub

WORLD = 4
TIMEOUT_S = 60
H = 4      # row width of the all-to-all
LOCAL = 2  # experts per rank of the expert-parallel group
TOKENS = {1: ((9,), (6,)), 3: ((7, 0, 11), (5, 6, 4))}  # rows per group rank, per routing


# ---- task 6: the count exchange and the uneven all-to-all --------------------------------------------------


def _group(rank: int) -> tuple[dist.ProcessGroup, list[int]]:
    """(this rank's group, its members): rank 0 alone, ranks 1-3 a group of 3; every rank creates both."""
    alone, trio = dist.new_group([0]), dist.new_group([1, 2, 3])
    return (alone, [0]) if rank == 0 else (trio, [1, 2, 3])


def _counts(n: int, routing: int, r: int) -> torch.Tensor:
    """Group rank ``r``'s rows per expert (``E = n LOCAL``): routing 0 spreads them over every expert but the
    last, routing 1 sends them all to the experts of the next rank."""
    e, t = n * LOCAL, TOKENS[n][routing][r]
    g = torch.Generator().manual_seed(100 * n + 10 * routing + r)
    if routing == 0:
        ids = torch.randint(0, e - 1, (t,), generator=g)
    else:
        ids = (r + 1) % n * LOCAL + torch.randint(0, LOCAL, (t,), generator=g)
    return torch.bincount(ids, minlength=e)


def _rows(r: int, t: int, sign: float = 1.0) -> torch.Tensor:
    """``[t, H]`` rows that name themselves: row ``i`` of rank ``r`` holds ``1000 r + i + c / 8`` in column
    ``c`` (negated for a gradient)."""
    return sign * (1000.0 * r + torch.arange(t, dtype=torch.float32).unsqueeze(1)
                   + torch.arange(H, dtype=torch.float32) / 8)


def _splits(counts: torch.Tensor, n: int) -> list[int]:
    return [int(counts[q * LOCAL:(q + 1) * LOCAL].sum()) for q in range(n)]


def _name(row: torch.Tensor) -> str:
    if not bool(row.any()):
        return "no row (zeros)"
    v = abs(int(row[0].item()))
    return f"rank {v // 1000}'s row {v % 1000}"


def _exchange_on_rank(ctx, path: str) -> None:
    torch.set_num_threads(1)
    mod = load_module(path)
    group, members = _group(ctx.rank)
    n, r = len(members), members.index(ctx.rank)
    for routing in range(2):
        counts = [_counts(n, routing, q) for q in range(n)]
        sends = [_splits(c, n) for c in counts]                    # sends[q][p]: rows q sends p
        where = (f"group rank {r} of a group of {n} (global ranks {members}), {LOCAL} experts each, "
                 f"rows per expert of every rank {[c.tolist() for c in counts]}")
        mine = counts[r].clone()
        recv = mod.exchange_counts(mine, group)
        want = torch.stack([counts[q][r * LOCAL:(r + 1) * LOCAL] for q in range(n)])
        assert isinstance(recv, torch.Tensor) and recv.dtype == torch.long and recv.shape == want.shape, (
            f"exchange_counts ({where}) returned {getattr(recv, 'dtype', type(recv).__name__)} of shape "
            f"{tuple(getattr(recv, 'shape', ()))}; want int64 of shape {tuple(want.shape)} ([N, E/N])")
        if not torch.equal(recv, want):
            hint = ""
            if torch.equal(recv, counts[r].view(n, LOCAL)):
                hint = (" (Hint: that is this rank's own counts reshaped: every rank routes its own tokens, "
                        "so what the peers send is theirs to tell: one all-to-all of the counts)")
            raise AssertionError(f"exchange_counts ({where}) = {recv.tolist()}, want {want.tolist()} "
                                 f"(recv[q, j]: the rows group rank q sends for this rank's local expert j)"
                                 f"{hint}")
        assert torch.equal(mine, counts[r]), f"exchange_counts ({where}) modified its input"

        out_splits = [sends[q][r] for q in range(n)]
        x_in = _rows(r, sum(sends[r]))
        x = x_in.clone().requires_grad_()
        y = mod.all_to_all_tokens(x, list(out_splits), list(sends[r]), group)
        call = (f"all_to_all_tokens(x [{x.shape[0]}, {H}], output_splits={out_splits}, "
                f"input_splits={sends[r]})")
        where = f"{call} on group rank {r} of a group of {n} (global ranks {members}), routing {routing}"
        want_y = torch.cat([_rows(q, sum(sends[q]))[sum(sends[q][:r]):sum(sends[q][:r + 1])]
                            for q in range(n)])
        assert isinstance(y, torch.Tensor) and y.shape == want_y.shape and y.dtype == x.dtype, (
            f"{where} returned {getattr(y, 'dtype', type(y).__name__)} of shape "
            f"{tuple(getattr(y, 'shape', ()))}; want {x.dtype} of shape {tuple(want_y.shape)}")
        if not torch.equal(y.detach(), want_y):
            p = next(p for p in range(y.shape[0]) if not torch.equal(y[p].detach(), want_y[p]))
            raise AssertionError(f"{where}: row {p} is {_name(y[p])}, want {_name(want_y[p])} (the rows "
                                 f"each group rank sends this one, in rank order)")
        assert y.requires_grad, (f"{where}: the output is not in the autograd graph (a collective into a new "
                                 f"tensor cuts it): wrap the all-to-all in a torch.autograd.Function")
        dy = _rows(r, sum(out_splits), sign=-1.0)
        try:
            y.backward(dy)
        except Exception as exc:  # noqa: BLE001 - a backward that cannot run: say what it must do
            raise AssertionError(f"{where}: the backward raised {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''} (the gradient of the "
                                 f"{sum(out_splits)} received rows goes back to the {x.shape[0]} sent ones: "
                                 f"the reverse all-to-all, output and input splits swapped)") from None
        dys = [_rows(q, sum(sends[p][q] for p in range(n)), sign=-1.0) for q in range(n)]
        # the rows this rank sent to q became q's rows [sum of what ranks before r sent q, + sends[r][q])
        want_dx = torch.cat([dys[q][sum(sends[p][q] for p in range(r)):][:sends[r][q]] for q in range(n)])
        assert x.grad is not None, f"{where}: no gradient reached x (the backward must route it home)"
        if not torch.equal(x.grad, want_dx):
            p = next(p for p in range(x.shape[0]) if not torch.equal(x.grad[p], want_dx[p]))
            raise AssertionError(f"{where}: row {p}'s gradient is that of {_name(x.grad[p])}, want that of "
                                 f"{_name(want_dx[p])}, the row it became (backward: the reverse all-to-all, "
                                 f"the splits swapped)")
        assert torch.equal(x.detach(), x_in), f"{where}: x was modified"


def check_exchange(path: str) -> None:
    from exercises.rank_batch import run_ranks

    mod = load_module(path)
    probe_stub(mod.exchange_counts, torch.zeros(2, dtype=torch.long), None)
    probe_stub(mod.all_to_all_tokens, torch.zeros(1, H), [1], [1], None)
    run_ranks(_exchange_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


# ---- task 7: the experts' gradients ------------------------------------------------------------------------

E, OUT, T = 4, 3, 8  # experts, an expert's output width (its input: H), tokens per shard (a power of two)


def _shard_grads(layout: int, q: int) -> torch.Tensor:
    """``[E, OUT, H]`` float64: the gradient of shard ``q``'s loss ``L_q = 1/T sum_t <W_e(t) x_t, G_t>``."""
    g = torch.Generator().manual_seed(500 + 10 * layout + q)
    x = torch.randint(-3, 4, (T, H), generator=g).double()
    up = torch.randint(-3, 4, (T, OUT), generator=g).double()
    ids = torch.randint(0, E, (T,), generator=g)
    out = torch.zeros(E, OUT, H, dtype=torch.float64)
    for t in range(T):
        out[ids[t]] += torch.outer(up[t], x[t]) / T
    return out


def _expert_grads_on_rank(ctx, path: str) -> None:
    torch.set_num_threads(1)
    mod = load_module(path)
    rank = ctx.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]    # every rank creates every group, in order
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    alone = [dist.new_group([q]) for q in range(WORLD)]
    # (name, ep group, edp group, N = dp x cp, the shards my ep group sees, my rank in the ep group)
    layouts = [("dp 4 x ep 2 (edp 2: ranks {0, 2} and {1, 3} hold the same experts)", pairs[rank // 2],
                strided[rank % 2], 4, [rank // 2 * 2, rank // 2 * 2 + 1], rank % 2),
               ("tp 2 x dp 2 with ep 2 over dp (edp 1; the tp pairs {0, 1} and {2, 3} see the same tokens)",
                strided[rank % 2], alone[rank], 2, [0, 1], rank // 2)]
    for layout, (name, ep, edp, n, seen, ep_rank) in enumerate(layouts):
        shards = [_shard_grads(layout, q) for q in range(n)]
        mine = range(ep_rank * E // 2, (ep_rank + 1) * E // 2)
        local = [sum(shards[q][e] for q in seen).float() for e in mine]
        want = [(sum(shards[q][e] for q in range(n)) / n).float() for e in mine]
        grads = [g.clone() for g in local]
        returned = mod.reduce_expert_gradients(grads, edp_group=edp, ep_group=ep)
        where = f"reduce_expert_gradients on global rank {rank}, {name}"
        for e, got, w, before in zip(mine, grads, want, local, strict=True):
            if torch.equal(got, w):
                continue
            hint = ""
            if torch.equal(got, before) and isinstance(returned, (list, tuple)):
                hint = " (Hint: update the gradients in place; what is returned is not read)"
            for k, why in ((n // dist.get_world_size(edp), "ep times too large: the mean over edp divides "
                            "by edp, the global loss by N = edp x ep = dp x cp (pytorch/pytorch#160285)"),
                           (n, "not divided: the global loss is the mean of the N = dp x cp ranks' losses"),
                           (n / WORLD, "divided by the world size: the tensor-parallel ranks hold copies of "
                            "the same tokens, they do not add to N = dp x cp")):
                if not hint and k != 1 and torch.equal(got, w * k):
                    hint = f" (Hint: {why})"
            raise AssertionError(f"{where}: expert {e}'s gradient is {got.flatten()[:3].tolist()}..., want "
                                 f"{w.flatten()[:3].tolist()}... (the sum over the edp group / N = {n}; "
                                 f"before the call {before.flatten()[:3].tolist()}...){hint}")


def check_expert_grads(path: str) -> None:
    from exercises.rank_batch import run_ranks

    fn = load_module(path).reduce_expert_gradients
    probe_stub(lambda: fn([torch.zeros(2)], edp_group=None, ep_group=None))
    run_ranks(_expert_grads_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


__all__ = ["check_exchange", "check_expert_grads"]
