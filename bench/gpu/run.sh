#!/usr/bin/env bash
# The prepared one-GPU check, bench/gpu/check.py (its docstring says what it checks and measures): this
# wrapper only picks the Python and the output folder. The course's .venv/bin/python when there is one,
# else the machine's python3 (a bare GPU image: whatever CUDA build of torch it has; refimpl is imported from
# this checkout). Results in $OUT (default bench/out/gpu): gpu_check.json and gpu_check.md.
#
#   bash bench/gpu/run.sh                  # one GPU, at most 6 minutes on an H100
#   bash bench/gpu/run.sh --smoke          # the same code on the CPU at tiny sizes
#   OUT=/tmp/gpu bash bench/gpu/run.sh     # elsewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export OUT="${OUT:-bench/out/gpu}"
exec "$PY" bench/gpu/check.py "$@"
