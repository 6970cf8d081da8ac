"""Compare `kernelguard train` runs of the same data and seed: packed, padded (``--packing none``) and the
negative control (``--packing leaky``), from their metrics.jsonl files.

``python bench/quality/compare.py --packed DIR --padded DIR [--leaky DIR] [--unigram unigram.json]
--out-json compare.json --out-png compare.png`` (each DIR a run's output folder or its metrics.jsonl).

The JSON holds, per run: steps, first/final train loss, first/final/min eval loss, median tokens/s over the
steady steps (the first ``WARMUP_STEPS`` steps compile and autotune, so they are left out) and the training
time; then the relative gaps (final and min eval loss, and the largest per-step train-loss gap) of padded and
of the control against packed, the unigram baseline, and the verdicts the quality issue asks for: packed within
1% (goal 0.5%) of padded, the control further from packed than padded is by ``CONTROL_MARGIN`` times, and a model
that learned (final eval loss below the first step's train loss, the untrained model's, and below the unigram
baseline). The plot: train and eval
curves of every run, and below them the differences against packed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["CONTROL_MARGIN", "compare", "main", "plot", "read_run", "summarize"]

WARMUP_STEPS = 5
CONTROL_MARGIN = 5.0  # how many times the packed-padded gap the control's gap must exceed


def read_run(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The train-step and eval records of one run (a folder holding metrics.jsonl, or the file)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        "train": [r for r in records if "loss" in r and "step" in r],
        "eval": [r for r in records if r.get("eval_loss") is not None],
    }


def summarize(run: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    train, evals = run["train"], run["eval"]
    if not train:
        raise SystemExit("a run has no training steps in its metrics.jsonl")
    steady = train[WARMUP_STEPS:] or train
    out: dict[str, Any] = {
        "steps": train[-1]["step"],
        "first_train_loss": train[0]["loss"],
        "final_train_loss": train[-1]["loss"],
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steady),
        "train_seconds": sum(r["step_time_s"] for r in train),
        "padding_pct_mean": statistics.fmean(r["padding_pct"] for r in train),
    }
    if evals:
        out.update(
            first_eval_loss=evals[0]["eval_loss"],
            final_eval_loss=evals[-1]["eval_loss"],
            min_eval_loss=min(r["eval_loss"] for r in evals),
            eval_tokens=evals[-1]["eval_tokens"],
        )
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _gaps(runs: dict[str, Any], summaries: dict[str, Any], name: str) -> dict[str, Any]:
    """``name`` against packed, on the steps both ran (a run cut short is compared on its prefix): eval-loss
    gaps at the last eval step both have, and the median and largest per-step train-loss gaps."""
    ref, other = summaries["packed"], summaries[name]
    by_step = {r["step"]: r["loss"] for r in runs["packed"]["train"]}
    step_gaps = [_rel(r["loss"], by_step[r["step"]]) for r in runs[name]["train"] if r["step"] in by_step]
    gaps: dict[str, Any] = {
        "common_train_steps": len(step_gaps),
        "median_step_train_loss_rel": statistics.median(step_gaps) if step_gaps else None,
        "max_step_train_loss_rel": max(step_gaps, default=None),
    }
    ref_eval = {r["step"]: r["eval_loss"] for r in runs["packed"]["eval"]}
    common = [r for r in runs[name]["eval"] if r["step"] in ref_eval]
    if common:
        gaps["common_eval_step"] = common[-1]["step"]
        gaps["final_eval_loss_rel"] = _rel(common[-1]["eval_loss"], ref_eval[common[-1]["step"]])
        gaps["eval_loss_rel_by_step"] = {r["step"]: _rel(r["eval_loss"], ref_eval[r["step"]]) for r in common}
    gaps["speedup_packed_over"] = ref["tokens_per_s_median"] / other["tokens_per_s_median"]
    return gaps


def compare(runs: dict[str, Any], unigram: dict[str, Any] | None) -> dict[str, Any]:
    summaries = {name: summarize(run) for name, run in runs.items()}
    result: dict[str, Any] = {"runs": summaries, "vs_packed": {}}
    for name in runs:
        if name != "packed":
            result["vs_packed"][name] = _gaps(runs, summaries, name)
    if unigram is not None:
        result["unigram_eval_cross_entropy"] = unigram["eval_cross_entropy"]
        result["unigram"] = unigram
    result["verdicts"] = _verdicts(summaries, result["vs_packed"], unigram)
    return result


def _verdicts(
    summaries: dict[str, Any], gaps: dict[str, Any], unigram: dict[str, Any] | None
) -> dict[str, Any]:
    packed = summaries["packed"]
    out: dict[str, Any] = {}
    padded = gaps.get("padded", {}).get("final_eval_loss_rel")
    if padded is not None:
        out["packed_within_1pct_of_padded"] = padded <= 0.01
        out["packed_within_0_5pct_of_padded"] = padded <= 0.005
    control = gaps.get("leaky", {}).get("final_eval_loss_rel")
    if control is not None and padded is not None:
        out["control_over_padded_gap"] = control / padded if padded else float("inf")
        out["control_detected"] = control > CONTROL_MARGIN * padded
    if "final_eval_loss" in packed:
        out["learned_below_start"] = packed["final_eval_loss"] < packed["first_train_loss"]
        if unigram is not None:
            out["learned_below_unigram"] = packed["final_eval_loss"] < unigram["eval_cross_entropy"]
    return out


def plot(runs: dict[str, Any], png: Path, unigram: float | None = None) -> Path:
    """Train and eval curves of every run (top) and each run's difference from packed (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ref_train = {r["step"]: r["loss"] for r in runs["packed"]["train"]}
    ref_eval = {r["step"]: r["eval_loss"] for r in runs["packed"]["eval"]}
    for (name, run), color in zip(runs.items(), ("C0", "C1", "C3")):
        steps = [r["step"] for r in run["train"]]
        top.plot(
            steps, [r["loss"] for r in run["train"]], color=color, alpha=0.5, lw=0.8, label=f"{name} train"
        )
        if run["eval"]:
            ev = run["eval"]
            top.plot(
                [r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", color=color, label=f"{name} eval"
            )
        if name == "packed":
            continue
        common = [r for r in run["train"] if r["step"] in ref_train]
        bottom.plot([r["step"] for r in common], [r["loss"] - ref_train[r["step"]] for r in common],
                    color=color, alpha=0.5, lw=0.8, label=f"{name} - packed, train")  # fmt: skip
        common_ev = [r for r in run["eval"] if r["step"] in ref_eval]
        bottom.plot([r["step"] for r in common_ev], [r["eval_loss"] - ref_eval[r["step"]] for r in common_ev],
                    "o-", color=color, label=f"{name} - packed, eval")  # fmt: skip
    if unigram is not None:
        top.axhline(unigram, color="gray", ls="--", lw=1, label="unigram baseline (eval)")
    top.set_ylabel("loss (nats/token)")
    top.legend(fontsize=8)
    bottom.axhline(0.0, color="black", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packed", type=Path, required=True)
    p.add_argument("--padded", type=Path, required=True)
    p.add_argument("--leaky", type=Path, default=None, help="the negative control (--packing leaky)")
    p.add_argument("--unigram", type=Path, default=None, help="unigram.json from prepare.py")
    p.add_argument("--out-json", type=Path, required=True)
    p.add_argument("--out-png", type=Path, required=True)
    args = p.parse_args(argv)
    runs = {"packed": read_run(args.packed), "padded": read_run(args.padded)}
    if args.leaky is not None:
        runs["leaky"] = read_run(args.leaky)
    unigram = json.loads(args.unigram.read_text()) if args.unigram else None
    result = compare(runs, unigram)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, args.out_png, unigram["eval_cross_entropy"] if unigram else None)
    print(json.dumps({"vs_packed": result["vs_packed"], "verdicts": result["verdicts"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
