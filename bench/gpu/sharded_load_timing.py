"""Helper of bench/gpu/sharded_load_timing.sh: make the checkpoint, run `kernelguard train` on the rank-0 load
path, and summarise what the trainer itself logged.

    python bench/gpu/sharded_load_timing.py make DIR [--layers 8] [--tiny] [--device cuda]
    python bench/gpu/sharded_load_timing.py train [--rank0] TRAIN_ARGS...
    python bench/gpu/sharded_load_timing.py summary OUT

``make``: a random-init Qwen3.5 text model at Qwen3.5-27B's widths (bench/configs/qwen3_5_27b_text.json:
hidden 5120, 24 attention heads, 48 value heads, vocab 248,320, untied head) with ``--layers`` of its layers,
built in bf16 directly on ``--device`` (no fp32 copy), saved with ``save_pretrained(max_shard_size="2GB")``.
``--tiny``: the same layer pattern at tiny widths (CPU, seconds).

``train``: ``kernelguard.train``'s own ``main``, in-process, with the end-of-run checkpoint skipped (what
is timed is the load and the export; a 5.6 B model's fp32 weights + AdamW state would not fit the disk).
``--rank0``: `kernelguard train` has no switch for the rank-0 load path (kernelguard.train.model.weights uses it
only where the sharded load cannot run), so ``kernelguard.train.model.build.load_weights`` is called with no plan:
rank 0 reads the folder with ``from_pretrained`` (fp32, on the host) and
``set_model_state_dict(broadcast_from_rank0=True)`` fills the shards. Everything else (guard, data, step,
export, log lines, metrics.jsonl) is the product's.

``summary``: one JSON object from each run's metrics.jsonl (first step record: ``start_s`` = process start to
step 1's start, ``load_s`` = the weight load, ``step_time_s``) and stderr log (``weights: ... in X s``,
``exported ... in Z s``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIG_27B = REPO / "bench" / "configs" / "qwen3_5_27b_text.json"
TINY = {  # same layer pattern and head ratios, tiny widths
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64,
}


def make(folder: Path, *, layers: int, tiny: bool, device: str) -> dict[str, Any]:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    values = json.loads(CONFIG_27B.read_text())
    values.pop("model_type", None)
    values["layer_types"] = values["layer_types"][:layers]
    values.update(num_hidden_layers=layers, pad_token_id=0, eos_token_id=2, **(TINY if tiny else {}))
    config = Qwen3_5TextConfig(**values)
    config.dtype = torch.bfloat16
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    model.save_pretrained(str(folder), max_shard_size="2GB")
    saved = time.perf_counter() - t1
    files = sorted(folder.glob("*.safetensors"))
    result = {
        "params_b": round(params / 1e9, 3), "layers": layers, "hidden": config.hidden_size,
        "vocab": config.vocab_size, "files": len(files), "bytes_gb": round(sum(f.stat().st_size for f in files) / 1e9, 2),
        "build_s": round(built, 1), "save_s": round(saved, 1), "device": device,
    }
    print(json.dumps(result), flush=True)
    return result


def train(argv: list[str]) -> int:
    """``kernelguard.train``'s own ``main`` with the end-of-run checkpoint skipped (fp32 weights + AdamW
    of ~5.6 B parameters are ~67 GB: more than the machine's disk, and not what is timed); ``--rank0`` first:
    the load forced onto the rank-0 path."""
    from kernelguard.train import loop
    from kernelguard.train.__main__ import main
    from kernelguard.train.model import build

    loop.save = lambda *args, **kwargs: loop.log(args[1], "checkpoint skipped by the bench")
    # No checkpoint is written, so preflight's room-for-a-checkpoint check (12 bytes per parameter: 62 GiB at
    # 8 layers, more than the machine's free disk) is not this run's; writability is still checked.
    from kernelguard.train.startup import preflight
    real_check = preflight.check_output
    preflight.check_output = lambda output, *, need_bytes: real_check(output, need_bytes=0)
    if argv[:1] == ["--rank0"]:
        argv = argv[1:]
        real = build.load_weights

        def rank0_path(model: Any, **kwargs: Any) -> str:
            kwargs.update(plan=None, note="the rank-0 path, forced by bench/gpu/sharded_load_timing.py")
            return real(model, **kwargs)

        build.load_weights = rank0_path
    return main(argv)


_LOADED = re.compile(r"weights: (loaded|initialised) \(([^)]*)\) in ([0-9.]+) s")
_EXPORTED = re.compile(r"exported (\S+) in ([0-9.]+) s \((\d+) safetensors files?\)")


def run_summary(out: Path, name: str) -> dict[str, Any]:
    """What the trainer logged for run ``name`` (OUT/NAME/metrics.jsonl, OUT/NAME.stderr, OUT/NAME.rc)."""
    row: dict[str, Any] = {"rc": _read(out / f"{name}.rc").strip() or None}
    metrics = out / name / "metrics.jsonl"
    records = [json.loads(line) for line in _read(metrics).splitlines() if line.startswith("{")]
    first = next((r for r in records if "start_s" in r), None)
    if first is not None:
        row.update({k: _round(first.get(k)) for k in ("start_s", "load_s", "step_time_s", "peak_mem_gb")})
        row["loss"] = first.get("loss")
        if first.get("start_s") is not None and first.get("step_time_s") is not None:
            row["first_step_done_s"] = round(first["start_s"] + first["step_time_s"], 2)
    log = _read(out / f"{name}.stderr")
    if m := _LOADED.search(log):
        row.update(load_path=m.group(2), load_logged_s=float(m.group(3)))
    if m := _EXPORTED.search(log):
        row.update(export_s=float(m.group(2)), export_files=int(m.group(3)))
    wall = _read(out / f"{name}.wall").strip()
    row["process_wall_s"] = float(wall) if wall else None
    written = _read(out / f"{name}.export_bytes").strip()
    if written and row.get("export_s"):
        row["export_bytes"] = int(written)
        row["export_mb_per_s"] = round(int(written) / row["export_s"] / 1e6, 1)
    return row


def _round(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def summary(out: Path) -> int:
    data: dict[str, Any] = {"checkpoint": json.loads(_read(out / "checkpoint.json") or "null")}
    for name in ("sharded", "rank0"):
        data[name] = run_summary(out, name)
    s, r = data["sharded"], data["rank0"]
    data["headline"] = {
        "X_sharded_start_to_first_step_s": s.get("start_s"),
        "Y_rank0_start_to_first_step_s": r.get("start_s"),
        "sharded_load_s": s.get("load_s"), "rank0_load_s": r.get("load_s"),
        "Z_export_s": s.get("export_s"),
    }
    if s.get("loss") is not None and r.get("loss") is not None:  # both paths must load the same weights
        data["same_first_loss"] = abs(s["loss"] - r["loss"]) <= 1e-3 * max(1.0, abs(s["loss"]))
    rank0_ok = r.get("rc") is None or (r.get("rc") == "0" and r.get("load_path", "").startswith("rank 0"))  # RUNS=sharded
    data["ok"] = s.get("rc") == "0" and rank0_ok and s.get("load_path", "").startswith("each rank") \
        and s.get("export_s") is not None
    (out / "sharded_load_timing.json").write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1), flush=True)
    return 0 if data["ok"] else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        return train(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make")
    p.add_argument("dir", type=Path)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, help="also write the result here")
    p = sub.add_parser("summary")
    p.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.cmd == "summary":
        return summary(args.out)
    result = make(args.dir, layers=args.layers, tiny=args.tiny, device=args.device)
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
