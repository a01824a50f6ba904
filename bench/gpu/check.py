"""The prepared one-GPU check: does the course run on CUDA + NCCL as it runs on CPU?

    python3 bench/gpu/check.py                 # one GPU: budgeted to 6 minutes on one H100
    python3 bench/gpu/check.py --smoke         # the same code on the CPU at tiny sizes, in seconds
    bash bench/gpu/run.sh [flags]              # the same, with .venv's Python if there is one

It starts on a bare image: ``python3`` with whatever CUDA build of torch it has, nothing installed, refimpl
imported from this checkout (bench/gpu/environment.py says what refimpl needs and what stands in for the
rest). The parts, in this order, each under a time cap inside the whole budget (``--budget-s``):

1. the environment: GPU, compute capability, SM clocks, driver, torch, CUDA, cuDNN and NCCL versions;
2. a default process group at world size 1: NCCL on the GPU (gloo in ``--smoke``), checked, and kept for
   the trainer (bench/gpu/trainer_rows.py);
3. fp8 GEMMs on ``torch._scaled_mm`` at the trainer's shapes, against float64 (bench/gpu/kernels.py);
4. the async-wait timing check: a matmul chain by the CPU clock and by CUDA events;
5. the trainer in bf16 and fp8 at GPT-2 small's width and at a width where fp8 pays: tokens/s, MFU
   against the dense bf16 peak, peak allocated and reserved bytes against the planner's;
6. grouped GEMMs on ``torch._grouped_mm`` against a loop over the groups; last of the in-process parts,
   since a device-side assert (an empty group, a misaligned offset) ends the CUDA context;
7. the ``gpu``-marked tests, when pytest is there (bench/gpu/gpu_tests.py), in a child process.

Everything goes to ``$OUT`` (``--out``; default bench/out/gpu): ``gpu_check.json`` and ``gpu_check.md``,
rewritten after each part (bench/gpu/report.py). Exit status 0 when every check passed, 1 when one failed
(a part that did not finish in its time is a failure), 2 for bad flags or no GPU without ``--smoke``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _import_from_checkout() -> None:
    """refimpl and bench.gpu from this checkout, nothing from bench/gpu/ itself (run as a script, Python
    puts the script's folder first on ``sys.path``, where ``report`` or ``kernels`` would shadow others)."""
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        sys.path[0] = str(ROOT)
    elif str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu/check.py", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="the same code path on the CPU at tiny sizes (gloo; seconds): for the test suite")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else bench/out/gpu)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all the parts together (default: 330 on a GPU, 900 with --smoke)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse first (a bad flag costs no torch import), then ``bench.gpu.runner.run_check``."""
    args = build_parser().parse_args(argv)  # bad flags: usage and exit status 2
    _import_from_checkout()
    from bench.gpu.runner import run_check

    return run_check(args, root=ROOT)


if __name__ == "__main__":
    sys.exit(main())
