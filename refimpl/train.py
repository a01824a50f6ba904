"""The trainer's command line: ``python -m refimpl.train`` (under torchrun for several ranks).

One process per device. Every rank builds the same model from the same seed, reads its own shard of each
global batch (:class:`refimpl.data.ShardedBatches`), and the gradients are averaged across ranks by data
parallelism before the AdamW step. Each step appends a JSON line to ``<out>/metrics.jsonl``; the end of the
run writes ``<out>/loss.png``, ``<out>/config.json`` and a text sample.

    python -m refimpl.train --steps 200                       # one process
    python -m refimpl.train --nproc-per-node 2                # launches torchrun for you (CPU: gloo)
    torchrun --nproc-per-node=8 -m refimpl.train --batch-size 64 --out runs/gpu

Bad input (an unknown flag, a missing data path, an empty corpus, heads that do not divide the width, more
ranks than the data can feed) stops with one line on stderr and exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from refimpl.config import ConfigError, DataConfig, ModelConfig, OptimConfig, TrainConfig
from refimpl.data import DataError, ShardedBatches, decode, encode, prepare_corpus
from refimpl.distributed import DistributedContext, init_distributed, log0, seed_everything, teardown
from refimpl.metrics import Throughput, format_bytes, format_mfu, peak_memory_bytes, progress
from refimpl.model import GPT, generate, lm_loss
from refimpl.optim import build_optimizer, lr_at, set_lr
from refimpl.planner import flops_per_token, param_count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refimpl.train",
        description="Train the course's byte-level GPT with data parallelism (run under torchrun, or pass "
        "--nproc-per-node to launch it). Writes metrics.jsonl, loss.png and config.json into --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=200, help="optimizer steps")
    run.add_argument("--batch-size", type=int, default=16, help="global batch in sequences (all ranks)")
    run.add_argument("--micro-batch-size", type=int, default=None,
                     help="sequences per rank per forward; fewer than batch/ranks means gradient accumulation")
    run.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    run.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    run.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up steps")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and sampling")
    run.add_argument("--data", default=None,
                     help="a text file or a folder of text files (default: Python's standard library source)")
    run.add_argument("--cache-dir", default=None, help="where prepared token files are kept")
    run.add_argument("--out", default="runs/default", help="the run folder")
    run.add_argument("--log-every", type=int, default=10, help="print a line every N steps")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    run.add_argument("--nproc-per-node", default=None,
                     help="launch this many ranks with torchrun ('auto' = one per GPU, else 2 CPU ranks)")
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-heads", type=int, default=4, help="attention heads; must divide --hidden-size")
    model.add_argument("--no-tie-embeddings", action="store_true", help="untie input and output embeddings")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_heads,
            max_seq_len=args.seq_len,
            tie_word_embeddings=not args.no_tie_embeddings,
        ),
        data=DataConfig(
            data=args.data,
            cache_dir=args.cache_dir,
            seq_len=args.seq_len,
            global_batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            seed=args.seed,
        ),
        optim=OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps),
        steps=args.steps,
        out=args.out,
        log_every=args.log_every,
        timeout_s=args.timeout,
    )


def check_fits(config: TrainConfig, world_size: int) -> ShardedBatches:
    """Everything that can be refused before a process group exists: batch split and data size."""
    config.data.accumulation_steps(world_size)
    corpus = prepare_corpus(config.data.data, config.data.cache_dir)
    return ShardedBatches(corpus.tokens, seq_len=config.data.seq_len,
                          global_batch_size=config.data.global_batch_size, seed=config.data.seed)


def train(config: TrainConfig, ctx: DistributedContext) -> list[dict]:
    """Run ``config.steps`` optimizer steps; return the per-step records (also written to metrics.jsonl)."""
    batches = check_fits(config, ctx.world_size)
    seed_everything(config.data.seed, rank=ctx.rank)
    out = Path(config.out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        (out / "metrics.jsonl").write_text("")

    model = GPT(config.model, seed=config.data.seed).to(ctx.device)
    ddp = DistributedDataParallel(model) if ctx.world_size > 1 else None
    optimizer = build_optimizer(model, config.optim)
    accumulation = config.data.accumulation_steps(ctx.world_size)
    micro = config.data.per_rank_batch(ctx.world_size) // accumulation
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    meter = Throughput(tokens_per_step=tokens_per_step, num_devices=ctx.world_size, device=ctx.device,
                       flops_per_token=flops_per_token(config.model, config.data.seq_len))
    log0(ctx, f"model: {param_count(config.model).total:,} parameters | world size {ctx.world_size} on "
              f"{ctx.device.type} ({ctx.backend}) | global batch {config.data.global_batch_size} x "
              f"{config.data.seq_len} tokens = {micro} per micro-batch x {accumulation} accumulation x "
              f"{ctx.world_size} ranks")

    records: list[dict] = []
    start = time.perf_counter()
    bar = progress(config.steps, enabled=ctx.is_main)
    for step in range(config.steps):
        lr = lr_at(step, config.optim, config.steps)
        set_lr(optimizer, lr)
        inputs, labels = batches.batch(step, ctx.rank, ctx.world_size)  # [B/W, s] each
        loss_sum = torch.zeros((), device=ctx.device)
        for i in range(accumulation):
            x = inputs[i * micro : (i + 1) * micro].to(ctx.device)
            y = labels[i * micro : (i + 1) * micro].to(ctx.device)
            last = i == accumulation - 1
            # no_sync must wrap the forward too: DDP arms its reducer during forward (chapter 03's trap).
            sync = contextlib.nullcontext() if ddp is None or last else ddp.no_sync()
            with sync:
                # The per-rank mean over the rank's batch; DDP then averages over equal-sized ranks, which
                # gives the mean over the global batch.
                loss = lm_loss((ddp or model)(x), y) / accumulation
                loss.backward()
            loss_sum += loss.detach()
        if config.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if ctx.world_size > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= ctx.world_size
        loss_value = loss_sum.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; try a lower --lr")
        tokens_per_s, mfu = meter.step()
        record = {"step": step, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_s,
                  "mfu": mfu, "peak_memory_bytes": peak_memory_bytes(ctx.device),
                  "elapsed_s": time.perf_counter() - start}
        records.append(record)
        if ctx.is_main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            if step % config.log_every == 0 or step == config.steps - 1:
                bar.write(f"step {step:5d} | loss {loss_value:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s | "
                          f"MFU {format_mfu(mfu)} | peak mem {format_bytes(record['peak_memory_bytes'])}")
    bar.close()

    if ctx.is_main:
        from refimpl.viz import plot_loss

        plot_loss({"train": ([r["step"] for r in records], [r["loss"] for r in records])},
                  path=out / "loss.png", title=f"{out.name}: loss over {config.steps} steps")
        model.eval()
        prompt = encode("def ")
        sample = decode(generate(model, prompt.to(ctx.device), max_new_tokens=120, seed=config.data.seed))
        (out / "sample.txt").write_text(sample)
        log0(ctx, f"done: loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} in "
                  f"{records[-1]['elapsed_s']:.1f} s; wrote {out}/metrics.jsonl, loss.png\nsample:\n{sample}")
    return records


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this command under torchrun with ``--nproc-per-node`` ranks (our flag removed)."""
    n = args.nproc_per_node
    if n == "auto":
        n = str(torch.cuda.device_count() or 2)
    if not n.isdigit() or int(n) < 1:
        print(f"error: --nproc-per-node must be a positive integer or 'auto', got {n!r}", file=sys.stderr)
        return 2
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            rest.append(a)
    check_fits(config_from_args(args), int(n))
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "refimpl.train", *rest]
    print("launching:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # an unknown flag: usage + exit 2
    under_launcher = "RANK" in os.environ
    try:
        if args.nproc_per_node is not None and not under_launcher:
            return _launch(args, argv)
        config = config_from_args(args)
        ctx = init_distributed(timeout_s=config.timeout_s)
        try:
            train(config, ctx)
        finally:
            teardown()
    except (ConfigError, DataError, FloatingPointError) as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
