"""What bench/gpu/check.py leaves in ``$OUT``: ``gpu_check.json`` (everything, for a program) and
``gpu_check.md`` (the tables to paste into bench/RESULTS.md). Both are rewritten after every part, so a run
stopped by its time limit still leaves what it measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
TITLES = {"process_group": "process group (world size 1)", "scaled_mm": "fp8 GEMM (torch._scaled_mm)",
          "async_timing": "async-wait timing (CPU clock vs CUDA events)",
          "grouped_mm": "grouped GEMM (torch._grouped_mm)", "pytest_gpu": "gpu-marked tests"}


def _finite(value: object) -> object:
    """``value`` with every non-finite float as a string: strict JSON has no Infinity or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(_finite(result), indent=1, default=str) + "\n")
    (out / MD_NAME).write_text(markdown(result))


def _gib(n: object) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny smoke model's plan); "-" for none."""
    if not isinstance(n, (int, float)):
        return "-"
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _header(result: dict) -> list[str]:
    env = result.get("environment", {})
    gpu = env.get("gpu") or {}
    smi = env.get("nvidia_smi") or {}
    after = env.get("nvidia_smi_after") or {}
    device = (f"{gpu.get('name')} (compute capability {gpu.get('capability')}, "
              f"{gpu.get('multi_processor_count')} SMs, {_gib(gpu.get('total_memory'))})" if gpu else
              env.get("device", "?"))
    clocks = (f"SM clock {smi.get('clocks.sm')} at the start, {after.get('clocks.sm', '-')} after the "
              f"load (max {smi.get('clocks.max.sm')}); driver {smi.get('driver_version')}" if smi else "")
    mods = ", ".join(f"{k} {v or 'missing'}" for k, v in env.get("modules", {}).items())
    verdict = "all checks passed" if result.get("ok") else "SOME CHECK FAILED"
    return [f"# GPU check (bench/gpu/check.py{' --smoke' if result.get('mode') == 'smoke' else ''})", "",
            f"- {result.get('started')}, {result.get('elapsed_s', 0):.0f} s: **{verdict}**",
            f"- device: {device}" + (f"; {clocks}" if clocks else ""),
            f"- torch {env.get('torch')} (the suite's: {env.get('suite_torch')}), CUDA {env.get('cuda')}, "
            f"cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}, Python {env.get('python')}",
            f"- packages: {mods}" + (f"; stand-ins: {', '.join(result['stand_ins'])}"
                                     if result.get("stand_ins") else ""), ""]


def _checks(result: dict) -> list[str]:
    lines = ["| check | status | detail |", "|---|---|---|"]
    checks = result.get("checks", {})
    for key, title in TITLES.items():
        if key in checks:
            c = checks[key]
            lines.append(f"| {title} | {c.get('status')} | {_cell(c.get('detail', c.get('error', '')))} |")
    for row in checks.get("trainer", {}).get("rows", []):
        what = row.get("detail") or row.get("error", "")
        lines.append(f"| trainer: {row['model']}, {row['precision']} | {row['status']} | {_cell(what)} |")
    return [*lines, ""]


def _trainer(result: dict) -> list[str]:
    trainer = result.get("checks", {}).get("trainer", {})
    rows = [r for r in trainer.get("rows", []) if r.get("status") == "pass"]
    if not rows:
        return []
    speed = trainer.get("fp8_over_bf16", {})
    lines = ["## Trainer, one device (refimpl.train.train in-process)", "",
             "| model | precision | steps (timed) | tokens/s (median) | MFU (dense bf16 peak) | "
             "peak allocated | peak reserved | planner | allocated / planner | fp8 / bf16 tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        ratio = r.get("allocated_over_planned")
        fp8 = f"{speed[r['model']]:.2f}" if r["precision"] == "fp8" and r["model"] in speed else "-"
        lines.append(f"| {r['model']} | {r['precision']} | {r['steps']} ({r['timed_steps']}) | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {_gib(r['peak_allocated_bytes'])} | "
                     f"{_gib(r.get('peak_reserved_bytes'))} | {_gib(r.get('planned_bytes'))} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {fp8} |")
    note = ("On a CPU (`--smoke`) the peak is the process's resident set, not comparable with the planner."
            if result.get("mode") == "smoke" else
            "MFU: tokens/s x FLOPs per token (6N + 12 L H Q T) / the GPU's dense bf16 peak, for fp8 too.")
    return [*lines, "", note, ""]


def markdown(result: dict) -> str:
    return "\n".join([*_header(result), *_checks(result), *_trainer(result)])
