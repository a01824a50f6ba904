"""Point-to-point that cannot deadlock on NCCL, proven on gloo under strict mode (chapters 02, 07, 08).

NCCL runs a pair's point-to-point calls in order and completes an unbatched send or receive only once the
peer has posted its match; gloo lets calls overtake each other, so code that hangs on GPUs passes on CPU.
``REFIMPL_STRICT_P2P=1`` (``refimpl.comm.ops``) makes every plain ``isend``/``irecv`` wait for itself
and every ``batch_isend_irecv`` group wait for its handles before returning: NCCL's rule, on gloo.

* Under strict mode the ring collectives (2, 3, 4 ranks), ring attention at cp 2 and 4 (forward and
  backward, causal zig-zag) and a pipeline with a tied embedding at pp 2 and 4 under every schedule
  (gpipe, 1f1b, interleaved v = 2, zbh1) run to completion and give the same bits as without it (strict
  mode only waits); the tracer books every op of a group, a send's bytes measured.
* The trainer (``python -m refimpl.train``, tiny model, 2 steps, torchrun's children) at ``--cp 2
  --cp-method ring`` and at ``--pp 2 --pp-schedule 1f1b`` finishes under strict mode, bounded by
  ``timeout -k``.
* Negative control: the old ordering (``irecv`` then ``isend``, unbatched, on both ranks of a pair)
  completes on plain gloo and hangs under strict mode: each rank's receive fails after a 3 s group
  timeout, reported as its one-line timeout error.
* Without processes: the executor's transfer plans (``refimpl.parallel.pipeline_parallel.p2p_plan``)
  complete under NCCL's rule for every schedule over p <= 5, m <= 8, v <= 3; the local rule (the sends of
  an action with the next action's receives) does for GPipe, 1F1B, ZB-H1 and a hand-made list, and
  deadlocks interleaved 1F1B (why the executor uses the rounds there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer, chunk_sizes, ops, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from refimpl.config import ModelConfig
from refimpl.launch import run_ranks
from refimpl.models import GPT, lm_loss
from refimpl.parallel.context_parallel import ring_attention as ra
from refimpl.parallel.context_parallel import sequence_layout as sl
from refimpl.parallel.pipeline_parallel import PipelineModule, build_schedule
from refimpl.parallel.pipeline_parallel.p2p_plan import _local_plan, find_table, p2p_plan, strict_deadlock
from refimpl.parallel.pipeline_parallel.schedules import Action, P2PAction
from refimpl.planner import ring_bytes_sent
from tests.support.timeouts import SPAWN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[4]
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2)]
M, B, S = 4, 2, 8


def _strict(on: bool) -> None:
    os.environ[ops.STRICT_P2P_ENV] = "1" if on else "0"


def _rings(ctx) -> dict:
    """The three ring collectives, strict and not; the tracer's record of the strict run."""
    out = {}
    for strict in (False, True):
        _strict(strict)
        x = torch.arange(37, dtype=torch.float64) * (ctx.rank + 1)  # 37: uneven chunks
        with CommTracer() as tracer:
            total = ring_all_reduce(x.clone())
            shard = ring_reduce_scatter(x)
            whole = ring_all_gather(shard, 37)
        out[strict] = {"all_reduce": total, "reduce_scatter": shard, "all_gather": whole,
                       "batched": all(e.batched for e in tracer.events),
                       "ops": sorted({e.op for e in tracer.events}), "sent": tracer.measured_bytes_sent(),
                       "strict": ops.strict_p2p()}
    ref = torch.arange(37, dtype=torch.float64) * sum(range(1, ctx.world_size + 1))
    out["reference"] = ref
    return out


@pytest.mark.timeout(3 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_collectives_run_under_strict_mode(n):
    for rank, got in enumerate(run_ranks(_rings, n, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=30)):
        plain, strict = got[False], got[True]
        assert strict["strict"] and not plain["strict"]
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            assert torch.equal(strict[op], plain[op]), (n, rank, op)
        assert torch.equal(strict["all_reduce"], got["reference"])  # integer-valued: exact
        assert torch.equal(strict["all_gather"], got["reference"])
        assert strict["batched"] and strict["ops"] == ["irecv", "isend"]
        # measured from the tensors of the groups: all-reduce's formula, then S - c_r (reduce-scatter) and
        # S - c_(r+1) (all-gather) float64 elements
        c = chunk_sizes(37, n)
        formula = ring_bytes_sent(37, n, rank, 8) + 8 * (37 - c[rank]) + 8 * (37 - c[(rank + 1) % n])
        assert strict["sent"] == plain["sent"] == formula, (n, rank)


def _ring_attention(ctx) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 8 * ctx.world_size, 4, generator=g, dtype=torch.float64)  # [b, a, s, d]
                   for _ in range(4))
    out = {}
    for strict in (False, True):
        _strict(strict)
        part = [sl.split_sequence(t, dim=2, cp_rank=ctx.rank, cp_size=ctx.world_size, layout="zigzag")
                for t in (q, k, v, do)]
        ql, kl, vl = (t.clone().requires_grad_() for t in part[:3])
        y = ra.ring_attention(ql, kl, vl, cp_group=None, causal=True, layout="zigzag")
        y.backward(part[3])
        out[strict] = [y.detach(), ql.grad, kl.grad, vl.grad]
    return out


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_forward_and_backward_run_under_strict_mode(cp):
    for got in run_ranks(_ring_attention, cp, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=30):
        # strict mode only waits: the same bits (tests/ranks/test_ring_attention.py proves them against one
        # device)
        assert all(torch.equal(a, b) for a, b in zip(got[True], got[False], strict=True))


def _pipeline(ctx) -> dict:
    p = ctx.world_size
    config = ModelConfig(num_layers=2 * p, hidden_size=16, num_attention_heads=2, max_seq_len=S,
                         tie_word_embeddings=True, ffn_hidden_size=48)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (M * B, S + 1), generator=g)
    out = {}
    for name, v in CASES:
        for strict in (False, True):
            _strict(strict)
            pipe = PipelineModule(GPT(config, seed=0), pp_group=None, pp_rank=ctx.rank, pp_size=p,
                                  schedule=name, virtual_stages=v)
            loss = pipe.step(tokens[:, :-1], tokens[:, 1:], num_microbatches=M,
                             loss_fn=lambda logits, y: lm_loss(logits, y, num_tokens=M * B * S))
            out[name, strict] = (loss.item(), {n: q.grad.clone() for n, q in pipe.named_parameters_full()})
    # compared here: the results travel back as plain values (many tensors through the queue do not)
    same = {}
    for name, _ in CASES:
        (loss, grads), (strict_loss, strict_grads) = out[name, False], out[name, True]
        same[name] = (strict_loss == loss, sorted(grads) == sorted(strict_grads),
                      all(torch.equal(g, grads[n]) for n, g in strict_grads.items()))
    return same


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
@pytest.mark.parametrize("pp", [2, 4])
def test_a_tied_pipeline_runs_every_schedule_under_strict_mode(pp):
    for got in run_ranks(_pipeline, pp, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=30):
        for name, _ in CASES:  # strict mode only waits: the same loss, the same gradients' bits
            assert got[name] == (True, True, True), name


def _old_ordering(ctx) -> dict:
    """The pre-batching exchange (irecv then isend, unbatched, on both ranks of a pair), plain and strict."""
    peer = 1 - ctx.rank
    mine, theirs = torch.full((4,), float(ctx.rank)), torch.empty(4)

    def old() -> None:
        works = [ops.irecv(theirs, src=peer), ops.isend(mine, dst=peer)]
        for w in works:
            w.wait()

    out = {}
    _strict(False)
    old()
    out["plain"] = theirs.tolist()
    _strict(True)
    for w in ops.batch_isend_irecv([ops.P2POp(dist.irecv, theirs, peer), ops.P2POp(dist.isend, mine, peer)]):
        w.wait()
    out["batched"] = theirs.tolist()
    try:
        old()
        out["strict"] = "completed"
    except RuntimeError as e:
        out["strict"] = str(e).strip().splitlines()[0]
    return out


@pytest.mark.timeout(120)
def test_negative_control_the_old_ordering_hangs_under_strict_mode_only():
    ranks = run_ranks(_old_ordering, 2, timeout_s=90, collective_timeout_s=3)
    for rank, got in enumerate(ranks):
        assert got["plain"] == got["batched"] == [float(1 - rank)] * 4  # gloo lets it pass; batched is fine
        # strict: each receive waits for a send queued behind the peer's receive. A rank's 3 s timeout
        # fires; the peer reports its own timeout, or (CI saw it once) the connection its peer closed on
        # giving up, whichever comes first
        strict = got["strict"].lower()
        assert "timed out" in strict or "connection closed by peer" in strict, got["strict"]
        print(f"rank {rank}, strict, irecv then isend: {got['strict']}")
    assert any("timed out" in got["strict"].lower() for got in ranks), [got["strict"] for got in ranks]


def _trainer(corpus: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
            ops.STRICT_P2P_ENV: "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
            "REFIMPL_CACHE": str(tmp_path / "cache")}
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "32", "--steps", "2",
            "--batch-size", "4", "--log-every", "1", "--data", str(corpus), "--out", str(tmp_path / "run"),
            "--cache-dir", str(tmp_path / "cache"), "--nproc-per-node", "2", "--timeout", "120", *flags]
    return subprocess.run(["timeout", "-k", "10", "300", sys.executable, "-m", "refimpl.train", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=330)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("flags", [("--cp", "2", "--cp-method", "ring"),
                                   ("--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2")],
                         ids=["cp2-ring", "pp2-1f1b"])
def test_the_trainer_finishes_under_strict_mode(corpus, tmp_path, flags):
    proc = _trainer(corpus["corpus"], tmp_path, *flags)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report  # 124: timeout killed a hang
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2, report


def _one_at_a_time(p: int, m: int) -> list[list[Action]]:
    return [[a for i in range(m) for a in (Action("F", r, i), Action("B", r, i))] for r in range(p)]


def test_every_schedules_transfer_plan_completes_under_nccls_rule():
    checked = 0
    for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (1, 2, 3)), ("zbh1", (1,))):
        for p in range(2, 6):
            for m in range(1, 9):
                for v in vs:
                    if name == "interleaved" and m % p:
                        continue
                    table = build_schedule(name, pp_size=p, num_microbatches=m, virtual_stages=v)
                    found = table if v > 1 else None  # multi-chunk lists: inferred alike on every rank
                    assert all(find_table(t, pp_size=p) == found for t in table)
                    for given in (None, table):  # the executor's default, and the rounds from the table
                        plans = [p2p_plan(t, num_stages=p * v, pp_size=p, table=given) for t in table]
                        assert strict_deadlock(plans) is None, (name, p, m, v, given is None)
                    local = strict_deadlock([_local_plan(t, num_stages=p * v, pp_size=p) for t in table])
                    assert local is None or v > 1, (name, p, m, v)  # several chunks: not always
                    checked += 1
    assert checked > 100
    # the local rule on interleaved 1F1B: rank 1 sends a gradient with the receive of an activation that
    # rank 0 posts only after a send rank 1 receives later: a deadlock, which the rounds avoid
    table = build_schedule("interleaved", pp_size=2, num_microbatches=4, virtual_stages=2)
    assert "rank 0" in (strict_deadlock([_local_plan(t, num_stages=4, pp_size=2) for t in table]) or "")
    # a hand-made list (chapter 08's negative control) is no named schedule: the local rule, deadlock-free
    hand = _one_at_a_time(2, 4)
    assert find_table(hand[0], pp_size=2) is None
    assert strict_deadlock([p2p_plan(t, num_stages=2, pp_size=2) for t in hand]) is None
    # the checker's own negative control: both ranks receive, then send, as two groups (unbatched); posted
    # as one group each they complete
    r0 = [[P2PAction("recv_activation", 0, 0, 1)], [P2PAction("send_grad", 1, 0, 1)]]
    r1 = [[P2PAction("recv_grad", 1, 0, 0)], [P2PAction("send_activation", 0, 0, 0)]]
    assert strict_deadlock([r0, r1]) is not None
    assert strict_deadlock([[r0[0] + r0[1]], [r1[0] + r1[1]]]) is None
