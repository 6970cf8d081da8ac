"""When ``kernelguard train`` profiles a step: its flags (``--profile-step``, ``--profile-every``,
``--profile-trace``) turned into this rank's :class:`~kernelguard.diagnosis.profiler.StepProfiler`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernelguard.diagnosis.profiler import DEFAULT_FIRST_STEP, StepProfiler

__all__: list[str] = [
    "step_profiler",
]


def step_profiler(
    cfg: Any, info: Any, hf_config: Any = None, peak: float = 0.0, *, log: Callable[[str], None] | None = None
) -> StepProfiler:
    """`kernelguard train`'s profiler for this rank (``cfg``: its TrainConfig, ``info``: its DistInfo): rank 0
    only. Without --profile-step: from step 10 on a GPU, never on a CPU-only run (no GPU to judge; asking for a
    trace asks for profiling)."""
    from kernelguard.geometry import layer_types

    first = cfg.metrics.profile_step
    if first is None:
        wanted = getattr(info.device, "type", None) == "cuda" or cfg.metrics.profile_trace is not None
        first = DEFAULT_FIRST_STEP if wanted else 0
    return StepProfiler(
        first_step=first if info.is_main else 0,
        every=cfg.metrics.profile_every,
        trace_dir=cfg.metrics.profile_trace,
        device=info.device,
        log=log,
        layers=(len(layer_types(hf_config)) or None) if hf_config is not None else None,
        peak_flops=peak or None,
    )
