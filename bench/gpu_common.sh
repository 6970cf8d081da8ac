# Sourced by the bench/gpu_run_*.sh scripts on the GPU machine: install the carried wheels, set the paths.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/causal_conv1d-*.whl .whl/kernels-*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
step() { echo; echo "================ $* ================ $(date +%T)"; }
