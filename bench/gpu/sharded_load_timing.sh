#!/usr/bin/env bash
# Issue 18 on one H200: a real-width checkpoint of a few billion parameters, saved sharded beforehand, loads to
# the first step of `kernelguard train` in X s on the sharded load (every rank reads its own slices) vs Y s on
# the rank-0 path (rank 0 reads the folder with from_pretrained and broadcasts), and exports final/ in Z s.
#
#   1. make:    a random-init Qwen3.5 text model at Qwen3.5-27B widths (hidden 5120, vocab 248,320, untied head)
#               with $LAYERS (8) of its layers (~5.6 B parameters, ~11 GB of bf16), built in bf16 on the GPU,
#               save_pretrained(max_shard_size="2GB") to local disk.
#   2. sharded: `kernelguard train --max-steps 1 --no-progress` from that folder (the product's default path), with
#               the export of final/ (sharded, 2GB files); run in-process by bench/gpu/sharded_load_timing.py train,
#               which only skips the end-of-run checkpoint (~67 GB of fp32 weights + AdamW: more than the disk).
#   3. rank0:   the same with the load forced onto the rank-0 path (`... train --rank0`: there is no user-facing
#               switch for it; the helper calls the trainer's load with no plan), --no-export.
#   4. summary: the trainer's own figures — metrics.jsonl's first step record (start_s: process start to step
#               1's start; load_s: the weight load; step_time_s) and its log lines ("weights: loaded (...) in
#               X s", "exported ... in Z s") — to $OUT/sharded_load_timing.json.
#
# Both loads read a page cache the write just filled (the host has 128 GiB): the figures are the load's work,
# not the disk's. Triton compiles its kernels in the first run's step 1 (step_time_s), not before it (start_s).
#
#   bench/gpu/sharded_load_timing.sh           # GPU machine, repository root, < 240 s (no wheels needed)
#   bench/gpu/sharded_load_timing.sh --tiny    # CPU logic check, tiny widths, ~1-2 minutes
#   KERNELS=fla BUDGET_S=420 bench/gpu/sharded_load_timing.sh   # the packed fla path, wheels in .whl/
#
# $OUT (default /tmp/kg-out): run.log, checkpoint.json, sharded.stderr, rank0.stderr, sharded/metrics.jsonl,
# rank0/metrics.jsonl, *.rc, *.wall, sharded_load_timing.json; the model, the runs and final/ live under $WORK
# (/tmp/kg-sharded-load, local disk: ~11 GB model + ~11 GB final/ at the peak)
# and are removed. BUDGET_S (230) bounds the whole script: each
# part runs under `timeout` with what is left, a part that does not fit is skipped and said so.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
BUDGET=${BUDGET_S:-230}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(left) s left)"; }
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/kg-sharded-load}; rm -rf "$WORK"; mkdir -p "$WORK"
LAYERS=${LAYERS:-8}

# KERNELS=reference (default): the step runs transformers' torch GDN reference, unpacked (--packing none, the two
# slow paths --allow-ed), with no fla on the path: the figures are the load's and the export's, which do not
# depend on the kernels, and a cold fla costs ~30 s of import and ~2 minutes of Triton compile in step 1 (H200
# session 5: step 1 took 123 s), which would not fit the call. KERNELS=fla: the product's packed path with the
# carried wheels (.whl/: fla-core, flash-linear-attention, causal-conv1d; --allow fla-640-refusal), for a
# longer budget (BUDGET_S=420).
KERNELS=${KERNELS:-reference}
SITE=  # after this checkout on the path: a kernelguard wheel in .whl/ must not shadow the code under test
if [ "$KERNELS" = fla ] && [ $TINY = 0 ]; then
  step "install carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  SITE=:/tmp/site
fi
export PYTHONPATH=$PWD$SITE${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}; mkdir -p "$TRITON_CACHE_DIR"
if [ "$KERNELS" = fla ]; then
  TRAIN=(--packing packed --allow fla-640-refusal)
else
  TRAIN=(--packing none --allow causal_conv1d_fn chunk_gated_delta_rule)
fi
if [ $TINY = 1 ]; then
  export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  [ "$KERNELS" = fla ] && export PYTHONPATH=$PYTHONPATH:$PWD/tests/fake_providers && TRAIN=(--packing packed)
  MAKE=(--tiny --device cpu); TRAIN+=(--param-dtype fp32 --max-length 256 --allow attention)
  NEED_TRAIN=20
else
  MAKE=(--device cuda); TRAIN+=(--param-dtype bf16 --max-length 4096)
  NEED_TRAIN=60
fi
echo "KERNELS=$KERNELS; train flags: ${TRAIN[*]}"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"
df -h "$WORK" | tail -1; free -g | sed -n 2p

step "fixture: tokenizer and chat data; the checkpoint, $LAYERS layers"
"$PY" bench/lib/make_train_fixture.py "$WORK/fixture" --examples 64 --layers 2 --hidden 64 >/dev/null || exit 1
timeout -k 5 $(( $(left) - NEED_TRAIN )) "$PY" bench/gpu/sharded_load_timing.py make "$WORK/model" --layers "$LAYERS" \
  "${MAKE[@]}" --json "$OUT/checkpoint.json" || { echo "make failed or timed out: rc=$?"; exit 1; }
ls -la "$WORK/model"

# run NAME [extra args]: kernelguard train, 1 step, under timeout; NAME.rc, NAME.wall, NAME.stderr
run() {
  local name=$1; shift
  if [ "$(left)" -lt "$NEED_TRAIN" ]; then echo "$name skipped: $(left) s left, $NEED_TRAIN s needed"; echo skipped > "$OUT/$name.rc"; return; fi
  step "$name"
  rm -rf "$OUT/$name" "$WORK/runs/$name"; mkdir -p "$OUT/$name"
  local t0; t0=$(date +%s.%N)
  timeout -k 10 $(( $(left) - 5 )) "$@" --model "$WORK/model" --tokenizer "$WORK/fixture/tokenizer" \
    --data "$WORK/fixture/chat.jsonl" --output-dir "$WORK/runs/$name" --max-steps 1 --no-progress --no-plot \
    --max-shard-size 2GB "${TRAIN[@]}" 2> >(tee "$OUT/$name.stderr" >&2)
  local rc=$?
  echo "$rc" > "$OUT/$name.rc"
  "$PY" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$t0" "$(date +%s.%N)" > "$OUT/$name.wall"
  echo "$name: rc=$rc, $(cat "$OUT/$name.wall") s wall"
  ls -la "$WORK/runs/$name" "$WORK/runs/$name/final" 2>/dev/null
  du -cb "$WORK/runs/$name/final/"*.safetensors 2>/dev/null | tail -1 | cut -f1 > "$OUT/$name.export_bytes"
  cp "$WORK/runs/$name"/*.json* "$OUT/$name/" 2>/dev/null  # metrics.jsonl, run.json: the GBs stay on local disk
  rm -rf "$WORK/runs/$name"
}
RUNS=" ${RUNS:-sharded rank0} "  # RUNS=sharded: the export only
[[ $RUNS == *" sharded "* ]] && run sharded "$PY" bench/gpu/sharded_load_timing.py train
[[ $RUNS == *" rank0 "* ]] && run rank0 "$PY" bench/gpu/sharded_load_timing.py train --rank0 --no-export

step "summary"
"$PY" bench/gpu/sharded_load_timing.py summary "$OUT"
rc=$?
rm -rf "$WORK"
exit $rc
