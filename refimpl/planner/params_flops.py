"""Parameters and FLOPs of the course's GPT, counted from its configuration (chapters 00-01).

Every figure here is a formula that a chapter checks against a measurement:

* parameters: counted from the architecture, equal to ``sum(p.numel())`` of ``refimpl.models.GPT``
  (``param_count``), and their shapes in ``named_parameters()`` order (``param_shapes``, read from
  a meta-device model and the tensor-parallel plan; what the ZeRO formulas of
  ``refimpl.planner.zero_state`` shard);
* FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): ``6 N + 12 L H Q T`` with N parameters,
  L layers, H heads, Q head dim, T sequence length. The ``6 N`` counts forward (2N) and backward (4N)
  matrix multiplies; ``12 L H Q T`` the attention scores and the weighted sum. Only weights that sit in a
  matrix multiply cost FLOPs, so ``flops_per_token`` can count exactly those (``matmul_only=True``)
  and then equals what ``torch.utils.flop_counter.FlopCounterMode`` measures.

MFU divides these FLOPs by the device peaks of ``refimpl.measure.peaks``
(``refimpl.measure.throughput.model_flops_utilization``, re-exported by ``refimpl.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass

from refimpl.config import ModelConfig
from refimpl.planner.param_table import param_table

__all__ = ["ParamCount", "flops_per_token", "matmul_weights_per_rank", "num_param_tensors", "param_count",
           "param_shapes"]


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    """Parameters of a GPT by role; ``total`` counts a tied embedding once. An MoE model (chapter 09) holds
    every expert (``total``) but each token uses ``k`` of the ``E`` experts of a block: ``inactive`` counts
    the other ``E - k`` experts' weights, ``active = total - inactive`` (what a token's FLOPs see; equal to
    ``total`` for a dense model)."""

    embedding: int  # word + position embeddings
    layers: int  # all transformer blocks (an MoE block: the router and every expert)
    final_layernorm: int
    output_layer: int  # 0 when tied to the word embedding
    matmul: int  # weights a token's matrix multiplies use (what costs FLOPs; MoE: the router, k experts)
    inactive: int = 0  # MoE: the weights of the E - k experts a token is not routed to, over the blocks
    experts: int = 0  # MoE: the routed experts' weights, over the blocks (what expert parallelism splits)

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_layernorm + self.output_layer

    @property
    def active(self) -> int:
        """The parameters one token uses: ``total`` minus the experts it is not routed to."""
        return self.total - self.inactive


def _attention_weights(config: ModelConfig) -> tuple[int, int]:
    """(parameters, matmul weights) of one block's attention. Multi-head / GQA: ``query_key_value`` (the q
    heads, then k and v at kv-head size) and ``dense``. Multi-head latent attention (DeepSeek-V2/V3,
    ``refimpl.models.mla``): the query path ``h -> r_q`` (RMSNorm) ``-> a (d_n + d_r)`` (or ``h -> a (d_n
    + d_r)`` without a query latent), the key/value down projection ``h -> r_kv + d_r`` (the latent and the
    one shared rotary key), its RMSNorm, the up projection ``r_kv -> a (d_n + d_v)`` and ``dense`` ``a d_v
    -> h``."""
    h, a, bias = config.hidden_size, config.num_attention_heads, int(config.add_bias)
    if config.attention_type != "mla":
        qkv = h + 2 * config.query_groups * config.head_dim
        shapes = [(h, qkv), (h, h)]
        norms = 0
    else:
        mla = config.mla
        rq, rkv, rope = mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim
        q_out = a * (mla.qk_nope_head_dim + rope)
        query = [(h, rq), (rq, q_out)] if rq else [(h, q_out)]
        shapes = [*query, (h, rkv + rope), (rkv, a * (mla.qk_nope_head_dim + mla.v_head_dim)),
                  (a * mla.v_head_dim, h)]
        norms = (rq or 0) + rkv
    matmul = sum(i * o for i, o in shapes)
    return matmul + bias * sum(o for _, o in shapes) + norms, matmul


def param_count(config: ModelConfig) -> ParamCount:
    """Count the parameters of ``refimpl.models.GPT`` for ``config`` without building it (an MoE block:
    a bias-free ``[E, h]`` router, ``E`` bias-free experts of 2 (GELU) or 3 (SwiGLU) ``h x f_e`` matrices
    and ``moe_shared_experts`` always-on experts of the same size; ``ParamCount``'s ``active`` and
    ``inactive``; multi-head latent attention: ``_attention_weights``)."""
    h, f, v, n = config.hidden_size, config.ffn_size, config.vocab_size, config.num_layers
    bias = int(config.add_bias)
    attention, attention_matmul = _attention_weights(config)
    up = 2 * f if config.activation == "swiglu" else f  # SwiGLU: gate and up
    mlp = (h * up + bias * up) + (f * h + bias * h)  # dense_h_to_4h and dense_4h_to_h
    norm = h * (2 if config.normalization == "layernorm" and config.add_bias else 1)  # weight (+ bias)
    layernorms = 2 * norm
    moe_layers = len(config.moe_layers)
    matrices = 3 if config.moe_activation == "swiglu" else 2
    expert = matrices * h * config.expert_hidden_size if moe_layers else 0
    e, k, shared = config.num_experts, config.top_k, config.moe_shared_experts
    dense_layers = n - moe_layers
    return ParamCount(
        embedding=v * h + (config.max_seq_len * h if config.position_embedding == "learned" else 0),
        layers=dense_layers * (attention + mlp + layernorms)
        + moe_layers * (attention + h * e + (e + shared) * expert + layernorms),
        final_layernorm=norm,
        output_layer=0 if config.tie_word_embeddings else h * v,
        matmul=n * attention_matmul + dense_layers * (h * up + f * h)
        + moe_layers * (h * e + (k + shared) * expert)
        + h * v,  # the output layer multiplies, tied or not
        inactive=moe_layers * (e - k) * expert,
        experts=moe_layers * e * expert,
    )


def num_param_tensors(config: ModelConfig) -> int:
    """How many parameter tensors the model has (Adam keeps one ``step`` scalar per tensor; a tied weight
    is one tensor): those of its ``named_parameters()`` (``refimpl.planner.param_table.param_table``)."""
    return len(param_table(config).params)


def flops_per_token(config: ModelConfig, seq_len: int, *, matmul_only: bool = False) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L H Q T`` (PaLM appendix B); for an MoE
    model ``N`` is the active parameters (the router and the ``k`` experts a token is routed to); under
    multi-head latent attention the scores run over the query/key width ``d_n + d_r`` and the weighted sum
    over ``d_v``: ``6 L H (d_n + d_r + d_v) T``.

    With ``matmul_only`` N counts only weights inside matrix multiplies (no position embedding,
    LayerNorm or bias); that is the number a FLOP counter measures. The attention term counts the full
    T x T score matrix, as PaLM and ``FlopCounterMode`` do, although a causal mask could skip half.
    """
    counts = param_count(config)
    n = counts.matmul if matmul_only else counts.active  # MoE: the parameters a token uses
    # the scores (q k^T over the query/key width) and the weighted sum (over the value width), each 2 FLOPs
    # per multiply-add forward and twice that backward: 12 L a d T when both widths are d
    qk, v = ((config.mla.qk_head_dim, config.mla.v_head_dim)
             if config.attention_type == "mla" else (config.head_dim, config.head_dim))
    attention = 6 * config.num_layers * config.num_attention_heads * (qk + v) * seq_len
    return 6.0 * n + attention


def param_shapes(config: ModelConfig, *, tp: int = 1) -> list[tuple[int, ...]]:
    """The shapes of ``refimpl.models.GPT``'s parameters in ``named_parameters()`` order (read from a
    meta-device model, ``refimpl.planner.param_table.param_table``); with ``tp > 1`` those one rank
    holds after ``refimpl.parallel.tensor_parallel.apply_tensor_parallel`` (Shoeybi et al. 2019;
    chapter 06), split as the model's ``tensor_parallel_plan`` declares.

    Sharded by ``t``: ``query_key_value`` and ``dense_h_to_4h`` by rows (weight and bias, column-parallel),
    ``dense`` and ``dense_4h_to_h`` weights by columns (row-parallel; their biases whole), the word
    embedding by rows, ``ceil(V/t)`` per rank (the Parameter includes the padding rows of the vocab-parallel
    padding rule), an untied output layer by rows. Whole on every rank: the LayerNorms, the position
    embedding and the row-parallel biases.
    """
    return [p.shape for p in param_table(config, tp=tp).params]


def matmul_weights_per_rank(config: ModelConfig, *, tp: int = 1) -> int:
    """Elements of the weights one rank multiplies (what autocast casts): its linear layers' weights, the
    output layer's included (tied: the embedding shard, padding rows included). ``tp = 1``:
    ``ParamCount.matmul``."""
    return sum(p.numel for p in param_table(config, tp=tp).params if p.matmul)
