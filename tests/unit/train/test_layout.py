"""``refimpl.train.layout.resolve``: a run's layout resolved once (chapter 12).

- the command line's whole run (one process: ``main``) takes each rule of the layout exactly once: the
  survivor shrink, the degrees against the world size, the shapes, the experts, the forwards per step.
  Before ``resolve`` the same run built the degrees 3 times and checked the shapes, the experts, the
  survivors and the micro-batches twice each (the preflight, then ``train``, then the setup): the counts
  below fail there;
- what ``resolve`` returns at a 3-D layout and after an elastic restart with fewer ranks;
- ``train`` takes the options or their resolved layout, not both, and refuses a layout resolved for
  another world size.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from refimpl.config import ConfigError, ParallelConfig
from refimpl.distributed import DistributedContext
from refimpl.train import RunOptions, build_parser, config_from_args, main, train
from refimpl.train import layout as layout_module
from refimpl.train.layout import resolve

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
        "--batch-size", "8"]
RULES = ("survivor_layout", "check_shapes", "check_experts", "forwards_per_step")


def _config(*flags: str):
    return config_from_args(build_parser().parse_args([*TINY, *flags]))


def test_the_command_lines_run_resolves_its_layout_once(corpus, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    calls: Counter[str] = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in RULES:
        monkeypatch.setattr(layout_module, name, counted(name, getattr(layout_module, name)))
    monkeypatch.setattr(RunOptions, "parallel_dims", counted("parallel_dims", RunOptions.parallel_dims))
    threads = torch.get_num_threads()
    try:
        code = main([*TINY, "--steps", "1", "--checkpoint-every", "0", "--no-report", "--data",
                     str(corpus["corpus"]), "--cache-dir", str(corpus["cache"]), "--out",
                     str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)  # init_distributed sets one thread on a CPU
    assert code == 0
    assert calls == {name: 1 for name in (*RULES, "parallel_dims")}, calls


def test_resolve_gives_the_mesh_and_the_batch_split():
    config = _config("--micro-batch-size", "1")
    options = RunOptions(parallel=ParallelConfig(tp=2, pp=2, microbatches=4))
    layout = resolve(config, options, 8)
    assert (layout.dims.dp, layout.dims.tp, layout.dims.pp) == (2, 2, 2)
    assert (layout.accumulation, layout.micro_batch) == (4, 1)  # per-rank batch 8 / dp 2 = 4 x 1
    assert layout.options is options and layout.shrunk is None
    with pytest.raises(ConfigError, match="not divisible"):
        resolve(config, options, 6)  # tp x pp = 4 does not take 6 ranks


def test_a_restart_with_fewer_ranks_shrinks_dp_and_says_so():
    options = RunOptions(parallel=ParallelConfig(dp=4, tp=2))
    first = resolve(_config(), options, 8)
    assert first.dims.dp == 4 and first.shrunk is None
    again = resolve(_config(), options, 4, restart_count=1)
    assert again.dims.dp == 2 and again.parallel.tp == 2 and again.accumulation == 1
    assert again.shrunk is not None and "restart 1" in again.shrunk


def test_train_takes_the_options_or_the_layout_not_both():
    config = _config()
    options = RunOptions()
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(TypeError, match="not both"):
        train(config, ctx, options, layout=resolve(config, options, 1))


def test_train_refuses_a_layout_resolved_for_another_world():
    config = _config()
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="for 2 ranks, this run has 1"):
        train(config, ctx, layout=resolve(config, RunOptions(), 2))
