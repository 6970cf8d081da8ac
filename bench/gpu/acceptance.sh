#!/usr/bin/env bash
# Every GPU claim of kernelguard, checked in one call (< 9 minutes on one H200, from a bare machine):
#
#   1. `kernelguard check --run` through the console script, cold (empty Triton cache), then warm;
#   2. the step diagnosis (kernelguard.diagnosis.verdict) on the fallback, the product and the stock recipe:
#      bench/gpu/train_throughput.py, one process each, a short timed run (a product-vs-stock-best ratio) and
#      one profiled window each, whose kernel records land in profiles/ (the CPU tests' fixtures);
#   3. the whole `pytest -m gpu tests` suite, each test bounded (pytest-timeout), the Triton cache of 1 reused;
#   4. extra GPU checks, if time is left: EXTRA_SCRIPTS (default bench/gpu/train_diagnosis.sh: a healthy
#      `kernelguard train` run with eval and checkpoints must raise no alarm), each `bash SCRIPT`, OUT set to its
#      own folder; a script's JSON files go into the summary under "extras".
#
# One JSON summary: $OUT/acceptance.json (the line to quote: $OUT/acceptance.txt), every part and log in
# $OUT/acceptance_parts.tgz (extra scripts write under acceptance_parts/extra_NAME/). Run it at the start and the
# end of every session that touches GPU-facing code.
#
#   bash bench/gpu/acceptance.sh            # on the GPU machine, repository root, wheels in .whl/
#   bash bench/gpu/acceptance.sh --tiny     # the same plumbing on CPU with tests/fake_providers (~3 minutes)
#
# Wheels in .whl/ (carried): fla-core + flash-linear-attention 0.6.0, causal_conv1d 1.7.0 (built for the
# machine's torch), pytest-timeout, and kernelguard's own wheel for the console script
# (`pip wheel --no-deps -w .whl .`). The checkout's code comes first on PYTHONPATH, so the console script runs
# this tree's kernelguard.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/acceptance.log") 2>&1
BUDGET=${BUDGET_S:-540}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(left) s left)"; }
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
RESULTS="$OUT/acceptance_parts"; mkdir -p "$RESULTS"
# Knobs for a call that repeats only part of it (a partial run is reported as such, never as green):
# SKIP_CHECK=1, VARIANTS="fallback stock_best", GPU_TESTS="tests/test_x.py ...", EXTRA_SCRIPTS="...".
VARIANTS=${VARIANTS-product_default fallback stock_best product_noac+compile}  # empty: none

if [ $TINY = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  export PYTHONPATH=$PWD:$PWD/tests/fake_providers:${PYTHONPATH:-}
  KG=("$PY" -m kernelguard)
  CHECK_ARGS=(--model qwen3_5 --mode training --allow attention)
  BENCH=(--tiny --device cpu --steps 4 --warmup 1 --profile-steps 1 --no-memory-estimate)
  CHILD_TIMEOUT=150; PYTEST_TIMEOUT=120
  PYTEST_SELECT=(tests/test_step_diagnosis.py)
else
  step "install carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
  KG=(/tmp/site/bin/kernelguard)
  [ -x "${KG[0]}" ] || KG=("$PY" -m kernelguard)
  CHECK_ARGS=(--model qwen3_5 --mode training --allow fla-640-refusal)
  BENCH=(--steps 8 --warmup 3 --no-memory-estimate)
  CHILD_TIMEOUT=${CHILD_TIMEOUT:-150}; PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-150}
  PYTEST_SELECT=(tests)
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"

if [ -z "${SKIP_CHECK:-}" ]; then
for name in cold warm; do
  step "kernelguard check --run, $name"
  export TRITON_CACHE_DIR=/tmp/kg-triton-check
  [ $name = cold ] && rm -rf "$TRITON_CACHE_DIR"
  s=$(date +%s.%N)
  TRITON_PRINT_AUTOTUNING=1 timeout 200 "${KG[@]}" check "${CHECK_ARGS[@]}" --run --json > "$RESULTS/check_$name.out" 2> "$RESULTS/check_$name.err"
  rc=$?
  "$PY" - "$RESULTS/check_$name.out" "$rc" "$(python3 -c "print(round($(date +%s.%N)-$s,1))")" "$RESULTS/check_$name.json" \
    "$(grep -c 'Triton autotuning for function' "$RESULTS/check_$name.err")" <<'PY'
import json, sys
text, rc, wall, dest, searches = open(sys.argv[1]).read(), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
try:
    data = json.loads(text)
except ValueError:
    data = {}
num = data.get("numerics") or {}
part = {"rc": rc, "wall_s": wall, "autotune_searches": searches, "numerics_ok": num.get("ok"),
        "numerics_s": num.get("seconds"), "cases": len(num.get("cases", []))}
json.dump(part, open(dest, "w"))
print(part)
PY
done

fi
export TRITON_CACHE_DIR=/tmp/kg-triton-check  # the suite and the benches reuse what check compiled

step "step diagnosis: $VARIANTS"
for variant in $VARIANTS; do
  budget=$(( $(left) - 20 ))
  if [ "$budget" -lt 60 ]; then echo "skipped $variant: $(left) s left"; continue; fi
  t=$(( budget < CHILD_TIMEOUT ? budget : CHILD_TIMEOUT ))
  timeout $((t + 15)) "$PY" bench/gpu/train_throughput.py --all --child-timeout "$t" --variants "$variant" "${BENCH[@]}" \
    --profile-dump "$RESULTS/profiles" --out "$RESULTS/bench_$variant.json" > "$RESULTS/bench_$variant.log" 2>&1
  echo "$variant: rc=$?"; tail -n 3 "$RESULTS/bench_$variant.log" | cut -c1-300
done


step "pytest -m gpu (each test <= ${PYTEST_TIMEOUT} s)"
s=$(date +%s)
# pytest-timeout registers itself through its entry point once installed: only its option is passed.
TIMEOUT_OPT=(); "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT=(--timeout "$PYTEST_TIMEOUT")
RESERVE=${EXTRA_RESERVE_S:-0}  # seconds kept for the extra scripts
# progress_log: a line per test as it ends, so a run this timeout cuts (no XML then) still reports what it did.
KG_TEST_PROGRESS="$RESULTS/gpu_tests.progress.jsonl" PYTHONPATH="$PWD/bench/gpu:$PYTHONPATH" \
timeout $(( $(left) - RESERVE > 330 ? 300 : $(left) - RESERVE - 30 )) "$PY" -m pytest -q -m gpu -p no:cacheprovider "${TIMEOUT_OPT[@]}" \
  -p progress_log --junitxml "$RESULTS/gpu_tests.xml" -rA ${GPU_TESTS:-"${PYTEST_SELECT[@]}"} 2>&1 | tail -n 60 | tee "$RESULTS/gpu_tests.tail"
echo "gpu tests: rc=${PIPESTATUS[0]} wall $(( $(date +%s) - s )) s"


for script in ${EXTRA_SCRIPTS-bench/gpu/train_diagnosis.sh}; do
  if [ "$(left)" -lt 40 ]; then echo "skipped $script: $(left) s left"; continue; fi
  step "extra: $script"
  mkdir -p "$RESULTS/extra_$(basename "$script" .sh)"
  OUT="$RESULTS/extra_$(basename "$script" .sh)" timeout $(( $(left) - 20 )) bash "$script" $([ $TINY = 1 ] && echo --tiny) \
    > "$RESULTS/extra_$(basename "$script").log" 2>&1
  echo "$script: rc=$?"; tail -n 5 "$RESULTS/extra_$(basename "$script").log" | cut -c1-300
done

step "summary"
[ -n "${SKIP_CHECK:-}${GPU_TESTS:-}" ] || [ "$VARIANTS" != "product_default fallback stock_best product_noac+compile" ] \
  && export ACCEPTANCE_PARTIAL="SKIP_CHECK=${SKIP_CHECK:-} VARIANTS=$VARIANTS GPU_TESTS=${GPU_TESTS:-all}"
"$PY" bench/gpu/acceptance_summary.py "$RESULTS" "$OUT/acceptance.json" | tee "$OUT/acceptance.txt"
# Few files come back from the machine: every part goes home in one archive.
tar czf "$OUT/acceptance_parts.tgz" -C "$OUT" acceptance_parts && rm -rf "$RESULTS"
