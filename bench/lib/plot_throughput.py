#!/usr/bin/env python
"""Bar chart of bench/gpu/train_throughput.py output: real tokens/s and MFU per variant.

python bench/lib/plot_throughput.py combined.json out.png              # --all output
python bench/lib/plot_throughput.py out.png tp_c.json tp_d.json ...     # single-variant files of ONE run

Variants that appear at several --tokens-per-batch values are labelled with the block size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LABELS = {
    "a": "a: fallback\npadded 2D",
    "b": "b: stock packing\n(position_ids, SDPA)",
    "c": "c: kernelguard\n(varlen, BFD)",
    "d": "d: c without\nactivation ckpt",
    "e": "e: d + chunked\nlinear CE",
}
COLORS = ["#b0b0b0", "#6a9fd4", "#2e7d32", "#f9a825", "#c62828", "#6a1b9a", "#00838f", "#4e342e"]


def merge(files: list[dict[str, Any]]) -> dict[str, Any]:
    """Single-variant results of one run -> the --all layout; keys gain the block size where it varies."""
    tokens = {f.get("data", {}).get("tokens_per_batch") for f in files}
    variants: dict[str, Any] = {}
    for f in files:
        key = f["variant"]
        if len(tokens) > 1:
            key += f" {int(f['data']['tokens_per_batch']) // 1024}k"
        variants[key] = f
    return {"variants": variants}


def _variants(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if "variants" in data:
        return {k: v for k, v in data["variants"].items() if isinstance(v, dict)}
    if "variant" in data:  # a single-variant file
        return {data["variant"]: data}
    raise ValueError("expected train_throughput JSON (--all output or one variant)")


def plot(data: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _variants(data)
    names = sorted(runs, key=lambda n: (n.split()[0], int(n.split()[1][:-1]) if " " in n else 0))
    labels = [
        LABELS.get(n.split()[0], n).replace(":", (" " + n.split()[1] + ":") if " " in n else ":", 1)
        + ("\n[fla refusal lifted]" if runs[n].get("fla_hopper_refusal_lifted") else "")
        for n in names
    ]
    tps = [float(runs[n].get("tokens_per_s") or 0.0) for n in names]
    mfu = [100.0 * float(runs[n].get("mfu") or 0.0) for n in names]
    mfu_mm = [100.0 * float(runs[n].get("mfu_vs_measured_matmul") or 0.0) for n in names]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(12, 3.6 * len(names)), 5.0))
    bars = ax1.bar(labels, tps, color=[COLORS[i % len(COLORS)] for i in range(len(names))])
    base = tps[names.index("a")] if "a" in names and tps[names.index("a")] else None
    for bar, value in zip(bars, tps):
        text = f"{value:,.0f}" + (f"\n{value / base:.2f}x" if base else "")
        ax1.annotate(text, (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=9)
    ax1.tick_params(axis="x", labelsize=8)
    ax1.set_ylabel("real (non-pad) tokens / s")
    ax1.set_title("Training throughput")
    ax1.margins(y=0.2)

    x = range(len(names))
    width = 0.38
    ax2.bar([i - width / 2 for i in x], mfu, width, label="vs datasheet bf16 peak")
    mm_n = next((r.get("matmul_bf16", {}).get("n") for r in runs.values() if r.get("matmul_bf16")), "?")
    ax2.bar([i + width / 2 for i in x], mfu_mm, width, label=f"vs measured {mm_n}^3 bf16 matmul in-process")
    for i, (m1, m2) in enumerate(zip(mfu, mfu_mm)):
        ax2.annotate(f"{m1:.1f}", (i - width / 2, m1), ha="center", va="bottom", fontsize=8)
        ax2.annotate(f"{m2:.1f}", (i + width / 2, m2), ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("MFU (%)")
    ax2.set_title("Model FLOPs utilization")
    ax2.legend(fontsize=8)
    ax2.margins(y=0.2)

    device = next((r.get("device") for r in runs.values() if r.get("device")), "")
    fig.suptitle(f"Qwen3.5-shaped 1.16 B proxy, bf16, AdamW, one run on {device}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    if len(args) == 2 and not args[0].endswith(".png"):
        src, out = Path(args[0]), Path(args[1])
        print(plot(json.loads(src.read_text()), out))
        return 0
    out = Path(args[0])
    print(plot(merge([json.loads(Path(a).read_text()) for a in args[1:]]), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
