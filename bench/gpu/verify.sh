#!/usr/bin/env bash
# Session-3 verification run on the H200 (one call, < 10 min): the real stack's `kernelguard check`, every
# GPU-marked test against the machine's own transformers (5.17.0), and the packing-quality evidence of issue 11
# (bench/gpu/quality_packing.py). Tests run before quality: the last run spent its budget in quality's first steps
# (fla compile/autotune) and never reached 4 tests. Wheels: fla-core + flash-linear-attention 0.6.0 and
# causal-conv1d 1.7.0 in .whl/ (carried). Output: $OUT/verify.log, $OUT/check.json, $OUT/quality/quality_packing.{json,png}.
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT/quality"
exec > >(tee -a "$OUT/verify.log") 2>&1
step() { echo; echo "================ $* ================ $(date +%T)"; }
step "install fla + causal-conv1d (the machine's transformers stays)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/kg-triton
python3 -c "import sys, torch, triton, transformers, fla; print(sys.version.split()[0], torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
if [ -z "${SKIP_CHECK:-}" ]; then
  step "kernelguard check (real stack, no --run)"
  python3 -m kernelguard check --model bench/configs/qwen3_5_k128.json --allow fla-640-refusal; echo "exit=$?"
  python3 -m kernelguard check --model bench/configs/qwen3_5_k128.json --allow fla-640-refusal --json > "$OUT/check.json"
fi
step "pytest -m gpu (full log: gpu_tests.log)"
timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -p no:cacheprovider -v -rA -m gpu tests/runtime/test_guard_gpu.py \
  tests/train/test_loss_gpu.py tests/stack/test_numerics.py tests/train/test_train_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit=$? (124: timed out)"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -40
step "quality: packed vs padded, same data/steps/schedule"
timeout "${QUALITY_TIMEOUT:-300}" python3 bench/gpu/quality_packing.py --steps "${QUALITY_STEPS:-400}" --out "$OUT/quality"
echo "quality exit=$?"
step "done"
