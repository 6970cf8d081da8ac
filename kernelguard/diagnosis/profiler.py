"""Where a training step's GPU time goes, and whether it is on a slow path: a short profiler window, now and then.

At one steady step (after warm-up, compilation and autotuning; see :class:`StepProfiler`) and then every N
steps, one step runs under ``torch.profiler``. Its events become plain :class:`Event` records
(:func:`events_from_profiler`: kernels linked to the op that launched them, ops nested, autograd sequence
numbers kept), and :mod:`kernelguard.diagnosis.verdict` turns them into figures and a verdict that does not
rest on "GPU busy": GPU time by kernel class and by what launched it (the torch reference functions or not),
kernels per decoder layer, MFU. A verdict other than healthy is logged as one line.

:func:`summarize_events` is a pure function of the records, tested with synthetic lists and with lists
recorded from real H200 traces. :class:`StepProfiler` decides when to profile and does it, for ``kernelguard
train``'s loop and for ``KernelGuardCallback`` alike; its cost (profiled step and event parsing, minus an
unprofiled step) is measured and reported with the figures.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .events import Event
from .kernel_classes import classify_kernel
from .window import StepProfile, summarize_events

__all__ = [
    "DEFAULT_FIRST_STEP",
    "StepProfiler",
    "classify_kernel",
    "events_from_profiler",
]

DEFAULT_FIRST_STEP = 10  # on a GPU when --profile-step is not given
_RECENT = 5  # unprofiled step times kept as the reference wall time
STEADY_STEPS = 3  # unprofiled steps that must agree before a window: so the first step that can be profiled is 4
# Recent steps are steady when the slowest is within this factor of the fastest: a compile, autotune or first
# eval shape makes a step many times slower (bench/lib/step_stats.py calls > 3x the median an outlier).
_STEADY_SPREAD = 3.0
_MAX_RETRIES = 50  # windows postponed (autotune inside, steps not steady yet) before one is reported anyway




def events_from_profiler(prof: Any) -> list[Event]:
    """A finished ``torch.profiler.profile``'s events as :class:`Event` records: CPU events nested by their
    CPU parent, each GPU kernel linked to the op that launched it.

    The link is the profiler's correlation id: a kernel's ``linked_correlation_id`` is the ``id`` of the op
    that launched it. It is read from the raw Kineto events, which carry it in every supported torch (the
    parsed device events do not in all of them)."""
    from torch.autograd import DeviceType

    raw = list(prof.events())
    index = {id(e): i for i, e in enumerate(raw)}
    out: list[Event] = []
    by_correlation: dict[int, int] = {}
    for e in raw:
        if e.device_type != DeviceType.CPU:
            continue
        name = e.name
        runtime = name.startswith(("cuda", "cu", "hip"))
        kind = ("launch" if "Launch" in name else "runtime") if runtime else "op"
        if kind == "op":
            by_correlation.setdefault(e.id, len(out))
        seq = getattr(e, "sequence_nr", -1)
        out.append(Event(name, kind, float(e.time_range.start), float(e.time_range.end), None,
                         seq if isinstance(seq, int) else -1))
    cpu_index = {i_raw: i_out for i_out, i_raw in enumerate(
        i for i, e in enumerate(raw) if e.device_type == DeviceType.CPU)}
    for i_raw, i_out in cpu_index.items():
        parent = raw[i_raw].cpu_parent
        if parent is not None and index.get(id(parent)) in cpu_index:
            out[i_out] = replace(out[i_out], parent=cpu_index[index[id(parent)]])
    out.extend(_device_events(prof, raw, by_correlation))
    return out


def _device_events(prof: Any, parsed: list[Any], by_correlation: dict[int, int]) -> list[Event]:
    """GPU kernels and memcpy/memset, from the raw Kineto events when the profiler kept them."""
    from torch.autograd import DeviceType

    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None:
        start = results.trace_start_ns()
        rows = [
            (k.name(), (k.start_ns() - start) / 1e3, (k.end_ns() - start) / 1e3, k.linked_correlation_id())
            for k in results.events()
            if k.device_type() != DeviceType.CPU and not k.is_user_annotation()
            and not getattr(k, "is_hidden_event", lambda: False)()
        ]
    else:
        rows = [
            (e.name, float(e.time_range.start), float(e.time_range.end), getattr(e, "linked_correlation_id", 0))
            for e in parsed
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        ]
    out = []
    for name, start_us, end_us, corr in rows:
        kind = "copy" if "memcpy" in name.lower() or "memset" in name.lower() else "kernel"
        out.append(Event(name, kind, start_us, end_us, by_correlation.get(corr) if corr else None))
    return out


# ------------------------------------------------------------------------------------------- profiler ---
@dataclass(slots=True)
class StepProfiler:
    """Profiles step ``first_step`` and every ``every`` steps after it (0: never again); ``first_step`` 0
    turns it off. ``begin(step)``/``end(step)`` bracket each step (``run`` does both); only profiled steps
    pay anything beyond two clock reads. A window is postponed to the next step while the recent unprofiled
    steps are not steady (a compile, an autotune or a first eval shape is still among them) or when an fla
    autotune search ran inside it. ``trace_dir``: the first window is also written as a Chrome/Perfetto trace
    there. ``log``: where a verdict other than healthy goes. ``layers``, ``peak_flops``, ``fix``: for kernels
    per decoder layer, MFU and the slow-path line (the step's FLOPs come with each ``run``)."""

    first_step: int = DEFAULT_FIRST_STEP
    every: int = 500
    trace_dir: Path | None = None
    device: Any = None
    log: Callable[[str], None] | None = None
    searches: Callable[[], int] | None = None  # autotune results held so far (default: fla's caches)
    layers: int | None = None
    peak_flops: float | None = None
    fix: str | None = None
    on_events: Callable[[list[Event]], None] | None = None  # each reported window's events (benches keep them)
    clock: Callable[[], float] = time.perf_counter
    # The run's last step: a window still waiting for steady steps is profiled there rather than never (a
    # window that was asked for and not taken is a flag silently not done).
    last_step: int | None = None
    # The user named first_step (--profile-step N): a window moved off it is said, with why.
    asked: bool = False
    profiles: list[StepProfile] = field(default_factory=list)
    retried: int = 0  # windows postponed: an autotune search inside, or steps not steady yet
    total_s: float = 0.0
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    _t0: float | None = None
    _cpu0: float = 0.0
    _prof: Any = None
    _searches0: int = 0
    _retry: bool = False
    _flops: float | None = None
    _moved_why: str = ""  # why the window that is due was postponed last

    def due(self, step: int) -> bool:
        """Step ``step`` is scheduled for a window (or a postponed one is waiting)."""
        if self.first_step <= 0 or step < self.first_step:
            return False
        if self._retry:
            return True
        return step == self.first_step or bool(self.every and (step - self.first_step) % self.every == 0)

    def _should_profile(self, step: int) -> bool:
        if not self.due(step):
            return False
        if self._steady() or self.retried >= _MAX_RETRIES or step == self.last_step:
            self._retry = False
            return True
        self._retry = True  # not steady yet: try again at the next step
        self.retried += 1
        self._moved_why = (f"the {STEADY_STEPS} steps before a window must be steady, and step {step} came "
                           "while the run was still compiling, autotuning or warming up")
        return False

    def _steady(self) -> bool:
        """The last unprofiled steps agree: none of them is still compiling, autotuning or warming up."""
        recent = list(self._recent)[-STEADY_STEPS:]
        return len(recent) >= STEADY_STEPS and max(recent) <= _STEADY_SPREAD * min(recent)

    def _search_count(self) -> int:
        if self.searches is not None:
            return self.searches()
        from kernelguard.resolution import fla_autotuners

        return sum(len(getattr(tuner, "cache", ())) for _, tuner in fla_autotuners())

    @property
    def gpu(self) -> bool:
        return getattr(self.device, "type", None) == "cuda"

    def run(
        self, step: int, fn: Callable[..., Any], *args: Any, flops: float | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``fn(*args)`` as step ``step`` (``flops``: its model FLOPs, for MFU); returns its result and the
        figures to add to the step's record."""
        self.begin(step, flops=flops)
        result = fn(*args)
        return result, self.end(step)

    def begin(self, step: int, *, flops: float | None = None) -> None:
        if self._t0 is not None:  # already begun (a callback's per-micro-batch hook): one window per step
            return
        self._flops = flops
        if self._should_profile(step):
            from torch.profiler import ProfilerActivity, profile

            self._sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
            self._searches0 = self._search_count()
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        self._cpu0, self._t0 = time.process_time(), self.clock()

    def end(self, step: int) -> dict[str, Any]:
        if self._t0 is None:
            return {}
        prof, t0 = self._prof, self._t0
        self._prof = self._t0 = None
        if prof is None:
            wall = self.clock() - t0
            self._recent.append(wall)
            self.total_s += wall
            return {}
        self._sync()
        wall, cpu = self.clock() - t0, time.process_time() - self._cpu0
        prof.__exit__(None, None, None)
        # A search inside the window launches each candidate config many times: the figures would describe
        # the autotuner, not the step (a busy GPU read launch-bound). Profile the next step instead.
        self._retry = self._search_count() > self._searches0 and self.retried < _MAX_RETRIES
        if self._retry:
            self.retried += 1
            self.total_s += wall
            self._moved_why = f"an fla autotune search ran inside step {step}"
            return {}
        reference = statistics.median(self._recent) if self._recent else None
        events = events_from_profiler(prof)
        if self.on_events is not None:
            self.on_events(events)
        profile = summarize_events(
            events, step=step, wall_s=wall, cpu_s=cpu, reference_step_s=reference,
            gpu=self.gpu, layers=self.layers, flops_per_step=self._flops, peak_flops=self.peak_flops,
            fix=self.fix or _allowed_fallback_fixes(),
        )
        trace = self._write_trace(prof, step)
        spent = self.clock() - t0
        self.total_s += spent
        profile = replace(profile, trace=trace)
        profile = replace(profile, overhead_s=max(0.0, spent - profile.step_s))
        if self.asked and not self.profiles and step != self.first_step and self.log is not None:
            self.log(f"--profile-step {self.first_step}: profiled step {step} instead ({self._moved_why}; its "
                     "figures would describe the compiler or the autotuner, not the step)")
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
        head = f"profile ({len(self.profiles)} window(s)): {last.line()}"
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



def _allowed_fallback_fixes() -> str | None:
    """The install commands the guard gave for the fallbacks this process was allowed to take."""
    from kernelguard.resolution import split_fix
    from kernelguard.runtime import fallback_events

    # The commands only: the verdict is one line, and the guard's own message carries the notes.
    fixes = sorted({split_fix(e.fix)[0] or e.fix for e in fallback_events() if e.allowed and e.fix})
    return "; ".join(fixes) or None


