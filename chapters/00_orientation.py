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
# | 01 single device | nothing | nothing: the baseline every other chapter is checked against | `refimpl.models`, `refimpl.data`, `refimpl.planner` |
# | 02 collectives | - | all-reduce, reduce-scatter, all-gather, all-to-all, built from send/recv | `refimpl.comm` |
# | 03 data parallel | the batch | gradients (all-reduce), overlapped with backward | `refimpl.parallel.data_parallel` |
# | 04 ZeRO / FSDP | batch + optimizer state, gradients, parameters | reduce-scatter + all-gather | `refimpl.parallel.zero` |
# | 05 mixed precision | (bytes per number) | overflow flags | `refimpl.precision` |
# | 06 tensor parallel (*planned*) | each weight matrix | activations, inside every layer | not written yet |
# | 07 sequence / context parallel (*planned*) | the sequence | activations, keys and values | not written yet |
# | 08 pipeline parallel (*planned*) | the layers | activations between stages | not written yet |
# | 09 checkpoints and elastic restart | the training state on disk | - | `refimpl.checkpoint`, `refimpl.elastic` |
# | 10 3D parallelism (*planned*) | all of the above on a mesh | all of the above | `refimpl.train` today trains data-parallel and ZeRO only |
#
# Every chapter runs on a laptop CPU (several processes talking through **gloo**) and, unchanged, on a
# multi-GPU box (**NCCL**). Every chapter *proves* its claim with assertions: equality with a
# single-device run and with PyTorch's own implementation, and measured figures against formulas.
# Chapters 06, 07, 08 and 10 are planned: their chapters and modules do not exist yet. The first cell
# checks that every module the map names as built can be imported.
#
# This chapter does three things: it starts several ranks from this notebook, runs the first collective,
# and then uses the planner to check a published claim with nothing but arithmetic.

# %%
import importlib.util

import torch

from refimpl.launch import run_command, start_ranks
from refimpl.planner import PEAK_FLOPS, model_flops_utilization

print("torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())
built = ["refimpl.models", "refimpl.data", "refimpl.planner", "refimpl.comm", "refimpl.parallel.data_parallel",
         "refimpl.parallel.zero", "refimpl.precision", "refimpl.checkpoint", "refimpl.elastic",
         "refimpl.train"]  # the modules the map names as built
missing = [name for name in built if importlib.util.find_spec(name) is None]
assert not missing, f"the course map names modules that do not exist: {missing}"

# %% [markdown]
# ## 1. Ranks
#
# A distributed job is a set of processes, one per device, each with a **rank** in `0..world_size-1`.
# `torchrun` starts them for scripts; in a notebook, `refimpl.launch.start_ranks` starts one
# [ipyparallel](https://ipyparallel.readthedocs.io) engine per rank, gives each its rank and device, and
# initialises the process group (gloo on CPU, NCCL on GPU) with a timeout. A cell that starts with
# `%%px` then runs on **every** rank, and each engine keeps its variables between cells.
#
# Why not `mp.spawn` a function defined here? Spawned processes must import the function by name, and a
# notebook's functions have no importable name. Why not `!torchrun`? A failing `!` command does not fail
# the cell: the notebook would go on as if nothing happened. `refimpl.launch.run_command` raises instead.

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
from refimpl.launch import RankError

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
# A claim of the kind that circulates, quoted whole: *"We trained on 2048 H100 GPUs, 128 nodes of 16
# GPUs each, with DP128 x TP8 x PP2 (data, tensor and pipeline parallel degrees), and sustained
# 3.2 PFLOP/s at 82% GPU utilisation."* Check each statement with arithmetic, as it is stated.

# %%
claim = {"gpus": 2048, "nodes": 128, "gpus_per_node": 16, "dp": 128, "tp": 8, "pp": 2,
         "flops": 3.2e15, "utilisation": 0.82}
peak = PEAK_FLOPS["H100"]["bf16"]  # 989e12, dense; the claim does not say its dtype: bf16 is the usual one
peak_fp32 = PEAK_FLOPS["H100"]["fp32"]  # 67e12: the most generous reading, were the run in float32

gpus = claim["gpus"]
per_gpu = claim["flops"] / gpus
mfu = model_flops_utilization(tokens_per_s=claim["flops"], flops_per_tok=1.0, num_devices=gpus,
                              peak_flops_per_device=peak)
mfu_fp32 = model_flops_utilization(claim["flops"], 1.0, gpus, peak_fp32)
as_mfu = claim["utilisation"] * gpus * peak  # what the cluster would deliver if "82%" were an MFU
checks = [
    ("nodes x GPUs per node = GPUs", f"{claim['nodes']} x {claim['gpus_per_node']} = "
     f"{claim['nodes'] * claim['gpus_per_node']}", claim["nodes"] * claim["gpus_per_node"] == gpus),
    ("DP x TP x PP = GPUs", f"{claim['dp']} x {claim['tp']} x {claim['pp']} = "
     f"{claim['dp'] * claim['tp'] * claim['pp']}", claim["dp"] * claim["tp"] * claim["pp"] == gpus),
    ("a TP group fits in a node", f"{claim['gpus_per_node']} % {claim['tp']} = "
     f"{claim['gpus_per_node'] % claim['tp']}", claim["gpus_per_node"] % claim["tp"] == 0),
    ("3.2 PFLOP/s is an MFU of >= 10%", f"{per_gpu / 1e12:.4f} TFLOP/s per GPU = {100 * mfu:.3f}% of bf16 "
     f"({100 * mfu_fp32:.2f}% of fp32)", mfu >= 0.10),
    ("82% is an MFU (within a factor 2)",
     f"0.82 x {gpus} x {peak / 1e12:.0f} TFLOP/s = {as_mfu / 1e15:,.0f} PFLOP/s, "
     f"{as_mfu / claim['flops']:.0f} x the claimed 3.2", 0.5 < as_mfu / claim["flops"] < 2),
]
for statement, arithmetic, holds in checks:
    print(f"{'holds ' if holds else 'FAILS '} {statement:<34s} {arithmetic}")

# %% [markdown]
# The layout is consistent: 128 nodes of 16 are 2048 GPUs, DP128 x TP8 x PP2 are 2048 GPUs, and a TP
# group of 8, which communicates inside every layer, fits inside a node (NVLink), two groups per node.
# (NVIDIA's HGX H100 board carries 8 GPUs, so a "16-GPU node" is either two boards in one server or
# another meaning of "node": a question to ask the authors, not an arithmetic contradiction.)
#
# The throughput is not. 3.2 PFLOP/s over 2048 GPUs is 1.5625 TFLOP/s each: **0.158%** of the dense BF16
# peak, and still only 2.33% of the 67 TFLOP/s an H100 does in plain float32. Well-run dense training
# reaches 35-55% MFU on H100s, 220 to 350 times more. And if "82% utilisation" were an MFU, the cluster would
# deliver 1,661 PFLOP/s, 519 times the 3.2 claimed: the two numbers of the claim cannot both measure FLOPs.
#
# They can both be true only because `nvidia-smi`'s *utilisation* is not a FLOPs figure. It is the
# fraction of time in the sampling window during which **at least one kernel** was running on the GPU,
# whatever that kernel did: a kernel that keeps one of 132 SMs busy, or waits on a slow all-reduce,
# counts as 100% utilised. So the claim, read as stated, describes GPUs that were busy 82% of the time
# doing 0.16% of their peak arithmetic: a very inefficient run, not a fast one.
#
# What would a plausible claim look like? The figure shows the cluster throughput as a function of MFU,
# with the claim marked: a realistic 40% MFU on 2048 H100s is about 810 PFLOP/s.

# %%
import matplotlib.pyplot as plt

mfus = [x / 1000 for x in range(1, 1000)]
fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot([100 * m for m in mfus], [m * gpus * peak / 1e15 for m in mfus], label="2048 x H100, dense BF16")
ax.scatter([100 * mfu], [claim["flops"] / 1e15], color="red", zorder=3, label="the claim: 3.2 PFLOP/s")
ax.scatter([100 * claim["utilisation"]], [as_mfu / 1e15], color="orange", zorder=3,
           label="82% read as an MFU")
ax.axvspan(35, 55, color="green", alpha=0.15, label="typical well-tuned MFU")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("MFU (%)")
ax.set_ylabel("cluster throughput (PFLOP/s)")
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=8)
fig.tight_layout()
print(f"40% MFU -> {0.40 * gpus * peak / 1e15:.0f} PFLOP/s")

# %% [markdown]
# ## What to take away
#
# * A rank is a process; collectives are how ranks agree. Every later chapter is a choice of what to
#   split and which collective restores the single-device result.
# * A throughput claim is checked with three numbers: FLOPs per second per device, the *dense* peak,
#   and the ratio of the two (MFU). `nvidia-smi` utilisation is a time fraction, not a FLOPs fraction.
# * `refimpl.planner` does this arithmetic for you; chapter 01 checks its formulas against a measurement.
#
# ## Exercise
#
# A blog post claims 1.2 M tokens/s for a 6.6 B-parameter GPT,
# `ModelConfig(vocab_size=32000, num_layers=32, hidden_size=4096, num_attention_heads=32, max_seq_len=4096)`
# trained on sequences of 4096 tokens, on 512 H100s in bf16. Is it plausible? Implement `flops_per_token`
# and `mfu` in `exercises/01_single_device.py` (their docstrings are the contract), grade them with
#
# ```
# make grade CH=01
# ```
#
# and then call your `mfu` on the claim. Decide from the MFU whether the claim is plausible, and what
# MFU it would take to be suspicious.

# %% [markdown]
# ## Questions
#
# 1. Section 1 summed a value over four ranks. If each rank held the gradient of the mean loss over its
#    own quarter of the batch, what must follow a SUM all-reduce to give the gradient of the mean over the
#    whole batch, and when is dividing by the world size the wrong correction?
# 2. Only rank 2 raised in the failure demo, and nothing else was waiting for it. If rank 2 had raised
#    just before an `all_reduce`, what would ranks 0, 1 and 3 do, and what decides how long?
# 3. In the claim's layout DP128 x TP8 x PP2 with the tensor-parallel axis innermost (adjacent ranks),
#    then data, then pipeline outermost: which ranks are in rank 0's TP group, its DP group and its PP
#    group, and which of these groups must cross nodes of 16 GPUs?
# 4. Describe a workload on one GPU that `nvidia-smi` reports as 100% utilised while its MFU is below 1%.
#    Which two numbers would you log in a training run so that a claim like the one above cannot be
#    ambiguous?
# 5. The exercise's model at 40% MFU on the same 512 H100s: how many tokens per second is that, and how
#    long would 1 T tokens take?
