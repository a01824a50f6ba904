"""Throughput and MFU measured (refimpl.measure.throughput) against the dense device peaks
(refimpl.measure.peaks): the arithmetic, the table, the compute dtype that picks the peak, and no default."""

from __future__ import annotations

import pytest
import torch

from refimpl.measure import Throughput, model_flops_utilization, peak_dtype, peak_flops


def test_model_flops_utilization_arithmetic():
    assert model_flops_utilization(1000.0, 1e9, 4, 1e12) == pytest.approx(0.25)
    assert model_flops_utilization(2000.0, 1e9, 4, 1e12) == pytest.approx(0.5)  # linear in tokens/s
    assert model_flops_utilization(1000.0, 1e9, 8, 1e12) == pytest.approx(0.125)  # 1 / devices


def test_peak_flops():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("cpu", "fp32") is None
    with pytest.raises(ValueError, match="unknown compute dtype"):
        peak_flops("NVIDIA H100 80GB HBM3", "int3")
    with pytest.raises(TypeError):
        peak_flops("NVIDIA H100 80GB HBM3")  # no silent bf16 default


@pytest.mark.parametrize(("name", "bf16", "tf32", "fp32"), [
    ("NVIDIA H100 80GB HBM3", 989e12, 494.7e12, 67e12),
    ("NVIDIA H200", 989e12, 494.7e12, 67e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12, 19.5e12),
    ("NVIDIA H100 PCIe", 756e12, 378e12, 51e12),  # matched before the SXM entry
])
def test_peak_table_has_every_compute_dtype(name, bf16, tf32, fp32):
    assert peak_flops(name, "bf16") == peak_flops(name, "fp16") == bf16
    assert (peak_flops(name, "tf32"), peak_flops(name, "fp32")) == (tf32, fp32)
    assert fp32 < tf32 < bf16  # CUDA-core fp32 < tensor-core tf32 < tensor-core 16-bit


def test_peak_dtype_follows_the_compute_dtype_and_matmul_precision():
    assert peak_dtype(torch.bfloat16) == "bf16"
    assert peak_dtype(torch.float16) == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # PyTorch's default: true fp32, no TF32
        assert peak_dtype(torch.float32) == "fp32"
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores allowed
        assert peak_dtype(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(ValueError, match="no peak"):
        peak_dtype(torch.float64)


def test_throughput_requires_the_compute_dtype():
    kwargs = dict(tokens_per_step=128, flops_per_token=1e6, num_devices=1, device=torch.device("cpu"))
    with pytest.raises(TypeError):
        Throughput(**kwargs)  # no default dtype
    with pytest.raises(TypeError):
        Throughput(128, 1e6, 1, torch.device("cpu"), "fp32")  # keyword-only
    with pytest.raises(ValueError, match="expected one of"):
        Throughput(**kwargs, dtype="float32")
    tokens_per_s, mfu = Throughput(**kwargs, dtype="fp32").step()
    assert tokens_per_s > 0 and mfu is None  # a CPU has no peak in the table: MFU is n/a, not made up


def test_progress_in_a_jupyter_kernel_is_a_text_bar_that_ends_at_100(monkeypatch: pytest.MonkeyPatch):
    """In a kernel (a notebook rank's engine too) ``tqdm.auto`` picks the notebook widget, whose saved output
    is its text when created: "train: 0%" (chapters 09 and 12, executed, kept such stale bars). The module is
    imported afresh with IPython reporting a kernel, ``tqdm.auto`` unimported: its bar must be the text one,
    caught by ``redirect_stderr``, its last redraw (what a cell shows) at 100%."""
    import contextlib
    import importlib.util
    import io
    import sys
    import types

    import IPython
    import tqdm
    import tqdm.auto
    import tqdm.autonotebook
    import tqdm.std

    import refimpl.measure.throughput as throughput

    class ZMQInteractiveShell:  # a kernel's shell, as tqdm.autonotebook recognises one
        config = {"IPKernelApp": {}}

    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setattr(IPython, "get_ipython", ZMQInteractiveShell)
    for name in ("tqdm.auto", "tqdm.autonotebook"):  # they decide when imported: afresh below, if at all
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(tqdm, name.split(".")[1], getattr(tqdm, name.split(".")[1]))
    spec = importlib.util.spec_from_file_location("_throughput_in_a_kernel", throughput.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown), contextlib.redirect_stdout(shown):
        spec.loader.exec_module(module)
        bar = module.progress(4)
        for _ in range(4):
            bar.update(1)
        bar.close()
    assert type(bar) is tqdm.std.tqdm, f"progress() made a {type(bar).__module__}.{type(bar).__name__}"
    last = shown.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert last.startswith("train: 100%") and "4/4" in last, repr(shown.getvalue())
    # and outside a kernel too (the trainer's command line)
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown):
        bar = throughput.progress(2)
        bar.update(2)
        bar.close()
    assert type(bar) is tqdm.std.tqdm and shown.getvalue().rsplit("\r", 1)[-1].startswith("train: 100%")
