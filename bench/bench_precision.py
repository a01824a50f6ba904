"""Benchmark of chapter 05: activation checkpointing, and our fp16 step against torch.amp + GradScaler.

    python -m bench.bench_precision [--steps 10] [--warmup 2] [--micro-batch 8] [--seq-len 128]

One process, the course's default GPT (4 layers, hidden 128), on the GPU when there is one, else the CPU.

1. **Activation checkpointing.** The same model trained with no block, every other block and every block
   checkpointed (``refimpl.parallel.activation_checkpoint``), fp32. Per variant: the median
   time of a training step (forward, backward, AdamW), the bytes saved for backward per block measured
   with ``SavedTensorMeter`` next to ``refimpl.planner.activation_bytes``, and the whole model's
   saved bytes.
2. **fp16 steps.** A step under fp16 autocast with our ``MixedPrecision`` (``DynamicLossScaler``: scale,
   unscale, overflow check, clip, step, update) against the same step with ``torch.amp.GradScaler``; fp32
   and bf16 (no scaler) for reference. Both fp16 variants run the same autocast forward and backward, so
   the difference is the scaler's bookkeeping: the part after backward (unscale, check, clip, AdamW,
   update) is also timed on its own.

Variants are **interleaved** step by step (A, B, C, A, B, C, ...) so that all see the same machine load;
the median over the measured steps is reported. On a CPU compare ratios only: absolute times depend on
the machine and its load, and 16-bit matmuls are emulated (slower than fp32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from refimpl.config import ModelConfig, OptimConfig
from refimpl.measure import measure_saved_activations
from refimpl.models import GPT, lm_loss
from refimpl.optim import build_optimizer
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.planner import activation_bytes
from refimpl.precision import MixedPrecision

KiB = 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(steps: dict[str, Callable[[int], float | None]], n: int, warmup: int,
                 device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per step, and median of what each step returned (a part of it it timed itself)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    parts: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + n):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            part = step(i)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                if part is not None:
                    parts[name].append(part)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in parts.items() if v})


def bench_checkpointing(cfg: ModelConfig, data: list[torch.Tensor], steps: int, warmup: int,
                        device: torch.device) -> str:
    variants = {"none": "none", "every other block": (lambda i: i % 2 == 1), "every block": "all"}
    models, optimizers, step_fns = {}, {}, {}
    for name, blocks in variants.items():
        model = GPT(cfg, seed=0).to(device)
        apply_activation_checkpointing(model, blocks)
        models[name], optimizers[name] = model, build_optimizer(model, OptimConfig())

        def step(i: int, model=model, opt=optimizers[name]) -> None:
            batch = data[i % len(data)]
            lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_fns[name] = step
    medians, _ = _interleaved(step_fns, steps, warmup, device)
    b, s = data[0].shape[0], data[0].shape[1] - 1
    lines = ["| checkpointed | median step | vs none | saved per block: measured | planner | "
             "whole model saved |", "|---|---|---|---|---|---|"]
    for name, model in models.items():
        batch = data[0]
        report = measure_saved_activations(model, lambda model=model, batch=batch: lm_loss(
            model(batch[:, :-1]), batch[:, 1:]))
        chosen = [i for i in range(cfg.num_layers) if variants[name] == "all" or (
            callable(variants[name]) and variants[name](i))]
        planned = activation_bytes(cfg, micro_batch=b, seq_len=s, checkpointed_blocks=chosen)
        measured = report.per_block()
        check = "=" if measured == planned else "!="
        lines.append(
            f"| {name} | {medians[name] * 1e3:.1f} ms | x{medians[name] / medians['none']:.2f} | "
            f"{', '.join(f'{v / KiB:.0f}' for v in measured)} KiB | {check} planner | "
            f"{report.total / KiB:.0f} KiB |")
    return "\n".join(lines)


def bench_fp16(cfg: ModelConfig, data: list[torch.Tensor], steps: int, warmup: int,
               device: torch.device) -> str:
    step_fns = {}
    for name in ("fp32", "bf16", "fp16 ours", "fp16 torch.amp"):
        model = GPT(cfg, seed=0).to(device)
        mp = MixedPrecision.from_name(name.split()[0], model, device=device)
        opt = build_optimizer(model, OptimConfig())
        params = [p for g in opt.param_groups for p in g["params"]]
        scaler = torch.amp.GradScaler(device.type) if name == "fp16 torch.amp" else None

        def step(i: int, model=model, mp=mp, opt=opt, params=params, scaler=scaler) -> float:
            batch = data[i % len(data)]
            with mp.autocast():
                loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            if scaler is None:
                mp.backward(loss)
                _sync(device)
                t0 = time.perf_counter()  # what differs between the variants: unscale ... update
                mp.step(opt, grad_clip=1.0)
            else:
                scaler.scale(loss).backward()
                _sync(device)
                t0 = time.perf_counter()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(opt)
                scaler.update()
            _sync(device)
            after_backward = time.perf_counter() - t0
            opt.zero_grad(set_to_none=True)
            return after_backward

        step_fns[name] = step
    medians, tails = _interleaved(step_fns, steps, warmup, device)
    lines = ["| step | median step | vs fp32 | vs fp16 torch.amp | after backward: unscale, check, clip, "
             "AdamW, update | vs fp16 torch.amp |", "|---|---|---|---|---|---|"]
    for name, t in medians.items():
        tail = tails[name]
        lines.append(f"| {name} | {t * 1e3:.1f} ms | x{t / medians['fp32']:.2f} | "
                     f"x{t / medians['fp16 torch.amp']:.3f} | {tail * 1e3:.2f} ms | "
                     f"x{tail / tails['fp16 torch.amp']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_precision", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (ignored on a GPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(max_seq_len=args.seq_len)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g).to(device)
            for _ in range(4)]
    start = time.time()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.machine()}, {os.cpu_count()} logical CPUs, {args.threads} threads"
    print(f"device: {device} ({name}), torch {torch.__version__}; default GPT (4 layers, hidden 128), "
          f"{args.micro_batch} x {args.seq_len} tokens per step, {args.steps} measured steps after "
          f"{args.warmup} warm-up, variants interleaved\n")
    print("Activation checkpointing (fp32):\n")
    print(bench_checkpointing(cfg, data, args.steps, args.warmup, device))
    print("\nMixed precision steps (autocast; fp16 with a dynamic loss scaler):\n")
    print(bench_fp16(cfg, data, args.steps, args.warmup, device))
    print(f"\n({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
