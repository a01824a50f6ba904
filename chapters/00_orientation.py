# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · Orientation: the map, the ranks, and how to check a claim
#
# A language model that fits on one accelerator trains in days on thousands of them. Every technique in
# this course answers one question: **what do we split across devices, and what must they tell each
# other so that the result is the same as on one device?**
#
# | chapter | what is split | what is communicated | built in |
# |---|---|---|---|
# | 01 single device | nothing | nothing: the baseline every other chapter is checked against | `refimpl.model`, `refimpl.data`, `refimpl.planner` |
# | 02 collectives | - | all-reduce, reduce-scatter, all-gather, all-to-all, built from send/recv | `refimpl.comm` |
# | 03 data parallel | the batch | gradients (all-reduce), overlapped with backward | `refimpl.parallel.data_parallel` |
# | 04 ZeRO / FSDP | batch + optimizer state, gradients, parameters | reduce-scatter + all-gather | `refimpl.parallel.zero` |
# | 05 mixed precision | (bytes per number) | overflow flags | `refimpl.precision` |
# | 06 tensor parallel | each weight matrix | activations, inside every layer | `refimpl.parallel.tensor_parallel` |
# | 07 sequence / context parallel | the sequence | activations, keys and values | |
# | 08 pipeline parallel | the layers | activations between stages | `refimpl.parallel.pipeline_parallel` |
# | 09 checkpoints and elastic restart | the training state on disk | - | `refimpl.checkpoint` |
# | 10 3D parallelism | all of the above on a mesh | all of the above | `refimpl.train` |
#
# Every chapter runs on a laptop CPU (several processes talking through **gloo**) and, unchanged, on a
# multi-GPU box (**NCCL**). Every chapter *proves* its claim with assertions: equality with a
# single-device run and with PyTorch's own implementation, and measured figures against formulas.
# The README's course map says which chapters are written today.
#
# This chapter does three things: it starts several ranks from this notebook, runs the first collective,
# and then uses the planner to check a published claim with nothing but arithmetic.

# %%
import math

import torch

import refimpl
from refimpl.notebook import run_command, start_ranks
from refimpl.planner import PEAK_FLOPS, model_flops_utilization

print("torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 1. Ranks
#
# A distributed job is a set of processes, one per device, each with a **rank** in `0..world_size-1`.
# `torchrun` starts them for scripts; in a notebook, `refimpl.notebook.start_ranks` starts one
# [ipyparallel](https://ipyparallel.readthedocs.io) engine per rank, gives each its rank and device, and
# initialises the process group (gloo on CPU, NCCL on GPU) with a timeout. A cell that starts with
# `%%px` then runs on **every** rank, and each engine keeps its variables between cells.
#
# Why not `mp.spawn` a function defined here? Spawned processes must import the function by name, and a
# notebook's functions have no importable name. Why not `!torchrun`? A failing `!` command does not fail
# the cell: the notebook would go on as if nothing happened. `refimpl.notebook.run_command` raises instead.

# %%
WORLD_SIZE = 4
ranks = start_ranks(WORLD_SIZE, timeout_s=60)
ranks

# %% [markdown]
# Each engine now holds `rank`, `world_size`, `device` and `dist` (`torch.distributed`). The first
# collective: every rank contributes a tensor holding its rank, and **all-reduce** leaves the sum on
# every rank: 0 + 1 + 2 + 3 = 6.

# %%
# %%px
t = torch.full((3,), float(rank), device=device)
print(f"rank {rank} before: {t.tolist()}")
dist.all_reduce(t)  # default op: SUM
print(f"rank {rank} after:  {t.tolist()}")

# %%
results = ranks.run(lambda: (rank, t.tolist()))  # names resolve on the engines
print(results)
expected = float(sum(range(WORLD_SIZE)))
assert all(values == [expected] * 3 for _, values in results), results
assert [r for r, _ in results] == list(range(WORLD_SIZE))

# %% [markdown]
# A failure on any rank fails the cell and shows that rank's traceback, so a bug on rank 3 cannot pass
# silently. We check this on purpose: only rank 2 raises, and the notebook sees it.

# %%
from refimpl.notebook import RankError

try:
    ranks.run(lambda: 1 / (rank - 2))  # ZeroDivisionError on rank 2 only
except RankError as err:
    print("caught:", str(err).splitlines()[0])
    assert list(err.failures) == [2]
else:
    raise AssertionError("a failing rank must fail the call")

# %%
ranks.stop()

# %% [markdown]
# Scripts run under `torchrun`, which sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `MASTER_ADDR/PORT` for
# each process; `refimpl.distributed.init_distributed` reads them. From a notebook, run it through
# `run_command`, which raises when the command fails. Here, four steps of the course's trainer on two
# CPU ranks:

# %%
import sys
import tempfile

out = tempfile.mkdtemp(prefix="ch00-")
log = run_command(
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
     "-m", "refimpl.train", "--steps", "4", "--num-layers", "1", "--hidden-size", "32", "--num-heads", "2",
     "--seq-len", "32", "--batch-size", "4", "--log-every", "1", "--out", out],
    timeout_s=240,
)
assert "world size 2" in log

# %% [markdown]
# ## 2. Checking a claim with arithmetic
#
# Before running anything at scale, the planner (`refimpl.planner`) tells what a run *can* deliver.
# The figure of merit is **MFU**, model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B):
#
# $$\text{MFU} = \frac{\text{tokens/s} \times \text{FLOPs per token}}{\text{devices} \times \text{peak FLOP/s}},
# \qquad \text{FLOPs per token} = 6N + 12\,L\,H\,Q\,T.$$
#
# The peak is the **dense** figure of the data sheet: 989 TFLOP/s in BF16 for an H100 SXM, not the
# 1979 "with sparsity", which only 2:4-sparse matrices reach.
#
# A claim of the kind that circulates: *"our run sustained 3.2 PFLOP/s on 2048 H100 GPUs, at 82% GPU
# utilisation."* Check it.

# %%
claimed_flops = 3.2e15  # FLOP/s, whole cluster
gpus = 2048
peak = PEAK_FLOPS["H100"]["bf16"]  # 989e12, dense

per_gpu = claimed_flops / gpus
mfu = model_flops_utilization(tokens_per_s=claimed_flops, flops_per_tok=1.0, num_devices=gpus,
                              peak_flops_per_device=peak)
print(f"per GPU: {per_gpu / 1e12:.3f} TFLOP/s of a {peak / 1e12:.0f} TFLOP/s peak -> MFU {100 * mfu:.3f}%")
assert math.isclose(per_gpu, 1.5625e12)
assert math.isclose(100 * mfu, 0.158, abs_tol=0.001)

# %% [markdown]
# 1.56 TFLOP/s per GPU is an MFU of about **0.16%**. Well-run dense training reaches 35-55% MFU on
# H100s; 0.16% is 200-300 times less. Then how can the same run report "82% GPU utilisation"?
#
# Because `nvidia-smi`'s *utilisation* is not a FLOPs figure. It is the fraction of time in the sampling
# window during which **at least one kernel** was running on the GPU, whatever that kernel did: a
# kernel that keeps one of 132 SMs busy, or waits on a slow all-reduce, counts as 100% utilised. A GPU
# can report 82% utilisation while doing 0.16% of its peak arithmetic. The two numbers are both possible,
# and together they say the run is very inefficient, not that it is fast.
#
# The other detail to check: an HGX H100 node holds **8** GPUs (NVLink within the node, InfiniBand
# between nodes). 2048 GPUs are 256 nodes; a write-up that speaks of "16-GPU H100 nodes" is describing a
# machine that does not exist in that form.

# %%
GPUS_PER_HGX_H100_NODE = 8
nodes = gpus // GPUS_PER_HGX_H100_NODE
print(f"{gpus} GPUs = {nodes} HGX nodes of {GPUS_PER_HGX_H100_NODE}")
assert nodes == 256

# %% [markdown]
# What would a plausible claim look like? The figure shows the cluster throughput as a function of MFU,
# with the claim marked: a realistic 40% MFU on 2048 H100s is about 810 PFLOP/s.

# %%
import matplotlib.pyplot as plt

mfus = [x / 1000 for x in range(1, 1000)]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot([100 * m for m in mfus], [m * gpus * peak / 1e15 for m in mfus], label="2048 x H100, dense BF16")
ax.scatter([100 * mfu], [claimed_flops / 1e15], color="red", zorder=3, label="the claim: 3.2 PFLOP/s")
ax.axvspan(35, 55, color="green", alpha=0.15, label="typical well-tuned MFU")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("MFU (%)")
ax.set_ylabel("cluster throughput (PFLOP/s)")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8)
fig.tight_layout()
realistic = 0.40 * gpus * peak
print(f"40% MFU -> {realistic / 1e15:.0f} PFLOP/s")
assert 800e15 < realistic < 820e15

# %% [markdown]
# ## What to take away
#
# * A rank is a process; collectives are how ranks agree. Every later chapter is a choice of what to
#   split and which collective restores the single-device result.
# * A throughput claim is checked with three numbers: FLOPs per second per device, the *dense* peak,
#   and the ratio of the two (MFU). `nvidia-smi` utilisation is a time fraction, not a FLOPs fraction.
# * `refimpl.planner` does this arithmetic for you; chapter 01 checks its formulas against a measurement.
#
# **Exercise.** A blog post claims 1.2 M tokens/s for a 7B-parameter model (L = 32, H = 32, Q = 128,
# T = 4096) on 512 H100s. Compute the MFU with `refimpl.planner.model_flops_utilization` and the
# `6N + 12LHQT` formula. Is it plausible? (Answer: about 11%; low but possible.)

# %%
n, L, H, Q, T = 7e9, 32, 32, 128, 4096
flops_per_token = 6 * n + 12 * L * H * Q * T
answer = model_flops_utilization(1.2e6, flops_per_token, 512, peak)
print(f"MFU = {100 * answer:.1f}%")
assert 0.10 < answer < 0.12
print("refimpl", refimpl.__name__, "ready")
