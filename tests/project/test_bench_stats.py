"""bench/lib/step_stats.py: the one step-time statistic of every throughput bench cannot be swamped by one slow
step (an autotune or recompile), and says when a run has too few steady steps to quote."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "lib"))
from step_stats import steady_rate, steady_stats

# issue 20's stock_best run: one 22.68 s autotune step among ~0.4 s steps (here with 2 warm-up and 12 timed).
STEPS = [3.1, 1.2] + [0.43, 0.44, 0.39, 0.44, 22.68, 0.41, 0.40, 0.42, 0.43, 0.41, 0.44, 0.40]


def test_one_autotune_step_is_listed_and_excluded() -> None:
    stats = steady_stats(STEPS, warmup=2)
    assert [o["step"] for o in stats.outliers] == [6]
    assert stats.outliers[0]["s"] == 22.68 and stats.outliers[0]["x_median"] > 50
    assert 6 not in stats.steady and stats.steady == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]
    assert stats.median_s == pytest.approx(0.42)
    assert (stats.min_s, stats.max_s) == (0.39, 0.44)
    assert stats.enough  # 11 steady steps


def test_the_rate_over_steady_steps_is_the_real_throughput() -> None:
    tokens = [8192] * len(STEPS)
    stats = steady_stats(STEPS, warmup=2)
    rate = steady_rate(stats, tokens)
    # ~19.6k tokens/s; a plain mean over the 12 timed steps gives ~3.4k (the swamped figure).
    assert rate == pytest.approx(8192 * 11 / sum(STEPS[i] for i in stats.steady))
    assert 19_000 < rate < 20_500
    swamped = 8192 * 12 / sum(STEPS[2:])
    assert swamped < rate / 5


def test_warmup_steps_never_count_even_when_slow() -> None:
    stats = steady_stats([30.0, 0.5, 0.5, 0.6], warmup=1)
    assert stats.outliers == [] and stats.steady == [1, 2, 3] and stats.max_s == 0.6


def test_a_step_just_under_three_times_the_median_stays() -> None:
    times = [0.4] * 10 + [1.19]
    stats = steady_stats(times, warmup=0)
    assert stats.outliers == [] and stats.max_s == 1.19
    stats = steady_stats([0.4] * 10 + [1.21], warmup=0)
    assert [o["step"] for o in stats.outliers] == [10]


def test_too_few_steady_steps_is_flagged_not_hidden() -> None:
    stats = steady_stats([0.4, 0.41, 22.7], warmup=0)
    assert not stats.enough and len(stats.steady) == 2
    record = stats.to_dict()
    assert record["enough_steady_steps"] is False
    assert record["step_times_s"] == [0.4, 0.41, 22.7]  # every step time is written, outliers included
    assert record["outliers"][0]["step"] == 2


def test_nothing_after_warmup_is_an_error() -> None:
    with pytest.raises(ValueError, match="no step after"):
        steady_stats([0.4, 0.4], warmup=2)
    with pytest.raises(ValueError, match="amounts"):
        steady_rate(steady_stats([0.4, 0.4], warmup=0), [1.0])
