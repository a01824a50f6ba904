"""Benchmark and proof of 2-D sharding: our ZeRO-3 over tensor-parallel shards against PyTorch's
``fully_shard`` over DTensor TP, at dp 2 x tp 2 (chapters 04 and 06).

    python -m bench.bench_fsdp_tp [--steps 8] [--warmup 2] [--micro-batch 4] [--seq-len 128]

One set of 4 CPU ranks (gloo) builds the course's GPT with an **untied** output layer (a tied head cannot
be handed to ``parallelize_module`` twice) from the same seed, twice, in the same processes:

* ours: ``refimpl.parallel.parallelize`` at ``ParallelDims(dp=2, tp=2)`` with ZeRO-3: tensor
  parallelism first (column/row-parallel attention and MLP, vocab-parallel embedding and head), then
  ``refimpl.parallel.zero.FullyShardedDataParallel`` over the dp group, each rank holding the dp rows
  of its TP blocks (``inner.within(rows)``); the vocab-parallel loss;
* PyTorch: ``bench.bench_tensor_parallel.dtensor_gpt`` on the mesh's ``tp`` dimension
  (``parallelize_module``), then ``fully_shard`` on each block and the root over its ``dp`` dimension
  (FSDP2 over DTensor TP: torch's own 2-D composition), the loss under ``loss_parallel()``.

Both train with plain AdamW (no weight-decay groups, no clipping) on the same batches: dp rank ``i`` reads
sequences ``[i B/2, (i+1) B/2)`` of the global batch, the two tp ranks of a replica the same ones.

1. **The same model** (``run_proof``): after the steps, every parameter, assembled whole from each rank's
   boxes (ours) or ``full_tensor()`` (PyTorch), against one device trained on the whole batch in the same
   processes, within ``FACTOR x spread`` (``spread``: how far one device moves when only the summation
   order changes, the batch in 2 and in 4 micro-batches against 1); and ours against PyTorch's within the
   same. Before that, the first step's reduced gradients, whole, before AdamW (which would hide a gradient
   off by a constant factor), against one device's, per tensor relative to its largest element. The ZeRO
   collectives per step (all-gather, reduce-scatter: count and payload) against
   ``refimpl.planner.zero_collectives`` of the rank's TP-local shapes over dp.
2. **Step time** (forward + loss + backward + AdamW), interleaved with a barrier before each, median over
   the measured steps, slowest rank; and the model state each rank holds at rest after a step (parameter
   shards, gradient shards, AdamW state: ours ``FullyShardedDataParallel.state_bytes``, PyTorch's the
   local tensors of its DTensors). On CPU compare ratios only.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; the models, batches and
the (dp, tp) mesh on ``ctx.device``, the CPU under gloo): the proof's one-device references run in the same
CPU processes, and tests/ranks/test_fsdp_tp.py runs ``proof_worker`` on CPU ranks too.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

FACTOR = 4.0  # x the one-device summation-order spread (tests/ranks/lane2/test_zero.py's rule)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)


def _batches(cfg, *, micro_batch: int, seq_len: int, n: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g).to(device)
            for _ in range(n)]


def _ours(cfg, ctx):
    """Our dp 2 x tp 2 ZeRO-3: (step(batch) -> loss, full parameters (collective), state bytes)."""
    from refimpl.distributed import ParallelDims
    from refimpl.distributed.placement import module_shards
    from refimpl.models import GPT
    from refimpl.parallel.parallelize import parallelize

    dims = ParallelDims(dp=2, tp=2)
    groups = dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
    par = parallelize(GPT(cfg, seed=0).to(ctx.device), groups, dims.config(zero_stage=3))
    opt = torch.optim.AdamW(par.state_module.parameters(), **ADAMW)
    dp_rank = groups.coords.dp

    def step(batch: torch.Tensor, grads: dict | None = None) -> float:
        part = batch.chunk(2)[dp_rank]  # [B/2, s+1]: this replica's sequences
        loss = par.loss(par.forward(part[:, :-1]), part[:, 1:])
        loss.backward()
        if grads is not None:  # the reduced gradient shards, whole, before AdamW (a collective)
            held = module_shards(par.state_module).items()
            grads.update(_assemble({n: (sh.tensor.grad, sh.box) for n, sh in held
                                    if sh.tensor.grad is not None}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def full() -> dict[str, torch.Tensor]:
        return _assemble({n: (sh.tensor, sh.box) for n, sh in module_shards(par.state_module).items()})

    return step, full, lambda: par.state_module.state_bytes(opt).total


def _assemble(shards: dict) -> dict[str, torch.Tensor]:
    """``{name: (tensor, box)}`` of every rank gathered and written into whole tensors (a collective)."""
    import torch.distributed as dist

    mine = [(n, box, t.detach().clone()) for n, (t, box) in shards.items()]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for name, box, t in (item for part in parts for item in part):
        out.setdefault(name, t.new_empty(box.global_shape))[box.slices()] = t
    return out


def _torch(cfg, ctx):
    """FSDP2 over DTensor TP on a (dp, tp) mesh of ``ctx.device``: (step, full parameters, state bytes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from bench.bench_tensor_parallel import dtensor_gpt
    from refimpl.models import lm_loss

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = dtensor_gpt(cfg, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    dp_rank = mesh["dp"].get_local_rank()

    def step(batch: torch.Tensor, grads: dict | None = None) -> float:
        part = batch.chunk(2)[dp_rank]
        with loss_parallel():
            loss = lm_loss(model(part[:, :-1]), part[:, 1:])
            loss.backward()
        if grads is not None:  # the reduced gradients, whole, before AdamW (a collective)
            grads.update({n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor().item()

    def full() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    def state() -> int:
        local = [p.to_local() for p in model.parameters()]
        local += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        local += [v.to_local() if hasattr(v, "to_local") else v
                  for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in local)

    return step, full, state


def _one_device(cfg, batches: list[torch.Tensor], micro: int,
                grads: dict | None = None) -> dict[str, torch.Tensor]:
    """One device's parameters after ``batches`` (each in ``micro`` micro-batches); the first step's
    gradients before AdamW into ``grads``."""
    from refimpl.models import GPT, lm_loss

    model = GPT(cfg, seed=0).to(batches[0].device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for i, batch in enumerate(batches):
        for part in batch.chunk(micro):
            (lm_loss(model(part[:, :-1]), part[:, 1:]) / micro).backward()
        if i == 0 and grads is not None:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel_diff(a: dict, b: dict) -> float:
    """The worst tensor's ``max |a - b| / max |b|``."""
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def proof_worker(ctx, steps: int, micro_batch: int, seq_len: int) -> dict:
    """``steps`` AdamW steps of both; the distances of section 1 and our traced ZeRO collectives."""
    import warnings

    from refimpl.comm import CommTracer
    from refimpl.config import ModelConfig

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_len=seq_len,
                      tie_word_embeddings=False)
    batches = _batches(cfg, micro_batch=micro_batch, seq_len=seq_len, n=steps, device=ctx.device)
    ours_step, ours_full, ours_state = _ours(cfg, ctx)
    torch_step, torch_full, torch_state = _torch(cfg, ctx)
    grads: dict[str, dict] = {"ours": {}, "torch": {}, "one": {}, "one, 2 micro-batches": {}}
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            with CommTracer() as tracer:
                ours_step(batch)
        else:
            ours_step(batch, grads["ours"] if i == 0 else None)
        torch_step(batch, grads["torch"] if i == 0 else None)
    ours, theirs = ours_full(), torch_full()
    single = _one_device(cfg, batches, 1, grads["one"])
    spread = max(_max_diff(_one_device(cfg, batches, m, grads["one, 2 micro-batches"] if m == 2 else None),
                           single) for m in (2, 4))
    one, order = grads["one"], grads["one, 2 micro-batches"]  # the gradients' yardstick: another order
    grad_spread = max(((order[k] - one[k]).abs().max() / one[k].abs().max()).item() for k in one)
    return {"spread": spread, "ours_vs_one": _max_diff(ours, single),
            "torch_vs_one": _max_diff(theirs, single), "ours_vs_torch": _max_diff(ours, theirs),
            "state_bytes": {"ours": ours_state(), "torch": torch_state()},
            "one_step_short": _max_diff(_one_device(cfg, batches[:-1], 1), single),  # the negative control
            "grad_spread": grad_spread,  # per tensor |g - g_one| / max|g_one|, the worst tensor
            "grads_ours_vs_one": _rel_diff(grads["ours"], one),
            "grads_torch_vs_one": _rel_diff(grads["torch"], one),
            "grads_x2_vs_one": _rel_diff({k: 2 * v for k, v in grads["ours"].items()}, one),
            "ops": {op: (s.count, s.nbytes) for op, s in tracer.summary().items()},
            "tp_shapes": _tp_local_unit_shapes(cfg, ctx.rank % 2)}


def _tp_local_unit_shapes(cfg, tp_rank: int) -> list[list[tuple[int, ...]]]:
    """The TP-local shapes of the rank's parameters per ZeRO-3 unit (root first, then each block)."""
    from refimpl.planner.param_table import param_table

    table = param_table(cfg, tp=2)
    root = [q.shape for q in table.embedding + table.final_layernorm + table.output_layer]
    return [root, *[[q.shape for q in block] for block in table.blocks]]


def time_worker(ctx, steps: int, warmup: int, micro_batch: int, seq_len: int) -> dict:
    import warnings

    import torch.distributed as dist

    from refimpl.config import ModelConfig

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = ModelConfig(max_seq_len=seq_len, tie_word_embeddings=False)
    batches = _batches(cfg, micro_batch=micro_batch, seq_len=seq_len, n=warmup + steps, device=ctx.device)
    impls = {"ours (ZeRO-3 over TP)": _ours(cfg, ctx),
             "PyTorch (fully_shard over DTensor TP)": _torch(cfg, ctx)}
    times: dict[str, list[float]] = {k: [] for k in impls}
    for i, batch in enumerate(batches):
        for name, (step, _, _) in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "state_bytes": {k: state() for k, (_, _, state) in impls.items()}}


def run(steps: int, warmup: int, micro_batch: int, seq_len: int) -> str:
    from refimpl.launch import run_ranks

    per_rank = run_ranks(time_worker, 4, steps, warmup, micro_batch, seq_len, timeout_s=900, backend="gloo")
    names = list(per_rank[0]["median_s"])
    step_s = {n: max(r["median_s"][n] for r in per_rank) for n in names}
    state = {n: max(r["state_bytes"][n] for r in per_rank) for n in names}
    ref = names[1]
    lines = ["| dp x tp | implementation | median step | / PyTorch | state per rank at rest (largest) | "
             "/ PyTorch |", "|---|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| 2 x 2 | {n} | {step_s[n] * 1e3:.1f} ms | {step_s[n] / step_s[ref]:.3f} | "
                     f"{state[n] / 1024:,.1f} KiB | {state[n] / state[ref]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_fsdp_tp", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="measured steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (global, over dp 2)")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    start = time.time()
    print(run(args.steps, args.warmup, args.micro_batch, args.seq_len))
    print(f"\n({args.steps} measured steps after {args.warmup} warm-up, interleaved; default GPT with an "
          f"untied head, {args.micro_batch} x {args.seq_len} tokens per step over dp 2; gloo on 4 CPU "
          f"ranks; torch {torch.__version__}, {platform.processor() or platform.machine()}; "
          f"{time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
