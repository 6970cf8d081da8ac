#!/usr/bin/env bash
# H200 run 9 (short): the chunked loss at the real vocabulary on the GPU (tests/test_loss_gpu.py).
set -u
exec > >(tee -a "$OUT/loss_gpu.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/pygments-*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -p no:cacheprovider -m gpu tests/test_loss_gpu.py -q -s -rA 2>&1 | tail -15
