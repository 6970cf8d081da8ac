#!/usr/bin/env bash
# Every GPU claim of kernelguard, checked in one call: green in < 480 s on a bare H200 (BUDGET_S=540 caps it).
#
# Three phases. Timing figures are taken only with the GPU to themselves; everything else shares it.
#   1. alone:  install the carried wheels; `kernelguard check --run` cold (empty Triton cache), through the
#              console script: its wall time is the figure quoted.
#   2. shared: at once, each its own process, log and time limit: `check --run` warm (verdict, numerics time,
#              no autotune search; its wall is marked as taken on a shared GPU), the fallback variant of the
#              step diagnosis (its verdict is the claim, not its speed), the `pytest -m gpu` files in
#              GPU_GROUPS (several pytest processes, each with its own junit XML and progress log; every test
#              bounded by pytest-timeout), and EXTRA_SCRIPTS (default bench/gpu/train_diagnosis.sh: a healthy
#              `kernelguard train` run with eval and checkpoints raises no alarm).
#   3. alone:  the timed variants one after another (bench/gpu/train_throughput.py, one fresh process each, a
#              short timed run and one profiled window): product_default and stock_best (their ratio is
#              quoted). Their kernel records land in profiles/ (the CPU tests' fixtures). The default against
#              earlier defaults is step_speed.sh's question, not the acceptance's.
# Phase 2 runs before phase 3 so the timed variants find the Triton cache warm; phase 2 ends (every process
# waited for, the GPU's compute processes listed) before phase 3 starts.
#
# One JSON summary: $OUT/acceptance.json (the line to quote: $OUT/acceptance.txt, with the whole wall time),
# every part and log in $OUT/acceptance_parts.tgz (parts.jsonl: each part's start, end, rc and limit; extra
# scripts write under acceptance_parts/extra_NAME/). Green only when every part ran whole: no test failed or
# cut, no part skipped or stopped for time, every variant's verdict present and right, wall <= 480 s.
#
#   bash bench/gpu/acceptance.sh            # on the GPU machine, repository root, wheels in .whl/
#   bash bench/gpu/acceptance.sh --tiny     # the same plumbing on CPU with tests/fake_providers: `check`
#                                           # without --run, the GPU test files skip (they must collect)
#
# Wheels in .whl/ (carried): fla-core + flash-linear-attention 0.6.0, causal_conv1d 1.7.0 (built for the
# machine's torch), pytest-timeout, and kernelguard's own wheel for the console script
# (`pip wheel --no-deps -w .whl .`). The checkout's code comes first on PYTHONPATH, so the console script runs
# this tree's kernelguard.
#
# Knobs for a call that repeats only part of it (reported as PARTIAL, never as green):
#   SKIP_CHECK=1; VARIANTS="fallback stock_best" (empty: none); GPU_TESTS="tests/test_x.py ..." (one group of
#   just those files; "none": no tests); EXTRA_SCRIPTS="..." (empty: none).
# Not partial: GPU_GROUPS (how the GPU test files are split over concurrent pytest processes).
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/acceptance.log") 2>&1
BUDGET=${BUDGET_S:-$([ $TINY = 1 ] && echo 1500 || echo 540)}
TARGET_S=${TARGET_S:-$([ $TINY = 1 ] && echo "$BUDGET" || echo 480)}  # the wall time a green run stays under
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
now() { echo $(( $(date +%s) - START )); }
step() { echo; echo "================ $* ================ $(date +%T) ($(now) s in, $(left) s left)"; }
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
RESULTS="$OUT/acceptance_parts"; rm -rf "$RESULTS"; mkdir -p "$RESULTS"
ALL_VARIANTS="product_default fallback stock_best"
VARIANTS=${VARIANTS-$ALL_VARIANTS}  # empty: none
SHARED_VARIANTS="fallback"  # verdict only: runs in phase 2, on the shared GPU
# GPU test files over concurrent pytest processes, NAME=file,file,...; REST: every other file under tests/
# with a `pytest.mark.gpu` (a new GPU test file joins that group without an edit here). Balanced by what each
# took on a bare H200 (RESULTS 2026-12-03): the train test ~85 s (three `kernelguard train` processes), the guard
# tests ~65-115 s (four fresh interpreters, cold fla autotune), boundaries ~20-70 s + numerics ~12-35 s,
# the trained exactness check (183 s on a bare H200 at its unpinned shapes: still over its 150 s bound, see the report) + the rest.
GPU_GROUPS=${GPU_GROUPS:-"train=tests/train/test_train_gpu.py guard=tests/runtime/test_guard_gpu.py kernels=tests/runtime/test_boundaries_gpu.py,tests/stack/test_numerics.py,tests/train/test_loss_gpu.py exact=tests/runtime/test_packing_exactness.py,REST"}
# GPU test files measured by a script of their own, not here: the KDA numerics (bench/gpu/kda_check_run.sh) searches
# fla's chunk_kda autotune cold at Kimi-Linear's shapes (~80 s alone on an H100, 171 s on the shared GPU, where it
# pushed itself and the qwen3_5 numerics test past their 150 s bounds: RESULTS 2026-12-07).
OWN_SCRIPT_FILES=${OWN_SCRIPT_FILES-"tests/stack/test_numerics_kda.py"}
TIMED_EST=${TIMED_EST_S:-80}  # seconds kept per timed variant of phase 3 (measured 57-72 s each, bare H200)

if [ $TINY = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  export PYTHONPATH=$PWD:$PWD/tests/fake_providers:${PYTHONPATH:-}
  KG=("$PY" -m kernelguard)
  CHECK_ARGS=(--model qwen3_5 --mode training --allow attention)  # no --run: it needs CUDA (exit 2 on a CPU)
  BENCH=(--tiny --device cpu --steps 4 --warmup 1 --profile-steps 1 --no-memory-estimate)
  CHILD_TIMEOUT=${CHILD_TIMEOUT:-300}; PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-300}; TEST_THREADS=1
else
  step "install carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
  KG=(/tmp/site/bin/kernelguard)
  [ -x "${KG[0]}" ] || KG=("$PY" -m kernelguard)
  CHECK_ARGS=(--model qwen3_5 --mode training --allow fla-640-refusal --run)
  BENCH=(--steps 8 --warmup 3 --no-memory-estimate)
  CHILD_TIMEOUT=${CHILD_TIMEOUT:-150}; PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-150}; TEST_THREADS=4
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"
export TRITON_CACHE_DIR=/tmp/kg-triton-check  # one cache: check compiles, everything after reuses it

# ---- each part appends one line to parts.jsonl: the summary's timeline and its "ran whole" check ----
record() {  # NAME KIND SHARED(true|false) RC T0 LIMIT
  printf '{"part": "%s", "kind": "%s", "shared_gpu": %s, "rc": %s, "t0_s": %s, "t1_s": %s, "limit_s": %s}\n' \
    "$1" "$2" "$3" "$4" "$5" "$(now)" "$6" >> "$RESULTS/parts.jsonl"
  echo "  $1: rc=$4 in $(( $(now) - $5 )) s (limit $6 s)"
}
skip_part() {  # NAME KIND REASON
  printf '{"part": "%s", "kind": "%s", "skipped": "%s"}\n' "$1" "$2" "$3" >> "$RESULTS/parts.jsonl"
  echo "  skipped $1: $3"
}

check_run() {  # NAME LIMIT SHARED
  local name=$1 t0; t0=$(now)
  local s; s=$(date +%s.%N)
  TRITON_PRINT_AUTOTUNING=1 timeout -k 10 "$2" "${KG[@]}" check "${CHECK_ARGS[@]}" --json \
    > "$RESULTS/check_$name.out" 2> "$RESULTS/check_$name.err"
  local rc=$?
  "$PY" - "$RESULTS/check_$name.out" "$rc" "$("$PY" -c "print(round($(date +%s.%N)-$s,1))")" \
    "$RESULTS/check_$name.json" "$(grep -c 'Triton autotuning for function' "$RESULTS/check_$name.err")" "$3" <<'PY'
import json, sys
text, rc, wall, dest, searches = open(sys.argv[1]).read(), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
try:
    data = json.loads(text)
except ValueError:
    data = {}
num = data.get("numerics") or {}
part = {"rc": rc, "wall_s": wall, "autotune_searches": searches, "numerics_ok": num.get("ok"),
        "numerics_s": num.get("seconds"), "cases": len(num.get("cases", [])), "shared_gpu": sys.argv[6] == "true"}
json.dump(part, open(dest, "w"))
print(f"  check {dest.rsplit('_', 1)[-1][:-5]}: {part}")
PY
  record "check_$name" check "$3" "$rc" "$t0" "$2"
}

variant_run() {  # VARIANT LIMIT SHARED
  local t0; t0=$(now)
  local t=$(( $2 - 15 ))
  timeout -k 10 "$2" "$PY" bench/gpu/train_throughput.py --all --child-timeout "$t" --variants "$1" "${BENCH[@]}" \
    --profile-dump "$RESULTS/profiles" --out "$RESULTS/bench_$1.json" > "$RESULTS/bench_$1.log" 2>&1
  local rc=$?
  record "variant_$1" variant "$3" "$rc" "$t0" "$2"
  tail -n 2 "$RESULTS/bench_$1.log" | cut -c1-300
}

TIMEOUT_OPT=(); "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT=(--timeout "$PYTEST_TIMEOUT")
tests_run() {  # GROUP LIMIT MARKER FILE...   (progress_log: a line per test as it ends, so a cut group reports)
  local group=$1 limit=$2 marker=$3 t0; t0=$(now); shift 3
  KG_TEST_PROGRESS="$RESULTS/gpu_tests.$group.progress.jsonl" PYTHONPATH="$PWD/bench/gpu:$PYTHONPATH" \
  OMP_NUM_THREADS=$TEST_THREADS timeout -k 10 "$limit" "$PY" -m pytest -q ${marker:+-m "$marker"} \
    -p no:cacheprovider "${TIMEOUT_OPT[@]}" -p progress_log --junitxml "$RESULTS/gpu_tests.$group.xml" -rA "$@" \
    > "$RESULTS/gpu_tests.$group.log" 2>&1
  local rc=$?
  [ $rc = 5 ] && rc=0  # pytest: no test selected (a group whose files hold no GPU test); the XML says 0 tests
  record "gpu_tests.$group" tests true "$rc" "$t0" "$limit"
  tail -n 1 "$RESULTS/gpu_tests.$group.log" | cut -c1-200
}

extra_run() {  # SCRIPT LIMIT
  local name; name=$(basename "$1" .sh); local t0; t0=$(now)
  mkdir -p "$RESULTS/extra_$name"
  OUT="$RESULTS/extra_$name" timeout -k 10 "$2" bash "$1" $([ $TINY = 1 ] && echo --tiny) \
    > "$RESULTS/extra_$name.log" 2>&1
  local rc=$?
  record "extra_$name" extra true "$rc" "$t0" "$2"
  tail -n 2 "$RESULTS/extra_$name.log" | cut -c1-300
}

# The GPU test groups: "NAME FILE..." lines.
gpu_files() { grep -l "pytest.mark.gpu" tests/*/test_*.py 2>/dev/null; }
test_groups() {
  if [ -n "${GPU_TESTS:-}" ]; then
    [ "$GPU_TESTS" = none ] || echo "selected $GPU_TESTS"
  else
    local named="" spec files
    for spec in $GPU_GROUPS; do named="$named ${spec#*=}"; done
    named=" $(echo "$named" | tr ',' ' ') $OWN_SCRIPT_FILES "
    for spec in $GPU_GROUPS; do
      files=""
      for f in $(echo "${spec#*=}" | tr ',' ' '); do
        if [ "$f" = REST ]; then
          for g in $(gpu_files); do case "$named" in *" $g "*) ;; *) files="$files $g" ;; esac; done
        elif [ -f "$f" ]; then files="$files $f"
        else echo "GPU_GROUPS: $f not found, left out" >&2
        fi
      done
      [ -n "$files" ] && echo "${spec%%=*}$files"
    done
  fi
  # --tiny: the GPU files skip without CUDA (they must import and collect cleanly); the summary's own test
  # is the plumbing that really runs in a group of its own.
  [ $TINY = 1 ] && [ -z "${GPU_TESTS:-}" ] && echo "plumbing tests/project/test_acceptance_summary.py"
}

# ================================================ phase 1: alone ==============================================
if [ -z "${SKIP_CHECK:-}" ]; then
  step "phase 1 (alone): kernelguard check --run, cold"
  rm -rf "$TRITON_CACHE_DIR"
  check_run cold 200 false
fi

# ================================================ phase 2: shared =============================================
TIMED=""; SHARED=""
for v in $VARIANTS; do case " $SHARED_VARIANTS " in *" $v "*) SHARED="$SHARED $v" ;; *) TIMED="$TIMED $v" ;; esac; done
n_timed=$(echo $TIMED | wc -w)
P2=$(( $(left) - n_timed * TIMED_EST - 25 ))  # phase 2's limit: what the timed variants and the summary leave
step "phase 2 (shared GPU, every part at once, limit $P2 s): check warm, diagnosis${SHARED:- (none)}, GPU tests, extras"
PIDS=()
if [ "$P2" -lt 60 ]; then
  echo "only $P2 s for phase 2: nothing started"
  [ -z "${SKIP_CHECK:-}" ] && skip_part check_warm check "$P2 s left for phase 2"
  for v in $SHARED; do skip_part "variant_$v" variant "$P2 s left for phase 2"; done
  test_groups | while read -r group _; do skip_part "gpu_tests.$group" tests "$P2 s left for phase 2"; done
  for script in ${EXTRA_SCRIPTS-bench/gpu/train_diagnosis.sh}; do skip_part "extra_$(basename "$script" .sh)" extra "$P2 s left"; done
else
  [ -z "${SKIP_CHECK:-}" ] && { check_run warm $(( P2 < 200 ? P2 : 200 )) true & PIDS+=($!); }
  for v in $SHARED; do variant_run "$v" $(( P2 < CHILD_TIMEOUT + 15 ? P2 : CHILD_TIMEOUT + 15 )) true & PIDS+=($!); done
  while read -r group files; do
    [ -z "$group" ] && continue
    marker=gpu; [ "$group" = plumbing ] && marker=""
    echo "  tests $group:$files"
    # shellcheck disable=SC2086
    tests_run "$group" "$P2" "$marker" $files & PIDS+=($!)
  done < <(test_groups)
  for script in ${EXTRA_SCRIPTS-bench/gpu/train_diagnosis.sh}; do extra_run "$script" "$P2" & PIDS+=($!); done
  wait "${PIDS[@]}"
fi
[ $TINY = 0 ] && { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null \
  | sed 's/^/  still on the GPU: /'; echo "  GPU compute processes listed above (none: the GPU is free)"; }

# ================================================ phase 3: alone, timed =======================================
step "phase 3 (alone, one after another): diagnosis${TIMED:- (none)}"
for v in $TIMED; do
  budget=$(( $(left) - 20 ))
  if [ "$budget" -lt 60 ]; then skip_part "variant_$v" variant "$(left) s left"; continue; fi
  variant_run "$v" $(( budget < CHILD_TIMEOUT + 15 ? budget : CHILD_TIMEOUT + 15 )) false
done

step "summary"
[ -n "${SKIP_CHECK:-}${GPU_TESTS:-}" ] || [ "$VARIANTS" != "$ALL_VARIANTS" ] \
  || [ "${EXTRA_SCRIPTS-bench/gpu/train_diagnosis.sh}" != bench/gpu/train_diagnosis.sh ] \
  && export ACCEPTANCE_PARTIAL="SKIP_CHECK=${SKIP_CHECK:-} VARIANTS=$VARIANTS GPU_TESTS=${GPU_TESTS:-all} EXTRA_SCRIPTS=${EXTRA_SCRIPTS-bench/gpu/train_diagnosis.sh}"
ACCEPTANCE_WALL_S=$(now) ACCEPTANCE_TARGET_S=$TARGET_S ACCEPTANCE_TINY=$TINY \
  "$PY" bench/gpu/acceptance_summary.py "$RESULTS" "$OUT/acceptance.json" | tee "$OUT/acceptance.txt"
# Few files come back from the machine: every part goes home in one archive.
tar czf "$OUT/acceptance_parts.tgz" -C "$OUT" acceptance_parts && rm -rf "$RESULTS"
