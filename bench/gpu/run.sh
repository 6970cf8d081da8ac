#!/usr/bin/env bash
# The one GPU runner: `bench/gpu/run.sh SUITE [SUITE...]` on the device machine, from the repository root,
# with the wheels in .whl/ (bench/gpu/README.md). Everything is logged to $OUT/run.log; JSON goes to $OUT.
#
#   check         `kernelguard check --run` three times, each in a fresh process: (1) empty Triton cache, no
#                 autotune pins (fla autotunes; its choices are recorded to $OUT/fla_autotune_pins.json and
#                 installed into kernelguard/fla_autotune_pins.json of this checkout), (2) empty Triton cache
#                 with those pins, (3) warm (the cache of 2).
#   throughput    bench/gpu/train_throughput.py --all over $VARIANTS (default: fallback,stock_best,product,product_noac)
#   levers        product_noac at 16,384 tokens per step, then bench/gpu/train_throughput.py --all over $LEVERS
#                 (default: product_noac+liger,product+sac2,product_noac+compile).
#   gpu-tests     pytest -m gpu tests/stack/test_numerics.py
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
step() { echo; echo "================ $* ================ $(date +%T)"; }
wall() { python3 -c "print(round($(date +%s.%N)-$1,1))"; }

step "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kg-triton; mkdir -p "$TRITON_CACHE_DIR"
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
CHECK_ARGS="--model qwen3_5 --mode training --allow fla-640-refusal"

timed_check() {  # NAME CACHE_DIR [check_timing args]
  local name=$1 cache=$2; shift 2
  step "check --run: $name (TRITON_CACHE_DIR=$cache)"
  local s; s=$(date +%s.%N)
  TRITON_CACHE_DIR=$cache timeout "${CHECK_TIMEOUT:-330}" python3 bench/gpu/check_timing.py --out "$OUT/$name.json" "$@" -- $CHECK_ARGS
  echo "$name: rc=$? shell wall $(wall "$s") s"
}

for suite in "$@"; do
  case $suite in
    check)
      rm -rf /tmp/kg-triton-cold /tmp/kg-triton-pinned
      timed_check check_cold /tmp/kg-triton-cold --no-pins --record "$OUT/fla_autotune_pins.json"
      if [ -s "$OUT/fla_autotune_pins.json" ]; then
        python3 - "$OUT/fla_autotune_pins.json" <<'PY'
import json, sys
from kernelguard import fla_autotune
new = json.load(open(sys.argv[1]))
pins = fla_autotune.load_pins()
for entry in new["entries"]:
    pins = fla_autotune.merge_entry(pins, entry)
fla_autotune.PINS_FILE.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
print("installed pins:", {e["capability"] + "/" + e["triton"]: sum(map(len, e["kernels"].values())) for e in pins["entries"]})
PY
      fi
      timed_check check_pinned /tmp/kg-triton-pinned
      timed_check check_warm /tmp/kg-triton-pinned
      cp -r /tmp/kg-triton-pinned/. "$TRITON_CACHE_DIR"/ 2>/dev/null ;;  # the benches reuse what the check compiled
    throughput)
      step "throughput"
      timeout "${THROUGHPUT_TIMEOUT:-400}" python3 bench/gpu/train_throughput.py --all --child-timeout 150 \
        --variants "${VARIANTS:-fallback,stock_best,product,product_noac}" --out "$OUT/throughput.json" ;;
    levers)
      step "product_noac at 16k"
      timeout 120 python3 bench/gpu/train_throughput.py --variant product_noac --tokens-per-batch 16384 \
        --out "$OUT/product_noac_16k.json"
      step "levers"
      timeout "${LEVERS_TIMEOUT:-400}" python3 bench/gpu/train_throughput.py --all --child-timeout 200 \
        --no-memory-estimate --variants "${LEVERS:-product_noac+liger,product+sac2,product_noac+compile}" \
        --out "$OUT/levers.json" ;;
    gpu-tests)
      step "gpu tests"
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/stack/test_numerics.py ;;
    *) echo "unknown suite $suite (check, throughput, levers, gpu-tests)"; exit 2 ;;
  esac
done
step "done"
