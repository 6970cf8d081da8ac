#!/usr/bin/env bash
# H200 run 2: fla #640 caught by numbers at key head dim 64 and passing at 128 (one shape each, same process,
# then repeated warm), the guard on CUDA with real / hidden fla, and packed vs unpacked with real kernels.
set -u
LOG=$OUT/numerics_guard.log
exec > >(tee -a "$LOG") 2>&1
source bench/gpu_common.sh
step "pytest -m gpu tests/test_guard_gpu.py (real fla passes the guard; hidden fla refused)"
timeout 150 python3 -m pytest -p no:cacheprovider -m gpu tests/test_guard_gpu.py -q -s -rA 2>&1 | tail -80
step "numerics: K=64 vs K=128, fla refusal lifted, cold then warm"
timeout 240 python3 - <<'PY'
import json, os, time
from kernelguard import smoke
from kernelguard.smoke import GdnShape
k64 = GdnShape(num_k_heads=4, num_v_heads=4, key_dim=64, value_dim=64, seq_len=1024, segments=(300, 500, 224), origin="generic")
k128 = GdnShape(num_k_heads=4, num_v_heads=4, key_dim=128, value_dim=128, seq_len=1024, segments=(300, 500, 224), origin="generic")
out = {}
for label, shape in (("k64", k64), ("k128", k128), ("k64_warm", k64), ("k128_warm", k128)):
    r = smoke.run_numerics(["chunk_gated_delta_rule"], shapes=[shape], device="cuda", lift_fla_hopper_refusal=True)
    print(f"--- {label}: ok={r.ok} seconds={r.seconds:.1f}")
    print(r.render())
    out[label] = r.to_dict()
json.dump(out, open(os.environ["OUT"] + "/numerics_k64_k128.json", "w"), indent=1)
PY
step "packed vs unpacked, real kernels (bf16)"
timeout 170 python3 bench/packed_vs_unpacked.py --out $OUT/packed_vs_unpacked.json 2>&1 | tail -40
echo done $(date +%T)
