#!/usr/bin/env bash
# Record fla autotune pins for this machine's call layout, then time a cold and a warm `kernelguard check --run`
# through the installed console script (what a user types). One call on the GPU machine:
#   1. in-process record (bench/gpu/check_timing.py --record), shipped pins applied: only the shapes that no pin
#      covers are autotuned, and every choice this process made is merged into the pins file;
#   2. those pins installed into the kernelguard wheel's copy in /tmp/site and into this checkout;
#   3. the console script, cold (empty TRITON_CACHE_DIR), then warm (same cache), in fresh processes, with
#      TRITON_PRINT_AUTOTUNING=1 so every remaining autotune search is counted.
# Needs in .whl/: fla-core, flash-linear-attention, causal-conv1d and kernelguard's own wheel
# (`pip wheel --no-deps -w .whl .`). Output under $OUT: check_pins.log, fla_autotune_pins.json, *.json.
#   CHECK_ARGS="--model kimi_linear --mode training --no-packed --allow fla-640-refusal" bash bench/gpu/check_pins.sh
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/check_pins.log") 2>&1
step() { echo; echo "================ $* ================ $(date +%T)"; }
secs() { python3 -c "print(round($(date +%s.%N)-$1,1))"; }
step "install the wheels (bytecode compiled, as a plain pip install does)"
s=$(date +%s.%N)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
echo "install: $(secs "$s") s"
s=$(date +%s.%N); PYTHONPATH=/tmp/site python3 -c "import fla" 2>/dev/null; echo "import fla (first): $(secs "$s") s"
s=$(date +%s.%N); PYTHONPATH=/tmp/site python3 -c "import fla" 2>/dev/null; echo "import fla (second): $(secs "$s") s"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PINS=kernelguard/resolution/fla_autotune_pins.json
# CHECK_ARGS: another model's check, e.g. "--model kimi_linear --mode training --no-packed --allow fla-640-refusal"
ARGS=${CHECK_ARGS:-"--model qwen3_5 --mode training --allow fla-640-refusal"}
if [ -z "${SKIP_RECORD:-}" ]; then
  step "record (in-process, shipped pins applied)"
  s=$(date +%s.%N)
  cp "$PINS" "$OUT/fla_autotune_pins.json"
  TRITON_CACHE_DIR=/tmp/tc-record PYTHONPATH=/tmp/site timeout "${RECORD_TIMEOUT:-330}" python3 bench/gpu/check_timing.py \
    --out "$OUT/record.json" --record "$OUT/fla_autotune_pins.json" -- $ARGS > "$OUT/record.out" 2>&1
  echo "record: rc=$? wall $(secs "$s") s"
  tail -n 1 "$OUT/record.out" | cut -c1-400
  cp "$OUT/fla_autotune_pins.json" "/tmp/site/$PINS"
  cp "$OUT/fla_autotune_pins.json" "$PINS"
fi
export TRITON_PRINT_AUTOTUNING=1
for name in cold warm; do
  step "console script, $name"
  [ $name = cold ] && rm -rf /tmp/tc-console
  s=$(date +%s.%N)
  TRITON_CACHE_DIR=/tmp/tc-console PYTHONPATH=/tmp/site timeout "${CONSOLE_TIMEOUT:-280}" /tmp/site/bin/kernelguard check $ARGS --run --json \
    > "$OUT/console_$name.out" 2>&1
  echo "console $name: rc=$? wall $(secs "$s") s; searches: $(grep -c 'Triton autotuning for function' "$OUT/console_$name.out")"
  python3 - "$OUT/console_$name.out" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
start = text.find('{\n')
try:
    num = json.loads(text[start:]).get("numerics") or {}
except ValueError:
    print("no JSON"); raise SystemExit
print("numerics_s", num.get("seconds"), "ok", num.get("ok"), "cases", len(num.get("cases", [])))
for note in num.get("notes", []):
    print(" note:", note[:300])
PY
done
step "done"
