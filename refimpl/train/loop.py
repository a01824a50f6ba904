"""The training loop, ``train``: resume from the newest valid checkpoint (chapter 11), run the steps
(``refimpl.train.step.train_step``), append a record per step to ``metrics.jsonl`` (loss, throughput,
memory, the bytes this rank sent per process group, and under pipeline parallelism the measured idle share),
save on the schedule and on SIGTERM (then raise ``Preempted``), and report at the end (``loss.png``,
``summary.json``, a text sample).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from refimpl import elastic
from refimpl.checkpoint import save_training_state
from refimpl.comm import CommTracer, ops
from refimpl.config import TrainConfig
from refimpl.data import ShardedBatches, decode, encode, to_device
from refimpl.distributed import DistributedContext, log0, seed_everything
from refimpl.distributed.mesh import ParallelDims, ParallelGroups
from refimpl.distributed.placement import LocalShard
from refimpl.measure import Throughput, format_bytes, format_mfu, peak_dtype, peak_memory_bytes, progress
from refimpl.measure.peak import peak_reserved_bytes, reset_peak_memory
from refimpl.models import generate
from refimpl.optim import lr_at, set_lr
from refimpl.planner import flops_per_token, param_count
from refimpl.train.args import RunOptions
from refimpl.train.gradients import gradient_shards
from refimpl.train.hooks import Hooks, TrainHooks, compose
from refimpl.train.layout import Layout, resolve
from refimpl.train.preflight import check_fits
from refimpl.train.probes import RunProbes
from refimpl.train.resume import Resumed, resume
from refimpl.train.setup import _sampling_model, _Setup, build_setup
from refimpl.train.step import StepPoints, train_step

SIGTERM_EXIT = 143  # 128 + SIGTERM: "stopped, not finished" for schedulers and torchrun


class Preempted(Exception):
    """The run saved its state on SIGTERM and stopped after ``step`` completed steps."""

    def __init__(self, step: int, path: Path | None) -> None:
        super().__init__(f"stopped on SIGTERM after saving step {step} in {path}; run the same command "
                         "again to resume")
        self.step, self.path = step, path


def _call(point: Callable[..., None] | None, *args) -> None:
    """A hook point (``refimpl.train.hooks``) called with ``args``, when some hook has it."""
    if point is not None:
        point(*args)


def _pipeline_idle(setup) -> float:
    """The idle share of the pipeline ranks in the last step, measured from the executor's events (per
    rank ``1 - sum(action time after its input arrived) / (last end - first start)``, averaged over the pp
    group: the bubble and the waits for transfers, chapter 08). The events' times are device time on CUDA
    (their reads synchronize once: ``refimpl.comm.device_clock``), and the share is all-reduced from the
    stages' device, the run's: NCCL takes no CPU tensor."""
    events = setup.pipeline.last_events
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.ready for e in events)
    device = next(setup.pipeline.parameters()).device  # ctx.device: the stages were built on it
    idle = torch.tensor(1.0 - busy / span if span > 0 else 0.0, device=device)
    torch.distributed.all_reduce(idle, group=setup.pipeline.pp_group)  # not traced: bookkeeping
    return idle.item() / setup.pipeline.pp_size


def train(config: TrainConfig, ctx: DistributedContext, options: RunOptions | None = None, *,
          layout: Layout | None = None, hooks: Hooks | None = None,
          gradient_probe: Callable[[int, dict[str, LocalShard]], None] | None = None) -> list[dict]:
    """Run the optimizer steps of ``config`` (resuming from ``options.checkpoint`` when it holds a valid
    checkpoint); return the per-step records (also in metrics.jsonl; on rank 0 they include the steps of
    earlier attempts). Raises ``Preempted`` after the save that follows a SIGTERM.

    ``options`` are resolved here (``refimpl.train.layout.resolve``: every rule of the layout, once);
    ``layout``: already resolved instead (the command line resolves before it starts the process group).

    ``hooks``: what the caller runs inside the loop, at the points ``refimpl.train.hooks`` documents (a
    ``refimpl.train.hooks.TrainHooks``, or a measurement such as
    ``refimpl.measure.run_measurement.TrainerProbe``). ``gradient_probe`` is short for
    ``hooks=TrainHooks(gradient_probe=...)``: on every rank and step, the gradients the step hands to the
    optimizer, reduced, as boxes of the plain GPT's tensors (the equivalence tests compare them with one
    device's)."""
    if gradient_probe is not None and hooks is not None:
        raise TypeError("give gradient_probe in hooks (TrainHooks(gradient_probe=...)), or hooks=None")
    if layout is not None and options is not None:
        raise TypeError("give the options or their resolved layout, not both")
    hooks = hooks if hooks is not None else TrainHooks(gradient_probe=gradient_probe)
    if layout is None:
        layout = resolve(config, options or RunOptions(), ctx.world_size,
                         restart_count=elastic.restart_count())
    elif layout.dims.world_size != ctx.world_size:
        raise ValueError(f"the layout {layout.dims.describe()} is for {layout.dims.world_size} ranks, "
                         f"this run has {ctx.world_size}: resolve it for this world "
                         "(refimpl.train.layout.resolve)")
    if layout.shrunk:
        log0(ctx, layout.shrunk)
    options, dims = layout.options, layout.dims  # pp x dp x cp x tp, tp innermost (refimpl.distributed.mesh)
    batches = check_fits(config)  # the global batch is split over the data-parallel axis (batches.batch)
    seed_everything(config.data.seed, rank=ctx.rank)
    out = Path(config.out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)

    # the process groups of the layout, built once here (collective) and passed down: no global
    groups = (dims.build(rank=ctx.rank, world_size=ctx.world_size, timeout_s=ctx.timeout_s)
              if torch.distributed.is_initialized() else None)
    setup = build_setup(config, ctx, layout, groups)
    resumed = resume(config, ctx, options, setup, out)
    begin = time.perf_counter()
    records = _run_steps(config, ctx, layout, setup, groups=groups, batches=batches, resumed=resumed,
                         hooks=hooks, out=out, begin=begin)
    all_records = resumed.earlier + records
    if options.report:
        _report(config, ctx, options, setup, resumed=resumed, all_records=all_records, out=out, begin=begin)
    elif all_records:
        log0(ctx, f"done: loss {all_records[0]['loss']:.3f} -> {all_records[-1]['loss']:.3f} in "
                  f"{time.perf_counter() - begin:.1f} s (--no-report: no loss.png, sample or summary)")
    return all_records


def _run_steps(config: TrainConfig, ctx: DistributedContext, layout: Layout, setup: _Setup, *,
               groups: ParallelGroups | None, batches: ShardedBatches, resumed: Resumed, hooks: Hooks,
               out: Path, begin: float) -> list[dict]:
    """Steps ``resumed.start`` to ``config.steps - 1``: a record per step (metrics.jsonl on rank 0), the
    saves on the schedule and on SIGTERM (then ``Preempted``). The run's own probes
    (``refimpl.train.probes.RunProbes``: faults, the heartbeat and its report of a failure) are hooks,
    composed before the caller's ``hooks`` and called at the points ``refimpl.train.hooks`` lists."""
    options, dims = layout.options, layout.dims
    coords = dims.coordinates(ctx.rank)
    start, schedule = resumed.start, resumed.schedule
    # per data-parallel rank (TP ranks share a batch); under pipeline parallelism the pipeline's micro-batches
    accumulation, micro = layout.accumulation, layout.micro_batch
    meter = _throughput(config, ctx, setup, dims, accumulation=accumulation, micro=micro)
    log0(ctx, _describe_run(config, ctx, options, dims, accumulation=accumulation, micro=micro))
    hooks = compose(RunProbes(options, ctx, out), hooks)  # the run's own probes first, at every point
    records: list[dict] = []
    bar = progress(config.steps, enabled=ctx.is_main, initial=start)
    step = start
    tracer = CommTracer().__enter__()  # the bytes each step sends, per axis (metrics.jsonl); left in finally
    axis_of = {None: "world"} | ({id(g): name for name, g in groups.named().items()}  # mesh.group_name's
                                 if groups is not None else {})
    try:
        for step in range(start, config.steps):
            tracer.events.clear()  # this step's calls only (a checkpoint's land here too, then are cleared)
            reset_peak_memory(ctx.device)  # a GPU's peaks from here: the record's are this step's
            _call(hooks.before_step, step, setup)
            lr = lr_at(step, config.optim, config.steps)
            set_lr(setup.optimizer, lr)
            inputs, labels = _step_batch(step, ctx, setup, batches, dp=coords.dp, dp_size=dims.dp)
            loss_sum = _train_step_at(step, config, setup, inputs, labels, hooks=hooks,
                                      accumulation=accumulation, micro=micro)
            if setup.parallel.group is not None and dims.dp * dims.cp > 1:
                # The mean over the dp x cp ranks (equal token counts), the group the gradients were
                # averaged over; the ranks of one tp group hold the same loss already.
                ops.all_reduce(loss_sum, group=setup.parallel.group)
                loss_sum /= dims.dp * dims.cp
            sent = {axis_of.get(g, "other"): b for g, b in tracer.bytes_sent_by_group().items()}
            record = _step_record(step, loss_sum, lr, meter, ctx, setup, sent=sent, begin=begin,
                                  attempt=resumed.attempt)
            records.append(record)
            if ctx.is_main:
                _write_record(record, config, out=out, bar=bar)
            if schedule is not None:
                _save_if_due(step, config, ctx, options, setup, resumed=resumed, hooks=hooks, bar=bar)
    except Preempted:
        raise  # saved on SIGTERM: a stop, not a failure
    except Exception as exc:
        _call(hooks.on_failure, step, setup, exc)  # the run's: the heartbeat's report, failures.jsonl
        raise
    finally:
        tracer.__exit__(None, None, None)
        if schedule is not None:
            schedule.close()
    bar.close()
    if resumed.checkpointer is not None:
        resumed.checkpointer.close()  # an asynchronous save commits before the run ends
    return records


def _throughput(config: TrainConfig, ctx: DistributedContext, setup: _Setup, dims: ParallelDims, *,
                accumulation: int, micro: int) -> Throughput:
    """The run's tokens per second and MFU meter."""
    # dp ranks x accumulation x micro sequences of seq_len tokens (under cp each of the cp ranks holds
    # seq_len / cp of them): the global batch x seq_len; the tp (and pp) ranks of a replica share them
    tokens_per_step = dims.dp * accumulation * micro * config.data.seq_len
    # MFU divides by every device of the run (all of them compute), not by the data-parallel ranks
    return Throughput(tokens_per_step=tokens_per_step, num_devices=dims.world_size, device=ctx.device,
                      flops_per_token=flops_per_token(config.model, config.data.seq_len),
                      dtype=peak_dtype(setup.mp.policy.compute_dtype))  # MFU against this dtype's peak


def _describe_run(config: TrainConfig, ctx: DistributedContext, options: RunOptions, dims: ParallelDims, *,
                  accumulation: int, micro: int) -> str:
    """The run's first line: the model, the world, ZeRO, precision, the batch and the layout."""
    par = options.parallel
    return (f"model: {param_count(config.model).total:,} parameters | world size {ctx.world_size} on "
            f"{ctx.device.type} ({ctx.backend}) | ZeRO stage {par.zero_stage} | {par.precision} | "
            f"global batch {config.data.global_batch_size} x {config.data.seq_len} tokens = {micro} per "
            f"micro-batch x {accumulation} accumulation x {dims.dp} data-parallel ranks | layout "
            f"{dims.describe()}{' with sequence parallelism' if par.sequence_parallel else ''}"
            + (f" | context parallel: {par.cp_method} attention" if dims.cp > 1 else "")
            + (f" | pipeline: {par.pp_schedule}, {accumulation} micro-batches"
               + (f", {par.virtual_stages} stages per rank" if par.virtual_stages > 1 else "")
               if dims.pp > 1 else ""))


def _step_batch(step: int, ctx: DistributedContext, setup: _Setup, batches: ShardedBatches, *, dp: int,
                dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(inputs, labels)`` of step ``step`` (``dp``: its data-parallel index), on its device."""
    inputs, labels = batches.batch(step, dp, dp_size)  # [B/dp, s] each: this dp rank's shard
    # context parallelism: this cp rank's part of each sequence, [B/dp, s/cp] (the layout of its
    # attention); the tp ranks of a replica take the same part; on the device once, pinned
    inputs, labels = (to_device(setup.parallel.split_batch(t), ctx.device) for t in (inputs, labels))
    return inputs, labels


def _train_step_at(step: int, config: TrainConfig, setup: _Setup, inputs: torch.Tensor, labels: torch.Tensor,
                   *, hooks: Hooks, accumulation: int, micro: int) -> torch.Tensor:
    """``train_step`` of step ``step`` inside the hooks' ``around_step``, their points bound to the step
    (``StepPoints``); returns this rank's loss (not reduced)."""

    def gradients_unscaled() -> None:  # what the optimizer receives, before clipping; the update follows
        if hooks.gradient_probe is not None:
            hooks.gradient_probe(step, gradient_shards(setup))
        _call(hooks.after_gradient_probe, step, setup)

    bound = {name: partial(point, step, setup)  # the hooks' points of train_step, bound to the step
             for name in ("after_first_forward", "after_first_loss", "before_optimizer_step")
             if (point := getattr(hooks, name)) is not None}
    points = StepPoints(**bound, after_unscale=gradients_unscaled, clock=hooks.clock)
    with hooks.around_step(step, setup) if hooks.around_step is not None else nullcontext():
        return train_step(setup, inputs, labels, accumulation=accumulation, micro=micro,
                          grad_clip=config.optim.grad_clip, points=points)


def _step_record(step: int, loss_sum: torch.Tensor, lr: float, meter: Throughput, ctx: DistributedContext,
                 setup: _Setup, *, sent: dict[str, float], begin: float, attempt: int) -> dict[str, Any]:
    """Step ``step``'s record (a line of metrics.jsonl); refuses a loss that is not finite."""
    bubble = _pipeline_idle(setup) if setup.pipeline is not None else None
    loss_value = loss_sum.item()
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"loss became {loss_value} at step {step}; try a lower --lr")
    tokens_per_s, mfu = meter.step()
    record: dict[str, Any] = {
        "step": step, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_s,
        "mfu": mfu, "peak_memory_bytes": peak_memory_bytes(ctx.device),
        "peak_reserved_bytes": peak_reserved_bytes(ctx.device),  # GPU only, else None
        "elapsed_s": time.perf_counter() - begin, "attempt": attempt,
        "world_size": ctx.world_size}
    record["bytes_sent"] = sent  # this rank, per process group (ring model for collectives)
    if bubble is not None:
        record["pipeline_idle"] = bubble  # measured: the idle share of the pp ranks in this step
    if setup.mp.scaler is not None:
        record["loss_scale"] = setup.mp.scale
    figures = None if setup.experts is None else setup.experts.figures
    if figures is not None:  # MoE: the balance loss (in "loss"), load, drops (chapter 09)
        record |= figures
        record["lm_loss"] = loss_value - figures["moe_aux_loss"]
    return record


def _write_record(record: dict[str, Any], config: TrainConfig, *, out: Path, bar: tqdm) -> None:
    """Rank 0: the record's line in metrics.jsonl, the progress bar, and a line every ``log_every`` steps."""
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    bar.update(1)
    bar.set_postfix(loss=f"{record['loss']:.3f}")
    step = record["step"]
    if step % config.log_every == 0 or step == config.steps - 1:
        bar.write(f"step {step:5d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                  f"{record['tokens_per_s']:,.0f} tok/s | MFU {format_mfu(record['mfu'])} | "
                  f"peak mem {format_bytes(record['peak_memory_bytes'])}")


def _save_if_due(step: int, config: TrainConfig, ctx: DistributedContext, options: RunOptions,
                 setup: _Setup, *, resumed: Resumed, hooks: Hooks, bar: tqdm) -> None:
    """After step ``step``: a save when the schedule says so and at the end; after a SIGTERM, once it is
    committed, ``Preempted``."""
    checkpointer, schedule = resumed.checkpointer, resumed.schedule
    assert checkpointer is not None and schedule is not None  # a save schedule comes with its checkpointer
    done = step + 1
    if not (schedule.due(done) or done == config.steps):  # due() is collective: always call it
        return
    _call(hooks.before_checkpoint, step, setup)
    save_training_state(checkpointer, done, model=setup.state_module,
                        optimizer=setup.optimizer, scaler=setup.mp.scaler,
                        extra={"run_id": resumed.job, "attempt": resumed.attempt},
                        config={"train": config.to_dict(), "run": options.to_dict()})
    if schedule.stop_requested:
        path = checkpointer.wait()
        bar.close()
        log0(ctx, f"SIGTERM: saved step {done} in {path}; stopping")
        raise Preempted(done, path)


def _report(config: TrainConfig, ctx: DistributedContext, options: RunOptions, setup, *, resumed: Resumed,
            all_records: list[dict], out: Path, begin: float) -> None:
    """Rank 0 writes loss.png, sample.txt (a text sample from the trained model) and summary.json."""
    sampler = _sampling_model(setup, config, options, ctx)  # collective: every rank takes part
    start, info, attempt = resumed.start, resumed.info, resumed.attempt
    if not (ctx.is_main and all_records):
        return
    assert sampler is not None  # rank 0 gets the full model
    import matplotlib.pyplot as plt

    from refimpl.viz import plot_loss

    title = f"{out.name}: loss over {config.steps} steps"
    title += f" (resumed at step {start})" if start else ""
    plt.close(plot_loss({"train": ([r["step"] for r in all_records], [r["loss"] for r in all_records])},
                        path=out / "loss.png", title=title))  # written to loss.png: not kept open
    sampler.eval()
    sample = decode(generate(sampler, encode("def ").to(ctx.device), max_new_tokens=120,
                             seed=config.data.seed))
    (out / "sample.txt").write_text(sample)
    summary = {"restart_count": attempt, "resumed_from_step": start if info is not None else None,
               "resumed_from": str(info.path) if info is not None else None,
               "checkpoint_world_size": info.manifest["world_size"] if info is not None else None,
               "world_size": ctx.world_size, "steps": config.steps,
               "first_loss": all_records[0]["loss"], "final_loss": all_records[-1]["loss"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    restarts = (f"restarts: {attempt} (this agent's TORCHELASTIC_RESTART_COUNT); "
                + (f"resumed from step {start} ({info.path}) at world size {ctx.world_size}"
                   if info is not None else "started from step 0"))
    log0(ctx, f"done: loss {all_records[0]['loss']:.3f} -> {all_records[-1]['loss']:.3f} in "
              f"{time.perf_counter() - begin:.1f} s; {restarts}; wrote {out}/metrics.jsonl, loss.png\n"
              f"sample:\n{sample}")
