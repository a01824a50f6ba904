"""Exercises of chapter 01: one device, the model, the data, the loop and what a step costs.

Replace each ``raise NotImplementedError`` with your implementation, then run ``make grade CH=01``
(or ``python -m exercises.grade 01``) to see your score per task. The grader builds real models with
``refimpl.models.GPT`` and real ``torch.optim.AdamW`` optimizers and compares your answers with them,
on several configurations (tied and untied embeddings, odd widths, one layer, long sequences).

You may import anything from ``torch`` and ``math``, and read ``refimpl`` to understand the model, but
do not call ``refimpl.planner``, ``refimpl.models.lm_loss`` or ``refimpl.optim.lr_at``: the point is to
derive these numbers yourself. Chapter 00's exercise (is a throughput claim plausible?) uses ``mfu``.
"""

from __future__ import annotations

import torch

from refimpl.config import ModelConfig, OptimConfig


def count_parameters(config: ModelConfig) -> int:
    """Number of parameters of ``refimpl.models.GPT(config)``, computed from ``config`` alone.

    It must equal ``sum(p.numel() for p in GPT(config).parameters())``, which counts a tied parameter once.
    Count, with h = ``hidden_size``, f = ``ffn_hidden_size``, v = ``vocab_size``, T = ``max_seq_len``:

    * the word embedding (v x h) and the position embedding (T x h);
    * per layer: two LayerNorms (a weight and a bias of h each), the fused query/key/value projection
      (h -> 3h, with bias), the attention output projection (h -> h, with bias), the MLP (h -> f and
      f -> h, each with bias);
    * the final LayerNorm;
    * the output layer (h -> v, no bias), but only when ``tie_word_embeddings`` is False; when True it
      *is* the word embedding.
    """
    raise NotImplementedError("count_parameters: count the parameters of GPT(config) from the config")


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) by the PaLM formula: ``6 N + 12 L H Q T``.

    N is *all* the parameters (``count_parameters(config)``, a tied embedding counted once), L the layers,
    H the attention heads, Q the head dimension (hidden_size / heads) and T is ``seq_len`` (the length of
    the sequences trained, which may be shorter than ``config.max_seq_len``). Return a float.
    """
    raise NotImplementedError("flops_per_token: 6N + 12 L H Q T (PaLM, appendix B)")


def mfu(config: ModelConfig, seq_len: int, tokens_per_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation of a run that trains ``GPT(config)`` on sequences of ``seq_len`` tokens.

    ``tokens_per_s`` is the throughput of the whole run (all ``num_devices`` devices together);
    ``peak_flops`` is the dense peak FLOP/s of *one* device in the dtype the run computes in. MFU is the
    fraction of the devices' peak that the model's training arithmetic (PaLM's count, your
    ``flops_per_token``) would fill at that throughput. Return a float fraction (0.4 means 40%); a claim
    can be impossible, so do not clamp it to 1.
    """
    raise NotImplementedError("mfu: the model's FLOP/s over what the devices could deliver at peak")


def adam_state_bytes(config: ModelConfig) -> int:
    """Bytes of optimizer state that ``torch.optim.AdamW`` holds for ``GPT(config)`` after its first step.

    Precisely: the model's parameters are float32 and all trainable; the optimizer is built with default
    options (not fused, not capturable) over ``model.parameters()``; ``loss.backward()`` then
    ``optimizer.step()`` have run once. The answer is the sum of ``t.numel() * t.element_size()`` over
    every tensor in ``optimizer.state``. For each parameter tensor AdamW keeps

    * ``exp_avg`` and ``exp_avg_sq``: the first and second moments, each shaped like the parameter
      (float32 here);
    * ``step``: a float32 scalar tensor (one per parameter *tensor*, not per number).

    Count a tied parameter once (the optimizer sees it once).
    """
    raise NotImplementedError("adam_state_bytes: two moments per parameter plus one step tensor per tensor")


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, in nats per token, as a 0-dim tensor that backward can go through.

    ``logits``: ``[batch, seq, vocab]`` float; ``labels``: ``[batch, seq]`` int64, the token that follows
    each position. The loss of one position is ``logsumexp(logits[b, s]) - logits[b, s, labels[b, s]]``;
    return the mean over all ``batch * seq`` positions, computed in float32 even if the logits are
    bfloat16. It must be numerically stable: logits of size 1000 must not give ``inf`` or ``nan``.
    (One line with ``torch.nn.functional.cross_entropy`` is a correct answer; so is writing it yourself.)
    """
    raise NotImplementedError("next_token_loss: mean cross entropy over all positions")


def lr_at(step: int, config: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay.

    With ``lr = config.lr``, ``W = config.warmup_steps`` and ``floor = config.min_lr_ratio * lr``:

    * warm-up, ``step < W``: ``lr * (step + 1) / W`` (so step 0 already trains, and step W - 1 uses lr);
    * decay, ``step >= W``: with ``progress = min(1, (step - W) / max(1, total_steps - W))``,
      ``floor + 0.5 * (lr - floor) * (1 + cos(pi * progress))``: lr at the end of warm-up, ``floor`` at
      ``total_steps`` and after it.

    ``W`` may be 0 (no warm-up).
    """
    raise NotImplementedError("lr_at: linear warm-up, then cosine decay to min_lr_ratio * lr")
