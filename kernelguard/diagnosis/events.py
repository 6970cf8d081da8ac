"""A profiled window as plain records: the :class:`Event` type every stage of the diagnosis reads, and the one
interval arithmetic (how long the GPU ran something, and its longest wait)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Event",
    "WRAPPERS",
    "busy_and_gap_us",
]

# Ranges that enclose whole steps: never the op to blame, never an op of the step.
WRAPPERS = ("ProfilerStep", "## ", "kernelguard.profile")


def busy_and_gap_us(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(length of the union of ``(start, end)`` intervals, the longest stretch between them): overlapping kernels
    (streams) count once."""
    if not intervals:
        return 0.0, 0.0
    spans = sorted(intervals)
    busy, gap, cur_start, cur_end = 0.0, 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gap = max(gap, start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return busy + cur_end - cur_start, gap


@dataclass(frozen=True, slots=True)
class Event:
    """One profiler event. ``kind``: ``op`` (a CPU op or range), ``launch`` (a CUDA runtime/driver call that
    launches a kernel), ``runtime`` (another runtime call), ``kernel`` (a GPU kernel), ``copy`` (a GPU
    memcpy/memset). ``parent``: index of the enclosing CPU event in the same list; for a kernel, the op that
    launched it. ``seq``: autograd's sequence number of an op (-1: none); a backward node carries the number
    of the forward op that created it."""

    name: str
    kind: str
    start_us: float = 0.0
    end_us: float = 0.0
    parent: int | None = None
    seq: int = -1
