#!/usr/bin/env bash
# Issue 31's lock round trip on the H200 with the carried wheels, in one call (< 2 minutes):
#   1. write:    kernelguard lock --model qwen3_5 --arch 9.0 --allow fla-640-refusal   (exit 0, the lock file)
#   2. accepted: kernelguard check --lock that file, same node                          (exit 0)
#   3. refused:  the same, after one wheel is swapped: causal-conv1d 1.7.0 installed again into a separate
#                target dir put first on the path, its extension .so given one more byte (same version, another
#                build: still loads)                                                      (exit 1, the sha256 line)
# Needs in .whl/: fla-core, flash-linear-attention 0.6.0 and causal_conv1d-1.7.0-cp312 (installed into
# /tmp/site). --tiny: the same on a CPU with tests/fake_providers (the swap edits the fake fla's version).
# Output: $OUT/lock_roundtrip.json (+ the lock and every step's output).
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
REPO=$(pwd)
PY=${PYTHON:-python3}
now() { date +%s.%N; }
T0=$(now)
if [ $TINY = 1 ]; then
  BASE="$REPO:$REPO/tests/fake_providers"
  SWAP=/tmp/kg-swap-tiny; rm -rf "$SWAP"; mkdir -p "$SWAP"
  cp -r "$REPO/tests/fake_providers/fla" "$SWAP/fla"
  sed -i 's/^__version__ = .*/__version__ = "0.6.1+swapped"/' "$SWAP/fla/__init__.py"
  SWAPPED="$SWAP:$BASE"
  ALLOW=${ALLOW:-attention}
else
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl \
    .whl/causal_conv1d-*.whl || exit 1
  BASE="$REPO:/tmp/site"
  SWAP=/tmp/kg-swap; rm -rf "$SWAP"
  "$PY" -m pip install -q --no-index --no-deps --target "$SWAP" .whl/causal_conv1d-*.whl || exit 1
  for so in "$SWAP"/causal_conv1d_cuda*.so; do printf '\0' >> "$so"; done  # another build of the same version
  SWAPPED="$SWAP:$BASE"
  ALLOW=${ALLOW:-fla-640-refusal}
fi
SETUP_S=$("$PY" -c "print(round($(now)-$T0,1))")
allow_args=""; for a in $ALLOW; do allow_args="$allow_args --allow $a"; done
export CUDA_DEVICE_ORDER=PCI_BUS_ID TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
[ $TINY = 1 ] && export CUDA_VISIBLE_DEVICES=""
run() {  # name, pythonpath, args...
  local name=$1 path=$2; shift 2
  local s; s=$(now)
  PYTHONPATH="$path" timeout 100 "$PY" -m kernelguard "$@" > "$OUT/lock_$name.out" 2> "$OUT/lock_$name.err"
  echo "$? $("$PY" -c "print(round($(now)-$s,1))")"
}
read -r W_RC W_S <<< "$(run write "$BASE" lock --model qwen3_5 --mode training --arch 9.0 $allow_args -o "$OUT/kernelguard.lock")"
if [ "$W_RC" != 0 ] && [ $TINY = 0 ] && [ -z "${NO_RETRY:-}" ]; then
  # a torch without varlen_attn (and no flash-attn) fails the packed check on attention alone: accept it, say so
  cp "$OUT/lock_write.out" "$OUT/lock_write_first.out"
  ALLOW="$ALLOW attention"; allow_args="$allow_args --allow attention"
  read -r W_RC W_S <<< "$(run write "$BASE" lock --model qwen3_5 --mode training --arch 9.0 $allow_args -o "$OUT/kernelguard.lock")"
fi
read -r A_RC A_S <<< "$(run accepted "$BASE" check --lock "$OUT/kernelguard.lock")"
read -r R_RC R_S <<< "$(run refused "$SWAPPED" check --lock "$OUT/kernelguard.lock")"
"$PY" - "$OUT" "$TINY" "$SETUP_S" "$W_RC" "$W_S" "$A_RC" "$A_S" "$R_RC" "$R_S" "$ALLOW" <<'PY'
import json, sys
from pathlib import Path
out, tiny, setup, w_rc, w_s, a_rc, a_s, r_rc, r_s, allow = sys.argv[1:]
out = Path(out)
def text(name): return (out / name).read_text(errors="replace") if (out / name).exists() else ""
lock = json.loads(text("kernelguard.lock")) if (out / "kernelguard.lock").exists() else None
refusal = [l[4:] for l in text("lock_refused.err").splitlines() if l.startswith("  - ")]
want = "chunk_gated_delta_rule: version:" if tiny == "1" else "causal_conv1d_fn: causal_conv1d_cuda"
result = {
    "mode": "tiny (CPU, tests/fake_providers)" if tiny == "1" else "h200 (carried wheels)",
    "allow": allow.split(),
    "setup_s": float(setup),
    "write": {"rc": int(w_rc), "s": float(w_s), "stdout": text("lock_write.out")[-2000:], "stderr": text("lock_write.err")[-2000:]},
    "accepted": {"rc": int(a_rc), "s": float(a_s), "verdict": (text("lock_accepted.out").strip().splitlines() or [""])[-1],
                 "stderr": text("lock_accepted.err")[-2000:]},
    "refused": {"rc": int(r_rc), "s": float(r_s), "differences": refusal, "stderr": text("lock_refused.err")[-3000:]},
    "lock": lock,
}
result["ok"] = (int(w_rc) == 0 and int(a_rc) == 0 and int(r_rc) == 1 and len(refusal) == 1
                and refusal[0].startswith(want))
(out / "lock_roundtrip.json").write_text(json.dumps(result, indent=2))
print(json.dumps({k: result[k] for k in ("mode", "ok", "setup_s")} | {
    "write_rc": result["write"]["rc"], "accepted_rc": result["accepted"]["rc"], "refused_rc": result["refused"]["rc"],
    "differences": refusal}, indent=2))
PY
