"""Is the GPU busy, or is the step launch-bound? A short torch.profiler window, now and then.

"GPU utilization" near 100% hides a CPU-bound slow path: a torch reference kernel issues tens of thousands of
tiny launches per step and the GPU idles between them. So at one early step (after warm-up and autotuning)
and then every N steps, one step runs under ``torch.profiler`` and is reduced to a few figures: the fraction
of the step's wall time the GPU was running kernels (the union of their intervals, over the step time of
unprofiled steps, since the profiler itself slows the host), kernels and CPU ops per step, process CPU time
per step, and the ops that launch the most kernels. Below ``BUSY_WARN_PCT`` one line names those ops.

The reduction (:func:`summarize_events`) is a pure function of plain :class:`Event` records, so it is tested
with synthetic event lists; :func:`events_from_profiler` turns a real profiler's events into them.
:class:`StepProfiler` decides when to profile and does it, for ``kernelguard train``'s loop and for
``KernelGuardCallback`` alike. Its cost (profiled step and event parsing, minus an unprofiled step) is
measured and reported with the figures.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "BUSY_WARN_PCT",
    "Event",
    "StepProfile",
    "StepProfiler",
    "busy_us",
    "events_from_profiler",
    "summarize_events",
]

BUSY_WARN_PCT = 70.0  # below this share of the step running kernels, the step is launch-bound
TOP_OPS = 4
# Wrapper ranges that enclose whole steps: never the op to blame.
_WRAPPERS = ("ProfilerStep", "## ", "kernelguard.profile")
_RECENT = 5  # unprofiled step times kept as the reference wall time
_MAX_RETRIES = 50  # windows skipped for autotuning before one is reported anyway


@dataclass(frozen=True, slots=True)
class Event:
    """One profiler event. ``kind``: ``op`` (a CPU op or range), ``launch`` (a CUDA runtime/driver call that
    launches a kernel), ``runtime`` (another runtime call), ``kernel`` (a GPU kernel), ``copy`` (a GPU
    memcpy/memset). ``parent``: index of the enclosing CPU event in the same list."""

    name: str
    kind: str
    start_us: float = 0.0
    end_us: float = 0.0
    parent: int | None = None


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
    def launch_bound(self) -> bool:
        busy = self.gpu_busy_pct
        return busy is not None and busy < BUSY_WARN_PCT

    def record(self) -> dict[str, Any]:
        """The keys added to this step's metrics.jsonl record (and KernelGuardCallback's log_history)."""
        busy = self.gpu_busy_pct
        return {
            "gpu_busy_pct": None if busy is None else round(busy, 1),
            "kernels_per_step": None if self.kernels is None else round(self.kernels, 1),
            "cpu_s_per_step": round(self.cpu_s, 4),
            "cpu_ops_per_step": round(self.cpu_ops, 1),
            "launch_bound": self.launch_bound,
            "launch_heavy_ops": [{"op": op, "per_step": round(n, 1)} for op, n in self.top_ops],
            "profile_overhead_s": round(self.overhead_s, 4),
            **({"profile_trace": self.trace} if self.trace else {}),
        }

    def line(self) -> str:
        """One sentence of the figures, for the end-of-run summary."""
        busy = self.gpu_busy_pct
        gpu = (
            "GPU busy n/a (no GPU)"
            if self.gpu_busy_s is None
            else f"GPU busy {busy:.0f}% of the step, {self.kernels:,.0f} kernels/step"
        )
        return f"step {self.step}: {gpu}, {self.cpu_ops:,.0f} CPU ops/step, {self.cpu_s:.3f} s CPU/step"

    def warning(self) -> str | None:
        """One line when the step is launch-bound, naming the ops that launch the most kernels."""
        if not self.launch_bound:
            return None
        ops = ", ".join(f"{op} x{n:,.0f}" for op, n in self.top_ops) or "none attributed"
        return (
            f"launch-bound: at step {self.step} the GPU ran kernels {self.gpu_busy_pct:.0f}% of the step "
            f"(< {BUSY_WARN_PCT:.0f}%; {self.kernels:,.0f} kernels, {self.cpu_s:.2f} s CPU per step); most "
            f"launches per step: {ops} — many small launches, typically a torch reference path or unfused "
            "ops (a trace: --profile-trace DIR)"
        )


# ------------------------------------------------------------------------------------------ reduction ---
def busy_us(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: overlapping kernels (streams) count once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def _blamed_op(events: Sequence[Event], index: int) -> str:
    """The outermost enclosing op that is not a whole-step wrapper: the call the training code made."""
    blamed, parent = None, events[index].parent
    while parent is not None:
        if not events[parent].name.startswith(_WRAPPERS):
            blamed = events[parent].name
        parent = events[parent].parent
    return blamed or "(no enclosing op)"


def summarize_events(
    events: Sequence[Event],
    *,
    step: int,
    steps: int = 1,
    wall_s: float,
    cpu_s: float,
    reference_step_s: float | None = None,
    gpu: bool,
) -> StepProfile:
    """The figures of a window of ``steps`` steps from its events (totals divided by ``steps``).

    Ops are ranked by the kernels they launched on a GPU (by kernel name when no launch call was recorded),
    and by their top-level calls on a CPU-only run."""
    ops = [e for e in events if e.kind == "op" and not e.name.startswith(_WRAPPERS)]
    kernels = [e for e in events if e.kind == "kernel"]
    counts: Counter[str] = Counter()
    if gpu:
        launches = [i for i, e in enumerate(events) if e.kind == "launch"]
        if launches:
            counts.update(_blamed_op(events, i) for i in launches)
        else:
            counts.update(e.name for e in kernels)
    else:
        counts.update(
            e.name for e in ops if e.parent is None or events[e.parent].name.startswith(_WRAPPERS)
        )
    busy = busy_us([(e.start_us, e.end_us) for e in events if e.kind in ("kernel", "copy")])
    return StepProfile(
        step=step,
        steps=steps,
        wall_s=wall_s / steps,
        reference_step_s=reference_step_s,
        cpu_s=cpu_s / steps,
        cpu_ops=len(ops) / steps,
        kernels=len(kernels) / steps if gpu else None,
        gpu_busy_s=busy / 1e6 / steps if gpu else None,
        top_ops=tuple((name, n / steps) for name, n in counts.most_common(TOP_OPS)),
    )


def events_from_profiler(prof: Any) -> list[Event]:
    """A finished ``torch.profiler.profile``'s events as :class:`Event` records (parents by CPU nesting)."""
    from torch.autograd import DeviceType

    raw = list(prof.events())
    index = {id(e): i for i, e in enumerate(raw)}
    out = []
    for e in raw:
        name = e.name
        if e.device_type == DeviceType.CPU:
            runtime = name.startswith(("cuda", "cu", "hip"))
            kind = ("launch" if "Launch" in name else "runtime") if runtime else "op"
        elif getattr(e, "is_user_annotation", False):
            kind = "annotation"  # a GPU-side range around kernels that are counted themselves
        else:
            kind = "copy" if "memcpy" in name.lower() or "memset" in name.lower() else "kernel"
        parent = index.get(id(e.cpu_parent)) if e.cpu_parent is not None else None
        out.append(Event(name, kind, float(e.time_range.start), float(e.time_range.end), parent))
    return out


# ------------------------------------------------------------------------------------------- profiler ---
@dataclass(slots=True)
class StepProfiler:
    """Profiles step ``first_step`` and every ``every`` steps after it (0: never again); ``first_step`` 0
    turns it off. ``begin(step)``/``end(step)`` bracket each step (``run`` does both); only profiled steps
    pay anything beyond two clock reads. ``trace_dir``: the first window is also written as a Chrome/Perfetto
    trace there. ``log``: where the launch-bound warning goes."""

    first_step: int = 3
    every: int = 500
    trace_dir: Path | None = None
    device: Any = None
    log: Callable[[str], None] | None = None
    searches: Callable[[], int] | None = None  # autotune results held so far (default: fla's caches)
    profiles: list[StepProfile] = field(default_factory=list)
    retried: int = 0  # windows thrown away because an autotune search ran inside them
    total_s: float = 0.0
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    _t0: float | None = None
    _cpu0: float = 0.0
    _prof: Any = None
    _searches0: int = 0
    _retry: bool = False

    def due(self, step: int) -> bool:
        if self.first_step <= 0 or step < self.first_step:
            return False
        if self._retry:
            return True
        return step == self.first_step or bool(self.every and (step - self.first_step) % self.every == 0)

    def _search_count(self) -> int:
        if self.searches is not None:
            return self.searches()
        from ..fla_autotune import fla_autotuners

        return sum(len(getattr(tuner, "cache", ())) for _, tuner in fla_autotuners())

    @property
    def gpu(self) -> bool:
        return getattr(self.device, "type", None) == "cuda"

    def run(self, step: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, Any]]:
        """``fn(*args)`` as step ``step``; returns its result and the figures to add to the step's record."""
        self.begin(step)
        result = fn(*args)
        return result, self.end(step)

    def begin(self, step: int) -> None:
        if self._t0 is not None:  # already begun (a callback's per-micro-batch hook): one window per step
            return
        if self.due(step):
            from torch.profiler import ProfilerActivity, profile

            self._sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
            self._searches0 = self._search_count()
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()

    def end(self, step: int) -> dict[str, Any]:
        if self._t0 is None:
            return {}
        prof, t0 = self._prof, self._t0
        self._prof = self._t0 = None
        if prof is None:
            wall = time.perf_counter() - t0
            self._recent.append(wall)
            self.total_s += wall
            return {}
        self._sync()
        wall, cpu = time.perf_counter() - t0, time.process_time() - self._cpu0
        prof.__exit__(None, None, None)
        # A search inside the window launches each candidate config many times: the figures would describe
        # the autotuner, not the step (a busy GPU read launch-bound). Profile the next step instead.
        self._retry = self._search_count() > self._searches0 and self.retried < _MAX_RETRIES
        if self._retry:
            self.retried += 1
            self.total_s += wall
            return {}
        reference = statistics.median(self._recent) if self._recent else None
        profile = summarize_events(
            events_from_profiler(prof), step=step, wall_s=wall, cpu_s=cpu, reference_step_s=reference,
            gpu=self.gpu,
        )
        trace = self._write_trace(prof, step)
        spent = time.perf_counter() - t0
        self.total_s += spent
        profile = replace(profile, trace=trace)
        profile = replace(profile, overhead_s=max(0.0, spent - profile.step_s))
        self.profiles.append(profile)
        warning = profile.warning()
        if warning and self.log is not None:
            self.log(warning)
        return profile.record()

    def summary(self) -> str | None:
        """The end-of-run line: the figures of the last window and what profiling cost."""
        if not self.profiles:
            return None
        last = self.profiles[-1]
        cost = sum(p.overhead_s for p in self.profiles)
        pct = 100.0 * cost / self.total_s if self.total_s > 0 else 0.0
        bound = "launch-bound" if last.launch_bound else "not launch-bound" if last.gpu_busy_s is not None else ""
        head = f"profile ({len(self.profiles)} window(s)): {last.line()}" + (f"; {bound}" if bound else "")
        return f"{head}; profiling cost {cost:.2f} s, {pct:.1f}% of the steps' time"

    def _write_trace(self, prof: Any, step: int) -> str | None:
        if self.trace_dir is None or len(self.profiles) > 0:
            return None
        path = Path(self.trace_dir) / f"trace_step{step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if self.log is not None:
            self.log(f"profile trace of step {step}: {path} (open it in https://ui.perfetto.dev)")
        return str(path)

    def _sync(self) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize(self.device)

