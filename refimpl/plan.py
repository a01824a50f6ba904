"""``python -m refimpl.plan``: the layouts (dp x tp x pp x cp) that fit a model on a cluster, ranked by an
estimated step time, with memory and communication per GPU broken down (chapter 10).

    python -m refimpl.plan --params 70e9 --gpus 512 --gpu H100 --seq-len 4096 --global-batch 1024

Every figure is a formula of :mod:`refimpl.planner` (the chapters check them against measurement) fed with
the assumptions printed under the table:

* **shape**: from ``--params`` a GPT of ``L`` layers and width ``h`` with ``12 L h^2 ~ N`` and ``h = 128 L``
  (GPT-3's aspect), heads of 128 (or give ``--num-layers --hidden-size --num-heads``);
* **memory per GPU** (Rajbhandari et al. 2020; Korthikanti et al. 2022): bf16 weights and gradients
  ``(2 + 2) N / (tp pp)``, fp32 master weights and Adam moments ``12 N / (tp pp)`` sharded over the ``dp x
  cp`` ranks by ZeRO-1; activations of one micro-batch of ``s/cp`` tokens per layer with sequence
  parallelism, ``34 s b h / t`` plus ``5 a s^2 b / t`` (no flash attention assumed unless ``--flash``),
  times ``L/pp`` layers, times the ``pp`` micro-batches the first stage of 1F1B holds; with ``--recompute``
  only each layer's input is kept, ``2 s b h / t``, plus one layer recomputed;
* **time per step**: the FLOPs ``(6 N + 12 L h s) x tokens`` at ``--mfu`` of the GPU's dense bf16 peak,
  stretched by the 1F1B bubble ``(pp-1)/(m+pp-1)``; plus the communication none of it hides, each
  collective at the bandwidth of the link it crosses (NVLink inside a node, the network between nodes):
  TP's four all-reduces per layer and micro-batch (Shoeybi et al. 2019;
  :func:`~refimpl.planner.communication.tensor_parallel_collectives`), the dp gradient all-reduce (counted
  whole: an upper bound, DDP overlaps part of it), the pipeline's sends (:func:`boundary_bytes`: what
  refimpl's pipeline sends, float32) and CP's ring
  (:func:`~refimpl.planner.communication.context_parallel_bytes`). A collective's bytes are the ring
  algorithm's, ``2 (n-1)/n`` of the payload for an all-reduce: a model, not what NCCL does on every box
  (inside an HGX H100 node it picks NVLS, NVLink SHARP, or a tree as well as rings).

This is an estimate for choosing a layout, not a measurement: its inputs (peak, MFU, link bandwidths from
the data sheets) are the assumptions it prints.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from refimpl.config import ConfigError, ModelConfig
from refimpl.planner import (
    PEAK_FLOPS,
    context_parallel_bytes,
    flops_per_token,
    param_count,
    tensor_parallel_collectives,
    wire_bytes,
)

__all__ = ["BOUNDARY_BYTES_PER_ELEMENT", "GPUS", "LayoutPlan", "boundary_bytes", "main", "model_for",
           "plan_layouts"]

# per GPU, from the data sheets: memory (bytes), NVLink bandwidth per direction and the network per GPU
# per direction (bytes/s); dense bf16 peaks come from refimpl.measure.peaks
GPUS = {
    "H100": {"memory": 80e9, "nvlink": 450e9, "network": 50e9},   # NVLink 4: 900 GB/s both ways; NDR 400 Gb/s
    "H200": {"memory": 141e9, "nvlink": 450e9, "network": 50e9},
    "A100": {"memory": 80e9, "nvlink": 300e9, "network": 25e9},   # NVLink 3: 600 GB/s both ways; HDR 200 Gb/s
}


# what refimpl's pipeline sends at a stage boundary: the residual stream, float32 under autocast too (the
# residual add of an fp32 input and a bf16 block output promotes to fp32; the receivers allocate float32:
# refimpl.parallel.pipeline_parallel), measured per send in tests/test_boundary_bytes.py. Megatron-LM
# sends its params dtype, bf16: half of this.
BOUNDARY_BYTES_PER_ELEMENT = 4


def boundary_bytes(*, micro_batch: int, seq_len: int, hidden_size: int, tp: int, cp: int,
                   sequence_parallel: bool = True) -> float:
    """Bytes of one stage-boundary tensor (an activation forward, or its gradient backward) one GPU sends:
    ``[b, s/cp, h]`` float32, ``[b, s/(cp tp), h]`` under sequence parallelism (each tp rank sends its
    sequence shard; Korthikanti et al. 2022)."""
    tokens = seq_len / cp / (tp if sequence_parallel else 1)
    return BOUNDARY_BYTES_PER_ELEMENT * micro_batch * tokens * hidden_size


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


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """One layout's estimate: bytes per GPU, bytes each GPU sends per step per axis, seconds."""

    dp: int
    tp: int
    pp: int
    cp: int
    microbatches: int
    state_bytes: float
    activation_bytes: float
    sent: dict[str, float]
    bubble: float
    compute_s: float
    comm_s: float
    fits: bool

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def step_s(self) -> float:
        return self.compute_s / (1 - self.bubble) + self.comm_s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_layouts(config: ModelConfig, *, gpus: int, gpu: str, gpus_per_node: int, seq_len: int,
                 global_batch: int, micro_batch: int = 1, mfu: float = 0.5, recompute: bool = False,
                 flash: bool = True) -> list[LayoutPlan]:
    """Every layout of ``gpus`` the model's sizes allow, estimated (module docstring), fastest first among
    those that fit, then the rest."""
    spec, peak = GPUS[gpu], PEAK_FLOPS[gpu]["bf16"]
    n = param_count(config).total
    L, h, a, s, b = (config.num_layers, config.hidden_size, config.num_attention_heads,  # noqa: N806
                     seq_len, micro_batch)
    tokens = global_batch * s
    flops = flops_per_token(config, s) * tokens
    plans = []
    for tp in _divisors(a):
        for pp in _divisors(L):
            for cp in (c for c in _divisors(gpus) if s % (2 * c) == 0 or c == 1):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                if global_batch % (dp * b):
                    continue
                m = global_batch // (dp * b)
                sc = s // cp  # tokens per GPU per sequence
                state = 4 * n / (tp * pp) + 12 * n / (tp * pp * dp * cp)
                # one layer's saved tensors (the s^2 scores too without flash attention); under recompute
                # only each layer's input is kept, plus the one layer being recomputed
                per_layer = 34 * sc * b * h / tp + (0 if flash else 5 * (a / tp) * sc * s * b)
                kept = (2 * sc * b * h / tp) * L / pp * min(pp, m) + per_layer if recompute else (
                    per_layer * L / pp * min(pp, m))
                act_bytes = boundary_bytes(micro_batch=b, seq_len=s, hidden_size=h, tp=tp, cp=cp)
                inside = tp * cp <= gpus_per_node
                tp_bw = spec["nvlink"] if tp <= gpus_per_node else spec["network"]
                collectives = tensor_parallel_collectives(num_layers=L // pp, hidden_size=h, micro_batch=b,
                                                          seq_len=sc, tp=tp, bytes_per_element=2)
                ring = context_parallel_bytes(config, micro_batch=b, seq_len=s, cp=cp, method="ring", tp=tp,
                                              compute_dtype=torch.bfloat16)
                sent = {  # bytes one GPU sends per step, per axis
                    "tp": sum(wire_bytes(op, payload, tp) for op, (_, payload) in collectives.items()) * m,
                    "dp": wire_bytes("all_reduce", 2 * n / (tp * pp), dp * cp),  # bf16 gradients
                    "pp": act_bytes * m * (0 if pp == 1 else 1 if pp == 2 else 2),  # an interior stage
                    "cp": (ring["forward"] + ring["backward"]) * (L // pp) * m,
                }
                dp_bw = spec["nvlink"] if tp * cp * dp <= gpus_per_node else spec["network"]
                pp_bw = spec["nvlink"] if tp * cp * dp * pp <= gpus_per_node else spec["network"]
                cp_bw = spec["nvlink"] if inside else spec["network"]
                comm = (sent["tp"] / tp_bw + sent["dp"] / dp_bw + sent["pp"] / pp_bw + sent["cp"] / cp_bw)
                bubble = (pp - 1) / (m + pp - 1)
                compute = flops / (gpus * peak * mfu)
                plans.append(LayoutPlan(dp=dp, tp=tp, pp=pp, cp=cp, microbatches=m, state_bytes=state,
                                        activation_bytes=kept, sent=sent, bubble=bubble, compute_s=compute,
                                        comm_s=comm, fits=state + kept <= 0.9 * spec["memory"]))
    return sorted(plans, key=lambda p: (not p.fits, p.step_s))


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _report(config: ModelConfig, plans: list[LayoutPlan], args: argparse.Namespace) -> str:
    n = param_count(config).total
    fit = [p for p in plans if p.fits]
    lines = [f"model: {n / 1e9:.2f}B parameters ({config.num_layers} layers, width {config.hidden_size}, "
             f"{config.num_attention_heads} heads, vocabulary {config.vocab_size}); {args.gpus} x {args.gpu} "
             f"in nodes of {args.gpus_per_node}; global batch {args.global_batch} x {args.seq_len} tokens",
             f"{len(plans)} layouts considered, {len(fit)} fit in {_gb(0.9 * GPUS[args.gpu]['memory'])} GB "
             "per GPU (90% of its memory)"]
    if not fit:
        best = min(plans, key=lambda p: p.memory_bytes)
        lines.append(f"none fits: the smallest needs {_gb(best.memory_bytes)} GB per GPU (dp {best.dp} x tp "
                     f"{best.tp} x pp {best.pp} x cp {best.cp}); try --recompute, more GPUs or a shorter "
                     "--seq-len")
        return "\n".join(lines)
    head = (f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'m':>5} | {'state':>6} {'activ':>6} GB | "
            f"{'tp':>7} {'dp':>7} {'pp':>7} {'cp':>7} GB sent | {'bubble':>6} | {'step s':>7} {'MFU':>5}")
    lines += ["", head, "-" * len(head)]
    for p in fit[: args.top]:
        mfu = args.mfu * p.compute_s / p.step_s
        lines.append(f"{p.dp:>5} {p.tp:>3} {p.pp:>3} {p.cp:>3} {p.microbatches:>5} | {_gb(p.state_bytes):>6} "
                     f"{_gb(p.activation_bytes):>6} GB | " + " ".join(f"{_gb(p.sent[k]):>7}" for k in
                                                               ("tp", "dp", "pp", "cp"))
                     + f" GB sent | {p.bubble:>6.1%} | {p.step_s:>7.2f} {mfu:>5.0%}")
    spec = GPUS[args.gpu]
    lines += ["", "assumptions: bf16 weights/gradients + fp32 master and Adam (16 B/parameter, the "
              f"optimizer's 12 sharded over dp x cp: ZeRO-1); sequence parallelism; float32 stage boundaries "
              "(what refimpl's pipeline sends); 1F1B; {args.mfu:.0%} of "
              f"the {PEAK_FLOPS[args.gpu]['bf16'] / 1e12:.0f} TFLOP/s bf16 peak; NVLink "
              f"{spec['nvlink'] / 1e9:.0f} GB/s and network {spec['network'] / 1e9:.0f} GB/s per GPU and "
              "direction (data sheets); communication not overlapped (an upper bound); "
              + ("activations recomputed per layer" if args.recompute else "no activation recomputation")
              + ("" if args.flash else "; no flash attention (the s^2 scores kept)")]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refimpl.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=float, default=None, help="parameters (e.g. 70e9); or give the shape")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--mfu", type=float, default=0.5, help="fraction of the bf16 peak the matmuls reach")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--no-flash", dest="flash", action="store_false", help="keep the s^2 attention scores")
    p.add_argument("--top", type=int, default=10, help="layouts shown")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the ranked layouts; exit status 0, 1 when none fits, 2 for bad input (one line)."""
    args = build_parser().parse_args(argv)
    try:
        for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                            ("--seq-len", args.seq_len), ("--global-batch", args.global_batch),
                            ("--micro-batch", args.micro_batch), ("--top", args.top)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if not 0 < args.mfu <= 1:
            raise ConfigError(f"--mfu is a fraction of the peak in (0, 1], got {args.mfu}")
        shape = (args.num_layers, args.hidden_size, args.num_heads)
        if args.params is not None and any(v is not None for v in shape):
            raise ConfigError("give --params or the shape (--num-layers --hidden-size --num-heads), not both")
        if args.params is not None:
            config = model_for(args.params, vocab_size=args.vocab_size, seq_len=args.seq_len)
        elif all(v is not None for v in shape):
            config = ModelConfig(vocab_size=args.vocab_size, num_layers=args.num_layers,
                                 hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
                                 max_seq_len=args.seq_len, tie_word_embeddings=False)
        else:
            raise ConfigError("give --params, or all of --num-layers --hidden-size --num-heads")
        plans = plan_layouts(config, gpus=args.gpus, gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                             seq_len=args.seq_len, global_batch=args.global_batch,
                             micro_batch=args.micro_batch, mfu=args.mfu, recompute=args.recompute,
                             flash=args.flash)
        if not plans:
            raise ConfigError(f"no layout of {args.gpus} GPUs divides the model "
                              f"({config.num_attention_heads} heads, {config.num_layers} layers) and the "
                              f"global batch {args.global_batch}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_report(config, plans, args))
    return 0 if any(p.fits for p in plans) else 1  # 1: nothing fits (the report says what the least needs)


if __name__ == "__main__":
    sys.exit(main())
