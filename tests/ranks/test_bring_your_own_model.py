"""Bring your own model (chapter 12): refimpl's techniques applied to models that are not refimpl's.

Two foreign models, each given only what a practitioner would write (a few lines of glue per technique):

* ``UserLM``, a transformer of the user's own, with its own names (``tok``, ``blocks``, ``attn.qkv``,
  ``attn.out``, ``ffn.up``/``ffn.down``, ``norm1``/``norm2``, an untied ``lm_head``): its attention is one
  FUSED ``[q|k|v]`` linear in nanoGPT's ``[3, heads, d]`` row order and infers its heads from the width
  (``view(b, s, -1, d)``), so it runs unchanged on a tensor-parallel rank's ``heads / t`` heads;
* Hugging Face's ``LlamaForCausalLM`` from a small ``LlamaConfig`` (built offline, never downloaded): GQA
  (4 query heads, 2 kv heads), RoPE, SwiGLU; its tensor-parallel plan is Hugging Face's own
  ``config.base_model_tp_plan`` (``layers.*.self_attn.q_proj: "colwise"``, ...) mapped to our styles.

Neither declares anything: a technique asked without its declaration is refused by
``refimpl.parallel.declarations.MissingDeclaration`` (a ``TypeError``) naming what to declare, never
an ``AttributeError``; with the declaration passed in (a plan, ``unit_types``, a ``pipeline_stages``
method) each technique runs. One 2-rank spawn per model computes every case; the tests assert on it.

**What is compared.** Losses and every gradient before the optimizer (AdamW's first step is about
``lr x sign(g)``: it hides a constant gradient factor), gathered to whole tensors from the boxes each
wrapper declares, against (a) one device running the same global batch and (b) PyTorch's own
implementation on the same ranks: ``parallelize_module`` with torch's ``ColwiseParallel`` /
``RowwiseParallel`` on a 1-D gloo ``DeviceMesh`` (``loss_parallel`` for the vocab-parallel loss),
``DistributedDataParallel``, FSDP2 ``fully_shard`` per block and root, and
``torch.distributed.algorithms``' ``checkpoint_wrapper``.

**Tolerances** (the numerics rule). Where the arithmetic is the same it is bit for bit: data parallelism,
ZeRO-1/2/3 and the pipeline at 2 ranks against one device running the global batch as 2 micro-batches
(each loss halved: a power of two, exact; two addends: commutative), and against DDP / ``fully_shard``;
activation checkpointing against no checkpointing (the recomputation repeats the same kernels on the same
inputs). Tensor parallelism multiplies by blocks of the weights and reduces partial sums in another
order: its loss and each gradient must lie within ``FACTOR x`` the one-device float32 run's distance from
the float64 run of the same model and batch, measured in the same spawn, per tensor (element-wise max;
the loss at least 1 ulp, since the float32 loss may round to the float64 one exactly). Each of the two
runs is about one such distance from exact arithmetic, so their difference is within 2x; another 2x for
the TP reduction's own roundings: ``FACTOR = 4`` (tests/ranks/test_tp_transformer.py's rule). Measured: ours
and torch's TP at most 0.51 of the tolerance (the Llama's ``k_proj`` gradient; AVX2, and 0.46 under
``ATEN_CPU_CAPABILITY=default``), ours against torch's at most 0.45; one device's 2 micro-batches against
its whole batch 0.26.

**Negative controls**: the fused qkv split by contiguous rows (``ColwiseParallel()`` instead of
``ColwiseParallel(chunks=3)``: rank 0 gets all of q and half of k) misses the tolerance by orders of
magnitude (1.6e6 x); so do data parallelism without its synchronisation (1.6e6 x) and a pipeline whose
micro-batch loss is a mean instead of a share of the global batch (every gradient doubled); checkpointing
saves less than half of what autograd saves without it (so its bitwise check is not vacuous).

**Checkpoints across layouts**: one AdamW step at 2 ranks (the Llama under TP=2 by Hugging Face's plan, the
user model under ZeRO-3 by its block type), saved by ``refimpl.checkpoint`` (each rank its boxes); this
process loads it into the plain model and a plain AdamW: parameters and moments equal the 2-rank run's
whole tensors, bit for bit.

The user model under TP=2 is not checkpointed: its fused qkv as ``ColwiseParallel(chunks=3)`` holds 3 row
blocks per rank, which one box cannot name, and the checkpoint refuses it by name (tested). A refimpl
entry point that fails on a foreign model raises ``RefimplBug`` with the refimpl error it hit.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Llama is built from a config: never download

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from refimpl.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    expected_shapes,
    load_training_state,
    save_training_state,
)
from refimpl.distributed.placement import Box, is_dtensor, module_shards
from refimpl.launch import run_ranks
from refimpl.parallel.activation_checkpoint import apply_activation_checkpointing
from refimpl.parallel.data_parallel import DataParallelBucket
from refimpl.parallel.declarations import MissingDeclaration
from refimpl.parallel.pipeline_parallel import PipelineModule, split_blocks, stage_rank
from refimpl.parallel.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    VocabParallel,
    apply_tensor_parallel,
    full_state_dict,
    tp_lm_loss,
)
from refimpl.parallel.zero import FullyShardedDataParallel, ShardedOptimizer
from tests.support.timeouts import SPAWN_TIMEOUT_S

FACTOR = 4.0  # x the one-device float32-vs-float64 distance (module docstring)
VOCAB, HIDDEN, HEADS, LAYERS, FFN = 64, 32, 4, 2, 64
BATCH, SEQ = 4, 8  # the global batch: 2 sequences per data-parallel rank, or 2 micro-batches of 2
WORLD = 2
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}


# -- the user's own model: nothing refimpl, nothing declared ------------------------------------------------

class Attention(nn.Module):
    """Causal self-attention with one fused ``qkv`` linear, rows ``[q | k | v]`` each ``[heads, head_dim]``
    (nanoGPT's ``c_attn``); the heads are inferred from the width, so a rank with ``heads / t`` heads runs
    the same code."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        # eps fixed: RMSNorm's default is the dtype's epsilon, which would make float64 another model
        self.norm1, self.attn = nn.RMSNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2, self.ffn = nn.RMSNorm(dim, eps=1e-6), FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class UserLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = HIDDEN, heads: int = HEADS, layers: int = LAYERS,
                 hidden: int = FFN) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


# The user's tensor-parallel plan for it (torch's pattern syntax). The fused qkv is three projections:
# ColwiseParallel(chunks=3) gives each rank rows of q, k and v of the same heads.
USER_PLAN = {
    "tok": VocabParallel(),
    "blocks.*.attn.qkv": ColwiseParallel(chunks=3),
    "blocks.*.attn.out": RowwiseParallel(),
    "blocks.*.ffn.up": ColwiseParallel(),
    "blocks.*.ffn.down": RowwiseParallel(),
    "lm_head": ColwiseParallel(),  # the logits shard [b, s, V/t]: tp_lm_loss takes the loss on it
}


class UserStage(nn.Module):
    """The user's pipeline stage (the protocol of refimpl/parallel/pipeline_parallel/stage.py): blocks
    ``block_ids`` of ``model`` (shared, not copied), the embedding on the first stage, the final norm and
    the head on the last."""

    def __init__(self, model: UserLM, block_ids: range, *, stage: int, num_stages: int) -> None:
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.hidden_size = model.tok.embedding_dim  # what crosses a stage boundary: [b, s, hidden_size]
        self.tied_copy = False  # the head is untied: no stage holds a copy of another's weight
        self.block_ids = block_ids
        self.tok = model.tok if self.is_first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in block_ids)
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def tied_weight(self) -> torch.Tensor | None:
        return None

    def full_name(self, name: str) -> str:
        """``blocks.0...`` of this stage is ``blocks.<its block id>...`` of the whole model."""
        if name.startswith("blocks."):
            i, rest = name.split(".", 2)[1:]
            return f"blocks.{self.block_ids[int(i)]}.{rest}"
        return name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x)) if self.is_last else x


def user_pipeline_stages(model: UserLM, *, pp_rank: int, pp_size: int, virtual_stages: int,
                         balance: str) -> dict[int, UserStage]:
    """The declaration PipelineModule reads: this rank's stages, stage ``s`` on rank ``s % pp_size``."""
    n = pp_size * virtual_stages
    ranges = split_blocks([sum(p.numel() for p in b.parameters()) for b in model.blocks], n, balance=balance)
    return {s: UserStage(model, ranges[s], stage=s, num_stages=n)
            for s in range(n) if stage_rank(s, pp_size=pp_size) == pp_rank}


# -- the two models as the worker sees them ----------------------------------------------------------------

class UserSpec:
    name = "user"

    def build(self) -> UserLM:
        torch.manual_seed(0)
        return UserLM()

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids)

    @property
    def unit(self) -> type[nn.Module]:
        return Block

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks

    def plan(self) -> dict:
        return USER_PLAN

    def torch_plan(self) -> dict:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
        from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

        return {"tok": TorchRowwise(input_layouts=Replicate()),  # torch's vocab-parallel embedding
                "blocks.*.attn.qkv": TorchColwise(),  # on the rows laid out per rank (qkv_rows_per_rank)
                "blocks.*.attn.out": TorchRowwise(),
                "blocks.*.ffn.up": TorchColwise(),
                "blocks.*.ffn.down": TorchRowwise(),
                "lm_head": TorchColwise(output_layouts=Shard(-1), use_local_output=False)}

    def fused(self, model: nn.Module) -> list[str]:
        """The fused qkv tensors: torch's ColwiseParallel has no chunks, so its run gets their rows
        reordered (``qkv_rows_per_rank``) and gives gradients in that order."""
        return [n for n, _ in model.named_parameters() if ".attn.qkv." in n]


class LlamaSpec:
    name = "llama"

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                           max_position_embeddings=SEQ, tie_word_embeddings=False,
                           attn_implementation="eager")

    def build(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(self.config())

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    @property
    def unit(self) -> type[nn.Module]:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def plan(self) -> dict:
        """Hugging Face's own plan for the decoder (under ``model.``), the embedding and head ours."""
        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
        return {"model.embed_tokens": VocabParallel(),
                **{f"model.{name}": styles[kind] for name, kind in self.config().base_model_tp_plan.items()},
                "lm_head": ColwiseParallel()}

    def torch_plan(self) -> dict:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
        from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

        styles = {"colwise": TorchColwise, "rowwise": TorchRowwise}
        hf_plan = self.config().base_model_tp_plan
        return {"model.embed_tokens": TorchRowwise(input_layouts=Replicate()),
                **{f"model.{name}": styles[kind]() for name, kind in hf_plan.items()},
                "lm_head": TorchColwise(output_layouts=Shard(-1), use_local_output=False)}

    def fused(self, model: nn.Module) -> list[str]:
        return []


SPECS = {"user": UserSpec(), "llama": LlamaSpec()}


# -- helpers ---------------------------------------------------------------------------------------------

def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Picklable copies (a tensor returned from a rank would travel as shared memory)."""
    return {n: t.detach().clone().numpy() for n, t in tensors.items()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t  # torch's DTensor: gathered (collective)


def _assemble(pieces: dict[str, tuple[torch.Tensor, Box]], shapes: dict[str, torch.Size],
              group=None) -> dict[str, np.ndarray]:
    """Whole tensors from each rank's boxes (a tensor-parallel block, a ZeRO row shard, a replica), reshaped
    to the plain model's shapes: each rank writes its box into zeros, one all-reduce adds the disjoint boxes
    (x + 0 is exact). A box no rank holds stays zero and fails the comparison."""
    out = {}
    for name in sorted(pieces):  # the same order on every rank
        t, box = pieces[name]
        if box.is_full:
            full = t.detach().clone()
        else:
            full = torch.zeros(box.global_shape, dtype=t.dtype)
            full[box.slices()] = t.detach()
            dist.all_reduce(full, group=group)
        out[name] = full.reshape(shapes[name]).numpy()
    return out


def _tp_grads(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, np.ndarray]:
    """Our TP model's gradients, whole: each parameter's gradient in the box its module declares."""
    params = dict(model.named_parameters())
    pieces = {n: (params[n].grad.view(s.tensor.shape), s.box) for n, s in module_shards(model).items()
              if n in params}
    return _assemble(pieces, shapes)


def qkv_rows_per_rank(rows: int, t: int) -> torch.Tensor:
    """The order of a fused ``[q | k | v]`` weight's rows in which rank ``r``'s contiguous block is q, k and
    v of its heads (what ``ColwiseParallel(chunks=3)`` keeps): the layout torch's plain ``ColwiseParallel``
    needs."""
    n = rows // 3
    return torch.cat([torch.arange(j * n + r * n // t, j * n + (r + 1) * n // t)
                      for r in range(t) for j in range(3)])


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {n: p.shape for n, p in model.named_parameters()}


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    return _numpy({n: _whole(p.detach()) for n, p in model.named_parameters()})


# -- what each rank computes -----------------------------------------------------------------------------

def _one_device(spec, dtype: torch.dtype, *, micro: int = 1, checkpointed: str = "") -> dict:
    """The global batch on one device, in ``micro`` micro-batches (each loss divided by ``micro``); the
    gradients, the bytes autograd saved for backward, and the parameters after one AdamW step."""
    model = spec.build().to(dtype)
    if checkpointed == "ours":
        apply_activation_checkpointing(model, "all", unit_types=(spec.unit,))
    elif checkpointed == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing as torch_checkpointing,
        )

        torch_checkpointing(model, check_fn=lambda m: isinstance(m, spec.unit))
    ids, labels = _batch()
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    loss = torch.zeros((), dtype=dtype)
    for x, y in zip(ids.chunk(micro), labels.chunk(micro), strict=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            part = _loss(spec.logits(model, x), y) / micro
        part.backward()
        loss += part.detach()
    names = {n: n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()}
    grads = {names[n]: p.grad for n, p in model.named_parameters()}
    out = {"loss": loss.item(), "grads": _numpy(grads), "saved_bytes": saved[0]}
    if dtype == torch.float32 and micro > 1:
        torch.optim.AdamW(model.parameters(), **ADAMW).step()
        out["params"] = {names[n]: v for n, v in _params(model).items()}
    return out


def _tensor_parallel(spec, plan: dict) -> dict:
    """Our TP over all ranks with ``plan``: the loss on the logits shard, the gradients whole."""
    model = spec.build()
    shapes = _shapes(model)
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_tensor_parallel(model, plan, tp_group=dist.group.WORLD)
    whole = full_state_dict(model, dist.group.WORLD)  # the plain state again, in the plain shapes
    ids, labels = _batch()
    loss = tp_lm_loss(spec.logits(model, ids), labels, tp_group=dist.group.WORLD, vocab_size=VOCAB)
    loss.backward()
    same = sorted(whole) == sorted(plain) and all(torch.equal(whole[n], plain[n]) for n in plain)
    return {"loss": loss.item(), "grads": _tp_grads(model, shapes), "whole_is_plain": same}


def _torch_tensor_parallel(spec) -> dict:
    """torch's ``parallelize_module`` with the same plan (the fused qkv's rows laid out per rank first) and
    its vocab-parallel loss (``loss_parallel``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = spec.build()
    order = {}
    with torch.no_grad():
        for name in spec.fused(model):
            p = model.get_parameter(name)
            order[name] = qkv_rows_per_rank(p.shape[0], WORLD)
            p.copy_(p[order[name]])
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize_module(model, mesh, spec.torch_plan())
    ids, labels = _batch()
    logits = spec.logits(model, ids)  # a DTensor placed Shard(-1): the logits shards
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = _whole(p.grad).detach().clone()
        if name in order:  # back to the model's own row order
            g[order[name]] = g.clone()
        grads[name] = g.numpy()
    return {"loss": _whole(loss).item(), "grads": grads}


def _mean_over_ranks(loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return (loss / dist.get_world_size()).item()


def _my_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD)[rank]


def _data_parallel(spec, rank: int, kind: str) -> dict:
    """This rank's half of the global batch under ``kind``: ours ("bucket", "bucket_no_sync": the
    negative control, gradients left local), torch's "ddp", ZeRO "zero1"/"zero2" (ShardedOptimizer), ZeRO-3
    "zero3" (ours, unit_types) or "fsdp2" (torch's fully_shard per block and root). The loss, the gradients
    as they enter the optimizer (whole), and the parameters after one AdamW step."""
    model = spec.build()
    shapes = _shapes(model)
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped, optimizer = model, None
    if kind.startswith("bucket"):
        wrapped = DataParallelBucket(model, bucket_cap_mb=16 * 1024 / 2**20)  # several buckets
    elif kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=16 * 1024 / 2**20)
    elif kind in ("zero1", "zero2"):
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, zero_stage=int(kind[-1]),
                                     bucket_numel=4096, **ADAMW)
    elif kind == "zero3":
        wrapped = FullyShardedDataParallel(model, unit_types=(spec.unit,))
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for block in spec.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = optimizer or torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    ids, labels = (_my_rows(t, rank) for t in _batch())
    if kind == "bucket_no_sync":
        with wrapped.no_sync():
            loss = _loss(spec.logits(wrapped, ids), labels)
    else:
        loss = _loss(spec.logits(wrapped, ids), labels)
    loss.backward()
    if kind.startswith("bucket"):
        wrapped.finish_gradient_synchronization()
    if kind in ("zero1", "zero2"):
        optimizer.reduce_gradients()  # stage 1: the reduce-scatter step() would do (stage 2: in backward)
        pieces = {names[id(p)]: (shard.grad, box) for p, shard, box in optimizer.local_state_shards()}
        grads = _assemble(pieces, shapes)
    elif kind == "zero3":
        grads = _assemble({n: (s.tensor.grad, s.box) for n, s in wrapped.local_shards().items()
                           if s.tensor.requires_grad}, shapes)
    else:
        grads = _numpy({n: _whole(p.grad) for n, p in model.named_parameters()})
    optimizer.step()
    params = _numpy(wrapped.full_state_dict()) if kind == "zero3" else _params(model)
    return {"loss": _mean_over_ranks(loss), "grads": grads, "params": params}


def _pipeline(spec, rank: int, *, loss_share: bool = True) -> dict:
    """The user model in 2 stages, 1F1B over 2 micro-batches; ``loss_share`` False is the negative control
    (each micro-batch's mean loss, not its share of the global batch's)."""
    model = spec.build()
    model.pipeline_stages = functools.partial(user_pipeline_stages, model)  # the one declaration it needs
    pipe = PipelineModule(model, pp_group=None, pp_rank=rank, pp_size=WORLD, schedule="1f1b")
    ids, labels = _batch()

    def share(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # this micro-batch's share of the mean
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / labels.numel()

    loss = pipe.step(ids, labels, num_microbatches=2, loss_fn=share if loss_share else _loss)
    grads = {}
    for stage in pipe.stages.values():
        grads |= {stage.full_name(n): p.grad for n, p in stage.named_parameters()}
    return {"loss": loss.item(), "grads": _numpy(grads)}


def _checkpoint(spec, folder: str, layout: str) -> dict:
    """One AdamW step under ``layout`` ("tp": TP=2 with the model's plan; "zero3": FullyShardedDataParallel
    with unit_types) on 2 ranks, saved; the saved state whole (parameters, moments) for the load to match.
    The user model's plan is refused here (its chunked qkv: a ValueError before anything is written)."""
    model = spec.build()
    shapes = _shapes(model)
    ids, labels = _batch()
    if layout == "tp":
        apply_tensor_parallel(model, spec.plan(), tp_group=dist.group.WORLD)
        saved = model
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        tp_lm_loss(spec.logits(model, ids), labels, tp_group=dist.group.WORLD, vocab_size=VOCAB).backward()
    else:
        saved = FullyShardedDataParallel(model, unit_types=(spec.unit,))
        optimizer = torch.optim.AdamW(saved.parameters(), **ADAMW)
        rank = dist.get_rank()
        _loss(spec.logits(saved, _my_rows(ids, rank)), _my_rows(labels, rank)).backward()
    optimizer.step()
    checkpointer = Checkpointer(CheckpointConfig(folder=folder))
    save_training_state(checkpointer, 1, model=saved, optimizer=optimizer)
    checkpointer.close()
    shards = {n: s for n, s in module_shards(saved).items() if n in shapes}  # the parameters' boxes
    moments = {key: _assemble({n: (optimizer.state[s.tensor][key], s.box) for n, s in shards.items()}, shapes)
               for key in ("exp_avg", "exp_avg_sq")}  # each rank's moments in its parameters' boxes
    whole = full_state_dict(model, dist.group.WORLD) if layout == "tp" else saved.full_state_dict()
    return {"params": _numpy(whole), "moments": moments, "folder": folder}


def _refusal(call) -> tuple[str, bool, str]:
    """``(exception type, is a MissingDeclaration, message)`` of ``call()``; ("", False, "") if none."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type is the verdict
        return type(exc).__name__, isinstance(exc, MissingDeclaration), str(exc)
    return "", False, ""


def _refusals(spec, rank: int) -> dict:
    """The techniques asked of the bare model, without the declaration each reads."""
    return {
        "tensor_parallel_plan": _refusal(lambda: apply_tensor_parallel(spec.build(),
                                                                       tp_group=dist.group.WORLD)),
        "shard_units (ZeRO-3)": _refusal(lambda: FullyShardedDataParallel(spec.build())),
        "shard_units (checkpointing)": _refusal(lambda: apply_activation_checkpointing(spec.build(), "all")),
        "pipeline_stages": _refusal(lambda: PipelineModule(spec.build(), pp_group=None, pp_rank=rank,
                                                           pp_size=WORLD)),
    }


def _guarded(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or ``{"error": ...}``: a check that fails in refimpl must not take the others down
    (both ranks fail at the same point, before any collective of that check)."""
    try:
        return {"error": None, **fn(*args, **kwargs)}
    except Exception as exc:  # noqa: BLE001 - reported by the test that reads it
        return {"error": f"{type(exc).__name__}: {exc}"}


def _worker(ctx, name: str, folder: str) -> dict:
    spec, rank = SPECS[name], ctx.rank
    out: dict = {"refusals": _refusals(spec, rank), "model": type(spec.build()).__name__}
    if rank == 0:  # the one-device references (every rank would compute the same bits)
        out["one32"] = _one_device(spec, torch.float32)
        out["one64"] = _one_device(spec, torch.float64)
        out["micro"] = _one_device(spec, torch.float32, micro=WORLD)
        out["ac_ours"] = _one_device(spec, torch.float32, checkpointed="ours")
        out["ac_torch"] = _one_device(spec, torch.float32, checkpointed="torch")
    out["tp"] = _tensor_parallel(spec, spec.plan())
    out["tp_torch"] = _torch_tensor_parallel(spec)
    if name == "user":  # negative control: the fused qkv split by contiguous rows
        out["tp_rows"] = _tensor_parallel(spec, {**USER_PLAN, "blocks.*.attn.qkv": ColwiseParallel()})
    for kind in ("bucket", "bucket_no_sync", "ddp", "zero1", "zero2", "zero3", "fsdp2"):
        out[kind] = _data_parallel(spec, rank, kind)
    if name == "user":
        out["pp"] = _guarded(_pipeline, spec, rank)
        out["pp_mean_loss"] = _guarded(_pipeline, spec, rank, loss_share=False)
    for layout in ("tp", "zero3") if name == "user" else ("tp",):
        out[f"checkpoint {layout}"] = _guarded(_checkpoint, spec, f"{folder}/{layout}", layout)
    return out


def _spawn(name: str, folder) -> list[dict]:
    return run_ranks(_worker, WORLD, name, str(folder), timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    return _spawn("user", tmp_path_factory.mktemp("byom_user"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    return _spawn("llama", tmp_path_factory.mktemp("byom_llama"))


class RefimplBug(Exception):
    """A generic entry point failed on a foreign model (a bug of refimpl's, reported, not worked around)."""


def _ok(result: dict, what: str) -> dict:
    if result.get("error") is not None:
        raise RefimplBug(f"{what}: {result['error']}")
    return result


def _tolerances(one: dict) -> tuple[float, dict[str, float]]:
    """``FACTOR x`` the one-device float32 run's distance from float64, for the loss (at least 1 ulp) and
    per gradient tensor (module docstring)."""
    one32, one64 = one["one32"], one["one64"]
    loss = max(abs(one32["loss"] - one64["loss"]), float(np.spacing(np.float32(one32["loss"]))))
    spread = {n: float(np.abs(g.astype(np.float64) - one64["grads"][n]).max())
              for n, g in one32["grads"].items()}
    assert all(0 < s < 1e-5 for s in spread.values()), spread  # float32 rounding: not zero, not a bug
    return FACTOR * loss, {n: FACTOR * s for n, s in spread.items()}


def _ratio(run: dict, ref: dict, tol: tuple[float, dict[str, float]]) -> tuple[float, str]:
    """The worst ``|run - ref| / tolerance`` over the loss and every gradient, and where."""
    loss_tol, grad_tol = tol
    assert sorted(run["grads"]) == sorted(grad_tol), sorted(set(run["grads"]) ^ set(grad_tol))
    worst = [(abs(run["loss"] - ref["loss"]) / loss_tol, "loss")]
    worst += [(float(np.abs(run["grads"][n].astype(np.float64) - ref["grads"][n]).max()) / t, n)
              for n, t in grad_tol.items()]
    return max(worst)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """The tensors that differ in any bit (or exist on one side only)."""
    return sorted(set(a) ^ set(b)) + [n for n in sorted(set(a) & set(b)) if not np.array_equal(a[n], b[n])]


MODELS = ["user", "llama"]


@pytest.fixture(params=MODELS)
def results(request) -> list[dict]:
    return request.getfixturevalue(request.param)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_a_technique_without_its_declaration_is_refused_by_name(results):
    """A bare foreign model: every technique that reads a declaration raises MissingDeclaration (a
    TypeError) naming the declaration, the model's class and what to write; never an AttributeError."""
    for out in results:
        for declaration, (kind, missing, message) in out["refusals"].items():
            name = declaration.split()[0]
            assert missing and kind == "MissingDeclaration", (declaration, kind, message)
            assert issubclass(MissingDeclaration, TypeError)
            assert f"declare {name}: {out['model']} has none" in message, message
    assert "pass unit_types=" in results[0]["refusals"]["shard_units (ZeRO-3)"][2]


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_tensor_parallel_by_plan_equals_one_device_and_torch(results):
    """Our apply_tensor_parallel with the model's plan (the user's; Hugging Face's base_model_tp_plan) at
    TP=2: the loss on the logits shard and every gradient, whole, within the tolerance of one device's;
    torch's parallelize_module with the same plan too, and ours within the tolerance of torch's."""
    tol = _tolerances(results[0])
    one = results[0]["one32"]
    for rank, out in enumerate(results):
        for run in ("tp", "tp_torch"):
            worst, where = _ratio(out[run], one, tol)
            assert worst <= 1, f"rank {rank} {run}: {where} off one device by {worst:.2f} x the tolerance"
        assert out["tp"]["whole_is_plain"], f"rank {rank}: full_state_dict is not the plain model's state"
        worst, where = _ratio(out["tp"], out["tp_torch"], tol)
        assert worst <= 1, f"rank {rank}: ours vs torch's tensor parallelism: {where}: {worst:.2f} x tol"


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_a_fused_qkv_split_by_rows_is_the_wrong_plan(user):
    """Negative control: ColwiseParallel() on the fused [q|k|v] (rank 0 keeps all of q and half of k) gives
    a loss and gradients off one device's by orders of magnitude more than the tolerance that
    ColwiseParallel(chunks=3) meets."""
    tol = _tolerances(user[0])
    for out in user:
        loss_tol, _ = tol
        assert abs(out["tp_rows"]["loss"] - user[0]["one32"]["loss"]) > 100 * loss_tol
        worst, where = _ratio(out["tp_rows"], user[0]["one32"], tol)
        assert worst > 1e4, (where, worst)


DATA_PARALLEL = ["bucket", "ddp", "zero1", "zero2", "zero3", "fsdp2"]


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_data_parallel_and_zero_equal_one_device_and_torch_bitwise(results):
    """DataParallelBucket, ShardedOptimizer ZeRO-1/2, FullyShardedDataParallel (ZeRO-3, unit_types = the
    block class) at 2 ranks, DDP and fully_shard beside them: the loss, the gradients entering the
    optimizer (gathered from each rank's shards) and the parameters after one AdamW step are the bits of one
    device running the global batch as 2 micro-batches (module docstring), and within the tolerance of
    one device running it at once. Negative control: data parallelism without its synchronisation."""
    micro, tol = results[0]["micro"], _tolerances(results[0])
    assert _ratio(micro, results[0]["one32"], tol)[0] <= 1  # another order of the same sums
    for rank, out in enumerate(results):
        for kind in DATA_PARALLEL:
            run = out[kind]
            assert run["loss"] == micro["loss"], (rank, kind, run["loss"], micro["loss"])
            assert _same(run["grads"], micro["grads"]) == [], (rank, kind, "gradients")
            assert _same(run["params"], micro["params"]) == [], (rank, kind, "parameters after AdamW")
        assert _same(out["bucket"]["grads"], out["ddp"]["grads"]) == []  # ours = torch's, bit for bit
        assert _same(out["zero3"]["grads"], out["fsdp2"]["grads"]) == []
        worst, where = _ratio(out["bucket_no_sync"], micro, tol)
        assert worst > 1e4, (rank, where, worst)


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_activation_checkpointing_by_unit_types_is_bitwise(results):
    """apply_activation_checkpointing(model, "all", unit_types=(Block,)) (and torch's checkpoint_wrapper
    alike): the same loss and gradients, bit for bit, as without; and it is on: autograd saves less than
    half of what it saves without (the blocks' inputs instead of their insides)."""
    one = results[0]["one32"]
    for which in ("ac_ours", "ac_torch"):
        run = results[0][which]
        assert run["loss"] == one["loss"] and _same(run["grads"], one["grads"]) == [], which
        assert run["saved_bytes"] < one["saved_bytes"] / 2, (which, run["saved_bytes"], one["saved_bytes"])


@pytest.mark.numerics
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_pipeline_1f1b_of_the_users_stages_equals_one_device(user):
    """PipelineModule (1F1B, 2 stages, 2 micro-batches) on the stages the user declares
    (``user_pipeline_stages``): the loss and every gradient (each on the rank of its stage) are the bits
    of one device running the 2 micro-batches. Negative control: a micro-batch loss that is its own mean,
    not its share of the global batch's, doubles every gradient."""
    micro, tol = user[0]["micro"], _tolerances(user[0])
    runs = [_ok(out["pp"], "PipelineModule.step") for out in user]
    grads = {n: g for run in runs for n, g in run["grads"].items()}
    assert all(run["loss"] == micro["loss"] for run in runs), [run["loss"] for run in runs]
    assert _same(grads, micro["grads"]) == []
    assert not set(runs[0]["grads"]) & set(runs[1]["grads"])  # each tensor on one stage only
    wrong = [_ok(out["pp_mean_loss"], "PipelineModule.step") for out in user]
    control = {"loss": wrong[0]["loss"], "grads": {n: g for run in wrong for n, g in run["grads"].items()}}
    assert _ratio(control, micro, tol)[0] > 1e4


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize(("name", "layout"), [("llama", "tp"), ("user", "zero3")])
def test_a_checkpoint_saved_on_two_ranks_loads_at_one_rank_bitwise(name, layout, request):
    """One AdamW step at 2 ranks (TP=2 with the model's plan; ZeRO-3 with unit_types), saved with
    refimpl.checkpoint; loaded here into the plain model and a plain AdamW: every parameter and both
    moments equal the 2-rank run's whole tensors, bit for bit, and the step count is 1."""
    out = request.getfixturevalue(name)
    saved = [_ok(rank[f"checkpoint {layout}"], f"save_training_state under {layout}") for rank in out]
    assert _same(saved[0]["params"], saved[1]["params"]) == []
    spec = SPECS[name]
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    checkpointer = Checkpointer(CheckpointConfig(folder=saved[0]["folder"]))
    try:
        info = checkpointer.find_latest_valid(expected=expected_shapes(model))
    except CheckpointError as exc:  # refimpl refusing a checkpoint refimpl wrote
        raise RefimplBug(f"saved under {layout}, it does not load into the plain model: {exc}") from exc
    state = load_training_state(checkpointer, info, model=model, optimizer=optimizer, restore_rng=False)
    checkpointer.close()
    assert state["step"] == 1
    assert _same(_params(model), saved[0]["params"]) == []
    for key in ("exp_avg", "exp_avg_sq"):
        loaded = {n: optimizer.state[p][key] for n, p in model.named_parameters()}
        assert _same(_numpy(loaded), saved[0]["moments"][key]) == [], key
    assert all(float(optimizer.state[p]["step"]) == 1 for p in model.parameters())


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_the_checkpoint_refuses_a_chunked_fused_qkv_by_name(user):
    """The user model under TP=2 holds its fused qkv as ColwiseParallel(chunks=3): 3 separate row blocks
    of the weight per rank, which one box cannot name. save_training_state refuses it before writing
    anything, naming the layer and what to do instead (per-head rows and chunks=1, or separate q, k, v)."""
    for out in user:
        error = out["checkpoint tp"]["error"] or ""
        assert error.startswith("ValueError: the checkpoint cannot save blocks.0.attn.qkv"), error
        assert "chunks=3" in error and "separate q, k, v" in error, error
