#!/usr/bin/env bash
# H200 run 5: where fla #640 bites, by numbers (bench/fla640_probe.py), Triton cache kept in .cache/ so the
# next call on the same warm machine (bench/gpu_run_check_warm.sh) starts from it.
set -u
exec > >(tee -a "$OUT/fla640_probe.log") 2>&1
source bench/gpu_common.sh
export TRITON_CACHE_DIR=$PWD/.cache/triton
mkdir -p "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step "fla #640 probe (refusal lifted): stock vs forced key-dim tiles"
timeout 500 python3 bench/fla640_probe.py --out "$OUT/fla640_probe.jsonl" --budget-s 420
echo "probe rc=$?"
du -sh "$TRITON_CACHE_DIR"
echo done $(date +%T)
