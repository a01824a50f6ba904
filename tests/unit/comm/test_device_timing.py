"""Timings read when the device did the work, not when the CPU launched it (docs/ARCHITECTURE.md, "GPUs").

On NCCL ``work.wait()`` returns at once: it only makes the current stream wait for the collective, and a
kernel launch returns before the kernel ran. Here a fake device emulates that, without a GPU: a
``FakeStream`` whose ``tail`` is when it finishes what is queued on it, works whose ``wait()`` returns
at once and makes the stream wait, and stamps (``FakeStamp``, a
``refimpl.comm.device_clock.DeferredStamp`` like a CUDA event) that complete when the stream gets
there. Each timing path (the tracer's events, the pipeline executor's, chapter 03's and chapter 07's
timelines) records, on that device, the device's completion time; each negative control runs the same
program on the CPU clock, the stamping these paths had before, and records about nothing. Stamps are not
read while the step runs (a CUDA stamp read then would synchronize), and on CPU the stamps are the
``perf_counter`` floats they always were. A fake ``torch.cuda`` checks the CUDA stamps themselves: read
after one synchronize, in seconds on the ``perf_counter`` axis.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from refimpl.comm import CommTracer, device_clock, ops
from refimpl.comm.device_clock import DeferredStamp, StampList
from refimpl.comm.tracer import now
from refimpl.config import ModelConfig
from refimpl.models import GPT, lm_loss
from refimpl.models.gpt_stages import build_stages
from refimpl.parallel.context_parallel import RingTimeline
from refimpl.parallel.data_parallel import SyncTimeline
from refimpl.parallel.pipeline_parallel import build_schedule
from refimpl.parallel.pipeline_parallel.executor import PipelineEvent, run_schedule
from refimpl.train.loop import _pipeline_idle

U = 1000.0  # a unit of fake device time: far beyond anything the CPU path could record here
DELAY = U  # device seconds an all-reduce takes
CPU_BOUND = 10.0  # what the CPU clock may record for the same program, even on a loaded machine


class FakeStamp(DeferredStamp):
    """An event recorded on a ``FakeStream``: it completes at the stream's tail when recorded."""

    __slots__ = ("at", "stream")

    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at = stream, stream.tail

    def seconds(self) -> float:
        self.stream.reads += 1
        return self.at


class FakeStream:
    """The current stream of a fake device: ``tail`` is the device time it finishes what is queued."""

    def __init__(self) -> None:
        self.tail = 0.0
        self.reads = 0  # stamps read (on CUDA: the reads that may synchronize)

    def run(self, seconds: float) -> None:
        """A kernel launch: the CPU returns at once, the stream is busy ``seconds`` more."""
        self.tail += seconds

    def mark(self) -> FakeStamp:
        return FakeStamp(self)

    def post(self, delay: float) -> FakeWork:
        """A collective on its own stream, started once the current stream is here, done ``delay`` later."""
        return FakeWork(self, done_at=self.tail + delay)


class FakeWork:
    """NCCL's ``Work``: ``wait()`` returns at once and makes the current stream wait for the collective."""

    def __init__(self, stream: FakeStream, done_at: float) -> None:
        self.stream, self.done_at = stream, done_at

    def wait(self, timeout: object = None) -> bool:
        self.stream.tail = max(self.stream.tail, self.done_at)
        return True


@pytest.fixture
def comm(monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """``dist.all_reduce`` posts on a fake device (blocking: the stream waits, the CPU does not); the
    tracer's clock is the CPU's (as in a CPU run, even where another test initialised CUDA)."""
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        work = stream.post(DELAY)
        return work if async_op else work.wait() and None

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return stream


@pytest.fixture
def device(comm: FakeStream, monkeypatch: pytest.MonkeyPatch) -> FakeStream:
    """The fake device is also the tracer's clock (``refimpl.comm.tracer.now``)."""
    monkeypatch.setattr(device_clock, "current_clock", lambda: comm)
    return comm


def _traced_all_reduce(stream: FakeStream, *, async_op: bool):
    """1 s of compute, the all-reduce posted, 0.5 s more compute (overlapping it), then its wait."""
    with CommTracer() as tracer:
        stream.run(1.0)
        work = ops.all_reduce(torch.zeros(4), async_op=async_op)
        stream.run(0.5)
        if work is not None:
            work.wait()
    (event,) = tracer.events
    return event


@pytest.mark.parametrize("async_op", [True, False])
def test_the_tracer_records_the_collectives_device_time(device, async_op):
    event = _traced_all_reduce(device, async_op=async_op)
    assert device.reads == 0  # stamped, not read: no synchronize while the step ran
    assert (event.start, event.end) == (1.0, 1.0 + DELAY)  # posted after 1 s, done DELAY later
    assert event.end - event.start == DELAY


def test_negative_control_the_cpu_clock_records_the_launch_not_the_collective(comm):
    event = _traced_all_reduce(comm, async_op=True)
    assert type(event.start) is float and type(event.end) is float  # on CPU: perf_counter floats, as before
    assert event.end - event.start < CPU_BOUND < DELAY  # the wait returned at once: ~0 recorded


def test_cpu_stamps_are_perf_counter_floats_and_deferred_stamps_read_and_pickle_as_seconds(comm):
    assert type(now()) is float
    stream = FakeStream()
    stream.run(2.0)
    stamp = stream.mark()
    assert float(stamp) == 2.0 and stamp - 0.5 == 1.5 and 3.0 - stamp == 1.0 and 1.0 < stamp <= 2.0
    assert type(pickle.loads(pickle.dumps(stamp))) is float  # a rank's events reach the notebook as floats
    stamps = StampList([stamp, None])
    assert list(stamps) == [2.0, None] and stamps[0] == 2.0 and stamps.raw(0) is stamp


class FakeCuda:
    """``torch.cuda`` as ``refimpl.comm.device_clock.CudaStamp`` uses it: events complete when the
    device is synchronized past them (this device makes progress only then); the syncs are counted."""

    def __init__(self) -> None:
        self.tail, self.reached, self.syncs = 0.0, 0.0, 0

    def synchronize(self, device: object = None) -> None:
        self.syncs += 1
        self.reached = self.tail

    def event(self, enable_timing: bool = False) -> SimpleNamespace:
        ev = SimpleNamespace(at=None)
        ev.record = lambda stream=None: setattr(ev, "at", self.tail)
        ev.query = lambda: self.reached >= ev.at
        ev.synchronize = lambda: None
        ev.elapsed_time = lambda other: (other.at - ev.at) * 1e3  # milliseconds, as CUDA's
        return ev


def test_cuda_stamps_are_read_after_one_synchronize_on_the_perf_counter_axis(monkeypatch):
    gpu = FakeCuda()
    fakes = {"Event": gpu.event, "synchronize": gpu.synchronize, "is_initialized": lambda: True,
             "current_device": lambda: 0, "current_stream": lambda device=None: None}
    for name, fake in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(device_clock, "_REFERENCES", {})
    stamps = []
    for _ in range(3):
        gpu.tail += 2.0  # kernels queued: the CPU does not wait
        stamps.append(now())  # CUDA is initialised: the tracer's clock is the device's
    assert all(isinstance(s, device_clock.CudaStamp) for s in stamps)
    assert gpu.syncs == 1  # the reference's, at the first stamp (device time 2), on an idle device
    at = device_clock._REFERENCES[0].at  # perf_counter as the reference completed
    assert [device_clock.seconds(s) for s in stamps] == pytest.approx([at, at + 2.0, at + 4.0])
    assert gpu.syncs == 2  # one synchronize for the three reads


# ------------------------------------------------------------------------------------- the pipeline
M, B, S, H = 2, 1, 4, 16
FORWARD, BACKWARD = 100.0, 200.0  # device seconds of a forward's and of a backward's kernels


def _one_stage_run(clock, stream: FakeStream) -> list[PipelineEvent]:
    """1F1B over one stage (pp = 1: no transfers); each forward and backward queues device time."""
    model = GPT(ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, max_seq_len=S), seed=0)
    stages = build_stages(model, pp_rank=0, pp_size=1)

    def queue(module, args, out):
        stream.run(FORWARD)
        out.register_hook(lambda grad: stream.run(BACKWARD))

    stages[0].register_forward_hook(queue)
    tokens = torch.randint(0, 256, (M * B, S + 1), generator=torch.Generator().manual_seed(0))
    events: list[PipelineEvent] = []
    run_schedule(build_schedule("1f1b", pp_size=1, num_microbatches=M)[0], stages=stages, pp_group=None,
                 pp_size=1, inputs=tokens[:, :-1].chunk(M), labels=tokens[:, 1:].chunk(M),
                 loss_fn=lambda y, t: lm_loss(y, t, num_tokens=M * B * S), activation_shape=(B, S, H),
                 activation_dtype=torch.float32, events=events, clock=clock)
    return events


def test_the_pipeline_events_read_the_device():
    stream = FakeStream()
    events = _one_stage_run(stream.mark, stream)
    assert stream.reads == 0  # the executor holds its stamps unread until the step's end
    assert [(e.kind, e.start, e.ready, e.end) for e in events] == [
        ("F", 0.0, 0.0, 100.0), ("B", 100.0, 100.0, 300.0), ("F", 300.0, 300.0, 400.0),
        ("B", 400.0, 400.0, 600.0)]


def test_negative_control_cpu_stamped_pipeline_events_miss_the_device_work():
    stream = FakeStream()
    events = _one_stage_run(None, stream)  # the default clock: the stages' device's, here the CPU's
    assert all(type(e.start) is float and type(e.end) is float for e in events)
    assert sum(e.end - e.ready for e in events) < CPU_BOUND < stream.tail  # the device was busy 600 s


def test_pipeline_idle_reads_device_time_and_reduces_on_the_stages_device(monkeypatch):
    stream = FakeStream()
    stamps = {}
    for name, busy in [("start", 0.0), ("ready", 3.0), ("end", 1.0), ("b_end", 1.0)]:  # waited 3 s
        stream.run(busy)
        stamps[name] = stream.mark()
    events = [PipelineEvent(kind="F", stage=0, microbatch=0, start=stamps["start"], ready=stamps["ready"],
                            end=stamps["end"]),
              PipelineEvent(kind="B", stage=0, microbatch=0, start=stamps["end"], ready=stamps["end"],
                            end=stamps["b_end"])]
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: reduced.append(t.device))
    param = torch.nn.Parameter(torch.zeros(1))
    setup = SimpleNamespace(pipeline=SimpleNamespace(last_events=events, pp_group=None, pp_size=1,
                                                     parameters=lambda: iter([param])))
    with torch.device("meta"):  # a bare factory would make the share here: NCCL would refuse it
        idle = _pipeline_idle(setup)
    assert idle == pytest.approx(1 - 2.0 / 5.0)  # busy 1 + 1 of a 5 s span
    assert reduced == [param.device]


# ------------------------------------------------------------------------------------- the timelines
def _ring_step(stream: FakeStream, clock, timeline: RingTimeline) -> None:
    """One ring step as ring_attention stamps it: post the exchange (5 U), compute (2 U), wait, record."""
    posted = clock()
    transfer = stream.post(5 * U)
    begin = clock()
    stream.run(2 * U)
    computed = clock()
    transfer.wait()
    timeline.add("compute", 0, begin, computed)
    timeline.add("transfer", 0, posted, clock())


def test_the_ring_timeline_reads_the_device_and_its_negative_control():
    stream, timeline = FakeStream(), RingTimeline()
    _ring_step(stream, stream.mark, timeline)
    assert stream.reads == 0
    assert timeline.exposed_transfer_seconds() == 3 * U  # 5 U of transfer, 2 U hidden behind the compute
    cpu = RingTimeline()
    _ring_step(FakeStream(), device_clock.CPU_CLOCK.mark, cpu)
    assert cpu.exposed_transfer_seconds() < CPU_BOUND < 3 * U  # launch times: nothing seen exposed


def _bucket_sync(stream: FakeStream, clock) -> SyncTimeline:
    """One backward as DataParallelBucket stamps it: two buckets launched by hooks, waited at the end."""
    timeline = SyncTimeline(launch=[None, None], done=[None, None])
    timeline.backward_start = clock()
    works = []
    for b in range(2):
        stream.run(U)  # the bucket's gradients
        timeline.grad_ready.append(clock())
        timeline.launch[b] = clock()
        works.append(stream.post(4 * U))
    timeline.backward_end = clock()
    timeline.wait_start = clock()
    for b, work in enumerate(works):
        work.wait()
        timeline.done[b] = clock()
    timeline.wait_end = clock()
    return timeline


def test_the_bucket_timeline_reads_the_device_and_its_negative_control():
    stream = FakeStream()
    timeline = _bucket_sync(stream, stream.mark)
    assert stream.reads == 0
    assert list(timeline.launch) == [U, 2 * U] and list(timeline.done) == [5 * U, 6 * U]
    assert timeline.comm_seconds() == 5 * U and timeline.exposed_seconds() == 4 * U  # backward ended at 2 U
    cpu = _bucket_sync(FakeStream(), device_clock.CPU_CLOCK.mark)
    assert type(cpu.launch[0]) is float and cpu.comm_seconds() < CPU_BOUND < 5 * U
