#!/usr/bin/env bash
# Performance round 6 (issue 48) on one GPU: the new default step beside the best stock recipe and the round-5
# default, one process each, in this order (the one under test first, so a cut-short call still has it):
#   product_default  `kernelguard train` with no performance flags: two 8,192-token blocks per step, activation
#                    checkpointing and blocks per forward chosen by the memory estimate on this card, compile on
#   stock_best       fla + causal-conv1d, DataCollatorWithFlattening with flash kwargs + seq_idx, SDPA, AC
#   product_round5   the default before round 6: one block per step, checkpointing auto, no compile
# Each JSON is written as soon as its variant ends (train_throughput --all rewrites the combined file).
# 20 timed steps (STEPS): stock best's steps spread 0.32-0.58 s between and within runs, the default's < 2%.
#
#   bash bench/gpu/step_speed.sh                                               # GPU; wheels in .whl/ (carried)
#   PYTHONPATH=$PWD/tests/fake_providers bash bench/gpu/step_speed.sh --tiny   # CPU logic check
# Wheels in .whl/: fla-core + flash-linear-attention 0.6.0, causal_conv1d 1.7.0 (../shared/device-wheels).
# Output under $OUT (default /tmp/kg-out): step_speed.json (combined, per variant), step_speed.log.
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/step_speed.log") 2>&1
PY=${PYTHON:-python3}
VARIANTS=${VARIANTS:-product_default,stock_best,product_round5}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
if [ "${1:-}" = "--tiny" ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH=$PWD:${PYTHONPATH:-}
  BENCH=(--tiny --device cpu --steps 10 --warmup 2 --profile-steps 1 --no-memory-estimate --no-detector)
  VARIANTS=${VARIANTS/stock_best,/}  # the stock collator needs fla's real varlen path
else
  t0=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  echo "wheels installed in $(( $(date +%s) - t0 )) s"
  export PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  BENCH=(--steps ${STEPS:-20} --warmup 3 --profile-steps 1 --no-memory-estimate --no-detector)
fi
"$PY" bench/gpu/train_throughput.py --all --variants "$VARIANTS" --out "$OUT/step_speed.json" \
  --child-timeout "${CHILD_TIMEOUT:-240}" "${BENCH[@]}"
"$PY" - "$OUT/step_speed.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["variants"].items():
    s = r.get("step_stats") or {}
    print(f"{name}: {r.get('tokens_per_s')} tok/s, median step {s.get('median_s')} s ({s.get('min_s')}-{s.get('max_s')}), "
          f"steady {s.get('steady_steps')}, outliers {s.get('outliers')}, MFU {r.get('mfu_vs_measured_matmul')}, "
          f"kernels/step {r.get('kernel_launches_per_step')}, peak {round((r.get('peak_memory_bytes') or 0) / 2**30, 1)} GiB, "
          f"layout: {(r.get('flags') or {}).get('step_layout')}")
print("speedup vs stock_best:", d.get("speedup_vs_stock_best"))
print("errors:", {k: v.get("returncode") for k, v in d.get("errors", {}).items()})
PY
