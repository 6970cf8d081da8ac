"""Why a training step is slow: the step profiler, each kernel's class, the verdict and its window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "DEFAULT_FIRST_STEP",
    "StepProfiler",
]

# What this room offers the rest of kernelguard: each name and the module of this room that defines it
# ("module:" offers that module itself), loaded on first use.
_OFFERS = {
    "DEFAULT_FIRST_STEP": "profiler",
    "StepProfiler": "profiler",
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .profiler import DEFAULT_FIRST_STEP, StepProfiler
