"""kernelguard: make slow fallback kernels in hybrid-model fine-tuning impossible to miss.

Public API (imports are lazy so ``import kernelguard`` stays cheap and never imports torch):
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

if TYPE_CHECKING:
    from .guard import guard
    from .require import check, require

_LAZY = {"guard": ("guard", "guard"), "require": ("require", "require"), "check": ("require", "check")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        from importlib import import_module

        return getattr(import_module(f".{module_name}", __name__), attribute)
    raise AttributeError(f"module 'kernelguard' has no attribute {name!r}")
