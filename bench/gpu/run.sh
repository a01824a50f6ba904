#!/usr/bin/env bash
# The one prepared GPU check: the trainer on every visible GPU in bf16, a GPT-2-small-sized model
# (12 layers, width 768, 12 heads, 1024 tokens), data parallel; prints the median tokens/s and MFU of the
# last steps from metrics.jsonl (MFU against the GPU's dense bf16 peak, refimpl.measure.peaks). Nothing in
# the test suite depends on it; record what it prints in bench/RESULTS.md with the GPU and the date.
#
#   bash bench/gpu/run.sh [extra trainer flags, e.g. --tp 2]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "error: no CUDA device visible: bench/gpu/run.sh measures GPUs" >&2
  exit 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m torch.distributed.run --standalone --nproc-per-node="$gpus" -m refimpl.train \
  --precision bf16 --num-layers 12 --hidden-size 768 --num-heads 12 --seq-len 1024 \
  --batch-size $((16 * gpus)) --steps 40 --warmup-steps 5 --log-every 10 --checkpoint-every 0 \
  --out "$out/run" "$@"
"$PY" - "$out/run/metrics.jsonl" "$gpus" <<'PYEOF'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])][-20:]  # the first steps warm up kernels
tps = statistics.median(r["tokens_per_s"] for r in records)
mfu = [r["mfu"] for r in records if r["mfu"] is not None]
print(f"{sys.argv[2]} GPU(s): median over the last {len(records)} steps: {tps:,.0f} tokens/s, "
      + (f"MFU {statistics.median(mfu):.1%}" if mfu else "MFU n/a (no peak known for this GPU)"))
PYEOF
