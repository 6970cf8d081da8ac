"""kernelguard: make slow fallback kernels in hybrid-model fine-tuning impossible to miss.

Public API (``import kernelguard`` stays cheap and never imports torch):
    require(model=..., mode=...)    import-time assertion for jobs (raises ResolutionError)
    guard(model, ...)               per-layer report + tripwires on torch reference paths
    check(...)                      the resolution behind ``kernelguard check``
"""

from __future__ import annotations

from .errors import (
    ConfigError,
    DataError,
    KernelFallbackError,
    KernelGuardError,
    ResolutionError,
    UnsupportedTransformersError,
)

__version__ = "0.2.0"

__all__ = [
    "ConfigError",
    "DataError",
    "KernelFallbackError",
    "KernelGuardError",
    "ResolutionError",
    "UnsupportedTransformersError",
    "__version__",
    "check",
    "guard",
    "require",
]

# Imported eagerly, in this order, so that each package attribute is the public function and not the submodule
# of the same name (``kernelguard.guard``, ``kernelguard.check``): importing a submodule binds it on the
# package, and a later ``from .x import x`` is what rebinds the function. None of these import torch.
from .api import check, require
from .guard import guard
