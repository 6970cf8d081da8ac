#!/usr/bin/env bash
# Does the round-6 default step change the numbers? `kernelguard train` on the 1.16 B proxy fixture
# (bench/lib/make_train_fixture.py), STEPS steps each, one run after another on the GPU:
#   new.s0      the default (no layout flags: auto picks no checkpointing, both blocks in one row, weights kept
#               gathered, compile; the clip inside the fused AdamW)
#   old.s0      the round-5 layout, same batches: --activation-checkpointing --blocks-per-forward 1
#               --reshard-after-forward --no-compile (two forwards per step, accumulated)
#   old.s1      the same with --seed 1 (another init and data order): the seed spread
#   lr2x.s0     the default at twice the learning rate: the control, a change the comparison must resolve (a
#               difference as large as this one between new and old would be a change of the numbers)
# Writes $OUT/default_curve.json: each run's per-step loss and grad norm, and the largest and the mean |loss
# difference| over the steps after the first ten of new vs old (seed 0), of the seed spread (old s0 vs s1) and of
# the control vs old (seed 0). Each run's checkpoints are deleted once it ends (only metrics.jsonl is read).
#
#   bash bench/gpu/default_curve.sh          # GPU, wheels in .whl/ (fla, causal-conv1d)
#   bash bench/gpu/default_curve.sh --tiny   # CPU plumbing with tests/fake_providers (~2 minutes)
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/default_curve.log") 2>&1
PY=${PYTHON:-python3}
FIX=/tmp/kg-curve-fixture; RUNS=/tmp/kg-curve-runs
rm -rf "$FIX" "$RUNS"
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
if [ "${1:-}" = "--tiny" ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests/fake_providers:${PYTHONPATH:-}
  FIXTURE=(--examples 200 --hidden 64 --layers 4); STEPS=${STEPS:-6}
  COMMON=(--param-dtype fp32 --max-length 256 --allow attention); LR=3e-3; LR2X=6e-3
  NEW=()  # on CPU auto is the old layout already: the plumbing is what runs here
else
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kg-triton}
  FIXTURE=(--examples 1500); STEPS=${STEPS:-60}
  COMMON=(--max-length 8192 --allow fla-640-refusal); LR=3e-4; LR2X=6e-4
  NEW=()
fi
OLD=(--activation-checkpointing --blocks-per-forward 1 --reshard-after-forward --no-compile)
"$PY" bench/lib/make_train_fixture.py "$FIX" "${FIXTURE[@]}" || exit 1
run() {  # NAME SEED FLAGS... (each run bounded by RUN_TIMEOUT_S; the summary is rewritten after each run, so a
          # call cut short keeps the curves measured so far)
  local name=$1 seed=$2 s; shift 2; s=$(date +%s)
  timeout "${RUN_TIMEOUT_S:-170}" "$PY" bench/gpu/pinned_train.py --model "$FIX/model/config.json" --tokenizer "$FIX/tokenizer" \
    --data "$FIX/chat.jsonl" --output-dir "$RUNS/$name" --max-steps "$STEPS" --warmup-steps 5 --seed "$seed" \
    --learning-rate "$LR" \
    --no-progress --no-plot --no-export "${COMMON[@]}" "$@" 2> "$OUT/$name.stderr"
  echo "$name: rc=$? in $(( $(date +%s) - s )) s; $(grep -m1 '^kernelguard train: step:' "$OUT/$name.stderr" | cut -c1-200)"
  rm -rf "$RUNS/$name/checkpoints"  # ~14 GB each at the proxy's size: four would fill the machine's disk
}
summarize() {
"$PY" - "$RUNS" "$OUT/default_curve.json" <<'PY'
import json, sys
from pathlib import Path

runs, dest = Path(sys.argv[1]), Path(sys.argv[2])
curves = {}
for d in sorted(runs.iterdir()) if runs.is_dir() else []:
    m = d / "metrics.jsonl"
    recs = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.exists() else []
    recs = [r for r in recs if "loss" in r and "step" in r]
    curves[d.name] = {"loss": [r["loss"] for r in recs], "grad_norm": [r.get("grad_norm") for r in recs]}

def gaps(a, b):
    x, y = curves.get(a, {}).get("loss", []), curves.get(b, {}).get("loss", [])
    d = [abs(p - q) for p, q in zip(x[10:], y[10:])]
    return (max(d), sum(d) / len(d)) if d else (None, None)

pairs = {"new_vs_old": ("new.s0", "old.s0"), "seed_spread_old": ("old.s0", "old.s1"),
         "control_lr2x_vs_old": ("lr2x.s0", "old.s0")}
out = {"curves": curves,
       "max_abs_loss_gap_after_step_10": {k: gaps(*ab)[0] for k, ab in pairs.items()},
       "mean_abs_loss_gap_after_step_10": {k: gaps(*ab)[1] for k, ab in pairs.items()}}
dest.write_text(json.dumps(out, indent=1))
print("max", json.dumps(out["max_abs_loss_gap_after_step_10"]))
print("mean", json.dumps(out["mean_abs_loss_gap_after_step_10"]))
for k, v in curves.items():
    print(k, "loss", [round(x, 3) for x in v["loss"][::10]], "grad_norm", [round(x or 0, 2) for x in v["grad_norm"][:4]])
PY
}
run new.s0 0 "${NEW[@]}"; summarize
run old.s0 0 "${OLD[@]}"; summarize
run lr2x.s0 0 "${NEW[@]}" --learning-rate "$LR2X"; summarize
run old.s1 1 "${OLD[@]}"; summarize
