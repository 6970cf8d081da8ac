"""Helper of bench/gpu/levers_widths_export.sh: one summary JSON and the Markdown tables for bench/RESULTS.md.

    python bench/gpu/levers_widths_export_summary.py OUT

Reads OUT/levers_widths_export_{proxy,levers,real}.json (bench/gpu/train_throughput.py --all), OUT/export/
(bench/gpu/sharded_load_timing.sh: sharded_load_timing.json) and OUT/check_times.txt; writes
OUT/levers_widths_export_summary.json and OUT/levers_widths_export_tables.md. Every throughput figure is a median over steady
steps (bench/lib/step_stats.py: warm-up dropped, > 3x median = outlier, listed and excluded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RUNS = ("proxy", "levers", "real")


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def variant_rows(out: Path) -> list[dict[str, Any]]:
    """One row per (run, variant): tokens/s from the median step, step stats, MFU, memory, class split."""
    rows = []
    for run in RUNS:
        data = _load(out / f"levers_widths_export_{run}.json") or {}
        for spec, r in (data.get("variants") or {}).items():
            stats = r.get("step_stats") or {}
            median = stats.get("median_s")
            tokens = r.get("real_tokens_measured") or 0
            steady = stats.get("steady_steps") or 0
            rows.append({
                "run": run, "variant": spec, "ok": r.get("ok"), "product_path": r.get("product_path"),
                "tokens_per_step": round(tokens / steady) if steady else None,
                "median_step_s": median, "min_s": stats.get("min_s"), "max_s": stats.get("max_s"),
                "steady_steps": steady, "outliers": stats.get("outliers"),
                "tokens_per_s_median": round(tokens / steady / median, 1) if steady and median else None,
                "tokens_per_s": r.get("tokens_per_s"),
                "mfu_vs_measured_matmul": r.get("mfu_vs_measured_matmul"),
                "matmul_tflops": (r.get("matmul_bf16") or {}).get("tflops"),
                "peak_memory_gib": round(r.get("peak_memory_bytes", 0) / 2**30, 1),
                "flags": r.get("flags"), "gpu_busy_fraction": r.get("gpu_busy_fraction"),
                "gpu_ms_by_class_per_step": r.get("gpu_ms_by_class_per_step"),
                "gpu_pct_by_class": r.get("gpu_pct_by_class"), "matmul_ops": r.get("matmul_ops"),
                "top_gpu_kernels": r.get("top_gpu_kernels"), "classifier": r.get("classifier"),
                "params": (r.get("config") or {}).get("params"), "notes": r.get("notes"),
            })
        for spec, err in (data.get("errors") or {}).items():
            if not any(x["run"] == run and x["variant"] == spec for x in rows):
                rows.append({"run": run, "variant": spec, "ok": False, "error": str(err.get("returncode")),
                             "error_tail": str(err.get("output_tail", ""))[-600:]})
    stock = {r["run"]: r.get("tokens_per_s_median") for r in rows if r["variant"] == "stock_best"}
    default = {r["run"]: r.get("tokens_per_s_median") for r in rows if r["variant"] == "product_default"}
    for r in rows:
        base, own = stock.get("proxy"), r.get("tokens_per_s_median")
        if r["run"] in ("proxy", "levers") and base and own:
            r["vs_stock_best"] = round(own / base, 3)
        ref = default.get("proxy") if r["run"] == "levers" else default.get(r["run"])
        if ref and own:
            r["vs_product_default"] = round(own / ref, 3)
    return rows


def tables(rows: list[dict[str, Any]], export: Any, check: list[str]) -> str:
    lines = ["### Throughput (median over steady steps; outliers listed, excluded)", "",
             ("| run | variant | tokens/step | median step s (min-max) | tok/s | vs stock best | vs default | "
              "MFU vs matmul | peak GiB | outliers |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("median_step_s"):
            lines.append(f"| {r['run']} | {r['variant']} | failed: {r.get('error', '?')} | | | | | | | |")
            continue
        outliers = ", ".join(f"step {o['step']}: {o['s']} s" for o in r.get("outliers") or []) or "none"
        lines.append(
            f"| {r['run']} | {r['variant']} | {r['tokens_per_step']:,} | {r['median_step_s']} "
            f"({r['min_s']}-{r['max_s']}) | {r['tokens_per_s_median']:,} | {r.get('vs_stock_best', '')} | "
            f"{r.get('vs_product_default', '')} | {r.get('mfu_vs_measured_matmul')} | {r['peak_memory_gib']} | "
            f"{outliers} |")
    for r in rows:
        if r["variant"] not in ("product_default", "stock_best") or not r.get("gpu_ms_by_class_per_step"):
            continue
        lines += ["", f"### GPU time by kernel class: {r['run']} {r['variant']} ({r.get('classifier')})", "",
                  "| class | ms / step | % of GPU time |", "|---|---|---|"]
        pct = r.get("gpu_pct_by_class") or {}
        lines += [f"| {c} | {ms} | {pct.get(c)} |" for c, ms in r["gpu_ms_by_class_per_step"].items()]
        if r.get("matmul_ops"):
            lines += ["", "| matmul op (input shapes) | calls / step | ms / step | TFLOP/s achieved |",
                      "|---|---|---|---|"]
            lines += [f"| {m['op']} {m['shapes']} | {m['calls_per_step']} | {m['ms_per_step']} | "
                      f"{m['tflops_achieved']} |" for m in r["matmul_ops"]]
        if r.get("top_gpu_kernels"):
            lines += ["", "| top kernel | calls / step | ms / step | % |", "|---|---|---|---|"]
            lines += [f"| `{k['kernel'][:90]}` | {k['calls_per_step']} | {k['ms_per_step']} | {k['pct_of_gpu_time']} |"
                      for k in r["top_gpu_kernels"][:10]]
    if export:
        run = (export.get("runs") or {}).get("sharded") or export.get("sharded") or {}
        lines += ["", "### Export", "", "```", json.dumps({"checkpoint": export.get("checkpoint"), "sharded": run},
                                                           indent=1), "```"]
    if check:
        lines += ["", "### check --run", "", "```", *check, "```"]
    return "\n".join(lines) + "\n"


def main(out: Path) -> int:
    rows = variant_rows(out)
    export = _load(out / "export" / "sharded_load_timing.json")
    try:
        check = (out / "check_times.txt").read_text().splitlines()
    except OSError:
        check = []
    summary = {"variants": rows, "export": export, "check": check}
    (out / "levers_widths_export_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    text = tables(rows, export, check)
    (out / "levers_widths_export_tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
