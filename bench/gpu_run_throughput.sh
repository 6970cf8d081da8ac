#!/usr/bin/env bash
# H200 run 3: training throughput variants (c first: kernelguard's path; then the real-kernel FSDP2
# `kernelguard train` run; then a, b), each with its own time limit so partial results come back.
set -u
LOG=$OUT/throughput.log
exec > >(tee -a "$LOG") 2>&1
source bench/gpu_common.sh
BENCH="--steps 6 --warmup 2 --profile-steps 2"
step "variant c"
timeout 170 python3 bench/train_throughput.py --variant c $BENCH --out $OUT/tp_c.json 2>&1 | tail -25
step "kernelguard train, 1 GPU FSDP2, real fla + causal-conv1d"
python3 bench/make_train_fixture.py /tmp/fx --examples 600
timeout 170 python3 -m torch.distributed.run --nproc-per-node 1 --standalone -m kernelguard.train \
  --model /tmp/fx/model/config.json --tokenizer /tmp/fx/tokenizer --data /tmp/fx/chat.jsonl --block-size 8192 \
  --output /tmp/fx/out --max-steps 10 --allow fla-640-refusal --no-progress --no-export 2>&1 | tail -25
cp /tmp/fx/out/metrics.jsonl $OUT/train_metrics.jsonl 2>/dev/null; cp /tmp/fx/out/metrics.png $OUT/train_metrics.png 2>/dev/null
step "variant a"
timeout 120 python3 bench/train_throughput.py --variant a $BENCH --out $OUT/tp_a.json 2>&1 | tail -15
step "variant b"
timeout 110 python3 bench/train_throughput.py --variant b $BENCH --out $OUT/tp_b.json 2>&1 | tail -15
echo done $(date +%T)
