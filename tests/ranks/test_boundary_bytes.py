"""The plan CLI's stage-boundary bytes against what the runtime sends (chapter 12).

``python -m refimpl.plan`` counts the pipeline's traffic with ``refimpl.plan.boundary_bytes``: a
``[b, s/(cp tp), h]`` tensor of ``refimpl.plan.BOUNDARY_BYTES_PER_ELEMENT`` bytes per element. Here ONE
spawn of 8 ranks trains a tiny untied GPT for one step through ``refimpl.train.train`` at dp 1 x tp 4 x
pp 2 with sequence parallelism in **bf16** (autocast, where a plan could believe the boundaries are bf16)
and records every tensor the pipeline executor posts for sending (through ``post_group``), its dtype and
bytes, and the dtype of every receive buffer. Each must be the plan's boundary tensor, dtype and bytes;
the step's sends per rank the plan's ``sent["pp"]`` for that layout (``refimpl.plan.plan_layouts``);
and the trainer's own tracer (``bytes_sent["pp"]`` in its records) must agree with the recorded sends.
Negative control: the plan's former term, a bf16 ``[b, s/cp, h]`` boundary (2 bytes per element, the
sequence-parallel split forgotten), is not what is sent (at tp 2 the two errors cancel: hence tp 4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from refimpl.data import make_corpus_file
from refimpl.launch import run_ranks
from refimpl.plan import BOUNDARY_BYTES_PER_ELEMENT, boundary_bytes, plan_layouts
from refimpl.train import build_parser, config_from_args, options_from_args, train
from tests.support.timeouts import SPAWN_TIMEOUT_S

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-heads", "4", "--seq-len", "16",
         "--batch-size", "4", "--steps", "1", "--lr", "1e-2", "--warmup-steps", "1", "--log-every", "100",
         "--checkpoint-every", "0",
         "--no-tie-embeddings", "--precision", "bf16", "--tp", "4", "--sequence-parallel",
         "--pp", "2", "--microbatches", "2"]


def _record_boundaries(ctx, files: dict) -> dict:
    import refimpl.parallel.pipeline_parallel.executor as executor

    sent: list[tuple[str, int]] = []
    received: list[str] = []
    original = executor.post_group

    def recording(transfers, *, outgoing, dtype, **kw):  # what the executor hands on, as it hands it on
        def handed_on(message):
            tensor = outgoing(message)
            sent.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
            return tensor
        received.extend(str(dtype) for t in transfers if t.kind.startswith("recv"))
        return original(transfers, outgoing=handed_on, dtype=dtype, **kw)

    args = build_parser().parse_args([*FLAGS, "--data", files["corpus"], "--cache-dir", files["cache"],
                                      "--out", str(Path(files["root"]) / f"rank{ctx.rank}")])
    options = dataclasses.replace(options_from_args(args), checkpoint=None)
    executor.post_group = recording
    try:
        records = train(config_from_args(args), ctx, options)
    finally:
        executor.post_group = original
    return {"sends": sent, "receives": received, "traced_pp": records[-1]["bytes_sent"].get("pp", 0)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("boundary")
    corpus = make_corpus_file(root / "corpus.txt", num_bytes=4000)
    files = {"corpus": str(corpus), "cache": str(root / "cache"), "root": str(root)}
    return run_ranks(_record_boundaries, 8, files, timeout_s=SPAWN_TIMEOUT_S)


def _plan():
    args = build_parser().parse_args([*FLAGS, "--data", "unused.txt"])
    config = config_from_args(args)
    plans = plan_layouts(config.model, gpus=8, gpu="H100", gpus_per_node=8, seq_len=config.data.seq_len,
                         global_batch=config.data.global_batch_size, micro_batch=2)
    plan = next(p for p in plans if (p.dp, p.tp, p.pp, p.cp) == (1, 4, 2, 1))
    one = boundary_bytes(micro_batch=config.data.global_batch_size // 2, seq_len=config.data.seq_len,
                         hidden_size=config.model.hidden_size, tp=4, cp=1)
    return plan, one, config


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_every_boundary_send_is_the_plans_tensor(measured):
    plan, one, config = _plan()
    assert plan.microbatches == 2  # 4 sequences in micro-batches of 2
    # [b, s/(cp tp), h] float32: b = 2, s = 16 / 4 = 4 tokens, h = 32
    assert one == 2 * 4 * 32 * BOUNDARY_BYTES_PER_ELEMENT
    former = 2 * 2 * 16 * 32  # bf16 [b, s/cp, h]: the term the plan used before
    for rank, got in enumerate(measured):
        assert len(got["sends"]) == plan.microbatches, (rank, got["sends"])  # pp 2: one send per micro-batch
        for dtype, nbytes in got["sends"]:
            assert dtype == "torch.float32" and nbytes == one, (rank, dtype, nbytes, one)
            assert nbytes != former, (rank, nbytes)  # the negative control
        assert got["receives"] == ["torch.float32"] * plan.microbatches, (rank, got["receives"])


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_the_plans_pipeline_bytes_are_the_runs(measured):
    plan, _, _ = _plan()
    for rank, got in enumerate(measured):
        total = sum(nbytes for _, nbytes in got["sends"])
        assert total == plan.sent["pp"], (rank, total, plan.sent["pp"])
        # the tracer saw the same sends, plus two fp32 scalars all-reduced over the pp pair (the step's loss
        # and the gradient norm's sum of squares: 2 (n-1)/n x 4 bytes each at n = 2)
        assert got["traced_pp"] == total + 2 * 4, (rank, got["traced_pp"], total)
    assert torch.float32.itemsize == BOUNDARY_BYTES_PER_ELEMENT
