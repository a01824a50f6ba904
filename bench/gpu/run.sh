#!/usr/bin/env bash
# The one prepared GPU check: the trainer on every visible GPU, a GPT-2-small-sized model (12 layers,
# width 768, 12 heads, 1024 tokens), data parallel, once in bf16 and once in fp8 (--precision fp8: bf16
# autocast with the linears' GEMMs in fp8 on torch._scaled_mm, chapter 10); prints per precision the median
# tokens/s and MFU of the last steps from metrics.jsonl (MFU against the GPU's dense bf16 peak,
# refimpl.measure.peaks, for both rows: the same yardstick), and fp8's tokens/s over bf16's. Nothing in the
# test suite depends on it; record what it prints in bench/RESULTS.md with the GPU and the date.
#
#   bash bench/gpu/run.sh [extra trainer flags, e.g. --tp 2]
#   PRECISIONS="bf16" bash bench/gpu/run.sh      # one row only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PRECISIONS=${PRECISIONS:-"bf16 fp8"}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "error: no CUDA device visible: bench/gpu/run.sh measures GPUs" >&2
  exit 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for precision in $PRECISIONS; do
  "$PY" -m torch.distributed.run --standalone --nproc-per-node="$gpus" -m refimpl.train \
    --precision "$precision" --num-layers 12 --hidden-size 768 --num-heads 12 --seq-len 1024 \
    --batch-size $((16 * gpus)) --steps 40 --warmup-steps 5 --log-every 10 --checkpoint-every 0 \
    --out "$out/$precision" "$@"
done
"$PY" - "$out" "$gpus" $PRECISIONS <<'PYEOF'
import json, statistics, sys
from pathlib import Path
root, gpus, precisions = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
tps = {}
for precision in precisions:
    records = [json.loads(line) for line in open(root / precision / "metrics.jsonl")][-20:]  # warm-up out
    tps[precision] = statistics.median(r["tokens_per_s"] for r in records)
    mfu = [r["mfu"] for r in records if r["mfu"] is not None]
    print(f"{precision}: {gpus} GPU(s): median over the last {len(records)} steps: {tps[precision]:,.0f} "
          "tokens/s, " + (f"MFU {statistics.median(mfu):.1%} of the bf16 peak" if mfu
                          else "MFU n/a (no peak known for this GPU)"))
if "bf16" in tps and "fp8" in tps:
    print(f"fp8 / bf16 tokens/s: {tps['fp8'] / tps['bf16']:.2f}")
PYEOF
