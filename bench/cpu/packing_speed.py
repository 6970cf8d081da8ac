"""Packing speed and fill on 200,000 chat-length examples (goal: < 10 s on 2 cores).

Run: `pytest bench/cpu/packing_speed.py --benchmark-only` (pytest-benchmark), or `python bench/cpu/packing_speed.py
[ROUNDS]` for one JSON line: 1 warm-up + ROUNDS (default 10) timed rounds per packer through bench/lib/step_stats.py
(median/min/max, outliers excluded, every round's time in the JSON). Lengths: lognormal, median ~1,100 tokens (as in DEVICE.md's reference runs),
clipped to [16, 8192]; block size 8192.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from kernelguard.train.step.packing import (
    build_packed_block,
    pack_best_fit_decreasing,
    pack_sequential_greedy,
    packing_stats,
)

N_EXAMPLES = 200_000
BLOCK = 8192


def chat_lengths(n: int = N_EXAMPLES, *, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(BLOCK, int(rng.lognormvariate(7.0, 0.8)))) for _ in range(n)]


def test_bench_best_fit_decreasing(benchmark: Any) -> None:
    lengths = chat_lengths()
    blocks = benchmark.pedantic(
        pack_best_fit_decreasing, args=(lengths, BLOCK), kwargs={"seed": 0}, rounds=3, iterations=1
    )
    stats = packing_stats(blocks, lengths, BLOCK)
    benchmark.extra_info.update(stats.to_dict())
    assert stats.examples == N_EXAMPLES


def test_bench_sequential_greedy(benchmark: Any) -> None:
    lengths = chat_lengths()
    blocks = benchmark.pedantic(pack_sequential_greedy, args=(lengths, BLOCK), rounds=3, iterations=1)
    benchmark.extra_info.update(packing_stats(blocks, lengths, BLOCK).to_dict())


def test_bench_build_packed_block(benchmark: Any) -> None:
    lengths = chat_lengths(2000)
    blocks = pack_best_fit_decreasing(lengths, BLOCK)
    examples = [(list(range(n)), list(range(n))) for n in lengths]
    block = blocks[len(blocks) // 2]
    benchmark(build_packed_block, [examples[i] for i in block], BLOCK, 0)


def main(rounds: int = 10) -> None:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "lib"))
    from step_stats import steady_stats

    lengths = chat_lengths()
    out: dict[str, Any] = {"examples": N_EXAMPLES, "block_size": BLOCK, "tokens": sum(lengths)}
    for name, fn in (
        ("bfd", lambda: pack_best_fit_decreasing(lengths, BLOCK, seed=0)),
        ("greedy", lambda: pack_sequential_greedy(lengths, BLOCK)),
    ):
        times = []
        for _ in range(1 + rounds):
            t0 = time.perf_counter()
            blocks = fn()
            times.append(time.perf_counter() - t0)
        stats = steady_stats(times, warmup=1)
        out[name] = {"seconds": round(stats.median_s, 3), "step_stats": stats.to_dict(),
                     **packing_stats(blocks, lengths, BLOCK).to_dict()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
