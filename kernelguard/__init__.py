"""kernelguard: make slow fallback kernels in hybrid-model fine-tuning impossible to miss.

Public API (``import kernelguard`` stays cheap and never imports torch):
    require(model=..., mode=...)    import-time assertion for jobs (raises ResolutionError)
    guard(model, ...)               per-layer report + tripwires on torch reference paths
    check(...)                      the resolution behind ``kernelguard check``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    DataError,
    KernelFallbackError,
    KernelGuardError,
    NumericsError,
    ResolutionError,
    UnsupportedTransformersError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataError",
    "KernelFallbackError",
    "KernelGuardError",
    "NumericsError",
    "ResolutionError",
    "UnsupportedTransformersError",
    "__version__",
    "check",
    "guard",
    "require",
]

# Imported eagerly (it is cheap: no torch) so that the package attribute ``guard`` is the function, not the
# submodule of the same name that a later ``import kernelguard.guard`` would otherwise bind.
from .guard import guard

if TYPE_CHECKING:
    from .require import check, require

_LAZY = {"require": ("require", "require"), "check": ("require", "check")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        from importlib import import_module

        return getattr(import_module(f".{module_name}", __name__), attribute)
    raise AttributeError(f"module 'kernelguard' has no attribute {name!r}")
