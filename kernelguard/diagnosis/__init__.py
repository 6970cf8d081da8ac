"""Why a training step is slow: the step profiler, each kernel's class, the verdict and its window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "DEFAULT_FIRST_STEP",
    "CompileWatch",
    "StepProfiler",
]

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "profiler": ("DEFAULT_FIRST_STEP", "StepProfiler"),
    "recompiles": ("CompileWatch",),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .profiler import DEFAULT_FIRST_STEP, StepProfiler
    from .recompiles import CompileWatch
