"""Wrong answers (``MUTANTS``) and independent right ones (``CORRECT``) for chapter 06's checks.

``exercises/checks/ch06.py`` re-exports both; tests/test_exercises.py grades every mutant (its task, and
only its task, must fail) and every ``CORRECT`` source (its task must pass). Each source is a whole module
that takes refimpl's answers (``exercises/reference/ch06.py``) for the other tasks and replaces one name.
The right implementations are written here independently of refimpl (a learner's way), and most mutants
are that same code with one line changed (:func:`_mutate` insists that the line is there).
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


def _mutate(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old  # a mutant that silently equals the answer would test nothing
    return source.replace(old, new)


CORRECT = {  # an independent implementation of each task (not refimpl's): the mutants below each break one
    "f: copy_to_tensor_parallel_region": _CONJUGATE.format(**_F),
    "g: reduce_from_tensor_parallel_region": _CONJUGATE.format(**_G),
    "ColumnParallelLinear": _LINEAR.format(**_COLUMN),
    "RowParallelLinear": _LINEAR.format(**_ROW),
    "vocab_parallel_cross_entropy": _LOSS,
}
MUTANTS = {
    "f: copy_to_tensor_parallel_region": _CONJUGATE.format(**{**_F, "forward": _SUM_Y}),  # sums x too
    "g: reduce_from_tensor_parallel_region": _CONJUGATE.format(**{**_G, "backward": _SUM_DX}),  # sums dy
    "ColumnParallelLinear": [
        _LINEAR.format(**{**_COLUMN, "size": "linear.in_features",  # splits the input features
                          "rows": ":, r * n:(r + 1) * n"}),
        _LINEAR.format(**{**_COLUMN, "forward": "F.linear(x, self.weight, self.bias)"}),  # without f
    ],
    "RowParallelLinear": [
        _LINEAR.format(**{**_ROW, "out": "y",  # each rank adds the bias to its partial sum: t biases
                          "forward": "reduce_from_tensor_parallel_region(F.linear(x, self.weight, "
                                     "self.bias), self.group)"}),
        _LINEAR.format(**{**_ROW, "out": "y",  # the right sum, but rank 1's bias never gets a gradient
                          "forward": "reduce_from_tensor_parallel_region(F.linear(x, self.weight, self.bias "
                                     "if dist.get_rank(self.group) == 0 else None), self.group)"}),
    ],
    "vocab_parallel_cross_entropy": [
        _mutate(_LOSS, "shifted = z - m.unsqueeze(-1)", "shifted = z"),  # no max subtraction
        _mutate(_LOSS, ".squeeze(-1).masked_fill(~owned, 0.0)", ".squeeze(-1)"),  # every rank adds a logit
        _mutate(_LOSS, "ops.all_reduce(m, op=ops.ReduceOp.MAX, group=group)", "pass"),  # its own max only
        _HEADER + (  # right values, but every rank holds the full logits
            "from refimpl.parallel.tensor_parallel import gather_from_tensor_parallel_region\n"
            "def vocab_parallel_cross_entropy(logits_shard, target, *, group):\n"
            "    z = gather_from_tensor_parallel_region(logits_shard, group)\n"
            "    loss = F.cross_entropy(z.flatten(0, -2), target.flatten(), reduction='none')\n"
            "    return loss.view(target.shape)\n"),
    ],
}
