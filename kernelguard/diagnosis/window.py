"""One profiled window's figures (:class:`StepProfile`), a pure function of its events: ops ranked by what they
launched, GPU busy, kernels per step and the verdict of :mod:`kernelguard.diagnosis.verdict`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .events import WRAPPERS, Event, busy_and_gap_us
from .verdict import Diagnosis, KernelRecord, attribute_kernels, diagnose

__all__: list[str] = [
    "StepProfile",
    "TOP_OPS",
    "summarize_events",
]



TOP_OPS = 4


@dataclass(frozen=True, slots=True)
class StepProfile:
    """The figures of one profiled window (per step); GPU figures are None on a CPU-only run."""

    step: int
    steps: int
    wall_s: float  # profiled, per step
    reference_step_s: float | None  # median of recent unprofiled steps
    cpu_s: float  # process CPU time per step
    cpu_ops: float
    kernels: float | None
    gpu_busy_s: float | None  # union of kernel/copy intervals per step
    top_ops: tuple[tuple[str, float], ...]  # (op, count per step), by kernel launches (GPU) or calls (CPU)
    overhead_s: float = 0.0  # what the window cost beyond an unprofiled step
    trace: str | None = None
    diagnosis: Diagnosis | None = None  # None on a CPU-only run

    @property
    def step_s(self) -> float:
        """The step time busy is measured against: the recent unprofiled steps' median, but never more than
        the profiled step itself (the profiler only slows a step down, so a larger median means those steps
        were still compiling or autotuning, and would make a busy GPU look idle)."""
        if self.reference_step_s and self.reference_step_s > 0:
            return min(self.reference_step_s, self.wall_s)
        return self.wall_s

    @property
    def gpu_busy_pct(self) -> float | None:
        if self.gpu_busy_s is None:
            return None
        wall = self.step_s
        return min(100.0, 100.0 * self.gpu_busy_s / wall) if wall > 0 else None

    @property
    def verdict(self) -> str | None:
        return None if self.diagnosis is None else self.diagnosis.verdict

    def record(self) -> dict[str, Any]:
        """The keys added to this step's metrics.jsonl record (and KernelGuardCallback's log_history)."""
        busy = self.gpu_busy_pct
        return {
            "gpu_busy_pct": None if busy is None else round(busy, 1),
            "kernels_per_step": None if self.kernels is None else round(self.kernels, 1),
            "cpu_s_per_step": round(self.cpu_s, 4),
            "cpu_ops_per_step": round(self.cpu_ops, 1),
            **(self.diagnosis.record() if self.diagnosis is not None else {"verdict": None}),
            "launch_heavy_ops": [{"op": op, "per_step": round(n, 1)} for op, n in self.top_ops],
            "profile_overhead_s": round(self.overhead_s, 4),
            **({"profile_trace": self.trace} if self.trace else {}),
        }

    def line(self) -> str:
        """One sentence of the figures, for the end-of-run summary."""
        if self.diagnosis is None:
            gpu = "GPU figures n/a (no GPU)"
        else:
            gpu = f"{self.diagnosis.line}; {self.kernels:,.0f} kernels/step, GPU busy {self.gpu_busy_pct:.0f}%"
        return f"step {self.step}: {gpu}, {self.cpu_ops:,.0f} CPU ops/step, {self.cpu_s:.3f} s CPU/step"

    def warning(self) -> str | None:
        """One line when the verdict is not healthy."""
        if self.diagnosis is None or not self.diagnosis.alarm:
            return None
        return f"at step {self.step}: {self.diagnosis.line} (a trace: --profile-trace DIR)"


def summarize_events(
    events: Sequence[Event],
    *,
    step: int,
    steps: int = 1,
    wall_s: float,
    cpu_s: float,
    reference_step_s: float | None = None,
    gpu: bool,
    layers: int | None = None,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    fix: str | None = None,
) -> StepProfile:
    """The figures of a window of ``steps`` steps from its events (totals divided by ``steps``).

    Ops are ranked by the kernels they launched on a GPU, and by their top-level calls on a CPU-only run."""
    ops = [e for e in events if e.kind == "op" and not e.name.startswith(WRAPPERS)]
    counts: Counter[str] = Counter()
    diagnosis = None
    kernels: list[KernelRecord] = []
    if gpu:
        kernels = attribute_kernels(events)
        counts.update(k.op for k in kernels if not k.copy)
    else:
        counts.update(
            e.name for e in ops if e.parent is None or events[e.parent].name.startswith(WRAPPERS)
        )
    profile = StepProfile(
        step=step,
        steps=steps,
        wall_s=wall_s / steps,
        reference_step_s=reference_step_s,
        cpu_s=cpu_s / steps,
        cpu_ops=len(ops) / steps,
        kernels=sum(1 for k in kernels if not k.copy) / steps if gpu else None,
        gpu_busy_s=busy_and_gap_us([(k.start_us, k.end_us) for k in kernels])[0] / 1e6 / steps if gpu else None,
        top_ops=tuple((name, n / steps) for name, n in counts.most_common(TOP_OPS)),
    )
    if gpu:
        diagnosis = diagnose(
            kernels, steps=steps, step_s=profile.step_s, layers=layers, flops_per_step=flops_per_step,
            peak_flops=peak_flops, fix=fix,
        )
        profile = replace(profile, diagnosis=diagnosis)
    return profile
