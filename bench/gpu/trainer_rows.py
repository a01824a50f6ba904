"""The process group and the trainer rows of bench/gpu/check.py.

**One process, world size 1.** ``init_group`` creates the default process group itself (NCCL on a GPU,
eagerly, so a broken NCCL shows here and not inside a step; gloo in ``--smoke``) and checks an all-reduce, a
broadcast, a barrier and refimpl's collective timing on the group's own device
(``refimpl.measure.collective_timing.group_device``). The trainer then runs in this process
(``refimpl.train.train``, the loop ``python -m refimpl.train`` runs) on that group, so every collective
the trainer makes at world size 1 goes through NCCL too.

**A row** (``run_row``) is one model in one precision: the trainer's own flags, parsed by its own parser,
checkpoints off (a checkpoint of the wide model would write about 13 GB); per row the median tokens/s and MFU
of the last ``timed`` steps from the trainer's records (MFU against the dense bf16 peak for bf16 and fp8
alike: fp8 computes under bf16 autocast and its GEMMs are counted once, refimpl.measure.throughput), the
peak allocated bytes of the steps (``peak_memory_bytes``) and the allocator's peak reserved bytes, against
what the trainer's memory preflight plans (``refimpl.train.preflight_memory``, the planner's
``run_memory_of``: model state plus one micro-batch's activations).

Without matplotlib (a bare image) the trainer's end-of-run report (loss.png and a text sample) is skipped:
it measures nothing the check records.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu.environment import has_module

GROUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RowSpec:
    """One model of the trainer rows: ``flags`` (the trainer's), ``steps`` run, the last ``timed`` kept."""

    name: str
    flags: tuple[str, ...]
    steps: int
    timed: int

    @property
    def key(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.name.lower())


def _model(layers: int, hidden: int, heads: int, seq: int, batch: int, lr: str) -> tuple[str, ...]:
    return ("--num-layers", str(layers), "--hidden-size", str(hidden), "--num-heads", str(heads),
            "--seq-len", str(seq), "--batch-size", str(batch), "--lr", lr, "--warmup-steps", "5")


GPU_ROWS = (
    # GPT-2 small's shape (byte vocabulary): 85 M parameters, 32 x 1024 tokens a step
    RowSpec("GPT-2 small (12 x 768)", _model(12, 768, 12, 1024, 32, "6e-4"), steps=30, timed=20),
    # wide enough for fp8's GEMMs to pay: 805 M parameters in 4 blocks, 16 x 1024 tokens a step
    RowSpec("wide (4 x 4096)", _model(4, 4096, 32, 1024, 16, "3e-4"), steps=30, timed=20),
)
SMOKE_ROWS = (RowSpec("tiny (2 x 64)", _model(2, 64, 4, 64, 4, "1e-3"), steps=4, timed=2),)  # the same loop
PRECISIONS = ("bf16", "fp8")


def init_group(device: torch.device, work: Path) -> dict[str, object]:
    """The world-size-1 default group on ``device``'s backend, and what was checked on it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S), **extra)
    t = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    b = torch.full((3,), 7.0, device=device)
    dist.broadcast(b, src=0)
    dist.barrier()
    ok = torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32)) and bool((b == 7).all())
    rec: dict[str, object] = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size(),
                              "collectives_ok": ok}
    rec |= _timed_collective(device)
    same = rec.get("group_device") is None or rec["group_device"].split(":")[0] == device.type
    rec["status"] = "pass" if ok and same else "fail"
    rec["detail"] = (f"{rec['backend']} at world size 1: all_reduce, broadcast, barrier "
                     f"{'as expected' if ok else 'WRONG'}; refimpl's measure_collective on "
                     f"{rec.get('group_device', '(refimpl not importable)')}")
    return rec


def _timed_collective(device: torch.device) -> dict[str, object]:
    """refimpl's ``measure_collective`` with its default device: the group's (recorded)."""
    try:
        from refimpl.comm import ops
        from refimpl.measure.collective_timing import group_device, measure_collective
    except ImportError as exc:
        return {"refimpl": f"not importable: {exc}"}
    timings = measure_collective(ops.all_reduce, (4, 1 << 20), repeats=3, warmup=1)
    return {"group_device": str(group_device()),
            "all_reduce_s": dict(zip(map(str, timings.sizes_bytes), timings.seconds, strict=True))}


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def skip_report_without_matplotlib() -> bool:
    """Without matplotlib, replace the trainer's end-of-run report (it imports matplotlib to draw loss.png)
    by nothing; True if it did (module docstring)."""
    if has_module("matplotlib"):
        return False
    import refimpl.train.loop as loop

    loop._report = lambda *args, **kwargs: None
    return True


def _context(device: torch.device):
    from refimpl.distributed import DistributedContext

    backend = "nccl" if device.type == "cuda" else "gloo"
    return DistributedContext(rank=0, world_size=1, local_rank=0, device=device, backend=backend,
                              timeout_s=GROUP_TIMEOUT_S)


def _parse(spec: RowSpec, precision: str, backend: str, work: Path):
    """The trainer's config and options for one row, checkpoints off."""
    from refimpl.train import build_parser, config_from_args, options_from_args

    args = build_parser().parse_args([
        *spec.flags, "--precision", precision, "--steps", str(spec.steps), "--log-every", "1000",
        "--checkpoint-every", "0", "--backend", backend, "--cache-dir", str(work / "cache"),
        "--out", str(work / f"{spec.key}-{precision}")])
    return config_from_args(args), replace(options_from_args(args), checkpoint=None)


def _train(config, ctx, options, log: Path) -> list[dict]:
    """``refimpl.train.train``, its progress bar and log lines into ``log``."""
    from refimpl.train import train

    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        return train(config, ctx, options)


def _peak_reserved(records: list[dict], device: torch.device) -> int | None:
    """The largest step's reserved bytes from the records (the trainer resets the GPU's peaks every step),
    else the allocator's peak since the row began; None on a CPU."""
    if device.type != "cuda":
        return None
    steps = [r["peak_reserved_bytes"] for r in records if r.get("peak_reserved_bytes") is not None]
    return max(steps) if steps else int(torch.cuda.max_memory_reserved(device))


def _summary(records: list[dict], timed: int, device: torch.device) -> dict[str, object]:
    last = records[-timed:]
    mfu = [r["mfu"] for r in last if r.get("mfu") is not None]
    reserved = _peak_reserved(records, device)
    return {"steps": len(records), "timed_steps": len(last),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in last),
            "mfu": statistics.median(mfu) if mfu else None, "final_loss": records[-1]["loss"],
            "peak_allocated_bytes": max(r["peak_memory_bytes"] for r in records),
            "peak_reserved_bytes": reserved}


def run_row(spec: RowSpec, precision: str, device: torch.device, work: Path) -> dict[str, object]:
    """One trainer row (module docstring); a failure is recorded with the end of the trainer's log."""
    from refimpl.measure.throughput import device_peak_flops
    from refimpl.planner import flops_per_token
    from refimpl.train import preflight_memory, resolve

    ctx, log = _context(device), work / f"{spec.key}-{precision}.log"
    rec: dict[str, object] = {"model": spec.name, "precision": precision, "flags": " ".join(spec.flags)}
    try:
        config, options = _parse(spec, precision, ctx.backend, work)
        plan = preflight_memory(config, resolve(config, options, 1), ranks_per_node=1, backend=ctx.backend)
        rec |= {"planned_bytes": plan.total if plan else None, "plan": plan.describe() if plan else None,
                "flops_per_token": flops_per_token(config.model, config.data.seq_len),
                "peak_flops_bf16": device_peak_flops(device, dtype="bf16")}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rec |= _summary(_train(config, ctx, options, log), spec.timed, device)
    except Exception as exc:  # noqa: BLE001 - one row's failure is a result, the others still run
        tail = log.read_text()[-2000:] if log.exists() else ""
        return rec | {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:500],
                      "traceback": traceback.format_exc()[-3000:], "log_tail": tail}
    finally:
        _free(device)
    if rec.get("planned_bytes"):
        rec["allocated_over_planned"] = rec["peak_allocated_bytes"] / rec["planned_bytes"]
    mfu = "" if rec["mfu"] is None else f", MFU {rec['mfu']:.1%}"
    return rec | {"status": "pass", "detail": f"{rec['tokens_per_s']:,.0f} tokens/s{mfu}, peak allocated "
                                              f"{rec['peak_allocated_bytes'] / 2**30:.2f} GiB"}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def fp8_speedups(rows: list[dict]) -> dict[str, float]:
    """Per model, fp8's tokens/s over bf16's (both rows passed)."""
    by = {(r["model"], r["precision"]): r for r in rows if r.get("status") == "pass"}
    return {m: by[(m, "fp8")]["tokens_per_s"] / by[(m, "bf16")]["tokens_per_s"]
            for m, p in by if p == "bf16" and (m, "fp8") in by}
