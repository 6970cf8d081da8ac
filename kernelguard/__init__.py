"""kernelguard: make slow fallback kernels in hybrid-model fine-tuning impossible to miss.

Public API (``import kernelguard`` stays cheap and never imports torch):
    require(model=..., mode=...)    import-time assertion for jobs (raises ResolutionError)
    guard(model, ...)               per-layer report + tripwires on torch reference paths
    inspect(model, ...)             the same report, nothing armed, nothing raised
    check(...)                      the resolution behind ``kernelguard check``
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    DataError,
    KernelFallbackError,
    KernelGuardError,
    PackedWithoutBoundariesError,
    ResolutionError,
    UnsupportedTransformersError,
)

__version__ = "0.3.0.dev0"

__all__ = [
    "ConfigError",
    "DataError",
    "KernelFallbackError",
    "KernelGuardError",
    "PackedWithoutBoundariesError",
    "ResolutionError",
    "UnsupportedTransformersError",
    "__version__",
    "check",
    "guard",
    "inspect",
    "require",
]

# The public functions load on first use (``import kernelguard`` stays cheap: the pytest plugin imports this package
# in every pytest session). ``check`` and ``guard`` are also submodule names, and importing a submodule binds it on
# its package, replacing the function of the same name; the package's module class refuses exactly that binding,
# so ``kernelguard.check`` is the function however often and in whatever order things are imported or called.
_LAZY = {"check": "api", "require": "api", "guard": "guard", "inspect": "guard"}


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule: kernelguard.<name> stays the public function
        super().__setattr__(name, value)


def __dir__() -> list[str]:
    """The public names (``require``, ``guard``... before their first use loads them), not this module's imports."""
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kernelguard' has no attribute {name!r}")
    from importlib import import_module

    function = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = function  # cached: later lookups never come here
    return function


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:
    from .api import check, require
    from .guard import guard, inspect
