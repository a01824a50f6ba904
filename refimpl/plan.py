"""``python -m refimpl.plan``: the layouts (dp x tp x pp x cp) that fit a model on a cluster, ranked by an
estimated step time, with memory and communication per GPU broken down (chapter 12).

    python -m refimpl.plan --params 70e9 --gpus 512 --gpu H100 --seq-len 4096 --global-batch 1024
    python -m refimpl.plan --params 1e12 --gpus 2048 --seq-len 2048 --global-batch 2048 \
        --layout dp=128,tp=8,pp=2
    python -m refimpl.plan --model llama3-70b --gpus 512 --seq-len 8192 --global-batch 512

Every figure is a formula of ``refimpl.planner`` (the chapters check them against measurement), one
layout at a time ``refimpl.planner.layout_plan.evaluate_layout`` (its docstring has each term), fed with
the assumptions printed under the table:

* **shape**: from ``--params`` a GPT of ``L`` layers and width ``h`` with ``12 L h^2 ~ N`` and ``h = 128 L``
  (GPT-3's aspect), heads of 128 (or give ``--num-layers --hidden-size --num-heads``, and ``--arch llama``
  with ``--num-kv-heads --ffn-hidden-size`` for the Llama form, ``--tie`` to tie the output layer); or a
  published model by name, ``--model llama3-8b|llama3-70b|llama3-405b|deepseek-v3|kimi-k2``
  (``refimpl.planner.presets.MODEL_PRESETS``: its count printed beside the published one; the two MoE
  models with the weights a token multiplies beside the activated size their cards print);
* **mixture of experts** (the DeepSeek-V3 form): the routed experts split over ``ep`` of the ``dp x cp``
  ranks, searched over the degrees that divide the experts and ``dp x cp`` (``--layout ...,ep=64``);
* **memory per GPU, bytes per axis, time per step**: ``evaluate_layout``'s terms (the ZeRO table with
  ``K = 12``, Korthikanti et al.'s activations, the ring model's bytes at the link each axis crosses, the
  FLOPs at ``--mfu`` of the dense bf16 peak stretched by the 1F1B bubble, none overlapped: an upper
  bound). Bytes are the ring algorithm's, ``2 (n-1)/n`` of an all-reduce's payload: a model, not what NCCL
  does on every box (inside an HGX H100 node it picks NVLS, NVLink SHARP, or a tree as well as rings).

**The search** tries every layout at ``--zero-stages`` (0-3), recomputation none and every block
(``--recompute`` forces one) and each HSDP degree dividing dp (``--no-hsdp``: none), with
``--global-batch / (dp --micro-batch)`` micro-batches, skips what the trainer refuses (the combinations of
refimpl/support.py's table, e.g. HSDP without ZeRO-3, and the shapes its tensor and context parallelism
cannot split: ``refimpl.planner.layout_plan.layout_refusals``, each combination as the trainer's
``ParallelConfig``), and keeps per layout the combination that fits with the shortest step; ties (stages
0-2 move the same bytes here) go to the lowest stage, then to no recomputation, then to no replication. So
a layout runs at the lowest ZeRO stage that fits it (ZeRO-3 sends 1.5 times the bytes) and recomputes only
when that is the cheaper way to fit (it costs a third more compute).
``--layout dp=128,tp=8,pp=2[,cp=1][,zero=3][,mb=1][,hsdp=1][,ep=1]`` estimates one layout at each stage the
trainer takes there instead (the others named, with the reason); exit status 0 when it fits at one (at
``zero=`` when given), 1 when not, 2 on bad input or a ``zero=`` the trainer refuses.

This is an estimate for choosing a layout, not a measurement: its inputs (peak, MFU, link bandwidths from
the data sheets) are the assumptions it prints.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from refimpl.config import ARCHS, ConfigError, ModelConfig
from refimpl.planner import PEAK_FLOPS, STAGES, param_count
from refimpl.planner.layout_plan import (
    BOUNDARY_BYTES_PER_ELEMENT,
    GPUS,
    MEMORY_FRACTION,
    LayoutPlan,
    boundary_bytes,
    choose,
    evaluate_layout,
    evaluate_stages,
    layout_refusals,
)
from refimpl.planner.presets import MODEL_PRESETS

__all__ = ["BOUNDARY_BYTES_PER_ELEMENT", "GPUS", "LayoutPlan", "boundary_bytes", "evaluate_layout",
           "evaluate_stages", "main", "model_for", "plan_layouts"]

LAYOUT_KEYS = {"dp": None, "tp": None, "pp": None, "cp": 1, "zero": None, "mb": None, "hsdp": 1, "ep": 1}
RECOMPUTE = {"search": None, "none": False, "every": True}  # --recompute as plan_layouts' recompute


def model_for(params: float, *, vocab_size: int, seq_len: int) -> ModelConfig:
    """A GPT of about ``params`` parameters: ``12 L h^2 = N`` with ``h ~ 128 L``, ``h`` rounded to a multiple
    of 1024 (heads of 128, a multiple of 8 of them: tensor parallelism up to a node) and ``L`` to a multiple
    of 8 (pipeline stages); smaller models keep ``h`` a multiple of 128."""
    if not params > 0:
        raise ConfigError(f"--params must be positive, got {params:g}")
    width = (128 * params / 12) ** (1 / 3)
    step = 1024 if width >= 1024 else 128
    hidden = max(128, round(width / step) * step)
    layers = params / (12 * hidden * hidden)
    layers = max(1, round(layers / 8) * 8 if layers >= 8 else round(layers))
    return ModelConfig(vocab_size=vocab_size, num_layers=layers, hidden_size=hidden,
                       num_attention_heads=hidden // 128, max_seq_len=seq_len, tie_word_embeddings=False)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expert_degrees(config: ModelConfig, ranks: int) -> list[int]:
    """The expert-parallel degrees searched: those dividing both the routed experts and the ``dp x cp``
    ranks (1 for a dense model)."""
    return [e for e in _divisors(ranks) if config.num_experts % e == 0] if config.num_experts else [1]


def plan_layouts(config: ModelConfig, *, gpus: int, gpu: str, gpus_per_node: int, seq_len: int,
                 global_batch: int, micro_batch: int = 1, mfu: float = 0.5, recompute: bool | None = False,
                 flash: bool = True, zero_stages: tuple[int, ...] = (1,), hsdp: bool = False
                 ) -> list[LayoutPlan]:
    """Every layout of ``gpus`` the model's sizes allow, each at the combination ``choose`` keeps of
    ``zero_stages``, recomputation (``recompute``: False none, True every block, None both), with ``hsdp``
    every HSDP degree dividing dp and, for an MoE model, every expert-parallel degree dividing the experts
    and ``dp x cp``; fastest first among those that fit, then the rest. The
    defaults are the planner before its search: ZeRO-1, no recomputation, no HSDP."""
    recomputes = (False, True) if recompute is None else (recompute,)
    s, b = seq_len, micro_batch
    plans = []
    for tp in _divisors(config.num_attention_heads):
        for pp in _divisors(config.num_layers):
            for cp in (c for c in _divisors(gpus) if s % (2 * c) == 0 or c == 1):
                if gpus % (tp * pp * cp) or global_batch % (gpus // (tp * pp * cp) * b):
                    continue
                dp = gpus // (tp * pp * cp)
                layout = dict(dp=dp, tp=tp, pp=pp, cp=cp, seq_len=s, global_batch=global_batch,
                              micro_batch=b)
                # what the trainer refuses is not searched: the support table's rows (HSDP is ZeRO-3's), the
                # shapes tensor and context parallelism cannot split
                combos = [(z, r, rep, ep) for z in zero_stages for r in recomputes
                          for rep in (_divisors(dp) if hsdp else (1,))
                          for ep in _expert_degrees(config, dp * cp)
                          if not layout_refusals(config, **layout, zero_stage=z, recompute=r,
                                                 dp_replicate=rep, ep=ep)]
                if combos:
                    plans.append(choose([evaluate_layout(config, **layout, zero_stage=z, recompute=r,
                                                         dp_replicate=rep, ep=ep, gpu=gpu, mfu=mfu,
                                                         flash=flash, gpus_per_node=gpus_per_node)
                                         for z, r, rep, ep in combos]))
    return sorted(plans, key=lambda p: (not p.fits, p.step_s))


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _form(config: ModelConfig) -> str:
    """The block's form in words, for the header."""
    parts = []
    if config.attention_type == "mla":
        parts.append(f"multi-head latent attention (latents {config.q_lora_rank}/{config.kv_lora_rank})")
    elif config.activation == "swiglu":
        parts.append(f"Llama form, {config.num_key_value_heads} key/value heads")
    if config.activation == "swiglu":
        parts.append(f"SwiGLU of {config.ffn_hidden_size}")
    if config.num_experts:
        parts.append(f"{len(config.moe_layers)} MoE blocks of {config.num_experts} experts of "
                     f"{config.expert_hidden_size}, top-{config.top_k}"
                     + (f" + {config.moe_shared_experts} shared" if config.moe_shared_experts else ""))
    return "".join(f"{p}, " for p in parts)


def _header(config: ModelConfig, args: argparse.Namespace) -> str:
    preset = MODEL_PRESETS.get(args.model) if args.model else None
    count = param_count(config)
    name = f"{args.model} (published: {preset.published}), " if preset else ""
    active = ""
    if config.num_experts:
        published = f" (published: {preset.published_active})" if preset and preset.published_active else ""
        active = f", {count.matmul / 1e9:.1f}B multiplied per token{published}"
    return (f"model: {name}{count.total / 1e9:.3f}B parameters{active} ({_form(config)}{config.num_layers} "
            f"layers, width {config.hidden_size}, {config.num_attention_heads} heads, vocabulary "
            f"{config.vocab_size}); "
            f"{args.gpus} x {args.gpu} in nodes of {args.gpus_per_node}; global batch {args.global_batch} x "
            f"{args.seq_len} tokens")


def _assumptions(args: argparse.Namespace) -> str:
    spec = GPUS[args.gpu]
    return ("assumptions: bf16 weights/gradients + fp32 master and Adam (16 B/parameter) sharded by ZeRO "
            f"stage {'/'.join(map(str, args.zero_stages))} over dp x cp (HSDP: over dp/hsdp x cp); ZeRO-3 "
            "gathers each block once per forward and backward and holds 2 blocks' weights and 1 block's "
            "gradients full; under pp it keeps the stage gathered (bf16 weights and gradients) through "
            "the step, or, stage 3m, gathers and reduces per micro-batch; sequence parallelism; float32 "
            f"stage boundaries (what refimpl's pipeline sends); 1F1B; {args.mfu:.0%} of the "
            f"{PEAK_FLOPS[args.gpu]['bf16'] / 1e12:.0f} TFLOP/s bf16 peak, one more forward when "
            "recomputing; MoE: the routed experts split over ep of the dp x cp ranks (replicated over tp), "
            "each token's k rows dispatched in fp32 and returned in bf16 by all-to-all (what refimpl's "
            f"expert parallelism sends); NVLink {spec['nvlink'] / 1e9:.0f} GB/s and network "
            f"{spec['network'] / 1e9:.0f} GB/s per GPU and direction (data sheets); communication not "
            "overlapped (an upper bound); recomputation: "
            + {"search": "none or every block", "none": "none", "every": "every block"}[args.recompute]
            + ("" if args.flash else "; no flash attention (the s^2 scores kept)"))


def _report(config: ModelConfig, plans: list[LayoutPlan], args: argparse.Namespace) -> str:
    fit = [p for p in plans if p.fits]
    lines = [_header(config, args), f"{len(plans)} layouts considered, {len(fit)} fit in "
             f"{_gb(MEMORY_FRACTION * GPUS[args.gpu]['memory'])} GB per GPU (90% of its memory)"]
    if not fit:
        best = min(plans, key=lambda p: p.memory_bytes)
        lines.append(f"none fits: the smallest needs {_gb(best.memory_bytes)} GB per GPU (dp {best.dp} x tp "
                     f"{best.tp} x pp {best.pp} x cp {best.cp}, ep {best.ep}, ZeRO-{best.zero_stage}, "
                     f"recompute {'every block' if best.recompute else 'none'}); try more GPUs, a shorter "
                     "--seq-len"
                     + ("" if args.zero_stages == STAGES and args.recompute == "search" else
                        ", or more of --zero-stages and --recompute"))
        return "\n".join(lines)
    axes = ("tp", "dp", "pp", "cp", "ep") if config.num_experts else ("tp", "dp", "pp", "cp")
    ep = f" {'ep':>3}" if config.num_experts else ""
    head = (f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3}{ep} {'m':>5} {'hsdp':>4} | {'ZeRO':>4} "
            f"{'recompute':>9} | {'state':>6} {'gathr':>5} {'activ':>6} GB | "
            + " ".join(f"{k:>7}" for k in axes) + f" GB sent | {'bubble':>6} | {'step s':>7} {'MFU':>5}")
    lines += ["", head, "-" * len(head)]
    for p in fit[: args.top]:
        mfu = args.mfu * p.compute_s / p.step_s
        ep = f" {p.ep:>3}" if config.num_experts else ""
        lines.append(f"{p.dp:>5} {p.tp:>3} {p.pp:>3} {p.cp:>3}{ep} {p.microbatches:>5} {p.dp_replicate:>4} | "
                     f"{p.zero_label:>4} {'every' if p.recompute else 'none':>9} | {_gb(p.state_bytes):>6} "
                     f"{_gb(p.gathered_bytes):>5} {_gb(p.activation_bytes):>6} GB | "
                     + " ".join(f"{_gb(p.sent[k]):>7}" for k in axes)
                     + f" GB sent | {p.bubble:>6.1%} | {p.step_s:>7.2f} {mfu:>5.0%}")
    return "\n".join([*lines, "", _assumptions(args)])


def parse_layout(text: str, gpus: int) -> dict[str, int | None]:
    """``dp=128,tp=8,pp=2[,cp=1][,zero=3][,mb=1][,hsdp=1][,ep=1]`` as a dict; a ConfigError on bad input."""
    out: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in LAYOUT_KEYS or key in out:
            raise ConfigError(f"--layout: {'repeated' if key in out else 'unknown'} key {key!r} in {text!r} "
                              f"(expected {','.join(k + '=' for k in LAYOUT_KEYS)}, integers)")
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"--layout: {key}={value!r} is not an integer") from None
    if missing := [k for k in ("dp", "tp", "pp") if k not in out]:
        raise ConfigError(f"--layout needs {', '.join(k + '=' for k in missing)} (got {text!r})")
    layout = {k: out.get(k, default) for k, default in LAYOUT_KEYS.items()}
    product = out["dp"] * out["tp"] * out["pp"] * out.get("cp", 1)  # LAYOUT_KEYS' default cp
    if product != gpus:
        raise ConfigError(f"--layout dp x tp x pp x cp = {product}, not --gpus {gpus}")
    return layout


def _evaluate_given(config: ModelConfig, args: argparse.Namespace) -> tuple[dict, list[LayoutPlan]]:
    """The --layout at each stage shown (``evaluate_stages``: the stages the trainer refuses at this
    layout are left out, ``layout["refused"]`` says which and why); a ConfigError on bad input, and when
    the trainer refuses the ``zero=`` given (the support table's words)."""
    layout: dict[str, Any] = parse_layout(args.layout, args.gpus)  # and the stages refused, below
    layout["mb"] = args.micro_batch if layout["mb"] is None else layout["mb"]
    stages = tuple(sorted({*args.zero_stages, *(() if layout["zero"] is None else (layout["zero"],))}))
    degrees = dict(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"], seq_len=args.seq_len,
                   global_batch=args.global_batch, micro_batch=layout["mb"], ep=layout["ep"])
    rows = evaluate_stages(config, stages=stages, recompute=RECOMPUTE[args.recompute], flash=args.flash,
                           dp_replicate=layout["hsdp"], **degrees, gpu=args.gpu,
                           gpus_per_node=args.gpus_per_node, mfu=args.mfu)
    refused = [z for z in stages if z not in {q.zero_stage for q in rows}]
    layout["refused"] = (refused, "; and ".join(layout_refusals(
        config, **degrees, zero_stage=refused[0], recompute=args.recompute == "every",
        dp_replicate=layout["hsdp"]))) if refused else None
    if layout["zero"] in refused:
        raise ConfigError(f"--layout zero={layout['zero']}: the trainer refuses it here: "
                          f"{layout['refused'][1]}")
    return layout, rows


def _layout_report(config: ModelConfig, layout: dict, rows: list[LayoutPlan], args: argparse.Namespace
                   ) -> str:
    p, count = rows[0], param_count(config)
    psi = (count.total - count.experts) / (p.tp * p.pp) + count.experts / (p.ep * p.pp)
    per_gpu = "dense / (tp pp) + experts / (ep pp)" if config.num_experts else "N / (tp pp)"
    limit, spec = p.limit_bytes, GPUS[args.gpu]
    hsdp = f" / hsdp {layout['hsdp']} replicas" if layout["hsdp"] > 1 else ""
    ep = f" x ep {p.ep} (within dp x cp)" if config.num_experts else ""
    head = (f"{'ZeRO':>4} {'recompute':>9} | {'weights':>7} {'grads':>7} {'optim':>7} {'gathr':>5} "
            f"{'activ':>6} {'total':>7} GB | {'dp sent':>7} GB | {'step s':>7} | fits")
    lines = [_header(config, args),
             f"layout dp {p.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp}{ep}: {p.microbatches} micro-batches of "
             f"{layout['mb']} sequence(s); {psi / 1e9:.2f}B parameters per GPU ({per_gpu}), ZeRO "
             f"shards over dp x cp = {p.dp * p.cp}{hsdp}",
             f"memory per GPU against {_gb(limit)} GB (90% of the {args.gpu}'s "
             f"{spec['memory'] / 1e9:.0f} GB):", "", head, "-" * len(head)]
    for q in rows:
        verdict = f"yes, {_gb(q.margin_bytes)} GB spare" if q.fits else f"no, {_gb(-q.margin_bytes)} GB over"
        lines.append(f"{q.zero_label:>4} {'every' if q.recompute else 'none':>9} | "
                     + " ".join(f"{_gb(x):>7}" for x in (q.state.weights, q.state.grads, q.state.optimizer))
                     + f" {_gb(q.gathered_bytes):>5} {_gb(q.activation_bytes):>6} {_gb(q.memory_bytes):>7} "
                     f"GB | {_gb(q.sent['dp']):>7} GB | {q.step_s:>7.2f} | {verdict}")
    fits, given = [str(q.zero_stage) for q in rows if q.fits], layout["zero"]
    verdict = (f"ZeRO-{given} (given): {'fits' if str(given) in fits else 'does not fit'}"
               if given is not None else f"ZeRO stages that fit: {', '.join(fits) or 'none'} (of "
               f"{', '.join(str(q.zero_stage) for q in rows)})")
    if layout["refused"]:
        left_out, why = layout["refused"]
        verdict += (f"; ZeRO-{', '.join(map(str, left_out))} not shown: the trainer refuses "
                    f"{'it' if len(left_out) == 1 else 'them'} at this layout ({why})")
    axes = ("tp", "pp", "cp", "ep") if config.num_experts else ("tp", "pp", "cp")
    lines += ["", "bytes each GPU sends per step: " + ", ".join(f"{k} {_gb(p.sent[k])} GB" for k in axes)
              + "; dp per stage above",
              f"bubble {p.bubble:.1%} (1F1B, pp {p.pp}, {p.microbatches} micro-batches)", verdict, "",
              _assumptions(args)]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refimpl.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=float, default=None, help="parameters (e.g. 70e9); or give the shape")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                   help="a published model's shape (instead of --params or the shape flags)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--arch", choices=tuple(ARCHS), default="gpt2",
                   help="the block: gpt2 (LayerNorm, GELU) or llama (RMSNorm, RoPE, GQA, SwiGLU, no biases)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="key/value heads (default: --num-heads)")
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="the MLP's width (default 4 h)")
    p.add_argument("--tie", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of the bf16 peak the matmuls reach")
    p.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages searched, comma-separated")
    p.add_argument("--recompute", nargs="?", const="every", default="search",
                   choices=("search", "none", "every"),
                   help="activation recomputation: searched, never, or every block (--recompute alone)")
    p.add_argument("--no-hsdp", dest="hsdp", action="store_false", help="search no HSDP degree (replicas)")
    p.add_argument("--no-flash", dest="flash", action="store_false", help="keep the s^2 attention scores")
    p.add_argument("--layout", default=None, help="estimate one layout at each ZeRO stage instead: "
                   "dp=128,tp=8,pp=2[,cp=1][,zero=3][,mb=1 (sequences per micro-batch)][,hsdp=1 (replicas)]"
                   "[,ep=1 (expert parallelism, within dp x cp)]")
    p.add_argument("--top", type=int, default=10, help="layouts shown")
    return p


def _config(args: argparse.Namespace) -> ModelConfig:
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                        ("--seq-len", args.seq_len), ("--global-batch", args.global_batch),
                        ("--micro-batch", args.micro_batch), ("--top", args.top)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu is a fraction of the peak in (0, 1], got {args.mfu}")
    try:
        args.zero_stages = tuple(sorted({int(z) for z in args.zero_stages.split(",")}))
    except ValueError:
        args.zero_stages = (-1,)
    if not set(args.zero_stages) <= set(STAGES):
        raise ConfigError(f"--zero-stages takes stages among {STAGES} (e.g. 1,3), got {args.zero_stages}")
    shape = (args.num_layers, args.hidden_size, args.num_heads)
    given = [flag for flag, used in (("--params", args.params is not None),
                                     ("--model", args.model is not None),
                                     ("the shape", any(v is not None for v in shape))) if used]
    if len(given) > 1:
        raise ConfigError(f"give one of --params, --model or the shape (--num-layers --hidden-size "
                          f"--num-heads), not {' and '.join(given)}")
    form = {flag: v for flag, v in (("--arch", args.arch != "gpt2"), ("--num-kv-heads", args.num_kv_heads),
                                    ("--ffn-hidden-size", args.ffn_hidden_size), ("--tie", args.tie)) if v}
    if form and given and given[0] != "the shape":
        raise ConfigError(f"{', '.join(form)} describe a shape: give them with --num-layers --hidden-size "
                          f"--num-heads, not with {given[0]}")
    if args.model is not None:
        return MODEL_PRESETS[args.model].config(max_seq_len=args.seq_len)
    if args.params is not None:
        return model_for(args.params, vocab_size=args.vocab_size, seq_len=args.seq_len)
    if all(v is not None for v in shape):
        optional = {k: v for k, v in (("num_key_value_heads", args.num_kv_heads),
                                      ("ffn_hidden_size", args.ffn_hidden_size)) if v is not None}
        form = {**ARCHS[args.arch], "tie_word_embeddings": args.tie}
        return ModelConfig(**form, vocab_size=args.vocab_size, num_layers=args.num_layers,
                           hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
                           max_seq_len=args.seq_len, **optional)
    raise ConfigError("give --params, --model, or all of --num-layers --hidden-size --num-heads")


def main(argv: list[str] | None = None) -> int:
    """Print the ranked layouts (or the one ``--layout``); exit status 0, 1 when none fits (the layout at no
    stage shown, or the ``zero=`` given), 2 for bad input (one line)."""
    args = build_parser().parse_args(argv)
    try:
        config = _config(args)
        if args.layout is not None:
            layout, rows = _evaluate_given(config, args)
        else:
            plans = plan_layouts(config, gpus=args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                                 seq_len=args.seq_len, global_batch=args.global_batch,
                                 micro_batch=args.micro_batch, mfu=args.mfu, flash=args.flash, hsdp=args.hsdp,
                                 recompute=RECOMPUTE[args.recompute], zero_stages=args.zero_stages)
            if not plans:
                raise ConfigError(f"no layout of {args.gpus} GPUs divides the model "
                                  f"({config.num_attention_heads} heads, {config.num_layers} layers) and the "
                                  f"global batch {args.global_batch}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.layout is not None:
        print(_layout_report(config, layout, rows, args))
        verdict = [q for q in rows if layout["zero"] in (None, q.zero_stage)]
        return 0 if any(q.fits for q in verdict) else 1
    print(_report(config, plans, args))
    return 0 if any(p.fits for p in plans) else 1  # 1: nothing fits (the report says what the least needs)


if __name__ == "__main__":
    sys.exit(main())
