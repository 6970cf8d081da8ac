#!/usr/bin/env bash
# `kernelguard check --run` for a Kimi-delta-attention model (issue 53): fla's chunk_kda and causal-conv1d at
# Kimi-Linear's geometry against transformers' torch reference (padded batches: --no-packed, since kimi_linear's
# layers cannot be packed; the kernel cases still include a packed varlen row), run as `python -m kernelguard`, cold and
# then warm with --json; then the KDA GPU tests (real kernels and the per-head-decay control).
#
#   bash bench/gpu/kda_check_run.sh      # on the GPU machine, repository root, wheels in .whl/ (carried)
#
# Everything lands in $OUT/00-kda_check_run.tgz (one file that sorts first: the runner returns only a few).
# Cold, fla autotunes chunk_kda at 32 heads x 128 with no pins: over 200 s on a bare H100 (RESULTS 5.10).
set -u
OUT=${OUT:-/tmp/kg-out}; R="$OUT/kda_check_run"; mkdir -p "$R"
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/00-kda_check_run.tgz" -C "$OUT" kda_check_run; }
trap pack EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  > "$R/install.log" 2>&1 || echo "install rc=$?" >> "$R/install.log"
export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.csv" 2>&1
"$PY" - > "$R/versions.json" 2>&1 <<'PYEOF'
import json, platform, torch, triton, transformers, fla
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": transformers.__version__, "fla": fla.__version__}))
PYEOF
run() {  # NAME LIMIT_S CMD...: its output, rc and wall seconds
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s%N)
  timeout "$limit" "$@" > "$R/$name.out" 2> "$R/$name.err"; local rc=$?
  echo "{\"part\": \"$name\", \"rc\": $rc, \"wall_ms\": $(( ($(date +%s%N) - t0) / 1000000 ))}" >> "$R/parts.jsonl"
  pack  # after every part: a call cut short still brings back what finished
}
run check_run_cold 330 "$PY" -m kernelguard check --run --model kimi_linear --no-packed --allow fla-640-refusal
run check_run_warm_json 90 "$PY" -m kernelguard check --run --model kimi_linear --no-packed --allow fla-640-refusal --json
run kda_gpu_tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/stack/test_numerics_kda.py -rA
cat "$R/parts.jsonl"
