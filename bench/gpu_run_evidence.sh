#!/usr/bin/env bash
# H200 run 1: kernelguard check output, numerics (--run, fla #640 by numbers), GPU tests, and the guard/check
# test suites against the machine's transformers 5.17.0. Everything goes to $OUT (at most 8 files).
set -u
LOG=$OUT/evidence.log
exec > >(tee -a "$LOG") 2>&1
source bench/gpu_common.sh
step versions
python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
step "kernelguard check --model qwen3_5 --mode training"
python3 -m kernelguard check --model qwen3_5 --mode training; echo "exit=$?"
python3 -m kernelguard check --model qwen3_5 --mode training --json > $OUT/check_qwen3_5_training.json; echo "json exit=$?"
step "kernelguard check --model bench/configs/qwen3_5_k128.json --allow fla-640-refusal --run"
time python3 -m kernelguard check --model bench/configs/qwen3_5_k128.json --allow fla-640-refusal --run; echo "exit=$?"
step "kernelguard check --model bench/configs/qwen3_5_k64.json (known issue by table)"
python3 -m kernelguard check --model bench/configs/qwen3_5_k64.json; echo "exit=$?"
step "kernelguard check --model bench/configs/qwen3_5_k64.json --allow fla-640-wrong-grads --run (numbers must catch it)"
python3 -m kernelguard check --model bench/configs/qwen3_5_k64.json --allow fla-640-wrong-grads --run; echo "exit=$?"
step "warm: kernelguard check --model qwen3_5 --allow fla-640-refusal --run"
time python3 -m kernelguard check --model qwen3_5 --allow fla-640-refusal --run > /dev/null; echo "exit=$?"
step "bench/gpu_numerics.py"
python3 bench/gpu_numerics.py --out $OUT/gpu_numerics.json; echo "exit=$?"
step "pytest -m gpu (guard on CUDA with real fla / hidden fla; smoke)"
python3 -m pytest -p no:cacheprovider -m gpu tests/test_guard_gpu.py tests/test_smoke.py -q -s -rA 2>&1 | tail -150
step "CPU suites under the machine's transformers (5.17.0), real fla NOT on the path"
PYTHONPATH=$PWD python3 -m pytest -p no:cacheprovider -q -x tests/test_guard.py tests/test_pytest_plugin.py \
  tests/test_fake_providers.py tests/test_resolver.py tests/test_train_equivalence.py tests/test_smoke.py -m "not gpu" 2>&1 | tail -30
echo done
