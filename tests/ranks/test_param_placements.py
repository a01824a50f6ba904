"""One placement per parameter (refimpl/parallel/placements.py): the record, the one gradient norm over it,
and the import graph it untangled.

* unit: a placement refuses an unknown group and an axis that both shards and replicates; ``along`` and
  ``narrowed`` compose boxes; with no sharded axis the norm *is* ``torch.nn.utils.clip_grad_norm_``
  (bitwise); the tensor-parallel declarations (boxes, sequence-parallel names) are read from the modules,
  so they survive a wrapper that replaces parameters.
* 4 ranks, six layouts (tp x dp with SP at ZeRO-0 and ZeRO-1, pp x dp with a tied embedding, pp x tp with
  SP and a tied embedding, dp x cp at ZeRO-1, ZeRO-3 over 4): every rank's gradient is its box of one
  global gradient (the same seed everywhere), and the trainer's clipping function (``Parallelized.
  build_optimizer(...).clip_fn``) returns the norm of that global gradient within float32 summation
  rounding. Negative controls: the same held gradients with every replica counted (the replicated axes
  dropped) and with the tied copy counted give a larger norm; ZeRO-3's placements are its row shards.
* the import graph of refimpl has no circle (function-level imports included, ``TYPE_CHECKING`` blocks not);
  the detector finds a planted one.
"""

from __future__ import annotations

import ast
import math
import pathlib
from dataclasses import replace

import pytest
import torch

from refimpl.distributed.placement import Box
from refimpl.launch import run_ranks
from refimpl.parallel.placements import HeldGradient, Placement, clip_grad_norm_, record_placements
from tests.support.timeouts import SPAWN_TIMEOUT_S

LAYOUTS = {  # name: (ParallelDims keywords, ParallelConfig technique keywords)
    "tp2-dp2-sp": ({"dp": 2, "tp": 2}, {"sequence_parallel": True}),
    "tp2-dp2-zero1": ({"dp": 2, "tp": 2}, {"zero_stage": 1}),
    "pp2-dp2-tied": ({"pp": 2, "dp": 2}, {}),
    "pp2-tp2-sp-tied": ({"pp": 2, "dp": 1, "tp": 2}, {"sequence_parallel": True}),
    "dp2-cp2-zero1": ({"dp": 2, "cp": 2}, {"zero_stage": 1}),
    "dp4-zero3": ({"dp": 4}, {"zero_stage": 3}),
}


def test_a_placement_refuses_what_cannot_be():
    with pytest.raises(ValueError, match="unknown group"):
        Placement(box=Box.full((2,)), sharded_over=("dp",))  # the batch view: no placement's group
    with pytest.raises(ValueError, match="both shard and replicate"):
        Placement(box=Box.full((2,)), sharded_over=("tp",), replicated_over=("tp",))


def test_along_and_narrowed_compose_boxes():
    tp_rows = Box.chunk((8, 4), 0, 1, 2)  # rows [4, 8) of a column-parallel weight
    p = Placement(box=tp_rows).along("tp", sharded=True).along("dp x cp", sharded=False, reduced=True)
    assert (p.sharded_over, p.replicated_over, p.reduce_over) == (("tp",), ("dp x cp",), ("dp x cp",))
    zero = p.narrowed(Box.chunk((4, 4), 0, 1, 2), "dp x cp")  # ZeRO-1's second half of those rows
    assert zero.box == Box((8, 4), (6, 0), (2, 4))
    assert (zero.sharded_over, zero.replicated_over) == (("tp", "dp x cp"), ())


def test_record_placements_reads_the_boxes():
    boxes = {"w": Box.chunk((8, 4), 0, 0, 2), "ln": Box.full((4,)), "emb": Box.full((6, 4))}
    placed = record_placements(boxes, tp=True, sequence_parallel=["ln"], pp=True, tied_copy="emb")
    assert placed["w"].sharded_over == ("tp", "pp")
    assert placed["ln"].replicated_over == ("tp",) and placed["ln"].reduce_over == ("tp",)
    assert placed["emb"].replicated_over == ("tp", "pp") and not placed["emb"].primary
    assert placed["w"].primary and placed["ln"].sharded_over == ("pp",)


def test_with_no_sharded_axis_the_norm_is_torchs():
    """torch's ``clip_grad_norm_`` on Parameters carrying these gradients: the same norm and clipped bits;
    the norm is far above 0.5, so the clipping is not vacuous."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    ours = [g.clone() for g in grads]
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(theirs, grads, strict=True):
        p.grad = g.clone()
    held = [HeldGradient(str(i), g, Placement(box=Box.full(g.shape), replicated_over=("dp x cp",)))
            for i, g in enumerate(ours)]
    n1 = clip_grad_norm_(held, 0.5, groups={}, device=torch.device("cpu"))
    n2 = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert n2 > 2 and torch.equal(n1, n2)
    assert all(torch.equal(a, p.grad) for a, p in zip(ours, theirs, strict=True))
    assert not any(torch.equal(a, g) for a, g in zip(ours, grads, strict=True))  # clipped


def test_sequence_parallel_roles_are_declared_by_modules_not_tensors():
    """The SP LayerNorm shares its parameters (nothing copied) and names them; no tensor carries a flag,
    so a wrapper that replaces the Parameters (ZeRO-3) cannot lose the role."""
    from refimpl.parallel.tensor_parallel import SequenceParallelLayerNorm, sequence_parallel_names

    norm = torch.nn.LayerNorm(4)
    sp = SequenceParallelLayerNorm.from_layernorm(norm)
    assert sp.weight is norm.weight and sp.bias is norm.bias
    assert sequence_parallel_names(torch.nn.Sequential(torch.nn.Linear(4, 4), sp)) == ["1.weight", "1.bias"]
    assert not hasattr(sp.weight, "sequence_parallel")
    x = torch.randn(3, 4)
    assert torch.equal(sp(x), norm(x))


def _norms_on_rank(ctx) -> dict:
    import torch.distributed as dist

    from refimpl.config import ModelConfig, OptimConfig
    from refimpl.distributed.mesh import ParallelDims
    from refimpl.models import GPT
    from refimpl.parallel.parallelize import parallelize

    config = ModelConfig(vocab_size=50, num_layers=2, hidden_size=16, num_attention_heads=2, max_seq_len=8,
                         tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(7)  # the same global gradient on every rank
    full = {n: torch.randn(p.shape, generator=gen) for n, p in GPT(config, seed=1).named_parameters()}
    out = {"global": math.sqrt(sum(float(g.double().square().sum()) for g in full.values()))}
    for name, (dims, options) in LAYOUTS.items():
        groups = ParallelDims(**dims).build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=60)
        par = parallelize(GPT(config, seed=1), groups, groups.dims.config(**options))
        setup = par.build_optimizer(OptimConfig(grad_clip=1e9))
        held = dict(_held(par))
        for n, p in held.items():
            box = par.placements[n].box
            grad = torch.zeros_like(p)
            part = full[n][box.slices()]
            grad[tuple(slice(0, s) for s in part.shape)] = part  # a padded vocab shard: zero padding rows
            p.grad = grad
        norm = float(setup.clip_fn(None))
        gs = par.groups()
        wrong = {}
        for control, change in (("replicas counted", lambda q: replace(q, replicated_over=())),
                                ("tied copy counted", _as_own_tensor)):
            grads = [HeldGradient(n, p.grad.clone(), change(par.placements[n])) for n, p in held.items()]
            if options.get("zero_stage") in (1, 2):  # the optimizer's shards: count the whole rows instead
                grads = [replace(h, placement=_whole_rows_summed_over_dp(h.placement)) for h in grads]
            wrong[control] = float(clip_grad_norm_(grads, 1e9, groups=gs, device=torch.device("cpu")))
        rows = [tuple(par.placements[n].box.shape) == tuple(p.shape)
                and par.placements[n].sharded_over == ("dp x cp",) for n, p in held.items()]
        out[name] = {"norm": norm, "wrong": wrong, "zero3 rows": rows}
        dist.barrier()
    return out


def _as_own_tensor(p: Placement) -> Placement:
    """A control: the tied embedding's last-stage copy taken for a stage's own tensor (counted there)."""
    if "pp" not in p.replicated_over:
        return p
    return replace(p, primary=True, sharded_over=p.sharded_over + ("pp",),
                   replicated_over=tuple(a for a in p.replicated_over if a != "pp"))


def _whole_rows_summed_over_dp(p: Placement) -> Placement:
    """A control's placement for a full ZeRO-1 gradient: summed over dp x cp like a shard would be."""
    return replace(p, sharded_over=p.sharded_over + ("dp x cp",),
                   replicated_over=tuple(a for a in p.replicated_over if a != "dp x cp"))


def _held(par) -> list:
    from refimpl.parallel.parallelized import held_parameters

    return held_parameters(par)


@pytest.fixture(scope="module")
def norms() -> list[dict]:
    return run_ranks(_norms_on_rank, 4, timeout_s=SPAWN_TIMEOUT_S)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trainers_norm_counts_every_element_once(norms, layout):
    """Within float32 rounding: the ranks sum ~1e4 float32 squares in their own order (relative error
    bounded by n eps ~ 1e-3 in the worst case, ~sqrt(n) eps ~ 1e-5 typically); measured at most 9e-8
    relative over the six layouts, so 1e-5 relative holds with room on any kernel, while the controls
    are 2 % (a tp replica counted twice) to 41 % (ZeRO rows counted on both replicas) off."""
    for rank, r in enumerate(norms):
        got, want = r[layout]["norm"], r["global"]
        assert abs(got - want) <= 1e-5 * want, (rank, layout, got, want)
        if layout.startswith(("tp", "pp2-tp")):
            assert r[layout]["wrong"]["replicas counted"] > want * (1 + 1e-3), (rank, layout)
        if "tied" in layout:
            assert r[layout]["wrong"]["tied copy counted"] > want * (1 + 1e-3), (rank, layout)
        if layout == "dp4-zero3":
            assert all(r[layout]["zero3 rows"]), rank


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    root = pathlib.Path(__file__).resolve().parents[2] / "refimpl"
    files = {".".join(("refimpl", *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}

    def imports(tree: ast.AST) -> set[str]:
        found: set[str] = set()

        def walk(nodes: list) -> None:
            for n in nodes:
                if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                    continue  # annotations only: no import at run time
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("refimpl"):
                    found.update(f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in files else n.module
                                 for a in n.names)
                elif isinstance(n, ast.Import):
                    found.update(a.name for a in n.names if a.name.startswith("refimpl"))
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(n, field, []) if isinstance(getattr(n, field, None), list) else [])

        walk(tree.body)
        return found

    return {m: {i for i in imports(ast.parse(f.read_text())) if i in files} - {m} for m, f in files.items()}


def test_the_import_graph_has_no_circle():
    graph = _import_graph()
    assert "refimpl.parallel.parallelize" in graph["refimpl.train.setup"]  # the graph is read, not empty
    assert _circles(graph) == []
    planted = {**graph, "refimpl.parallel.optimizer_setup":
               graph["refimpl.parallel.optimizer_setup"] | {"refimpl.parallel.parallelize"}}
    assert any("refimpl.parallel.parallelize" in c for c in _circles(planted))  # negative control
