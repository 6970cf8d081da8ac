#!/usr/bin/env bash
# A healthy `kernelguard train` run, step 1 to the end, with eval and checkpoints on: the step diagnosis must
# raise no alarm, and its cost must stay small. The 1.16 B proxy fixture (bench/lib/make_train_fixture.py),
# 8,192-token packed blocks, 30 steps: eval every 10 steps (3 evals), a checkpoint every 15 (2, the last at the
# end), a window every 8 steps from step 8 (3 windows, each postponed past an eval or checkpoint step until the
# steps are steady again). 60 steps, 3 evals and 4 windows took ~170 s of the 2026-12-03 acceptance; these
# 30 keep the claim (windows next to evals and checkpoints, none alarmed) at about half the steps and saves.
# fla's autotune pins go in first (bench/gpu/pinned_train.py): without them each kernel of the proxy's shapes
# is searched on a bare machine. Writes $OUT/train_diagnosis.json (every profiled window's verdict, the alarm
# lines, the profiling cost).
#
#   bash bench/gpu/train_diagnosis.sh          # GPU machine, wheels installed in /tmp/site (acceptance.sh)
#   bash bench/gpu/train_diagnosis.sh --tiny   # CPU plumbing with tests/fake_providers (~1 minute)
set -u
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
FIX=/tmp/kg-train-diagnosis-fixture; RUN=/tmp/kg-train-diagnosis-run
rm -rf "$FIX" "$RUN"
if [ "${1:-}" = "--tiny" ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests/fake_providers:${PYTHONPATH:-}
  FIXTURE=(--examples 120 --hidden 64 --layers 4); STEPS=12
  ARGS=(--param-dtype fp32 --max-length 256 --allow attention --profile-step 4 --profile-every 4)
else
  FIXTURE=(--examples 1500); STEPS=${STEPS:-30}
  ARGS=(--max-length 8192 --allow fla-640-refusal --profile-step 8 --profile-every 8)
fi
"$PY" bench/lib/make_train_fixture.py "$FIX" "${FIXTURE[@]}" || exit 1
s=$(date +%s)
"$PY" bench/gpu/pinned_train.py --model "$FIX/model/config.json" --tokenizer "$FIX/tokenizer" --data "$FIX/chat.jsonl" \
  --output-dir "$RUN" --max-steps "$STEPS" --no-progress --no-plot --no-export --eval-fraction 0.05 \
  --eval-every 10 --save-steps 15 "${ARGS[@]}" 2> "$OUT/train_diagnosis.stderr"
rc=$?
"$PY" - "$RUN/metrics.jsonl" "$OUT/train_diagnosis.stderr" "$rc" "$(( $(date +%s) - s ))" "$OUT/train_diagnosis.json" <<'PY'
import json, sys
from pathlib import Path

metrics, stderr, rc, wall, dest = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
windows = [{k: r.get(k) for k in ("step", "verdict", "verdict_line", "gpu_busy_pct", "reference_pct",
                                  "gpu_time_by_class_pct", "kernels_per_layer", "profile_mfu", "profile_overhead_s")}
           for r in recs if "cpu_s_per_step" in r]
err = stderr.read_text() if stderr.exists() else ""
alarms = [l for l in err.splitlines() if any(m in l for m in ("slow path:", "small-kernel bound:", "GPU idle:"))]
summary_lines = [l for l in err.splitlines() if "profile (" in l]
out = {"rc": rc, "wall_s": wall, "steps": max((r.get("step", 0) for r in recs), default=0),
       "evals": sum(1 for r in recs if "eval_loss" in r), "windows": windows, "alarms": alarms,
       "summary": summary_lines[-1] if summary_lines else None,
       "no_alarm": rc == 0 and not alarms and bool(windows) and all(w["verdict"] in ("healthy", None) for w in windows)}
Path(dest).write_text(json.dumps(out, indent=2))
print(json.dumps({k: out[k] for k in ("rc", "steps", "evals", "alarms", "summary", "no_alarm")}))
PY
