"""Chapter 07's checks that need ranks: the ring forward and backward, and Ulysses' all-to-alls.

Each check runs on 4 ranks (``refimpl.launch.run_ranks``; each rank loads the graded file by path):
rank 0 alone is a group of one (no transfer, plain attention), ranks 1-3 are a ring of 3 handed over as a
group object that is not the world (its group ranks 0, 1, 2 are global ranks 1, 2, 3), so an answer must
address peers by global rank, and a ring of 3 tells the direction of travel apart (a ring of 2 does not).
A ``refimpl.comm.CommTracer`` records every transfer: point-to-point sends are the events whose wire
bytes are measured and non-zero, collectives the ones the tracer models.

* ring forward: the whole sequence's q, k, v seeded alike on every rank of a group, rank ``r`` keeps the
  tokens ``[r c, (r+1) c)``; its output against its rows of ``scaled_dot_product_attention`` of the whole
  sequence in float64, within ``FACTOR`` x SDPA's own float32 error measured in the same run; causal and
  not, ordinary scores and scores of about ``1e4`` (``e^S`` overflows float32 unless the row's maximum is
  taken out first); ``2 (n - 1)`` sends of ``k``'s size, to the next rank, and no collective;
* ring backward: this rank's dQ, dK, dV against its rows of SDPA's autograd on the whole sequence (float64,
  the same tolerance rule per tensor), given ``out`` and ``lse`` computed in float64; transfers only between
  ring neighbours, no collective;
* Ulysses: ``sequence_to_heads`` and ``heads_to_sequence`` bit for bit against slices of the whole tensor
  (6 heads on the ring of 3), one all-to-all each with the input's bytes as payload, the round trip the
  identity, ``ValueError`` for 4 heads or 13 tokens at n = 3.

``FACTOR`` (``ch07.FACTOR``) is stated and measured in ``exercises/checks/ch07.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises.grading import load_module, probe_stub

WORLD = 4
TIMEOUT_S = 90
B, A, C, D = 2, 2, 4, 8  # batch, heads, tokens per rank, head dim
HIGH = 1e4               # the large-score case: every score + HIGH


def _group(rank: int) -> tuple[dist.ProcessGroup, list[int]]:
    """(this rank's group, its members): rank 0 alone, ranks 1-3 a ring; every rank creates every group."""
    alone, ring = dist.new_group([0]), dist.new_group([1, 2, 3])
    return (alone, [0]) if rank == 0 else (ring, [1, 2, 3])


def _events(tracer, where: str) -> list:
    """This rank's sends (measured, non-zero wire bytes); no collective allowed."""
    collectives = sorted({e.op for e in tracer.events if not e.measured})
    assert not collectives, f"{where}: saw the collectives {collectives}; the ring uses point-to-point only"
    return [e for e in tracer.events if e.measured and e.wire_bytes > 0]


def _whole(n: int, seed: int, high: bool) -> dict[str, torch.Tensor]:
    """The whole sequence's q, k, v, dO ``[B, A, n C, D]``, the same on every rank of a group."""
    g = torch.Generator().manual_seed(seed)
    t = {name: torch.randn(B, A, n * C, D, generator=g) for name in ("q", "k", "v", "do")}
    if high:  # q_0 k_0 / sqrt(D) = HIGH for every (query, key): the scores of about 1e4, softmax unchanged
        t["q"][..., 0], t["k"][..., 0] = HIGH * D ** 0.5, 1.0
    return t


def _sdpa(t: dict, causal: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Whole-sequence SDPA: out, lse of the rows' masked scores, and dQ, dK, dV for dO."""
    q, k, v = (t[n].detach().to(dtype, copy=True).requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * t["do"].to(dtype)).sum().backward()
    s = q.detach() @ k.detach().transpose(-2, -1) * D ** -0.5                     # [B, A, s, s]
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return {"out": out.detach(), "lse": torch.logsumexp(s, -1), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _compare(name: str, got, want64: torch.Tensor, spread: float, where: str) -> None:
    from exercises.checks.ch07 import FACTOR

    assert isinstance(got, torch.Tensor) and got.shape == want64.shape, (
        f"{where}: {name} has shape {tuple(getattr(got, 'shape', ()))}, want {tuple(want64.shape)}")
    assert got.dtype == torch.float32, f"{where}: {name} is {got.dtype}, want float32"
    assert torch.isfinite(got).all(), (f"{where}: {name} is not finite; e^S overflows float32 for scores of "
                                       "1e4: take each row's maximum out before exp")
    err = float((got.double() - want64).abs().max())
    assert err <= FACTOR * spread, (f"{where}: {name} is {err:.3g} from float64 SDPA on the whole sequence, "
                                    f"more than {FACTOR:g} x {spread:.3g} (SDPA's float32 error here)")


def _attention_on_rank(ctx, path: str, backward: bool) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    mod = load_module(path)
    group, members = _group(ctx.rank)
    n, r = len(members), members.index(ctx.rank)
    right, left = members[(r + 1) % n], members[(r - 1) % n]
    mine = slice(r * C, (r + 1) * C)
    for seed, high in ((21, False), (22, True)):
        for causal in (False, True):
            where = (f"ring of {n}, group rank {r}, {'causal' if causal else 'no mask'}, "
                     f"{'scores of about 1e4' if high else 'ordinary scores'}")
            t = _whole(n, seed, high)
            r32, r64 = _sdpa(t, causal, torch.float32), _sdpa(t, causal, torch.float64)
            part = {k_: x[:, :, mine].clone() for k_, x in t.items()}  # [B, A, C, D]: this rank's tokens
            kept = {k_: x.clone() for k_, x in part.items()}
            with CommTracer() as tracer:
                if backward:
                    got = mod.ring_attention_backward(
                        part["do"], part["q"], part["k"], part["v"], r32["out"][:, :, mine].clone(),
                        r32["lse"][:, :, mine].clone(), group=group, causal=causal)
                else:
                    got = (mod.ring_attention_forward(part["q"], part["k"], part["v"], group=group,
                                                      causal=causal),)
            names = ("dq", "dk", "dv") if backward else ("out",)
            assert isinstance(got, tuple) and len(got) == len(names), (
                f"{where}: return ({', '.join(names)}), got {type(got).__name__}")
            for name, value in zip(names, got, strict=True):
                spread = float((r32[name].double() - r64[name]).abs().max())
                assert spread > 0, f"grader: {name} in float32 equals float64, no spread for a tolerance"
                _compare(name, value, r64[name][:, :, mine], spread, where)
            assert all(torch.equal(part[k_], kept[k_]) for k_ in part), f"{where}: the inputs were modified"
            sends = _events(tracer, where)
            if backward:
                peers = sorted({e.peer for e in sends} - {right, left})
                assert not peers, f"{where}: sent to ranks {peers}; only the ring neighbours {left}, {right}"
                continue
            want = [(right, part["k"].nbytes)] * (2 * (n - 1))
            got_sends = [(e.peer, e.nbytes) for e in sends]
            assert got_sends or n == 1, (f"{where}: no send seen; make them with refimpl.comm.ops (isend) "
                                         "so that the grader's tracer sees them")
            assert got_sends == want, (f"{where}: sent (peer, bytes) {got_sends}; want {len(want)} K/V "
                                       f"blocks of {part['k'].nbytes} B to the next rank (global {right})")


def check_ring(path: str) -> None:
    from exercises.rank_batch import run_ranks

    x = torch.zeros(1, 1, C, D)
    probe_stub(lambda: load_module(path).ring_attention_forward(x, x, x, group=None, causal=True))
    run_ranks(_attention_on_rank, WORLD, path, False, timeout_s=TIMEOUT_S)


def check_ring_backward(path: str) -> None:
    from exercises.rank_batch import run_ranks

    x = torch.zeros(1, 1, C, D)
    probe_stub(lambda: load_module(path).ring_attention_backward(x, x, x, x, x, x[..., 0], group=None,
                                                                 causal=True))
    run_ranks(_attention_on_rank, WORLD, path, True, timeout_s=TIMEOUT_S)


def _raises_value_error(fn, what: str) -> None:
    try:
        fn()
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 - the message says what was raised instead
        raise AssertionError(f"{what} raised {type(exc).__name__}; want ValueError") from None
    raise AssertionError(f"{what} must raise ValueError")


def _ulysses_on_rank(ctx, path: str) -> None:
    from refimpl.comm import CommTracer

    torch.set_num_threads(1)
    mod = load_module(path)
    group, members = _group(ctx.rank)
    n, r, heads = len(members), members.index(ctx.rank), 6
    whole = torch.arange(B * heads * n * C * D, dtype=torch.float32).reshape(B, heads, n * C, D)
    tokens, mine = slice(r * C, (r + 1) * C), slice(r * heads // n, (r + 1) * heads // n)
    x, y = whole[:, :, tokens].clone(), whole[:, mine].clone()  # [B, 6, C, D], [B, 6/n, n C, D]
    for fn, arg, want, what in ((mod.sequence_to_heads, x, y, "sequence_to_heads"),
                                (mod.heads_to_sequence, y, x, "heads_to_sequence")):
        where = f"{what} on a ring of {n}, group rank {r}"
        kept = arg.clone()
        with CommTracer() as tracer:
            got = fn(arg, group)
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
            f"{where}: shape {tuple(getattr(got, 'shape', ()))}, want {tuple(want.shape)}")
        if not torch.equal(got, want):
            # whole is an arange: a value names its (head, token) in the whole tensor
            got_heads = sorted({int(h) for h in (got[0, :, 0, 0] // (n * C * D)) % heads})
            raise AssertionError(f"{where}: not the right elements (the first token's heads {got_heads}, "
                                 f"want "
                                 f"{list(range(heads))[mine] if what == 'sequence_to_heads' else 'all'})")
        assert torch.equal(arg, kept), f"{where}: the input was modified"
        if n > 1:
            seen = [(e.op, e.nbytes) for e in tracer.events]
            assert seen == [("all_to_all", arg.nbytes)], (
                f"{where}: saw (op, bytes) {seen}; want one all_to_all of the input's {arg.nbytes} B "
                "(refimpl.comm.ops.all_to_all_single)")
    assert torch.equal(mod.heads_to_sequence(mod.sequence_to_heads(x, group), group), x), "round trip"
    if n > 1:
        _raises_value_error(lambda: mod.sequence_to_heads(torch.zeros(B, 4, C, D), group),
                            "sequence_to_heads of 4 heads at n = 3")
        _raises_value_error(lambda: mod.heads_to_sequence(torch.zeros(B, 2, n * C + 1, D), group),
                            f"heads_to_sequence of {n * C + 1} tokens at n = 3")


def check_ulysses(path: str) -> None:
    from exercises.rank_batch import run_ranks

    probe_stub(load_module(path).sequence_to_heads, torch.zeros(1, 2, C, D), None)
    probe_stub(load_module(path).heads_to_sequence, torch.zeros(1, 2, C, D), None)
    run_ranks(_ulysses_on_rank, WORLD, path, timeout_s=TIMEOUT_S)


__all__ = ["check_ring", "check_ring_backward", "check_ulysses"]
