"""The model's configuration: ``ModelConfig``, the forms it names (``LLAMA``, ``DEEPSEEK_V3``,
``ARCHS``) and the
class that builds it (``MODEL_CLASS``) (chapter 01; ``refimpl.config`` re-exports them with the data
and run configurations). Names follow Megatron-LM (``hidden_size``, ``num_attention_heads``,
``ffn_hidden_size``); it validates itself on construction and imports nothing of refimpl but the error.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refimpl.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ACTIVATIONS", "ARCHS", "ATTENTION_TYPES", "DEEPSEEK_V3", "LLAMA", "MODEL_CLASS",
           "MOE_ACTIVATIONS", "MOE_LOAD_BALANCE", "MOE_SCORE_FUNCS", "NORMALIZATIONS", "POSITION_EMBEDDINGS",
           "ROPE_TYPES", "MLAShape", "ModelConfig"]

MOE_SCORE_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")  # chapter 09: Switch / Mixtral, DeepSeek-V3
MOE_LOAD_BALANCE: tuple[str, ...] = ("aux", "bias")  # chapter 09: the balance loss, or DeepSeek-V3's bias
MOE_ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")  # chapter 09: the experts' MLP
POSITION_EMBEDDINGS: tuple[str, ...] = ("learned", "rope")  # chapter 01: GPT-2's table, Llama's rotation
ROPE_TYPES: tuple[str, ...] = ("default", "llama3")  # RoFormer's frequencies, Llama 3.1's scaled ones
NORMALIZATIONS: tuple[str, ...] = ("layernorm", "rmsnorm")
ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")  # the dense MLP's
ATTENTION_TYPES: tuple[str, ...] = ("mha", "mla")  # multi-head (GQA, MQA), DeepSeek's multi-head latent
MLA_DIMS: tuple[str, ...] = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The dimensions multi-head latent attention needs (``q_lora_rank`` may stay None)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's dimensions, validated: ``ModelConfig.mla`` of a configuration with
    ``attention_type="mla"`` (``q_lora_rank`` None: queries projected straight from the hidden state)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Each head's query/key width, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the small GPT that runs through the whole course (chapter 01).

    A decoder-only transformer with pre-LayerNorm blocks (GPT-2, Radford et al. 2019), learned position
    embeddings and a byte vocabulary of 256.

    **The Llama form** (one config-driven model, as Megatron-Core's ``GPTModel``): ``num_key_value_heads``
    (grouped-query attention, Ainslie et al. 2023; 1: multi-query), ``position_embedding="rope"`` (Su et al.
    2021, with ``rope_theta`` and ``rope_type="llama3"``'s frequency scaling), ``normalization="rmsnorm"``,
    ``activation="swiglu"`` (Shazeer 2020), ``add_bias=False`` and an untied output layer:
    ``ModelConfig(**LLAMA, ...)``. At their defaults these fields are GPT-2's and left out of
    ``to_dict``.

    **Mixture of experts** (chapter 09; Shazeer et al. 2017, GShard, Switch, DeepSeek-V3): with ``num_experts
    = E > 0`` the MLP of every ``moe_every``-th block (blocks ``0, N, 2N, ...``, the rule of Megatron-LM's
    ``moe_layer_freq``; 1: all) is an ``MoEMLP`` (``refimpl.models.moe``): a top-``top_k`` router over ``E``
    experts with ``score_func`` scores, each expert an MLP of ``moe_ffn_hidden_size`` (None: the dense MLP's
    ``ffn_hidden_size``) with ``moe_activation`` (``gelu``: two matrices like the dense MLP; ``swiglu``:
    three). ``moe_normalize_topk``: divide each token's ``k`` combine weights by their sum (GShard, Mixtral,
    DeepSeek-V3) or keep the raw scores (Switch's top-1); None (the default) renormalises when ``top_k > 1``
    (at ``k = 1`` a renormalised weight is 1 and the router would learn nothing from the task).
    ``capacity_factor`` None is dropless, else each expert takes ``ceil(k T / E cf)`` of the ``T`` tokens of
    one forward on one rank. ``moe_load_balance``: ``aux`` adds the sequence-wise balance loss
    ``aux_loss_coeff x E sum_i f_i P_i`` (DeepSeek-V3 eq. 17-20) to the loss; ``bias`` also adds it (0 for
    none) and steers the choice with DeepSeek-V3's expert bias, moved by ``moe_bias_update_rate`` before each
    optimizer step. ``moe_shared_experts``: DeepSeekMoE's shared experts (Dai et al. 2024), an always-on
    MLP of ``moe_shared_experts x`` the expert width in each MoE block, added to the routed output;
    ``moe_first_dense``: the first blocks keep the dense MLP (DeepSeek-V3's ``first_k_dense_replace``, 3).
    With ``num_experts = 0`` (dense, the default) the MoE fields are unused and left out of
    ``to_dict``, so a dense configuration reads as before; the two DeepSeek fields are left out at 0
    too.

    **The DeepSeek-V3 form** (DeepSeek-AI 2024; chapters 01 and 09): ``attention_type="mla"``, multi-head
    latent attention (DeepSeek-V2, 2024; ``refimpl.models.mla``): keys and values are projected up from a
    per-token latent of ``kv_lora_rank`` dims, each head's query and key are ``qk_nope_head_dim`` dims
    without position and ``qk_rope_head_dim`` rotated ones (the rotated key shared by all heads), values
    ``v_head_dim``; ``q_lora_rank`` (None: queries projected straight from the hidden state, as
    DeepSeek-V2-Lite) compresses the queries alike. MLA needs RoPE and has no key/value heads of its own
    (``num_key_value_heads`` stays at the heads). ``ModelConfig(**DEEPSEEK_V3, kv_lora_rank=...,
    ...)``; with ``attention_type="mha"`` (the default) the MLA fields are None and left out of
    ``to_dict``. """

    vocab_size: int = 256
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    max_seq_len: int = 128
    tie_word_embeddings: bool = True
    layernorm_eps: float = 1e-5
    num_key_value_heads: int | None = None  # GQA; None: num_attention_heads (multi-head), 1: MQA
    position_embedding: str = "learned"  # "learned" (GPT-2) or "rope" (Llama)
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "llama3": Llama 3.1's frequency scaling, with the four rope_* below
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    normalization: str = "layernorm"  # or "rmsnorm"
    activation: str = "gelu"  # the dense MLP's: "gelu" (GPT-2) or "swiglu" (Llama)
    add_bias: bool = True  # the linear layers' (and LayerNorms') biases
    num_experts: int = 0  # 0: dense; E > 0: MoE blocks (chapter 09)
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coeff: float = 0.01
    score_func: str = "softmax"
    moe_load_balance: str = "aux"
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_activation: str = "gelu"
    moe_bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma
    moe_normalize_topk: bool | None = None  # None: renormalise the top-k weights when top_k > 1
    moe_shared_experts: int = 0  # DeepSeekMoE's always-on experts, each of expert_hidden_size
    moe_first_dense: int = 0  # the first blocks keep the dense MLP (DeepSeek-V3's first_k_dense_replace)
    attention_type: str = "mha"  # "mha": multi-head (GQA, MQA); "mla": multi-head latent attention
    q_lora_rank: int | None = None  # MLA: the queries' latent (None: projected from the hidden state)
    kv_lora_rank: int | None = None  # MLA: the keys' and values' latent, what the KV cache keeps
    qk_nope_head_dim: int | None = None  # MLA: each head's query/key dims without position
    qk_rope_head_dim: int | None = None  # MLA: each head's rotated query dims, the one shared rotated key
    v_head_dim: int | None = None  # MLA: each head's value dims

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"ModelConfig: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; each head needs hidden_size / heads "
                f"dimensions; head counts that divide it: {_divisors(self.hidden_size)[:8]}"
            )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        elif self.ffn_hidden_size <= 0:
            raise ConfigError(f"ModelConfig.ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self._check_architecture()
        self._check_attention()
        self._check_moe()

    def _check_architecture(self) -> None:
        kv, a = self.num_key_value_heads, self.num_attention_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or a % kv:
            raise ConfigError(f"ModelConfig.num_key_value_heads must divide num_attention_heads = {a} (each "
                              f"key/value head serves a group of query heads), got {kv!r}")
        for name, known in (("position_embedding", POSITION_EMBEDDINGS), ("rope_type", ROPE_TYPES),
                            ("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"ModelConfig.{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.position_embedding == "rope" and self.attention_type == "mha" and self.head_dim % 2:
            raise ConfigError(f"ModelConfig: RoPE rotates pairs of dimensions: head_dim = {self.head_dim} "
                              "must be even")

    def _check_attention(self) -> None:
        if self.attention_type not in ATTENTION_TYPES:
            raise ConfigError(f"ModelConfig.attention_type must be one of {ATTENTION_TYPES}, got "
                              f"{self.attention_type!r}")
        dims = ("q_lora_rank", *MLA_DIMS)
        if self.attention_type == "mha":
            given = [name for name in dims if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"ModelConfig: {', '.join(given)} given: the dimensions of multi-head "
                                  "latent attention need attention_type='mla' (the trainer's --arch "
                                  "deepseek); leave them None for multi-head attention")
            return
        missing = [name for name in MLA_DIMS if getattr(self, name) is None]
        if missing:
            raise ConfigError(f"ModelConfig: attention_type='mla' needs {', '.join(missing)} (multi-head "
                              "latent attention's dimensions: the kv latent, each head's query/key dims "
                              "without and with rotation, its value dims; the trainer's --kv-lora-rank, "
                              "--qk-nope-head-dim, --qk-rope-head-dim, --v-head-dim)")
        for name in dims:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.mla.qk_rope_head_dim % 2:
            raise ConfigError(f"ModelConfig: RoPE rotates pairs of dimensions: qk_rope_head_dim = "
                              f"{self.qk_rope_head_dim} must be even")
        if self.position_embedding != "rope":
            raise ConfigError(f"ModelConfig: attention_type='mla' rotates its qk_rope_head_dim dims: it "
                              f"needs position_embedding='rope', got {self.position_embedding!r}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"ModelConfig.num_key_value_heads={self.num_key_value_heads}: multi-head "
                              "latent attention has no key/value heads of its own (every head's keys and "
                              "values come from one latent per token); leave it at num_attention_heads = "
                              f"{self.num_attention_heads}")

    def _check_moe(self) -> None:
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ConfigError(f"ModelConfig.num_experts must be 0 (dense) or a positive integer, got "
                              f"{self.num_experts!r}")
        for name in ("moe_shared_experts", "moe_first_dense"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"ModelConfig.{name} must be an integer >= 0, got {value!r}")
        if self.moe_first_dense > self.num_layers:
            raise ConfigError(f"ModelConfig.moe_first_dense={self.moe_first_dense}: there are only "
                              f"num_layers = {self.num_layers} blocks to keep dense")
        if self.num_experts == 0:
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"ModelConfig.top_k must be in [1, num_experts = {self.num_experts}], got "
                              f"{self.top_k}")
        if self.moe_every < 1:
            raise ConfigError(f"ModelConfig.moe_every must be >= 1 (1: every block), got {self.moe_every}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"ModelConfig.capacity_factor must be > 0 or None (dropless), got "
                              f"{self.capacity_factor}")
        if not self.aux_loss_coeff >= 0 or not self.moe_bias_update_rate >= 0:
            raise ConfigError(f"ModelConfig.aux_loss_coeff and moe_bias_update_rate must be >= 0, got "
                              f"{self.aux_loss_coeff} and {self.moe_bias_update_rate}")
        for name, known in (("score_func", MOE_SCORE_FUNCS), ("moe_load_balance", MOE_LOAD_BALANCE),
                            ("moe_activation", MOE_ACTIVATIONS)):
            if getattr(self, name) not in known:
                raise ConfigError(f"ModelConfig.{name} must be one of {known}, got {getattr(self, name)!r}")
        if self.moe_normalize_topk not in (None, True, False):
            raise ConfigError(f"ModelConfig.moe_normalize_topk must be None (when top_k > 1), True or False, "
                              f"got {self.moe_normalize_topk!r}")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size <= 0:
            raise ConfigError(f"ModelConfig.moe_ffn_hidden_size must be positive, got "
                              f"{self.moe_ffn_hidden_size}")

    @property
    def head_dim(self) -> int:
        """Q in the PaLM FLOPs formula: the width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """The dense MLP's width: ``ffn_hidden_size`` as ``__post_init__`` set it (``4 * hidden_size`` when
        None was given), never None."""
        f = self.ffn_hidden_size
        assert f is not None, "ModelConfig.__post_init__ sets ffn_hidden_size"
        return f

    @property
    def expert_hidden_size(self) -> int:
        """The width of one expert's MLP: ``moe_ffn_hidden_size``, else the dense MLP's."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def mla(self) -> MLAShape:
        """Multi-head latent attention's dimensions (validated ints, ``q_lora_rank`` may be None); a
        ConfigError under ``attention_type="mha"``, which has none."""
        if self.attention_type != "mla":
            raise ConfigError(f"ModelConfig.mla: attention_type={self.attention_type!r} has no multi-head "
                              "latent attention dimensions (they need attention_type='mla')")
        kv, nope, rope, v = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        assert kv is not None and nope is not None and rope is not None and v is not None, \
            "ModelConfig._check_attention requires the MLA dimensions under attention_type='mla'"
        return MLAShape(q_lora_rank=self.q_lora_rank, kv_lora_rank=kv, qk_nope_head_dim=nope,
                        qk_rope_head_dim=rope, v_head_dim=v)

    @property
    def qk_head_dim(self) -> int | None:
        """MLA: each head's query/key width, ``qk_nope_head_dim + qk_rope_head_dim`` (None under mha)."""
        if self.attention_type != "mla":
            return None
        return self.mla.qk_head_dim

    @property
    def query_groups(self) -> int:
        """Key/value heads, each serving ``num_attention_heads / num_key_value_heads`` query heads:
        ``num_key_value_heads`` as ``__post_init__`` set it (the heads when None was given), never None."""
        g = self.num_key_value_heads
        assert g is not None, "ModelConfig.__post_init__ sets num_key_value_heads"
        return g

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has an MoE MLP: ``num_experts > 0``, ``index >= moe_first_dense`` (the
        first blocks stay dense, DeepSeek-V3's ``first_k_dense_replace``) and ``index % moe_every == 0``."""
        return self.num_experts > 0 and index >= self.moe_first_dense and index % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the blocks whose MLP is an MoE."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def build(self, *, seed: int = 0) -> nn.Module:
        """The model this configuration describes (the course GPT, ``MODEL_CLASS``), built on the
        current default device (``with torch.device("meta"):`` for shapes only). The planner reads the
        model's declarations through it (its parameters and its tensor-parallel plan) without importing a
        model. The configuration names the class it builds and it is resolved when called (Hugging Face's
        ``config.architectures`` and ``AutoModel.from_config``): nothing here imports ``refimpl.models``,
        which imports this file."""
        module, _, name = MODEL_CLASS.rpartition(".")
        return getattr(importlib.import_module(module), name)(self, seed=seed)

    def to_dict(self) -> dict:
        """The fields as a dict; a dense configuration (``num_experts = 0``) without its unused MoE fields,
        and without the fields still at their defaults that older configurations did not have (GPT-2's
        architecture, multi-head attention, no shared experts, no dense first blocks)."""
        out = dataclasses.asdict(self)
        if self.num_experts == 0:
            for name in _MOE_FIELDS:
                out.pop(name)
        for name, default in _DEEPSEEK_MOE_DEFAULTS.items():
            if out.get(name, default) == default:
                out.pop(name, None)
        for name, default in _ARCHITECTURE_DEFAULTS.items():  # GPT-2's form reads as it always did
            if out[name] == default:
                out.pop(name)
        if out.get("num_key_value_heads") == self.num_attention_heads:
            out.pop("num_key_value_heads")
        return out


MODEL_CLASS = "refimpl.models.gpt.GPT"
"""The class a ``ModelConfig`` describes (``ModelConfig.build``), by name."""

_ARCHITECTURE_DEFAULTS: dict[str, object] = {
    "position_embedding": "learned", "rope_theta": 10000.0, "rope_type": "default", "rope_factor": 8.0,
    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position": 8192,
    "normalization": "layernorm", "activation": "gelu", "add_bias": True, "attention_type": "mha",
    "q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
    "v_head_dim": None}
"""The architecture fields at GPT-2's values: left out of ``ModelConfig.to_dict`` (the GPT-2 form's dict is
the one it always was; ``ModelConfig(**d)`` restores them)."""

LLAMA = {"position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu", "add_bias": False,
         "tie_word_embeddings": False, "layernorm_eps": 1e-6}
"""The Llama form (Touvron et al. 2023; Llama 3, Dubey et al. 2024): RoPE, RMSNorm, SwiGLU, no biases, an
untied output layer: ``ModelConfig(**LLAMA, num_key_value_heads=..., ...)``. ``ARCHS`` names the forms."""

DEEPSEEK_V3 = {"attention_type": "mla", "position_embedding": "rope", "normalization": "rmsnorm",
               "activation": "swiglu", "add_bias": False, "tie_word_embeddings": False, "layernorm_eps": 1e-6,
               "score_func": "sigmoid", "moe_load_balance": "bias", "moe_activation": "swiglu",
               "moe_normalize_topk": True}
"""The DeepSeek-V3 form (DeepSeek-AI 2024): the Llama form's RMSNorm, RoPE, SwiGLU, no biases and untied
output layer, with multi-head latent attention (DeepSeek-V2) and, when it has experts, sigmoid router
scores, renormalised top-k weights, the auxiliary-loss-free expert bias and SwiGLU experts. Its shapes are
the caller's: ``ModelConfig(**DEEPSEEK_V3, kv_lora_rank=..., qk_nope_head_dim=..., qk_rope_head_dim=...,
v_head_dim=..., num_experts=..., moe_shared_experts=1, moe_first_dense=3, ...)``."""

ARCHS: dict[str, dict] = {"gpt2": {}, "llama": LLAMA, "deepseek": DEEPSEEK_V3}

_MOE_FIELDS = ("num_experts", "top_k", "moe_every", "capacity_factor", "aux_loss_coeff", "score_func",
               "moe_load_balance", "moe_ffn_hidden_size", "moe_activation", "moe_bias_update_rate",
               "moe_normalize_topk", "moe_shared_experts", "moe_first_dense")

_DEEPSEEK_MOE_DEFAULTS: dict[str, object] = {"moe_shared_experts": 0, "moe_first_dense": 0}
"""MoE fields left out of ``ModelConfig.to_dict`` at these values (an MoE configuration of before reads as
it did)."""
