"""Step-time statistics that one slow step cannot swamp: the one helper every throughput bench uses.

A mean over a handful of timed steps is at the mercy of a single Triton autotune or a torch.compile recompile:
one 22.7 s step among 0.4 s steps turned a 17,286 tokens/s baseline into 1,453 (bench/RESULTS.md, speed).
``steady_stats`` drops the warm-up steps, takes the median of the rest, lists every step slower than
``outlier_factor`` x that median as an outlier (autotune/recompile), and reports median/min/max/mean over the
steps that remain. ``steady_rate`` turns per-step amounts (tokens, FLOPs) into a rate over those same steps.
A bench writes ``SteadyStats.to_dict()`` into its JSON, so every step time is on record next to the figure.

    import sys; sys.path.insert(0, "bench/lib"); from step_stats import steady_stats
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MIN_STEADY_STEPS", "OUTLIER_FACTOR", "SteadyStats", "steady_rate", "steady_stats"]

MIN_STEADY_STEPS = 10  # fewer steady steps than this and the figure is flagged, not trusted
OUTLIER_FACTOR = 3.0  # a step this many times the median is an autotune/recompile, not throughput


@dataclass(frozen=True, kw_only=True)
class SteadyStats:
    """Every step time, which ones count, and the statistics of those that do."""

    step_times_s: list[float]  # every step, warm-up included, in order
    warmup: int  # the first `warmup` steps are never counted
    steady: list[int]  # indices into step_times_s of the counted steps
    outliers: list[dict[str, float]] = field(default_factory=list)  # {"step", "s", "x_median"}
    median_s: float
    min_s: float
    max_s: float
    mean_s: float
    min_steady: int = MIN_STEADY_STEPS

    @property
    def enough(self) -> bool:
        """True when at least ``min_steady`` steps remain after warm-up and outliers."""
        return len(self.steady) >= self.min_steady

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_times_s": [round(t, 4) for t in self.step_times_s],
            "warmup_steps": self.warmup,
            "steady_steps": len(self.steady),
            "steady_step_indices": list(self.steady),
            "outliers": self.outliers,
            "median_s": round(self.median_s, 4),
            "min_s": round(self.min_s, 4),
            "max_s": round(self.max_s, 4),
            "mean_s": round(self.mean_s, 4),
            "enough_steady_steps": self.enough,
            "rule": f"first {self.warmup} steps are warm-up; a step > {OUTLIER_FACTOR:g}x the median of the rest is "
            f"an outlier (autotune/recompile) and excluded; >= {self.min_steady} steady steps wanted",
        }


def steady_stats(
    step_times: Sequence[float], warmup: int, *, outlier_factor: float = OUTLIER_FACTOR,
    min_steady: int = MIN_STEADY_STEPS,
) -> SteadyStats:
    """Statistics over the steps after ``warmup``, excluding every step > ``outlier_factor`` x their median.

    ``step_times`` holds every timed step in order, warm-up included. Raises ``ValueError`` when no step is left
    after the warm-up (a figure from nothing). Fewer than ``min_steady`` steady steps is allowed (a CPU smoke run)
    but ``enough`` is then False, and the JSON says so.
    """
    times = [float(t) for t in step_times]
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    after = list(range(warmup, len(times)))
    if not after:
        raise ValueError(f"no step after the {warmup} warm-up step(s) ({len(times)} timed)")
    median_all = statistics.median(times[i] for i in after)
    limit = outlier_factor * median_all
    outliers = [
        {"step": i, "s": round(times[i], 4), "x_median": round(times[i] / median_all, 1) if median_all else 0.0}
        for i in after
        if times[i] > limit
    ]
    out = {o["step"] for o in outliers}
    steady = [i for i in after if i not in out]
    kept = [times[i] for i in steady]
    return SteadyStats(
        step_times_s=times, warmup=warmup, steady=steady, outliers=outliers,
        median_s=statistics.median(kept), min_s=min(kept), max_s=max(kept), mean_s=statistics.fmean(kept),
        min_steady=min_steady,
    )


def steady_rate(stats: SteadyStats, amounts: Sequence[float]) -> float:
    """Sum of ``amounts`` (per step, aligned with ``stats.step_times_s``) over the steady steps, per second."""
    if len(amounts) != len(stats.step_times_s):
        raise ValueError(f"{len(amounts)} amounts for {len(stats.step_times_s)} step times")
    seconds = sum(stats.step_times_s[i] for i in stats.steady)
    return sum(amounts[i] for i in stats.steady) / seconds if seconds else 0.0
