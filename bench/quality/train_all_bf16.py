"""`kernelguard train` with every parameter cast to the compute dtype, the GDN decay included (the FSDP2 policy
before Qwen3.5's ``A_log`` / ``dt_bias`` were kept in fp32): the other arm of the step-time comparison in
gpu_quality.sh. ``python bench/quality/train_all_bf16.py TRAIN_ARGS...`` (the same arguments as
``python -m kernelguard.train``). For measurement only."""

from __future__ import annotations

import functools
import sys

from kernelguard.train.__main__ import main
from kernelguard.train.model import build, parallel

build.apply_fsdp = functools.partial(parallel.apply_fsdp, keep_fp32=())

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
