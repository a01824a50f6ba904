"""A run's layout, resolved once: ``resolve(config, options, world_size, restart_count=...) -> Layout``.

Every rule that ties the layout to the model, the data and the ranks is checked here and nowhere else
(chapter 12 walks it): an elastic restart's survivors (``survivor_layout``: tp, pp and cp kept, dp from
the ranks left), the degrees against the world size (``refimpl.distributed.mesh.ParallelDims``), the
shapes tensor and context parallelism need (``check_shapes``: the sentences of
``refimpl.support.shape_refusals``), the experts and expert parallelism (``check_experts``), the global
batch over the data-parallel ranks, and the forwards per step (``forwards_per_step``: gradient
accumulation's micro-batches, or the pipeline's). The combinations of techniques were refused before, by
the support table, when the ``RunOptions`` were made (``refimpl.support.check_supported``).

The trainer's command line resolves in the launcher (before torchrun: a layout that cannot run is one
line and exit status 2) and in each rank; ``train``, ``build_setup`` and ``preflight_memory`` take the
``Layout`` and check nothing again. torchtitan validates its ``ParallelDims`` once in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from refimpl.config import ConfigError, ParallelConfig, TrainConfig, micro_batches
from refimpl.distributed.mesh import ParallelDims
from refimpl.support import check_supported, shape_refusals
from refimpl.train.args import RunOptions


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What ``resolve`` found: the options to run (after an elastic restart's shrink), the mesh's degrees,
    and the split of each data-parallel rank's batch, ``per-rank batch = accumulation x micro_batch``."""

    options: RunOptions  # as run: ``options.parallel`` may have a smaller dp than asked (``shrunk``)
    dims: ParallelDims  # pp x dp x cp x tp (and ep inside dp x cp), their product the world size
    accumulation: int  # forwards per data-parallel rank and step: accumulation or pipeline micro-batches
    micro_batch: int  # sequences per forward
    shrunk: str | None = None  # the sentence that says a restart changed the layout

    @property
    def parallel(self) -> ParallelConfig:
        return self.options.parallel


def resolve(config: TrainConfig, options: RunOptions, world_size: int, *, restart_count: int = 0) -> Layout:
    """The layout of ``options`` on ``world_size`` ranks, every rule checked once (``ConfigError`` in one
    line otherwise; module docstring). ``restart_count``: the elastic agent's (``refimpl.elastic``); a
    restart with fewer ranks shrinks dp."""
    options, shrunk = survivor_layout(options, world_size, restart_count=restart_count)
    dims = options.parallel_dims(world_size)
    check_shapes(config, options.parallel)
    check_experts(config, options)
    accumulation = forwards_per_step(config, options, dims.dp)
    micro = config.data.per_rank_batch(dims.dp) // accumulation
    return Layout(options=options, dims=dims, accumulation=accumulation, micro_batch=micro, shrunk=shrunk)


def check_shapes(config: TrainConfig, parallel: ParallelConfig) -> None:
    """Refuse a ``--tp`` or ``--cp`` the model or the sequence cannot take (chapters 06 and 07): the
    sentences of ``refimpl.support.shape_refusals``, the rule set the planner's search asks too."""
    why = shape_refusals(config.model, parallel, seq_len=config.data.seq_len)
    if why:
        raise ConfigError("; and ".join(why))


def check_experts(config: TrainConfig, options: RunOptions) -> None:
    """Refuse what an MoE model or ``--ep`` cannot take (chapter 09): ``--ep`` without MoE blocks, experts
    that do not split over ``--ep``, and the combinations ``refimpl.support.MOE_SUPPORT_TABLE`` refuses
    for a model with MoE blocks (ZeRO-3)."""
    experts, ep = config.model.num_experts, options.parallel.ep
    if ep > 1 and experts == 0:
        raise ConfigError(f"--ep {ep} splits the experts of MoE blocks over {ep} ranks: give --moe-experts")
    if experts and experts % ep:
        raise ConfigError(f"--moe-experts {experts} do not split over --ep {ep} (each expert-parallel rank "
                          f"holds experts / ep of them); use a multiple of {ep}")
    if experts:
        check_supported(options.parallel, moe=True)


def forwards_per_step(config: TrainConfig, options: RunOptions, dp: int) -> int:
    """The forwards a data-parallel rank runs per optimizer step: gradient accumulation's micro-batches
    without a pipeline, the pipeline's (``pipeline_microbatches``) with one; refused (one line) when
    the per-rank batch does not split (``refimpl.config.micro_batches`` is the rule)."""
    if options.parallel.pp == 1:
        return config.data.accumulation_steps(dp)
    return pipeline_microbatches(config, options, dp)


def pipeline_microbatches(config: TrainConfig, options: RunOptions, dp: int) -> int:
    """The pipeline micro-batches per step and data-parallel rank (chapter 08): ``--microbatches``, else
    the per-rank batch over ``--micro-batch-size``, else ``pp``; refused (one line) when the per-rank batch
    does not split into them, they disagree with ``--micro-batch-size``, the interleaved schedule cannot
    take them or the blocks do not fill the stages."""
    par, per_rank, micro = options.parallel, config.data.per_rank_batch(dp), config.data.micro_batch_size
    m = micro_batches(per_rank_batch=per_rank, micro_batch_size=micro, pp=par.pp,
                      microbatches=par.microbatches)
    if par.microbatches is not None and micro is not None and micro * m != per_rank:
        raise ConfigError(f"--microbatches {m} x --micro-batch-size {micro} is not the per-rank batch "
                          f"{per_rank} (= --batch-size / dp {dp}); give one of the two")
    if par.microbatches is None and micro is not None:
        config.data.accumulation_steps(dp)  # micro must divide the per-rank batch: refused in its words
    if per_rank % m:
        raise ConfigError(f"the per-rank batch {per_rank} (= --batch-size / dp {dp}) does not split into {m} "
                          "pipeline micro-batches; set --microbatches to a divisor of it")
    stages = par.pp * par.virtual_stages
    if config.model.num_layers < stages:
        raise ConfigError(f"--num-layers {config.model.num_layers} cannot fill {stages} pipeline stages "
                          f"(--pp {par.pp} x --virtual-stages {par.virtual_stages}): each needs a "
                          "block")
    if par.pp_schedule == "interleaved" and m % par.pp:
        raise ConfigError(f"--pp-schedule interleaved sends micro-batches in rounds of --pp {par.pp}: "
                          f"{m} micro-batches do not divide by {par.pp}")
    return m




def survivor_layout(options: RunOptions, world_size: int, *,
                    restart_count: int) -> tuple[RunOptions, str | None]:
    """The layout of a run that an elastic agent restarted with another number of ranks (chapters 11-12).

    A ``--dp`` given for the first attempt no longer multiplies out when a machine is lost (``torchrun
    --nnodes=1:2``): the trainer keeps ``tp``, ``pp`` and ``cp`` (a model split that the survivors can still
    hold the same way) and sets ``dp = world / (tp pp cp)``; the checkpoint reshards by its boxes and the
    global batch stays (more accumulation per rank). Returns the options to run and the sentence that says
    so (None when nothing changed). A first attempt is never changed: a layout that does not match the ranks
    started is the user's mistake and ``RunOptions.parallel_dims`` refuses it."""
    par = options.parallel
    if par.dp is None or restart_count == 0:
        return options, None
    asked = options.parallel_dims(par.dp * par.tp * par.pp * par.cp)
    if asked.world_size == world_size:
        return options, None
    others = par.tp * par.pp * par.cp
    if world_size % others:
        raise ConfigError(f"restart {restart_count}: {world_size} ranks survived; the layout "
                          f"{asked.describe()} keeps tp x pp x cp = {others} ranks per model copy, which "
                          f"{world_size} does not divide: no layout to resume at")
    dp = world_size // others
    hsdp = ("" if dp % par.dp_replicate == 0 else
            f"; dp_replicate {par.dp_replicate} does not divide dp {dp}: no hybrid sharding")
    chosen = replace(options, parallel=replace(par, dp=dp, dp_replicate=par.dp_replicate if not hsdp else 1))
    now = chosen.parallel_dims(world_size).describe()
    return chosen, (f"restart {restart_count}: the layout {asked.describe()} needs {asked.world_size} "
                    f"ranks, {world_size} are here: resuming at {now} (tp, pp and cp kept, dp from the "
                    f"survivors{hsdp})")
