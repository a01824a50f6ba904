"""Benchmark of chapter 06: our tensor-parallel GPT against the same model under PyTorch's DTensor TP.

    python -m bench.bench_tensor_parallel [--tp 2 4] [--steps 8] [--warmup 2] [--micro-batch 4]
                                          [--seq-len 128] [--arch gpt2|llama] [--num-kv-heads G]

For each tensor-parallel size ``t`` one set of CPU ranks (gloo, world = t) builds the course's default GPT
(4 layers, hidden 128, 4 heads) with an **untied** output layer (a tied head cannot be given to
``parallelize_module`` twice) three times from the same seed:

* ours: ``refimpl.parallel.tensor_parallel.apply_tensor_parallel`` (column/row-parallel attention and
  MLP, vocab-parallel embedding and head) and ``refimpl.parallel.tensor_parallel.tp_lm_loss``;
* ours + SP: the same with ``sequence_parallel=True`` (Korthikanti et al. 2022), the replicated
  parameters' gradients summed after backward (``allreduce_sequence_parallel_grads``);
* DTensor: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` on
  ``query_key_value`` and ``dense_h_to_4h``, ``RowwiseParallel`` on ``dense`` and ``dense_4h_to_h``
  (local outputs, so SDPA runs on plain tensors: it takes no DTensor on the CPU, and the attention
  modules get ``a/t`` heads), ``RowwiseParallel(input_layouts=Replicate())`` on the word embedding and
  ``ColwiseParallel(output_layouts=Shard(-1))`` on the head, the loss under ``loss_parallel()``.

Each trains with AdamW on the same batches (every rank of the group sees the same tokens). ``--arch llama``
(with ``--num-kv-heads G``) is the Llama form (RMSNorm, RoPE, GQA, SwiGLU, no biases) under the same plan:
its fused qkv rows are grouped by key/value head and SwiGLU's gate/up rows interleaved, so DTensor's plain
row split is right whenever ``t`` divides ``G``; with fewer key/value heads than ``t`` DTensor's split
would cut a group (no plan of that form exists for it), so only ours runs
(``refimpl.models.gpt_sharding.SharedKeyValueQKV``) and the ratios are to ours.

1. **Step time** (forward + loss + backward + AdamW), and the forward + backward part alone (up to the
   end of backward and, under SP, the gradient sums; AdamW on DTensor parameters dispatches per DTensor):
   steps interleaved (ours, ours + SP, DTensor, ours, ...) with a barrier before each; per rank the median
   over the measured steps, then the slowest rank's median. On CPU compare ratios only; gloo's
   reduce-scatter is built from an all-reduce, so CPU timings say nothing of NCCL.
2. **Collectives per step and rank**: ours counted and sized by ``refimpl.comm.CommTracer`` (payload
   = the full tensor, ``nbytes``), beside the planner's ``refimpl.planner.tensor_parallel_collectives``
   and the ring model's bytes sent (``refimpl.planner.wire_bytes``: ``2(t-1)/t b s h`` floats per
   all-reduce of the blocks); DTensor's collectives counted by ``CommDebugMode`` (counts only).
3. A sanity check: the first step's loss of ours and DTensor's, side by side.

**Pinned to gloo on the CPU**, also on a GPU box (``run_ranks(..., backend="gloo")``; the models, batches
and DTensor's mesh on ``ctx.device``, the CPU under gloo): DTensor's SDPA and gloo's reduce-scatter behave
otherwise on GPUs, so these CPU ratios say nothing of NCCL.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

KiB = 1024


def dtensor_gpt(cfg, mesh):
    """The course GPT under PyTorch's DTensor TP over ``mesh`` (1-D): the plan of the module docstring."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from refimpl.models import GPT

    model = GPT(cfg, seed=0).to(mesh.device_type)  # the mesh's device: parallelize_module shards in place
    t = mesh.size()
    for block in model.layers:
        parallelize_module(block, mesh, {
            "self_attention.query_key_value": ColwiseParallel(use_local_output=True),
            "self_attention.dense": RowwiseParallel(use_local_output=True),
            "mlp.dense_h_to_4h": ColwiseParallel(use_local_output=True),
            "mlp.dense_4h_to_h": RowwiseParallel(use_local_output=True)})
        block.self_attention.num_heads = cfg.num_attention_heads // t  # the local qkv holds a/t heads
    parallelize_module(model, mesh, {
        "embedding.word_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output_layer": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    return model


def model_config(seq_len: int, arch: str, kv_heads: int | None):
    """The default model, untied, in ``arch``'s form (``kv_heads``: its key/value heads)."""
    from refimpl.config import ARCHS, ModelConfig

    kv = {} if kv_heads is None else {"num_key_value_heads": kv_heads}
    return ModelConfig(**{**ARCHS[arch], "tie_word_embeddings": False}, max_seq_len=seq_len, **kv)


def _worker(ctx, steps: int, warmup: int, micro_batch: int, seq_len: int, arch: str,
            kv_heads: int | None) -> dict:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    from refimpl.comm import CommTracer
    from refimpl.models import GPT, lm_loss
    from refimpl.parallel.tensor_parallel import (
        allreduce_sequence_parallel_grads,
        apply_tensor_parallel,
        tp_lm_loss,
    )

    # DTensor's embedding style hooks a module whose input (token ids) needs no gradient: torch warns
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = model_config(seq_len, arch, kv_heads)
    group, t = dist.group.WORLD, ctx.world_size
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank of the tensor-parallel group
    data = [torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g).to(ctx.device)
            for _ in range(1 + warmup + steps)]

    def ours(sp: bool):
        model = apply_tensor_parallel(GPT(cfg, seed=0).to(ctx.device), tp_group=group, sequence_parallel=sp)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def step(batch) -> float:
            loss = tp_lm_loss(model(batch[:, :-1]), batch[:, 1:], tp_group=group, vocab_size=cfg.vocab_size)
            loss.backward()
            if sp:
                allreduce_sequence_parallel_grads(model, group)
            backward_done.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return step

    def dtensor():
        model = dtensor_gpt(cfg, init_device_mesh(ctx.device.type, (t,)))
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def step(batch) -> float:
            with loss_parallel():
                loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
                loss.backward()
            backward_done.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.full_tensor().item()

        return step

    backward_done: list[float] = []  # each step appends the time its backward (and gradient sums) ended
    variants = {"ours": ours(False), "ours + SP": ours(True)}
    if cfg.num_key_value_heads >= t:  # DTensor's row split keeps whole query groups only then
        variants["DTensor"] = dtensor()
    out: dict = {"first_loss": {}, "times": {k: [] for k in variants}, "fwd_bwd": {k: [] for k in variants}}
    for name, step in variants.items():
        dist.barrier()
        out["first_loss"][name] = step(data[0])
    for i, batch in enumerate(data[1:]):
        for name, step in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(batch)
            if i >= warmup:
                out["times"][name].append(time.perf_counter() - t0)
                out["fwd_bwd"][name].append(backward_done[-1] - t0)
    out["collectives"] = {}
    for name in ("ours", "ours + SP"):
        dist.barrier()
        with CommTracer() as tracer:
            variants[name](data[-1])
        out["collectives"][name] = {op: (s.count, s.nbytes, s.wire_bytes)
                                    for op, s in tracer.summary().items()}
    if "DTensor" in variants:
        dist.barrier()
        with CommDebugMode() as comm:
            variants["DTensor"](data[-1])
        out["dtensor_counts"] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    out["median_s"] = {k: statistics.median(v) for k, v in out.pop("times").items()}
    out["median_fwd_bwd_s"] = {k: statistics.median(v) for k, v in out.pop("fwd_bwd").items()}
    return out


def _ops(c: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(c.items()))


def run(sizes: list[int], steps: int, warmup: int, micro_batch: int, seq_len: int, arch: str = "gpt2",
        kv_heads: int | None = None) -> str:
    from refimpl.launch import run_ranks
    from refimpl.planner import tensor_parallel_collectives, wire_bytes

    cfg = model_config(seq_len, arch, kv_heads)
    x = micro_batch * seq_len * cfg.hidden_size
    lines = ["| t | implementation | median step | / DTensor (or ours) | forward + backward / DTensor's | "
             "collectives per step (traced) | payload | ring-model bytes sent per rank | "
             "planned (counts, payload) |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for t in sizes:
        per_rank = run_ranks(_worker, t, steps, warmup, micro_batch, seq_len, arch, kv_heads, timeout_s=900,
                             backend="gloo")
        names = list(per_rank[0]["median_s"])
        base = "DTensor" if "DTensor" in names else "ours"
        step_s = {n: max(r["median_s"][n] for r in per_rank) for n in names}
        fb_s = {n: max(r["median_fwd_bwd_s"][n] for r in per_rank) for n in names}
        for n in names:
            traced = per_rank[0]["collectives"].get(n)
            if traced is None:
                counts, payload, wire, planned = _ops(per_rank[0]["dtensor_counts"]), "-", "-", "-"
            else:
                same = all(r["collectives"][n] == traced for r in per_rank)
                counts = _ops({op: c for op, (c, _, _) in traced.items()})
                counts += "" if same else " (ranks differ)"
                payload = f"{sum(b for _, b, _ in traced.values()) / KiB:,.1f} KiB"
                wire = f"{sum(w for _, _, w in traced.values()) / KiB:,.1f} KiB"
                plan = tensor_parallel_collectives(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                                   micro_batch=micro_batch, seq_len=seq_len, tp=t,
                                                   sequence_parallel=n.endswith("SP"), config=cfg)
                equal = plan == {op: (c, b) for op, (c, b, _) in traced.items()}
                planned_bytes = sum(b for _, b in plan.values())
                planned = f"{'equal' if equal else 'DIFFERENT'} ({planned_bytes / KiB:,.1f} KiB)"
            lines.append(f"| {t} | {n} | {step_s[n] * 1e3:.1f} ms | {step_s[n] / step_s[base]:.3f} | "
                         f"{fb_s[n] / fb_s[base]:.3f} | {counts} | {payload} | {wire} | {planned} |")
        per_ar = wire_bytes("all_reduce", 4 * x, t)
        losses = per_rank[0]["first_loss"]
        theirs = (f", DTensor {losses['DTensor']:.6f} (|ours - DTensor| = "
                  f"{abs(losses['ours'] - losses['DTensor']):.1e})" if "DTensor" in losses else
                  f"; no DTensor row: {cfg.num_key_value_heads} key/value heads over {t} ranks")
        notes.append(f"t = {t}: one all-reduce of b s h = {x:,d} floats sends 2(t-1)/t x "
                     f"{4 * x / KiB:,.1f} KiB = {per_ar / KiB:,.1f} KiB per rank (ring model); first-step "
                     f"loss ours {losses['ours']:.6f}, ours + SP {losses['ours + SP']:.6f}{theirs}")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_tensor_parallel",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes (= ranks)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (the same on every rank)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--num-kv-heads", type=int, default=None, help="key/value heads (default: the heads)")
    args = p.parse_args(argv)
    start = time.time()
    table = run(args.tp, args.steps, args.warmup, args.micro_batch, args.seq_len, args.arch,
                args.num_kv_heads)
    print(table)
    form = "" if args.arch == "gpt2" else f", Llama form with {args.num_kv_heads} key/value heads"
    print(f"\n({args.steps} measured steps after {args.warmup} warm-up, interleaved; default GPT{form} with "
          f"an untied head, {args.micro_batch} x {args.seq_len} tokens per step; gloo on CPU ranks; torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}; {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
