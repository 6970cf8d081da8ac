#!/usr/bin/env bash
# Performance round 4 (issue 33) on one GPU: profile first, then the levers, the export and the warm check.
#
# Parts (PARTS, space-separated, in this order; each runs only if what it needs still fits in BUDGET_S):
#   proxy   bench/gpu/train_throughput.py on the 1.16 B proxy at 8,192 tokens: stock_best and product_default,
#           one process each; each profiles its own step (GPU time by kernel class, the matmul ops' achieved
#           TFLOP/s, kernelguard.diagnosis.kernel_classes when importable) and runs the step diagnosis.
#   levers  product_default + one lever each, one process each (--no-detector): no_reshard, accum2, tokens2x,
#           compile, then fused_norms and liger when liger_kernel is importable (a carried wheel in .whl/);
#           LEVERS=product_default+X,... picks others. Each variant's JSON is kept as soon as it ends, so a budget
#           that runs out keeps the levers measured so far (in this order: the expected largest first).
#   real    product_default at Qwen3.5-27B's widths (--widths 27b) with REAL_LAYERS (8) layers, profiled the
#           same way (the model is initialised on the host first: ~1 minute of the part).
#   export  bench/gpu/sharded_load_timing.sh RUNS=sharded at 27B widths, EXPORT_LAYERS (8) layers: `kernelguard
#           train` for one step, then the export of final/ (2 GB files); bytes/s from the files written.
#   check   the import floor (a fresh `import torch, transformers, fla, fla.ops.gated_delta_rule, causal_conv1d`
#           and the Qwen3.5 modeling module, twice), then `kernelguard check --run` through the console script:
#           cold (empty Triton cache), warm, and warm with KERNELGUARD_IMPORT_PROBE=spawn (the probe as it ran
#           before round 4 on a GPU node: a fresh interpreter importing torch again).
# Everything at once does not fit one call: run two (each < 9 minutes on one H200):
#   PARTS="proxy levers" bash bench/gpu/levers_widths_export.sh
#   PARTS="real export check" bash bench/gpu/levers_widths_export.sh
#   PYTHONPATH=$PWD/tests/fake_providers bash bench/gpu/levers_widths_export.sh --tiny     # CPU logic check (~10 min)
#
# Wheels in .whl/ (carried): fla-core + flash-linear-attention 0.6.0, causal_conv1d 1.7.0, kernelguard's own
# wheel (`pip wheel --no-deps -w .whl .`, for the console script; this checkout's code comes first on
# PYTHONPATH), liger_kernel (optional: `pip download --no-deps liger-kernel -d .whl`).
# Output under $OUT (default /tmp/kg-out): levers_widths_export.log, levers_widths_export_{proxy,levers,real}.json,
# export/ (sharded_load_timing's files), check_*.out, levers_widths_export_summary.json and levers_widths_export_tables.md.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/levers_widths_export.log") 2>&1
BUDGET=${BUDGET_S:-530}
PARTS=" ${PARTS:-proxy levers real export check} "
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(left) s left)"; }
want() { [[ $PARTS == *" $1 "* ]]; }
# fits NAME SECONDS: the part runs only with SECONDS left, else it says so
fits() { if [ "$(left)" -lt "$2" ]; then echo "$1 skipped: $(left) s left, $2 s needed"; return 1; fi; }
secs() { python3 -c "print(round($(date +%s.%N)-$1,1))"; }
PY=${PYTHON:-python3}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

if [ $TINY = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  BENCH=(--tiny --device cpu --steps 10 --warmup 2 --profile-steps 1 --no-memory-estimate)
  REAL=(); CHILD_TIMEOUT=200; NEED_VARIANT=60; NEED_REAL=60; NEED_EXPORT=90; NEED_CHECK=60
  KG=("$PY" -m kernelguard); CHECK_ARGS=(--model qwen3_5 --mode training --allow attention)
else
  step "install carried wheels (bytecode compiled, as a plain pip install does)"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}; mkdir -p "$TRITON_CACHE_DIR"
  BENCH=(--steps 10 --warmup 3 --profile-steps 2 --no-memory-estimate)
  REAL=(--widths 27b --layers "${REAL_LAYERS:-8}")
  CHILD_TIMEOUT=${CHILD_TIMEOUT:-240}; NEED_VARIANT=70; NEED_REAL=200; NEED_EXPORT=150; NEED_CHECK=170
  if [ -x /tmp/site/bin/kernelguard ]; then KG=(/tmp/site/bin/kernelguard); else KG=("$PY" -m kernelguard); fi
  CHECK_ARGS=(--model qwen3_5 --mode training --allow fla-640-refusal --run)
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"
LIGER=0; "$PY" -c "import liger_kernel" 2>/dev/null && [ $TINY = 0 ] && LIGER=1
echo "liger_kernel importable on a GPU: $LIGER; parts:$PARTS; budget $BUDGET s"

# throughput NAME VARIANTS [extra args]: one bench/gpu/train_throughput.py --all run into levers_widths_export_NAME.json
throughput() {
  local name=$1 variants=$2; shift 2
  local n; n=$(echo "$variants" | tr ',' '\n' | wc -l)
  fits "$name" $((NEED_VARIANT * n / 2 + 30)) || return
  step "$name: $variants"
  timeout $(( $(left) - 10 )) "$PY" bench/gpu/train_throughput.py --all --child-timeout "$CHILD_TIMEOUT" \
    --variants "$variants" "${BENCH[@]}" "$@" --out "$OUT/levers_widths_export_$name.json"
  echo "$name: rc=$?"
}

want proxy && throughput proxy stock_best,product_default --profile-dump "$OUT/profiles"

if want levers; then
  LEVERS=${LEVERS:-product_default+no_reshard,product_default+accum2,product_default+tokens2x,product_default+compile}
  [ $LIGER = 1 ] && [[ $LEVERS != *fused_norms* ]] && LEVERS=$LEVERS,product_default+fused_norms,product_default+liger
  throughput levers "$LEVERS" --no-detector
fi

if want real && fits real $NEED_REAL; then
  step "real widths: product_default, ${REAL[*]}"
  timeout $(( $(left) - 10 )) "$PY" bench/gpu/train_throughput.py --all --child-timeout $(( $(left) - 20 )) \
    --variants product_default "${BENCH[@]}" "${REAL[@]}" --out "$OUT/levers_widths_export_real.json"
  echo "real: rc=$?"
fi

if want export && fits export $NEED_EXPORT; then
  step "export at 27B widths (bench/gpu/sharded_load_timing.sh, RUNS=sharded)"
  budget=$(( $(left) - 10 )); [ $budget -gt 300 ] && budget=300
  TINY_ARG=(); [ $TINY = 1 ] && TINY_ARG=(--tiny)
  # Without the carried wheels on the path: the step runs transformers' torch GDN reference (what is timed is
  # the load and the export), and an importable fla on Triton 3.6 would need --allow fla-640-refusal.
  PYTHONPATH= OUT=$OUT/export RUNS=sharded LAYERS=${EXPORT_LAYERS:-8} BUDGET_S=$budget PYTHON=$PY \
    bash bench/gpu/sharded_load_timing.sh "${TINY_ARG[@]}" > "$OUT/export.out" 2>&1
  echo "export: rc=$?"; tail -n 25 "$OUT/export.out"
fi

if want check && fits check $NEED_CHECK; then
  step "import floor, then kernelguard check --run: cold, warm, warm with the spawned import probe"
  IMPORTS="import torch, transformers, fla, fla.ops.gated_delta_rule, causal_conv1d; import transformers.models.qwen3_5.modeling_qwen3_5"
  for i in 1 2; do
    s=$(date +%s.%N); "$PY" -c "$IMPORTS" 2>/dev/null; echo "import floor ($i): rc=$? $(secs "$s") s" | tee -a "$OUT/check_times.txt"
  done
  for name in cold warm warm_spawn; do
    [ $name = cold ] && [ $TINY = 0 ] && rm -rf /tmp/kg-check-triton
    probe=; [ $name = warm_spawn ] && probe=spawn
    s=$(date +%s.%N)
    TRITON_CACHE_DIR=/tmp/kg-check-triton TRITON_PRINT_AUTOTUNING=1 KERNELGUARD_IMPORT_PROBE=$probe \
      timeout 280 "${KG[@]}" check "${CHECK_ARGS[@]}" --json > "$OUT/check_$name.out" 2>&1
    echo "check $name: rc=$? $(secs "$s") s; autotune searches: $(grep -c 'Triton autotuning for function' "$OUT/check_$name.out")" \
      | tee -a "$OUT/check_times.txt"
  done
fi

step "summary"
"$PY" bench/gpu/levers_widths_export_summary.py "$OUT"
step "done"
