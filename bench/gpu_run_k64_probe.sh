#!/usr/bin/env bash
# H200 run 4 (short): look for fla #640 by numbers at key head dim 64 on other shapes than run 2's.
set -u
exec > >(tee -a "$OUT/k64_probe.log") 2>&1
source bench/gpu_common.sh
step "K=64 shapes, fla refusal lifted"
timeout 160 python3 - <<'PY'
from kernelguard import smoke
from kernelguard.smoke import GdnShape
for shape in (
    GdnShape(num_k_heads=16, num_v_heads=32, key_dim=64, value_dim=128, seq_len=2048, segments=(1000, 700, 348), origin="generic"),
    GdnShape(num_k_heads=4, num_v_heads=4, key_dim=64, value_dim=64, batch=2, seq_len=512, origin="generic"),
):
    r = smoke.run_numerics(["chunk_gated_delta_rule"], shapes=[shape], device="cuda", lift_fla_hopper_refusal=True)
    print(r.render(), flush=True)
PY
echo done $(date +%T)
