#!/usr/bin/env bash
# Why is a cold `kernelguard check --run` through the console script slow although the in-process bench with the
# same pins is fast? One call on the GPU machine, each run in a fresh process with its own empty Triton cache and
# TRITON_PRINT_AUTOTUNING=1 (Triton prints one line per autotune search: a pinned key prints none):
#   1. the console script of a pip-installed kernelguard (what a user types), cold, then warm;
#   2. the in-process bench (bench/gpu/check_timing.py), cold.
# Output: $OUT/diagnose.log, $OUT/*.json. Wheels: fla-core + flash-linear-attention + causal-conv1d in .whl/.
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/diagnose.log") 2>&1
step() { echo; echo "================ $* ================ $(date +%T)"; }
secs() { python3 -c "print(round($(date +%s.%N)-$1,1))"; }
step "install the wheels and kernelguard itself (as a user would)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
# .whl/ also holds kernelguard's own wheel (built on the dev machine: `pip wheel --no-deps -w .whl .`), so the
# console script below is exactly what `pip install kernelguard` gives a user.
ls /tmp/site/bin/kernelguard /tmp/site/kernelguard/fla_autotune_pins.json || echo "no kernelguard wheel in .whl/"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TRITON_PRINT_AUTOTUNING=1
ARGS="--model qwen3_5 --mode training --allow fla-640-refusal --run --json"
s=$(date +%s.%N); PYTHONPATH=/tmp/site python3 -c "import fla" ; echo "import fla: $(secs "$s") s"
s=$(date +%s.%N); PYTHONPATH=/tmp/site python3 -c "import torch; torch.zeros(1, device='cuda')"; echo "import torch + CUDA init: $(secs "$s") s"
run() {  # NAME CACHE CMD...
  local name=$1 cache=$2; shift 2
  step "$name (TRITON_CACHE_DIR=$cache)"
  local s; s=$(date +%s.%N)
  TRITON_CACHE_DIR=$cache timeout "${RUN_TIMEOUT:-280}" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name: rc=$? wall $(secs "$s") s; autotune searches printed: $(grep -c 'Triton autotuning for function' "$OUT/$name.err")"
  grep 'Triton autotuning for function' "$OUT/$name.err" | sed -E 's/ finished after/ :/; s/; best config.*//' | sort | uniq -c | head -30
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except ValueError:
    print("no JSON"); raise SystemExit
if "numerics_s" in data:  # bench/gpu/check_timing.py's summary line
    num = {"seconds": data["numerics_s"], "ok": data["numerics_ok"], "cases": [None] * data["cases"], "notes": data["notes"]}
else:
    num = data.get("check", data).get("numerics") or {}
print("numerics_s", num.get("seconds"), "ok", num.get("ok"), "cases", len(num.get("cases", [])))
for note in num.get("notes", []):
    print(" note:", note[:400])
PY
}
rm -rf /tmp/tc-console /tmp/tc-bench
if [ -x /tmp/site/bin/kernelguard ]; then
  run console_cold /tmp/tc-console env PYTHONPATH=/tmp/site /tmp/site/bin/kernelguard check $ARGS
  run console_warm /tmp/tc-console env PYTHONPATH=/tmp/site /tmp/site/bin/kernelguard check $ARGS
else
  run module_cold /tmp/tc-console env PYTHONPATH=/tmp/site:$PWD python3 -m kernelguard check $ARGS
fi
run bench_cold /tmp/tc-bench env PYTHONPATH=/tmp/site:$PWD python3 bench/gpu/check_timing.py --out "$OUT/bench_cold_full.json" -- --model qwen3_5 --mode training --allow fla-640-refusal
step "done"
