#!/usr/bin/env bash
# Performance round 3 (issue 20) in one go on one GPU, one process family, one machine:
#
#   1. bench/gpu/train_throughput.py --all over fallback, stock_best, product_default (what `kernelguard train`
#      runs with no performance flags) and product_noac+compile: 4 warm-up + 12 timed steps each, step times
#      through bench/lib/step_stats.py (median/min/max, > 3x median = outlier, excluded), and the step
#      diagnosis (kernelguard.diagnosis.verdict) on each variant's own step: it must call the fallback a
#      slow path and the product healthy.
#   2. `kernelguard train` itself on the 1.16 B proxy for 15 steps (detector at steps 5, 10, 15; one
#      Chrome/Perfetto trace), when the time left allows: the detector's figures as a user sees them.
#
# JSON and logs go to $OUT (default /tmp/kg-out): variants_throughput.json, variants_train/metrics.jsonl,
# variants_summary.json, run.log.
#
#   bench/gpu/variants_and_train_profile.sh            # on the GPU machine, from the repository root, wheels in .whl/
#   PYTHONPATH=$PWD/tests/fake_providers bench/gpu/variants_and_train_profile.sh --tiny   # CPU logic check, ~1-2 minutes
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
BUDGET=${BUDGET_S:-560}  # whole script; the kernelguard train part runs only if it still fits
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(left) s left)"; }
PY=${PYTHON:-python3}

if [ $TINY = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  BENCH=(--tiny --device cpu --steps 10 --warmup 2 --profile-steps 1 --no-memory-estimate)
  CHILD_TIMEOUT=120; TRAIN_ARGS=(--param-dtype fp32 --max-length 256 --allow attention); FIXTURE=(--examples 200 --hidden 64 --layers 2)
  TRAIN_STEPS=6; PROFILE_EVERY=2; TRAIN_NEED=40
else
  step "install carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}; mkdir -p "$TRITON_CACHE_DIR"
  BENCH=(--steps 12 --warmup 4 --no-memory-estimate)
  # stock_best's cold Triton compile + autotune of its own call shapes took more than 170 s on the H200
  # (bench/RESULTS.md 1.5).
  CHILD_TIMEOUT=${CHILD_TIMEOUT:-240}; TRAIN_ARGS=(--max-length 8192 --allow fla-640-refusal); FIXTURE=(--examples 400)
  TRAIN_STEPS=15; PROFILE_EVERY=5; TRAIN_NEED=120
fi
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"

step "throughput + detector: fallback, stock_best, product_default, product_noac+compile"
timeout $(( $(left) > 60 ? $(left) - 30 : 30 )) "$PY" bench/gpu/train_throughput.py --all --child-timeout $CHILD_TIMEOUT \
  --variants fallback,stock_best,product_default,product_noac+compile "${BENCH[@]}" --out "$OUT/variants_throughput.json"
echo "throughput: rc=$?"

TRAIN_RC=skipped
if [ "$(left)" -gt "$TRAIN_NEED" ]; then
  step "kernelguard train, $TRAIN_STEPS steps, detector every $PROFILE_EVERY steps"
  FIX=/tmp/kg-perf3-fixture; rm -rf "$FIX" "$OUT/variants_train"
  "$PY" bench/lib/make_train_fixture.py "$FIX" "${FIXTURE[@]}"
  timeout $(( $(left) - 10 )) "$PY" -m kernelguard.train --model "$FIX/model/config.json" --tokenizer "$FIX/tokenizer" \
    --data "$FIX/chat.jsonl" --output-dir "$OUT/variants_train" --max-steps $TRAIN_STEPS --no-progress --no-plot \
    --no-export --profile-step $PROFILE_EVERY --profile-every $PROFILE_EVERY --profile-trace "$OUT/variants_trace" \
    "${TRAIN_ARGS[@]}" 2> >(tee "$OUT/variants_train.stderr" >&2)
  TRAIN_RC=$?
  echo "kernelguard train: rc=$TRAIN_RC"
else
  echo "kernelguard train skipped: $(left) s left, $TRAIN_NEED s needed"
fi

step "summary"
"$PY" - "$OUT" "$TRAIN_RC" <<'PY'
import json, sys
from pathlib import Path

out, train_rc = Path(sys.argv[1]), sys.argv[2]
summary = {"train_rc": train_rc}
bench = out / "variants_throughput.json"
if bench.exists():
    data = json.loads(bench.read_text())
    for key in ("tokens_per_s", "speedup_vs_stock_best", "mfu_vs_measured_matmul", "step_stats", "detector", "errors"):
        summary[key] = data.get(key)
    det = data.get("detector", {})
    summary["detector_verdict_ok"] = (
        det.get("fallback", {}).get("verdict") == "slow_path" and det.get("product_default", {}).get("verdict") == "healthy"
    )
metrics = out / "variants_train" / "metrics.jsonl"
if metrics.exists():
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    keys = ("step", "step_time_s", "tokens_per_s", "mfu", "gpu_busy_pct", "kernels_per_step", "cpu_s_per_step",
            "verdict", "verdict_line", "reference_pct", "gpu_time_by_class_pct", "launch_heavy_ops", "profile_overhead_s")
    summary["train_profiled_steps"] = [{k: r.get(k) for k in keys} for r in recs if "cpu_s_per_step" in r]
    times = [r["step_time_s"] for r in recs if "cpu_s_per_step" not in r and "step_time_s" in r][2:]
    if times:
        sys.path.insert(0, "bench/lib")
        from step_stats import steady_stats
        summary["train_unprofiled_step_stats"] = steady_stats(times, warmup=0, min_steady=8).to_dict()
err = out / "variants_train.stderr"
if err.exists():
    summary["train_detector_lines"] = [l for l in err.read_text().splitlines() if "profile" in l or "slow path" in l or "small-kernel" in l or "GPU idle" in l]
(out / "variants_summary.json").write_text(json.dumps(summary, indent=2, default=str))
print(json.dumps({k: summary.get(k) for k in ("tokens_per_s", "speedup_vs_stock_best", "detector", "detector_verdict_ok", "train_detector_lines", "errors")}, indent=1, default=str))
PY
step "done"
