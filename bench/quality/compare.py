"""Compare `kernelguard train` runs of the quality design (bench/quality/gpu_quality.sh): packed and padded
(``--packing none``) over several seeds, and the controls without boundaries (``naive``, ``leaky``).

``python bench/quality/compare.py --dir OUT [--dir OUT2 ...] [--run MODE:SEED=PATH ...] [--unigram unigram.json]
--out-json compare.json --out-png compare.png``: each ``--dir`` is read for ``<mode>.s<seed>.metrics.jsonl``
files; ``--run`` names one more (a metrics.jsonl or a run folder).

Per run: the final and minimum eval loss (whole examples and their first K label tokens), whether the eval loss
was still falling at the end (the last eval below every earlier one), first/final train loss, median tokens/s
over the steady steps. Per mode: mean, standard deviation and spread (max - min) over seeds. Then:

Every mode is compared at the last eval step that every run reached (a run cut by its time limit keeps what it
wrote; the others are read at the same step, ``eval_step`` in the JSON).

- **method gap** (padded vs packed): the difference of the mean eval losses against the seed spread
  (the larger of the two modes' max - min). They *agree* when the difference is within that spread AND within
  ``AGREE_REL`` (0.5%) of padded's mean;
- **control gap** (each control vs packed): the difference against packed's mean, in units of the seed spread;
  the control is *detected* when it is more than ``CONTROL_MARGIN`` spreads away;
- the same two on the first-K-token loss;
- learned: final eval below the unigram baseline and the first step's train loss; still falling at the end.

Every verdict is also one line of ``verdict_lines``, printed at the end. The PNG: eval loss curves (mean and a
min-max band over seeds) for the whole examples and for their first K tokens, and the difference of each mode's
mean curve from packed's with packed's own seed band.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

__all__ = ["AGREE_REL", "CONTROL_MARGIN", "compare", "main", "plot", "read_dirs", "read_run", "summarize"]

WARMUP_STEPS = 10
AGREE_REL = 0.005
CONTROL_MARGIN = 3.0  # seed spreads a control must be away from packed to count as detected
CONTROLS = ("naive", "leaky")
_NAME = re.compile(r"^(?P<mode>[a-z]+)\.s(?P<seed>\d+)\.metrics\.jsonl$")


def read_run(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The train-step and eval records of one run (a folder holding metrics.jsonl, or the file)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        "train": [r for r in records if "loss" in r and "step" in r],
        "eval": [r for r in records if r.get("eval_loss") is not None],
    }


def read_dirs(dirs: list[Path]) -> dict[str, dict[int, Any]]:
    """mode -> seed -> run, from ``<mode>.s<seed>.metrics.jsonl`` files."""
    runs: dict[str, dict[int, Any]] = {}
    for d in dirs:
        for path in sorted(d.glob("*.metrics.jsonl")):
            m = _NAME.match(path.name)
            if m and m["mode"] != "steptime":
                runs.setdefault(m["mode"], {})[int(m["seed"])] = read_run(path)
    return runs


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
    }
    if evals:
        losses = [r["eval_loss"] for r in evals]
        out.update(
            final_eval_loss=losses[-1],
            min_eval_loss=min(losses),
            eval_tokens=evals[-1]["eval_tokens"],
            eval_steps=[r["step"] for r in evals],
            still_falling=len(losses) > 1 and losses[-1] < min(losses[:-1]),
        )
        if "eval_loss_first_k" in evals[-1]:
            out.update(
                final_eval_loss_first_k=evals[-1]["eval_loss_first_k"],
                eval_tokens_first_k=evals[-1]["eval_tokens_first_k"],
                first_k=evals[-1]["eval_first_k"],
            )
        out["by_step"] = {r["step"]: {k: r[k] for k in ("eval_loss", "eval_loss_first_k") if k in r} for r in evals}
    return out


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "spread": max(values) - min(values),
        "values": values,
    }


def common_eval_step(summaries: dict[str, dict[int, Any]]) -> int | None:
    """The last eval step every run reached (a run cut by its time limit is compared where all others were)."""
    lasts = [max(s["by_step"]) for seeds in summaries.values() for s in seeds.values() if s.get("by_step")]
    return min(lasts) if lasts else None


def _by_mode(summaries: dict[str, dict[int, Any]], key: str, step: int) -> dict[str, dict[str, Any]]:
    out = {}
    for mode, seeds in summaries.items():
        values = [s["by_step"][step][key] for _, s in sorted(seeds.items()) if key in s.get("by_step", {}).get(step, {})]
        if values:
            out[mode] = _stats(values)
    return out


def _method_gap(stats: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if "packed" not in stats or "none" not in stats:
        return None
    p, n = stats["packed"], stats["none"]
    diff = p["mean"] - n["mean"]
    spread = max(p["spread"], n["spread"])
    return {
        "packed_minus_padded": diff,
        "rel": abs(diff) / n["mean"],
        "seed_spread": spread,
        "within_spread": abs(diff) <= spread,
        "within_0_5pct": abs(diff) / n["mean"] <= AGREE_REL,
        "agree": abs(diff) <= spread and abs(diff) / n["mean"] <= AGREE_REL,
        "seeds": [p["n"], n["n"]],
    }


def _control_gaps(stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    if "packed" not in stats:
        return out
    p = stats["packed"]
    spread = max(p["spread"], (stats.get("none") or p)["spread"])
    for control in CONTROLS:
        if control in stats:
            gap = stats[control]["mean"] - p["mean"]
            out[control] = {
                "control_minus_packed": gap,
                "rel": abs(gap) / p["mean"],
                "seed_spread": spread,
                "in_spreads": abs(gap) / spread if spread else float("inf"),
                "detected": abs(gap) > CONTROL_MARGIN * spread,
            }
    return out


def compare(runs: dict[str, dict[int, Any]], unigram: dict[str, Any] | None) -> dict[str, Any]:
    summaries = {mode: {seed: summarize(run) for seed, run in seeds.items()} for mode, seeds in runs.items()}
    step = common_eval_step(summaries)
    result: dict[str, Any] = {"runs": summaries, "eval_step": step, "modes": {}, "method_gap": {}, "control_gap": {}}
    for key, label in (("eval_loss", "whole"), ("eval_loss_first_k", "first_k")):
        stats = _by_mode(summaries, key, step) if step is not None else {}
        result["modes"][label] = stats
        result["method_gap"][label] = _method_gap(stats)
        result["control_gap"][label] = _control_gaps(stats)
    if unigram is not None:
        result["unigram_eval_cross_entropy"] = unigram["eval_cross_entropy"]
        result["unigram"] = unigram
    result["verdict_lines"] = verdict_lines(result, summaries, unigram)
    return result


def verdict_lines(result: dict[str, Any], summaries: dict[str, Any], unigram: dict[str, Any] | None) -> list[str]:
    lines = []
    step = result["eval_step"]
    for label, words in ((("whole", f"eval loss at step {step}"),
                          ("first_k", f"eval loss on the first K label tokens at step {step}"))):
        gap = result["method_gap"][label]
        if gap is not None:
            lines.append(
                f"method ({words}): packed vs padded {'AGREE' if gap['agree'] else 'DIFFER'}: difference of means "
                f"{gap['packed_minus_padded']:+.4f} ({100 * gap['rel']:.2f}%) against a seed spread of "
                f"{gap['seed_spread']:.4f} ({gap['seeds'][0]} + {gap['seeds'][1]} seeds)"
            )
        for control, c in result["control_gap"][label].items():
            lines.append(
                f"control {control} ({words}): {'DETECTED' if c['detected'] else 'NOT DETECTED'}: "
                f"{c['control_minus_packed']:+.4f} ({100 * c['rel']:.2f}%) from packed, {c['in_spreads']:.1f} seed "
                f"spreads (detected above {CONTROL_MARGIN:g})"
            )
    finals = [s for seeds in summaries.values() for s in seeds.values() if "final_eval_loss" in s]
    if finals:
        falling = sum(bool(s["still_falling"]) for s in finals)
        lines.append(f"schedule: eval loss still falling at the end in {falling} of {len(finals)} runs")
        learned = all(s["final_eval_loss"] < s["first_train_loss"] for s in finals)
        below = unigram is not None and all(s["final_eval_loss"] < unigram["eval_cross_entropy"] for s in finals)
        lines.append(
            f"learning: every run's final eval loss below its first train loss: {learned}"
            + (f"; below the unigram baseline {unigram['eval_cross_entropy']:.4f}: {below}" if unigram else "")
        )
    return lines


def _mean_curve(seeds: dict[int, Any], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    by_step: dict[int, list[float]] = {}
    for run in seeds.values():
        for r in run["eval"]:
            if key in r:
                by_step.setdefault(r["step"], []).append(r[key])
    steps = sorted(s for s, v in by_step.items() if len(v) == len(seeds))
    return (steps, [statistics.fmean(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])  # fmt: skip


def plot(runs: dict[str, dict[int, Any]], png: Path, unigram: float | None = None) -> Path:
    """Eval curves with seed bands (whole examples, first K tokens) and each mode's difference from packed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"packed": "C0", "none": "C1", "naive": "C3", "leaky": "C4"}
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for ax, key, title in ((axes[0], "eval_loss", "eval loss, whole examples"),
                           (axes[1], "eval_loss_first_k", "eval loss, first K label tokens of each example")):  # fmt: skip
        for mode, seeds in runs.items():
            steps, mean, lo, hi = _mean_curve(seeds, key)
            if not steps:
                continue
            c = colors.get(mode, "C5")
            ax.plot(steps, mean, "o-", ms=3, color=c, label=f"{mode} ({len(seeds)} seed{'s' * (len(seeds) > 1)})")
            ax.fill_between(steps, lo, hi, color=c, alpha=0.25)
        if unigram is not None and key == "eval_loss":
            ax.axhline(unigram, color="gray", ls="--", lw=1, label="unigram baseline")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("nats/token")
        ax.legend(fontsize=8)
    if "packed" in runs:
        ref_steps, ref, lo, hi = _mean_curve(runs["packed"], "eval_loss")
        ref_at = dict(zip(ref_steps, ref))
        axes[2].fill_between(ref_steps, [a - b for a, b in zip(lo, ref)], [a - b for a, b in zip(hi, ref)],
                             color="C0", alpha=0.25, label="packed seed band")  # fmt: skip
        for mode, seeds in runs.items():
            if mode == "packed":
                continue
            steps, mean, _, _ = _mean_curve(seeds, "eval_loss")
            common = [(s, m) for s, m in zip(steps, mean) if s in ref_at]
            axes[2].plot([s for s, _ in common], [m - ref_at[s] for s, m in common], "o-", ms=3,
                         color=colors.get(mode, "C5"), label=f"{mode} - packed (means)")  # fmt: skip
    axes[2].axhline(0.0, color="black", lw=0.5)
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("eval loss difference")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, action="append", default=[], help="a folder of <mode>.s<seed>.metrics.jsonl")
    p.add_argument("--run", action="append", default=[], metavar="MODE:SEED=PATH", help="one more run")
    p.add_argument("--unigram", type=Path, default=None, help="unigram.json from prepare.py")
    p.add_argument("--out-json", type=Path, required=True)
    p.add_argument("--out-png", type=Path, required=True)
    args = p.parse_args(argv)
    runs = read_dirs(args.dir)
    for spec in args.run:
        name, _, path = spec.partition("=")
        mode, _, seed = name.partition(":")
        runs.setdefault(mode, {})[int(seed or 0)] = read_run(Path(path))
    if not runs:
        raise SystemExit("no runs found: pass --dir with <mode>.s<seed>.metrics.jsonl files, or --run")
    unigram = json.loads(args.unigram.read_text()) if args.unigram and args.unigram.exists() else None
    result = compare(runs, unigram)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, args.out_png, unigram["eval_cross_entropy"] if unigram else None)
    print("\n".join(result["verdict_lines"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
