#!/usr/bin/env bash
# H200 run 6: `kernelguard check --run` wall time in fresh processes: the first fills fla's on-disk Triton
# autotune cache (partly filled by run 5 on the same machine), the second is the warm figure.
set -u
exec > >(tee -a "$OUT/check_warm.log") 2>&1
source bench/gpu_common.sh
export TRITON_CACHE_DIR=$PWD/.cache/triton
mkdir -p "$TRITON_CACHE_DIR"; du -sh "$TRITON_CACHE_DIR"
for i in 1 2; do
  step "check --run, process $i"
  s=$(date +%s.%N)
  timeout 330 python3 -m kernelguard check --model bench/configs/qwen3_5_k128.json --mode training \
    --allow fla-640-refusal --run --json > "$OUT/check_run_$i.json"
  rc=$?
  e=$(date +%s.%N)
  echo "process $i: rc=$rc wall $(python3 -c "print(round($e-$s,1))") s"
  python3 - "$OUT/check_run_$i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
n = d.get("numerics") or {}
cases = n.get("cases", [])
print("numerics ok:", n.get("ok"), "cases:", len(cases), "seconds:", n.get("seconds"),
      "worst rel:", max((c.get("rel_error", 0) for c in cases), default=None))
PY
done
echo done $(date +%T)
