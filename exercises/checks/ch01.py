"""Checks of chapter 01's exercises (``exercises/01_single_device.py``), graded by ``make grade CH=01``.

Each check loads the graded module by path, calls one function on several configurations, including the
awkward ones (untied embeddings, one layer, a width that is not a power of two, a vocabulary other than
256, sequences shorter than ``max_seq_len``), and compares the answer with the ground truth: a real
``GPT`` and a real ``torch.optim.AdamW`` where one can be built, refimpl's implementation otherwise. A
wrong answer raises AssertionError with what was expected and, where the mistake is a common one, a hint.

``MUTANTS`` holds one plausible wrong implementation per task: the test suite grades each and expects
exactly that task to fail (a check that cannot fail proves nothing).
"""

from __future__ import annotations

import math
import operator

import torch

from exercises.grading import Task, load_module
from refimpl import planner
from refimpl.config import ModelConfig, OptimConfig
from refimpl.models import GPT, lm_loss
from refimpl.optim import lr_at

CONFIGS = [
    ModelConfig(),  # the course's default: 4 layers, hidden 128, tied
    ModelConfig(tie_word_embeddings=False),
    ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=3, max_seq_len=17),
    ModelConfig(num_layers=3, hidden_size=40, num_attention_heads=5, ffn_hidden_size=100, max_seq_len=33,
                vocab_size=300, tie_word_embeddings=False),
]


def _describe(config: ModelConfig) -> str:
    return (f"ModelConfig(num_layers={config.num_layers}, hidden_size={config.hidden_size}, "
            f"num_attention_heads={config.num_attention_heads}, ffn_hidden_size={config.ffn_hidden_size}, "
            f"max_seq_len={config.max_seq_len}, vocab_size={config.vocab_size}, "
            f"tie_word_embeddings={config.tie_word_embeddings})")


def _as_int(value: object, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise AssertionError(f"{what} must return an int, got {type(value).__name__} {value!r}") from None


def check_count_parameters(path: str) -> None:
    count_parameters = load_module(path).count_parameters
    for config in CONFIGS:
        got = _as_int(count_parameters(config), "count_parameters")
        want = sum(p.numel() for p in GPT(config).parameters())
        if got == want:
            continue
        h, v, t = config.hidden_size, config.vocab_size, config.max_seq_len
        hint = ""
        if got - want == h * v and config.tie_word_embeddings:
            hint = " Hint: with tie_word_embeddings the output layer is the word embedding; count it once."
        elif want - got == h * v and not config.tie_word_embeddings:
            hint = " Hint: untied, the output layer (h x v, no bias) is a parameter of its own."
        elif want - got == t * h:
            hint = " Hint: the position embedding (max_seq_len x h) is a parameter too."
        elif (want - got) % config.num_layers == 0 and want - got < 10 * h * config.num_layers:
            hint = " Hint: a per-layer vector is missing or extra: biases? both LayerNorms' weight and bias?"
        raise AssertionError(
            f"count_parameters({_describe(config)}) = {got:,d}, but GPT(config) has {want:,d} parameters "
            f"(off by {got - want:+,d}).{hint}"
        )


def check_flops_per_token(path: str) -> None:
    flops_per_token = load_module(path).flops_per_token
    for config in CONFIGS:
        for seq_len in (config.max_seq_len, max(1, config.max_seq_len // 2 - 1)):
            got = flops_per_token(config, seq_len)
            want = planner.flops_per_token(config, seq_len)
            if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-12):
                continue
            counts = planner.param_count(config)
            attention = 12 * config.num_layers * config.num_attention_heads * config.head_dim
            hint = ""
            if isinstance(got, (int, float)):
                if math.isclose(got, planner.flops_per_token(config, seq_len, matmul_only=True)):
                    hint = " Hint: N is every parameter here (the PaLM formula), not only the matmul weights."
                elif math.isclose(got, 6.0 * counts.total):
                    hint = " Hint: the attention term 12 L H Q T is missing."
                elif math.isclose(got, 6.0 * counts.total + attention * config.max_seq_len):
                    hint = " Hint: T is the seq_len argument, not config.max_seq_len."
                elif math.isclose(got, 2.0 * counts.total + attention / 3 * seq_len):
                    hint = " Hint: that is the forward pass only; add the backward pass (x3 in all)."
            raise AssertionError(
                f"flops_per_token({_describe(config)}, seq_len={seq_len}) = {got!r}, expected {want:,.0f} "
                f"= 6 x {counts.total:,d} + 12 x {config.num_layers} x {config.num_attention_heads} x "
                f"{config.head_dim} x {seq_len}.{hint}"
            )


MFU_CASES = [  # (config, seq_len, tokens/s of the whole run, devices, dense peak per device)
    (CONFIGS[0], 128, 5.0e5, 1, 67e12),  # the course's model on one H100 in fp32
    (CONFIGS[1], 64, 3.0e6, 8, 19.5e12),  # untied, 8 A100s in fp32, sequences shorter than max_seq_len
    (CONFIGS[3], 33, 1.0e9, 3, 1e12),  # an impossible claim: MFU above 1 must not be clamped
    (ModelConfig(vocab_size=32000, num_layers=32, hidden_size=4096, num_attention_heads=32, max_seq_len=4096),
     4096, 1.0e6, 256, 989e12),  # a 6.6 B-parameter model on 256 H100s in bf16
]


def check_mfu(path: str) -> None:
    mfu = load_module(path).mfu
    for config, seq_len, tokens_per_s, devices, peak in MFU_CASES:
        got = mfu(config, seq_len, tokens_per_s, devices, peak)
        want = tokens_per_s * planner.flops_per_token(config, seq_len) / (devices * peak)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9):
            continue
        hint = ""
        if isinstance(got, (int, float)):
            if math.isclose(got, want * devices, rel_tol=1e-9) and devices > 1:
                hint = " Hint: tokens_per_s is the whole run's; divide by the peak of all the devices."
            elif math.isclose(got, 100 * want, rel_tol=1e-9):
                hint = " Hint: return a fraction, not a percentage."
            elif math.isclose(got, min(want, 1.0), rel_tol=1e-9):
                hint = " Hint: an impossible claim has an MFU above 1; do not clamp it."
            elif math.isclose(got, want * 6 * planner.param_count(config).total
                              / planner.flops_per_token(config, seq_len), rel_tol=1e-9):
                hint = " Hint: the FLOPs per token include the attention term 12 L H Q T."
        raise AssertionError(
            f"mfu({_describe(config)}, seq_len={seq_len}, tokens_per_s={tokens_per_s:g}, "
            f"num_devices={devices}, peak_flops={peak:g}) = {got!r}, expected {want:.6g}.{hint}"
        )


def _measured_adam_state_bytes(config: ModelConfig) -> int:
    """Build GPT(config) and AdamW, take one step, and add up the bytes of the optimizer's state."""
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.arange(9) % config.vocab_size
    lm_loss(model(tokens[:-1].unsqueeze(0)), tokens[1:].unsqueeze(0)).backward()
    optimizer.step()
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


def check_adam_state_bytes(path: str) -> None:
    adam_state_bytes = load_module(path).adam_state_bytes
    for config in CONFIGS:
        got = _as_int(adam_state_bytes(config), "adam_state_bytes")
        want = _measured_adam_state_bytes(config)
        assert want == planner.state_memory(config).optimizer, "internal: the planner disagrees with AdamW"
        if got == want:
            continue
        n, tensors = planner.param_count(config).total, planner.num_param_tensors(config)
        hint = ""
        if got == 8 * n:
            hint = (f" Hint: AdamW also keeps a `step` counter, a float32 scalar tensor for each of the "
                    f"{tensors} parameter tensors.")
        elif got == 8 * n + 8 * tensors:
            hint = " Hint: `step` is a float32 tensor: 4 bytes, not 8."
        elif got == 8 * n + 4 * n:
            hint = " Hint: there is one `step` per parameter *tensor*, not per number."
        elif got in (2 * n + 4 * tensors, 4 * n + 4 * tensors):
            hint = " Hint: the moments are float32, 4 bytes per number, two moments per parameter."
        raise AssertionError(
            f"adam_state_bytes({_describe(config)}) = {got:,d}, but AdamW holds {want:,d} bytes after one "
            f"step ({n:,d} parameters in {tensors} tensors).{hint}"
        )


def _loss_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    cases = []
    for name, (b, s, v), scale, dtype in [
        ("random", (2, 5, 256), 1.0, torch.float32),
        ("one position, vocabulary 7", (1, 1, 7), 3.0, torch.float32),
        ("odd shape", (3, 4, 11), 1.0, torch.float32),
        ("large logits (numerical stability)", (2, 3, 256), 1000.0, torch.float32),
        ("bfloat16 logits", (2, 6, 256), 2.0, torch.bfloat16),
    ]:
        logits = (torch.randn(b, s, v, generator=g) * scale).to(dtype)
        labels = torch.randint(0, v, (b, s), generator=g)
        cases.append((name, logits, labels))
    return cases


def check_next_token_loss(path: str) -> None:
    next_token_loss = load_module(path).next_token_loss
    for name, logits, labels in _loss_cases():
        mine = logits.detach().clone().requires_grad_(True)
        ref = logits.detach().clone().requires_grad_(True)
        got = next_token_loss(mine, labels.clone())
        want = lm_loss(ref, labels)
        where = f"next_token_loss on {name} logits {tuple(logits.shape)} {logits.dtype}"
        assert torch.is_tensor(got), f"{where}: must return a tensor, got {type(got).__name__}"
        assert got.dim() == 0, f"{where}: must return a 0-dim tensor, got shape {tuple(got.shape)}"
        assert got.dtype == torch.float32, f"{where}: compute the loss in float32, got {got.dtype}"
        assert torch.isfinite(got), f"{where}: got {got.item()}; use log-sum-exp (subtract the max)"
        if not torch.allclose(got.detach(), want.detach(), rtol=1e-5, atol=1e-5):
            ratio = got.item() / want.item()
            hint = ""
            if math.isclose(ratio, labels.numel(), rel_tol=1e-4):
                hint = " Hint: that is the sum over positions; take the mean."
            elif any(math.isclose(ratio, d, rel_tol=1e-4) for d in labels.shape if d > 1):
                hint = " Hint: average over every position, batch and sequence together."
            raise AssertionError(f"{where}: got {got.item():.6f}, expected {want.item():.6f}.{hint}")
        assert got.requires_grad, f"{where}: the result must be differentiable (do not detach or use .item())"
        got.backward()
        want.backward()
        rtol = 1e-4 if logits.dtype == torch.float32 else 2e-2  # a bfloat16 gradient keeps ~3 digits
        assert mine.grad is not None, f"{where}: no gradient reached the logits"
        error = (mine.grad.float() - ref.grad.float()).abs().max().item()
        assert torch.allclose(mine.grad.float(), ref.grad.float(), rtol=rtol, atol=1e-6), \
            f"{where}: the gradient is wrong (max error {error:.3g})"


OPTIM_CASES = [
    (OptimConfig(), 50),  # lr 3e-3, 10 warm-up steps, floor 10%
    (OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.0), 20),  # no warm-up, decay to zero
    (OptimConfig(lr=6e-4, warmup_steps=7, min_lr_ratio=0.25), 8),  # a single decay step
    (OptimConfig(lr=1e-2, warmup_steps=12), 5),  # the run ends inside the warm-up
]


def check_lr_at(path: str) -> None:
    mine = load_module(path).lr_at
    for config, total in OPTIM_CASES:
        for step in range(total + 3):  # a few steps past the end: the schedule stays at the floor
            got, want = mine(step, config, total), lr_at(step, config, total)
            if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
                continue
            phase = "warm-up" if step < config.warmup_steps else "cosine decay"
            raise AssertionError(
                f"lr_at(step={step}, OptimConfig(lr={config.lr}, warmup_steps={config.warmup_steps}, "
                f"min_lr_ratio={config.min_lr_ratio}), total_steps={total}) = {got!r}, expected {want!r} "
                f"({phase})"
            )


TASKS = [
    Task(name="count_parameters", points=2, check=check_count_parameters),
    Task(name="flops_per_token", points=2, check=check_flops_per_token),
    Task(name="mfu", points=2, check=check_mfu),
    Task(name="adam_state_bytes", points=2, check=check_adam_state_bytes),
    Task(name="next_token_loss", points=2, check=check_next_token_loss),
    Task(name="lr_at", points=2, check=check_lr_at),
]

# Plausible mistakes, one per task (task name -> module source); each must fail its task and only it.
_HEADER = (
    "from exercises.reference.ch01 import *  # noqa: F403\n"
    "import math\nimport torch\nfrom refimpl import planner\n"
)
MUTANTS = {
    "count_parameters": _HEADER + (
        "def count_parameters(config):\n"
        "    return planner.param_count(config).total + 1  # off by one\n"
    ),
    "flops_per_token": _HEADER + (
        "def flops_per_token(config, seq_len):\n"
        "    return planner.flops_per_token(config, seq_len, matmul_only=True)  # N without the vectors\n"
    ),
    "mfu": _HEADER + (
        "def mfu(config, seq_len, tokens_per_s, num_devices, peak_flops):\n"
        "    flops = tokens_per_s * planner.flops_per_token(config, seq_len)\n"
        "    return flops / peak_flops  # one device's peak for the whole run's throughput\n"
    ),
    "adam_state_bytes": _HEADER + (
        "def adam_state_bytes(config):\n"
        "    return 8 * planner.param_count(config).total  # forgets the per-tensor step counters\n"
    ),
    "next_token_loss": _HEADER + (
        "def next_token_loss(logits, labels):\n"
        "    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),\n"
        "                                             reduction='sum')  # a sum, not a mean\n"
    ),
    "lr_at": _HEADER + (
        "def lr_at(step, config, total_steps):\n"
        "    if step < config.warmup_steps:\n"
        "        return config.lr * step / config.warmup_steps  # step 0 trains with lr 0\n"
        "    floor = config.min_lr_ratio * config.lr\n"
        "    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))\n"
        "    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))\n"
    ),
}
