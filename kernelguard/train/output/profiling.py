"""When ``kernelguard train`` profiles a step: its flags (``--profile-step``, ``--profile-every``,
``--profile-trace``) turned into this rank's :class:`~kernelguard.diagnosis.profiler.StepProfiler`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelguard.diagnosis import DEFAULT_FIRST_STEP, StepProfiler

__all__: list[str] = [
    "first_profiled_step",
    "step_profiler",
    "unprofiled_warning",
]


def first_profiled_step(cfg: Any, *, gpu: bool) -> int:
    """The first step profiled (0: none): --profile-step, else step 10 on a GPU or when a trace is asked for."""
    first = cfg.metrics.profile_step
    if first is None:
        wanted = gpu or cfg.metrics.profile_trace is not None
        first = DEFAULT_FIRST_STEP if wanted else 0
    return int(first)


def unprofiled_warning(cfg: Any, profiler: StepProfiler, *, stop_step: int) -> str | None:
    """One line when profiling was asked for (--profile-step N, --profile-trace) and the run ended with no
    profiled step: it stopped before step N (epochs shorter than it, or a resume past it with --profile-every 0)."""
    asked = bool(cfg.metrics.profile_step) or cfg.metrics.profile_trace is not None
    if not asked or profiler.profiles or profiler.first_step <= 0:
        return None
    trace = f", so --profile-trace {cfg.metrics.profile_trace} holds no trace" if cfg.metrics.profile_trace else ""
    return (
        f"--profile-step {profiler.first_step}: no step was profiled; the run's steps ended at step {stop_step}"
        f"{trace} (give a --profile-step within the run's steps)"
    )


def step_profiler(
    cfg: Any,
    info: Any,
    hf_config: Any = None,
    peak: float = 0.0,
    *,
    log: Callable[[str], None] | None = None,
    last_step: int | None = None,
) -> StepProfiler:
    """`kernelguard train`'s profiler for this rank (``cfg``: its TrainConfig, ``info``: its DistInfo): rank 0
    only. Without --profile-step: from step 10 on a GPU, never on a CPU-only run (no GPU to judge; asking for a
    trace asks for profiling)."""
    from kernelguard.resolution import layer_types

    first = first_profiled_step(cfg, gpu=getattr(info.device, "type", None) == "cuda")
    return StepProfiler(
        first_step=first if info.is_main else 0,
        every=cfg.metrics.profile_every,
        trace_dir=cfg.metrics.profile_trace,
        device=info.device,
        log=log,
        layers=(len(layer_types(hf_config)) or None) if hf_config is not None else None,
        peak_flops=peak or None,
        last_step=last_step,
        asked=cfg.metrics.profile_step is not None,
    )
