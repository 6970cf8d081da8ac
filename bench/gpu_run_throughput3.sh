#!/usr/bin/env bash
# H200 run 8: variant d vs e (reworked chunked loss: one fused log-softmax pass) at 8,192 and 16,384 tokens
# per step, in one run on one machine.
set -u
exec > >(tee -a "$OUT/throughput3.log") 2>&1
source bench/gpu_common.sh
export TRITON_CACHE_DIR=$PWD/.cache/triton; mkdir -p "$TRITON_CACHE_DIR"
BENCH="--steps 6 --warmup 2 --profile-steps 2"
step "variant d, 8k"; timeout 220 python3 bench/train_throughput.py --variant d $BENCH --out $OUT/tp3_d_8k.json 2>&1 | tail -1
step "variant e, 8k"; timeout 90 python3 bench/train_throughput.py --variant e $BENCH --out $OUT/tp3_e_8k.json 2>&1 | tail -1
step "variant d, 16k"; timeout 100 python3 bench/train_throughput.py --variant d $BENCH --tokens-per-batch 16384 --out $OUT/tp3_d_16k.json 2>&1 | tail -1
step "variant e, 16k"; timeout 100 python3 bench/train_throughput.py --variant e $BENCH --tokens-per-batch 16384 --out $OUT/tp3_e_16k.json 2>&1 | tail -1
echo done $(date +%T)
