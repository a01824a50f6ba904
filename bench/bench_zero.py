"""Benchmark of chapter 04: our ZeRO-3 (FullyShardedDataParallel) against FSDP2 (fully_shard), side by side.

    python -m bench.bench_zero [--ranks 2] [--steps 10] [--warmup 2] [--micro-batch 4] [--seq-len 128]

For each world size one set of CPU ranks (gloo) builds the course's default GPT (4 layers, hidden 128,
tied embeddings) three times from the same seed: ours without prefetch, ours with ``prefetch=True``, and
FSDP2 (``fully_shard`` on each block, then on the model: the same units). Each trains with AdamW on the
same shards of the same batches.

1. **Peak bytes per rank** of parameters + gradients + optimizer state, over one whole training step
   (forward, backward, optimizer), sampled after every tensor operation by
   ``refimpl.measure.PeakStateBytes``. Counted from the tensors, each storage once:
   parameters = shards + gathered full parameters + all-gather outputs in flight (a prefetch), gradients
   = shards + full gradients not yet reduced, and the optimizer state. Reduce-scatter buffers and
   activations are left out on both sides. For FSDP2 the tensors are read from its ``FSDPParam`` objects
   (private attributes of torch 2.13: ``sharded_param``, ``_unsharded_param``, ``all_gather_outputs``,
   ``unsharded_accumulated_grad``, the group's ``_all_gather_result``).
2. **Step time**: steps are **interleaved** (ours, ours + prefetch, FSDP2, ours, ...) with a barrier before
   each so all see the same load; per rank the median over the measured steps, then the slowest rank's
   median. On CPU compare ratios only.
3. A sanity check: after the same steps, our parameters and FSDP2's are compared (bit for bit expected).

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; the models, batches and
FSDP2's mesh on ``ctx.device``, the CPU under gloo): the state bytes are counted from the tensors wherever
they live, and the step-time ratio is taken on the same CPU ranks.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

KiB = 1024


def fsdp2_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """What FSDP2 holds now in parameters, gradients and optimizer state (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    from refimpl.measure import state_bytes

    params, grads = [], []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            in_flight = getattr(group, "_all_gather_result", None)
            if in_flight is not None:
                params.append(in_flight.all_gather_output)
            for fp in group.fsdp_params:
                params.append(fp.sharded_param)
                params += list(getattr(fp, "all_gather_outputs", []))
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    params.append(unsharded)
                    grads.append(unsharded.grad)
                grads.append(getattr(fp, "unsharded_accumulated_grad", None))
    return state_bytes(params, optimizer, extra_grads=grads)


def _worker(ctx, steps: int, warmup: int, micro_batch: int, seq_len: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refimpl.config import ModelConfig
    from refimpl.measure import PeakStateBytes
    from refimpl.models import GPT, lm_loss
    from refimpl.optim import param_groups
    from refimpl.parallel.zero import FullyShardedDataParallel

    cfg = ModelConfig(max_seq_len=seq_len)
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(ctx.rank)
    data = [torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g).to(ctx.device)
            for _ in range(1 + warmup + steps)]

    variants = {}
    for name, prefetch in (("ours", False), ("ours + prefetch", True)):
        model = FullyShardedDataParallel(GPT(cfg, seed=0).to(ctx.device), prefetch=prefetch)
        opt = torch.optim.AdamW(param_groups(model, 0.1), **adamw)
        variants[name] = (model, opt, lambda m=model, o=opt: m.state_bytes(o))
    model = GPT(cfg, seed=0).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model, 0.1), **adamw)
    variants["FSDP2"] = (model, opt, lambda m=model, o=opt: fsdp2_state_bytes(m, o))

    def step(model, opt, batch):
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"peak": {}, "rest": {}, "samples": {}, "times": {k: [] for k in variants}}
    for name, (model, opt, count) in variants.items():  # step 0: lazy init + optimizer state, measured
        torch.distributed.barrier()
        with PeakStateBytes(count) as peak:
            step(model, opt, data[0])
        out["peak"][name] = peak.peak
        out["samples"][name] = peak.samples
        out["rest"][name] = count()
    for i, batch in enumerate(data[1:]):
        for name, (model, opt, _) in variants.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(model, opt, batch)
            if i >= warmup:
                out["times"][name].append(time.perf_counter() - t0)
    # after the timed steps too, the peak of one more step (state and grads already allocated)
    for name, (model, opt, count) in variants.items():
        torch.distributed.barrier()
        with PeakStateBytes(count) as peak:
            step(model, opt, data[-1])
        if peak.peak.total > out["peak"][name].total:
            out["peak"][name] = peak.peak
    ours = variants["ours"][0].full_state_dict()
    theirs = {k: v.full_tensor() for k, v in variants["FSDP2"][0].named_parameters()}
    out["bitwise"] = all(torch.equal(ours[k], theirs[k]) for k in ours)
    out["median_s"] = {k: statistics.median(v) for k, v in out.pop("times").items()}
    out["params"] = sum(p.numel() for p in GPT(cfg).parameters())
    return out


def run(ranks: list[int], steps: int, warmup: int, micro_batch: int, seq_len: int) -> str:
    from refimpl.launch import run_ranks

    lines = [
        "| ranks | implementation | peak params + grads + state per rank | of which params / grads / state "
        "| at rest | median step | / FSDP2 |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for world in ranks:
        per_rank = run_ranks(_worker, world, steps, warmup, micro_batch, seq_len, timeout_s=1800,
                             backend="gloo")
        names = list(per_rank[0]["peak"])
        step_s = {n: max(r["median_s"][n] for r in per_rank) for n in names}
        for n in names:
            worst = max(per_rank, key=lambda r, n=n: r["peak"][n].total)
            p = worst["peak"][n]
            rest = max(r["rest"][n].total for r in per_rank)
            parts = f"{p.weights / KiB:,.1f} / {p.grads / KiB:,.1f} / {p.optimizer / KiB:,.1f} KiB"
            lines.append(
                f"| {world} | {n} | {p.total / KiB:,.1f} KiB | {parts} | {rest / KiB:,.1f} KiB | "
                f"{step_s[n] * 1e3:.1f} ms | {step_s[n] / step_s['FSDP2']:.3f} |")
        peaks = {n: max(r["peak"][n].total for r in per_rank) for n in names}
        ratio, ratio_pf = peaks["ours"] / peaks["FSDP2"], peaks["ours + prefetch"] / peaks["FSDP2"]
        notes.append(f"{world} ranks: {per_rank[0]['params']:,d} parameters; ours / FSDP2 peak bytes = "
                     f"{ratio:.3f} (with prefetch: {ratio_pf:.3f}); parameters bit-identical to FSDP2 after "
                     f"the same steps: "
                     f"{all(r['bitwise'] for r in per_rank)}; samples per measured step: "
                     f"{min(min(r['samples'].values()) for r in per_rank):,d}+")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_zero", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--steps", type=int, default=10, help="measured steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.ranks, args.steps, args.warmup, args.micro_batch, args.seq_len)
    print(table)
    print(f"\n({args.steps} measured steps after {args.warmup} warm-up, interleaved; default GPT, "
          f"{args.micro_batch} x {args.seq_len} tokens per rank per step; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
