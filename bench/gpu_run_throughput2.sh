#!/usr/bin/env bash
# H200 run 7: all five training-throughput variants in one run on one machine (c, d, e first: kernelguard's
# path with and without activation checkpointing and with the chunked linear cross-entropy; then a and b).
set -u
exec > >(tee -a "$OUT/throughput2.log") 2>&1
source bench/gpu_common.sh
export TRITON_CACHE_DIR=$PWD/.cache/triton; mkdir -p "$TRITON_CACHE_DIR"
BENCH="--steps 6 --warmup 2 --profile-steps 2"
for v in c d e; do
  step "variant $v"
  timeout 200 python3 bench/train_throughput.py --variant $v $BENCH --out $OUT/tp2_$v.json 2>&1 | tail -3
done
step "variant a"
timeout 100 python3 bench/train_throughput.py --variant a $BENCH --out $OUT/tp2_a.json 2>&1 | tail -3
step "variant b"
timeout 100 python3 bench/train_throughput.py --variant b $BENCH --out $OUT/tp2_b.json 2>&1 | tail -3
echo done $(date +%T)
