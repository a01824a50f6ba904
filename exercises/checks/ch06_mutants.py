"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 06's checks.

``exercises/checks/ch06.py`` re-exports both; tests/course/cli/test_exercises.py grades every mutant (its
task, and only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole
module that takes refimpl's answers (``exercises/reference/ch06.py``) for the other tasks and replaces one
name. The right implementations are written here independently of refimpl (a learner's way), and most mutants
are that same code with one line changed (``_mutate`` insists that the line is there).
"""

from __future__ import annotations

_HEADER = ("from exercises.reference.ch06 import *  # noqa: F403\n"
           "import torch\nimport torch.distributed as dist\nimport torch.nn.functional as F\n"
           "from torch import nn\nfrom refimpl.comm import ops\n")
_CONJUGATE = _HEADER + """
class _Conjugate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
{forward}        return y
    @staticmethod
    def backward(ctx, dy):
        dx = dy.clone()
{backward}        return dx, None
def {name}(x, group):
    return _Conjugate.apply(x, group)
"""
_SUM_Y = "        ops.all_reduce(y, group=group)\n"
_SUM_DX = "        ops.all_reduce(dx, group=ctx.group)\n"
_F = dict(name="copy_to_tensor_parallel_region", forward="", backward=_SUM_DX)
_G = dict(name="reduce_from_tensor_parallel_region", forward=_SUM_Y, backward="")
_LINEAR = _HEADER + """
class {cls}(nn.Module):
    def __init__(self, linear, *, group):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if {size} % t:
            raise ValueError("does not divide")
        n, self.group = {size} // t, group
        self.weight = nn.Parameter(linear.weight.detach()[{rows}].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[{bias}].clone())
    def forward(self, x):
        y = {forward}
        return {out}
"""
_COLUMN = dict(cls="ColumnParallelLinear", size="linear.out_features", rows="r * n:(r + 1) * n",
               bias="r * n:(r + 1) * n", out="y",
               forward="F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)")
_ROW = dict(cls="RowParallelLinear", size="linear.in_features", rows=":, r * n:(r + 1) * n", bias=":",
            forward="reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)",
            out="y if self.bias is None else y + self.bias  # once, after the sum")
_LOSS = _HEADER + """
class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, target, group):
        part = z.shape[-1]
        m = z.amax(dim=-1)
        ops.all_reduce(m, op=ops.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)
        local = target - dist.get_rank(group) * part
        owned = (local >= 0) & (local < part)
        index = local.masked_fill(~owned, 0)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        ops.all_reduce(picked, group=group)
        ops.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, owned)
        return sum_exp.log() - picked
    @staticmethod
    def backward(ctx, dloss):
        softmax, index, owned = ctx.saved_tensors
        grad = softmax * dloss.unsqueeze(-1)
        grad.scatter_add_(-1, index.unsqueeze(-1), -(dloss * owned).unsqueeze(-1))
        return grad, None, None
def vocab_parallel_cross_entropy(logits_shard, target, *, group):
    return _Loss.apply(logits_shard, target, group)
"""
_SEQUENCE = _HEADER + """
def _chunk(x, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % t:
        raise ValueError("the sequence does not divide")
    n = x.shape[1] // t
    return x[:, r * n:(r + 1) * n].contiguous()
def _chunk_world(x, group):  # the world's rank
    n = x.shape[1] // dist.get_world_size(group)
    return x[:, dist.get_rank() * n:(dist.get_rank() + 1) * n].contiguous()
def _gather(x, group):
    t = dist.get_world_size(group)
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((t * front.shape[0], *front.shape[1:]))
    ops.all_gather_into_tensor(out, front, group=group)
    return out.transpose(0, 1).contiguous()
def _gather_flat(x, group):  # gathers along dim 0, then views the result as [b, s, h]
    t = dist.get_world_size(group)
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    ops.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(x.shape[0], t * x.shape[1], *x.shape[2:])
def _reduce_scatter(x, group):
    t = dist.get_world_size(group)
    if x.shape[1] % t:
        raise ValueError("the sequence does not divide")
    front = x.transpose(0, 1).contiguous()
    out = front.new_empty((front.shape[0] // t, *front.shape[1:]))
    ops.reduce_scatter_tensor(out, front, group=group)
    return out.transpose(0, 1).contiguous()
def _all_reduce_chunk(x, group):  # the right values for twice the bytes
    y = x.clone()
    ops.all_reduce(y, group=group)
    return _chunk(y, group)
class _Sequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return {forward}(x, group)
    @staticmethod
    def backward(ctx, dy):
        return {backward}(dy, ctx.group), None
def {name}(x, group):
    if dist.get_world_size(group) == 1:
        return x
    return _Sequence.apply(x, group)
"""
_SCATTER = dict(name="scatter_to_sequence_parallel_region", forward="_chunk", backward="_gather")
_GATHER = dict(name="gather_from_sequence_parallel_region", forward="_gather", backward="_reduce_scatter")
_REDUCE_SCATTER = dict(name="reduce_scatter_to_sequence_parallel_region", forward="_reduce_scatter",
                       backward="_gather")
_QKV = _HEADER + """
def shard_fused_qkv(tensor, *, num_heads, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if num_heads % t:
        raise ValueError("the heads do not divide")
    q, k, v = tensor.chunk(3, dim=0)  # nanoGPT: all q, all k, all v, each [h, ...] in head order
    per, d = num_heads // t, q.shape[0] // num_heads
    rows = [z[i * d:(i + 1) * d] for i in range(r * per, (r + 1) * per) for z in (q, k, v)]
    return torch.cat(rows).clone()
"""


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


CORRECT = {  # an independent implementation of each task (not refimpl's): the mutants below each break one
    "f: copy_to_tensor_parallel_region": _CONJUGATE.format(**_F),
    "g: reduce_from_tensor_parallel_region": _CONJUGATE.format(**_G),
    "ColumnParallelLinear": _LINEAR.format(**_COLUMN),
    "RowParallelLinear": _LINEAR.format(**_ROW),
    "vocab_parallel_cross_entropy": _LOSS,
    "scatter_to_sequence_parallel_region": _SEQUENCE.format(**_SCATTER),
    "gather_from_sequence_parallel_region": _SEQUENCE.format(**_GATHER),
    "reduce_scatter_to_sequence_parallel_region": _SEQUENCE.format(**_REDUCE_SCATTER),
    "shard_fused_qkv": _QKV,
}
_GROUP_RANK = "t, r = dist.get_world_size(group), dist.get_rank(group)"
MUTANTS = {
    "f: copy_to_tensor_parallel_region": _CONJUGATE.format(**{**_F, "forward": _SUM_Y}),  # sums x too
    "g: reduce_from_tensor_parallel_region": _CONJUGATE.format(**{**_G, "backward": _SUM_DX}),  # sums dy
    "ColumnParallelLinear": [
        _LINEAR.format(**{**_COLUMN, "size": "linear.in_features",  # splits the input features
                          "rows": ":, r * n:(r + 1) * n"}),
        _LINEAR.format(**{**_COLUMN, "forward": "F.linear(x, self.weight, self.bias)"}),  # without f
        _mutate(_LINEAR.format(**_COLUMN), _GROUP_RANK,  # the world's size and rank, not the group's
                "t, r = dist.get_world_size(), dist.get_rank()"),
    ],
    "RowParallelLinear": [
        _LINEAR.format(**{**_ROW, "out": "y",  # each rank adds the bias to its partial sum: t biases
                          "forward": "reduce_from_tensor_parallel_region(F.linear(x, self.weight, "
                                     "self.bias), self.group)"}),
        _LINEAR.format(**{**_ROW, "out": "y",  # the right sum, but rank 1's bias never gets a gradient
                          "forward": "reduce_from_tensor_parallel_region(F.linear(x, self.weight, self.bias "
                                     "if dist.get_rank(self.group) == 0 else None), self.group)"}),
        _mutate(_LINEAR.format(**_ROW), _GROUP_RANK,  # the world's rank: ranks 2 and 3 take no block
                "t, r = dist.get_world_size(group), dist.get_rank()"),
    ],
    "vocab_parallel_cross_entropy": [
        _mutate(_LOSS, "shifted = z - m.unsqueeze(-1)", "shifted = z"),  # no max subtraction
        _mutate(_LOSS, ".squeeze(-1).masked_fill(~owned, 0.0)", ".squeeze(-1)"),  # every rank adds a logit
        _mutate(_LOSS, "ops.all_reduce(m, op=ops.ReduceOp.MAX, group=group)", "pass"),  # its own max only
        _mutate(_LOSS, "dist.get_rank(group) * part", "dist.get_rank() * part"),  # the world's rank
        _HEADER + (  # right values, but every rank holds the full logits
            "from refimpl.parallel.tensor_parallel import gather_from_tensor_parallel_region\n"
            "def vocab_parallel_cross_entropy(logits_shard, target, *, group):\n"
            "    z = gather_from_tensor_parallel_region(logits_shard, group)\n"
            "    loss = F.cross_entropy(z.flatten(0, -2), target.flatten(), reduction='none')\n"
            "    return loss.view(target.shape)\n"),
    ],
    "scatter_to_sequence_parallel_region": [
        _SEQUENCE.format(**{**_SCATTER, "forward": "_chunk_world"}),  # the world's rank picks the chunk
        _SEQUENCE.format(**{**_SCATTER, "backward": "_gather_flat"}),  # gathers dim 0, not the sequence
    ],
    "gather_from_sequence_parallel_region": [
        _SEQUENCE.format(**{**_GATHER, "forward": "_gather_flat"}),  # gathers dim 0, not the sequence
        _SEQUENCE.format(**{**_GATHER, "backward": "_chunk"}),  # its own chunk of dy, not of the sum
    ],
    "reduce_scatter_to_sequence_parallel_region": [
        _SEQUENCE.format(**{**_REDUCE_SCATTER, "forward": "_all_reduce_chunk"}),  # right values, 2x bytes
        _SEQUENCE.format(**{**_REDUCE_SCATTER, "backward": "_gather_flat"}),  # gathers dim 0
    ],
    "shard_fused_qkv": [
        _mutate(_QKV, "    q, k, v = tensor.chunk", "    return tensor.chunk(t, dim=0)[r].clone()\n"
                "    q, k, v = tensor.chunk"),  # a plain row block: rank 0 gets all of q, half of k
        _mutate(_QKV, "for i in range(r * per, (r + 1) * per) for z in (q, k, v)]",  # whole heads, but in
                "for z in (q, k, v) for i in range(r * per, (r + 1) * per)]"),  # the [3, a/t, d] order
        _mutate(_QKV, _GROUP_RANK, "t, r = dist.get_world_size(group), dist.get_rank()"),  # world rank
    ],
}
