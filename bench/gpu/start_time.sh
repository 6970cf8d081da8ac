#!/usr/bin/env bash
# Issue 49: `kernelguard train` at Qwen3.5-27B's widths, from process start to the end of step 1, on a bare machine
# and again on the same machine. Three runs of bench/gpu/start_time.py (the trainer's own main, in-process, the
# end-of-run checkpoint skipped), each to $OUT/NAME.json, NAME.stderr, NAME.stdout, NAME/metrics.jsonl:
#   cold_shipped  empty Triton and inductor cache folders, the pins kernelguard ships: a user's first start
#                 today. Every fla autotune choice it made is merged into this checkout's pins file
#                 (kernelguard/resolution/fla_autotune_pins.json, also copied to $OUT/fla_autotune_pins.json).
#   cold_pinned   empty cache folders again, with those pins: a first start once they ship.
#   warm          cold_pinned's cache folders kept: the next start on the same machine; with --export, so the
#                 export of final/ at these widths is timed too (bytes written / the trainer's own seconds).
# TRITON_PRINT_AUTOTUNING=1 in all three: every search fla still makes is a line of NAME.stdout.
#
#   bash bench/gpu/start_time.sh           # GPU machine, repository root, .whl/ and .fixture/start.tgz carried
#   PYTHON=.venv/bin/python bash bench/gpu/start_time.sh --tiny   # CPU plumbing with tests/fake_providers
#
# The model: LAYERS layers of bench/configs/qwen3_5_27b_text.json (hidden 5120, vocab 248,320), random init;
# auto (the default): 2 on an 80 GB card (what the default step's plan fits, bench/RESULTS.md 4.6), 8 on a 141 GB
# one (the plan fits 8 in 120.8 GiB without checkpointing, one block per forward, weights freed). The data: .fixture/start.tgz,
# the chitchat conversations and the Qwen3.5 vocabulary, made on a CPU machine (the GPU machine has neither
# package) by
#   python bench/quality/prepare.py --out /tmp/start --size gpu --no-unigram
#   mkdir -p .fixture && tar czf .fixture/start.tgz -C /tmp/start tokenizer train.jsonl
# --tiny: bench/lib/make_train_fixture.py's byte-level fixture, 2 tiny layers, fp32, on CPU.
# Run folders and caches live under $WORK (/tmp/kg-start, removed); BUDGET_S (560) bounds the whole script.
set -u
TINY=0; [ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-/tmp/kg-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/start_time.log") 2>&1
BUDGET=${BUDGET_S:-560}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "================ $* ================ $(date +%T) ($(left) s left)"; }
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/kg-start}; rm -rf "$WORK"; mkdir -p "$WORK/fixture"
LAYERS=${LAYERS:-auto}
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 TRITON_PRINT_AUTOTUNING=1

if [ $TINY = 1 ]; then
  [ "$LAYERS" = auto ] && LAYERS=2
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/tests/fake_providers:${PYTHONPATH:-}
  "$PY" bench/lib/make_train_fixture.py "$WORK/fixture" --examples 200 --hidden 64 --layers "$LAYERS" || exit 1
  MODEL=$WORK/fixture/model/config.json; DATA=$WORK/fixture/chat.jsonl
  ARGS=(--param-dtype fp32 --max-length 256 --allow attention)
else
  step "install carried wheels; unpack the fixture"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
  tar xzf .fixture/start.tgz -C "$WORK/fixture" || { echo "no .fixture/start.tgz (see the header)"; exit 1; }
  MODEL=$WORK/model/config.json; DATA=$WORK/fixture/train.jsonl
  # auto: the most layers the default plan fits on this card (RESULTS 4.6: 2 on an 80 GB card; 8 on a 141 GB one)
  [ "$LAYERS" = auto ] && LAYERS=$("$PY" -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 120e9 else 2)")
  "$PY" - "$LAYERS" "$MODEL" <<'PY'
import json, sys
from pathlib import Path
layers, dest = int(sys.argv[1]), Path(sys.argv[2])
config = json.loads(Path("bench/configs/qwen3_5_27b_text.json").read_text())
config["num_hidden_layers"] = layers
config["layer_types"] = config["layer_types"][:layers]
dest.parent.mkdir(parents=True, exist_ok=True)
dest.write_text(json.dumps(config, indent=1))
print(f"model: {layers} layers of Qwen3.5-27B's widths ({', '.join(config['layer_types'])})")
PY
  ARGS=(--allow fla-640-refusal)
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
"$PY" -c "import fla, triton; print('fla', fla.__version__, 'triton', triton.__version__)" 2>/dev/null || echo "fla/triton: not importable"
PINS=kernelguard/resolution/fla_autotune_pins.json

# start NAME CACHE EXPORT_FLAG [record]: one start, caches in $WORK/cache-CACHE
start() {
  local name=$1 cache=$2 export_flag=$3 record=${4:-}
  local need=60; [ $TINY = 0 ] && need=90
  if [ "$(left)" -lt $need ]; then echo "$name skipped: $(left) s left"; return; fi
  step "$name (caches: $cache)"
  local rec=(); [ -n "$record" ] && rec=(--record "$PINS")
  local s; s=$(date +%s.%N)
  TRITON_CACHE_DIR=$WORK/cache-$cache/triton TORCHINDUCTOR_CACHE_DIR=$WORK/cache-$cache/inductor \
    timeout $(( $(left) - 15 )) "$PY" bench/gpu/start_time.py --out "$OUT/$name.json" "${rec[@]}" -- \
    --model "$MODEL" --init random --tokenizer "$WORK/fixture/tokenizer" --data "$DATA" \
    --output-dir "$WORK/$name" --max-steps 3 --no-progress --no-plot "$export_flag" "${ARGS[@]}" \
    > "$OUT/$name.stdout" 2> "$OUT/$name.stderr"
  echo $? > "$OUT/$name.rc"
  "$PY" -c "import time; print(round(time.time() - $s, 1))" > "$OUT/$name.wall"
  mkdir -p "$OUT/$name"; cp "$WORK/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  du -cb "$WORK/$name"/final/*.safetensors 2>/dev/null | tail -n 1 | cut -f1 > "$OUT/$name.export_bytes"
  rm -rf "$WORK/$name/final"
  echo "$name: rc=$(cat "$OUT/$name.rc") wall $(cat "$OUT/$name.wall") s; autotune searches: $(grep -c 'Triton autotuning for function' "$OUT/$name.stdout")"
  tail -n 1 "$OUT/$name.stdout" | cut -c1-300
  grep -E "fla autotune|fla autotuned|weights: |compile|exported" "$OUT/$name.stderr" | cut -c1-300
}

start cold_shipped a --no-export record
[ -f "$PINS" ] && cp "$PINS" "$OUT/fla_autotune_pins.json"
start cold_pinned b --no-export
start warm b --export

step "summary"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench/gpu")
from sharded_load_timing import run_summary
out = Path(sys.argv[1])
rows = {}
for name in ("cold_shipped", "cold_pinned", "warm"):
    if not (out / f"{name}.rc").exists():
        continue
    row = run_summary(out, name)
    stdout = (out / f"{name}.stdout").read_text() if (out / f"{name}.stdout").exists() else ""
    row["autotune_searches"] = stdout.count("Triton autotuning for function")
    try:
        row["harness"] = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        row["harness"] = None
    records = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if l.startswith("{")] \
        if (out / name / "metrics.jsonl").exists() else []
    row["step_times_s"] = [r.get("step_time_s") for r in records if "step_time_s" in r]
    rows[name] = row
(out / "start_time.json").write_text(json.dumps(rows, indent=2))
print("| run | rc | start_s (to step 1) | step 1 s | first step done s | load s | searches | process wall s | export MB/s |")
print("|---|---|---|---|---|---|---|---|---|")
for name, r in rows.items():
    steps = r.get("step_times_s") or [None]
    print(f"| {name} | {r.get('rc')} | {r.get('start_s')} | {steps[0]} | {r.get('first_step_done_s')} | "
          f"{r.get('load_s')} | {r['autotune_searches']} | {r.get('process_wall_s')} | {r.get('export_mb_per_s')} |")
PY
rm -rf "$WORK"
# Everything in one file that sorts first: the device runner returns only the first few files of $OUT (by name),
# and the recorded pins must come back (bench/RESULTS.md 4.8 lost them).
tar czf "$OUT/00-start_time.tgz" -C "$OUT" --exclude=00-start_time.tgz . && echo "all of \$OUT: $OUT/00-start_time.tgz"
step "done"
