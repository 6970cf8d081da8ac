"""kernelguard: make slow fallback kernels in hybrid-model fine-tuning impossible to miss.

Public API (``import kernelguard`` stays cheap and never imports torch):
    require(model=..., mode=...)    import-time assertion for jobs (raises ResolutionError)
    guard(model, ...)               per-layer report + tripwires on torch reference paths
    inspect(model, ...)             the same report, nothing armed, nothing raised
    check(...)                      the resolution behind ``kernelguard check``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kernelguard.errors import (
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


def lazy_face(package: str, offers: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The ``__getattr__`` of a room's face: ``offers`` maps each module of the room to the names it offers, each
    imported on first use, so importing a face costs nothing. Nothing is cached here: the next lookup sees
    whatever the defining module holds then (a test's monkeypatch included). A name of a submodule is never
    offered: importing that submodule would bind it on the package in the name's place."""
    where = {name: module for module, names in offers.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        from importlib import import_module

        return getattr(import_module(f"{package}.{where[name]}"), name)

    return __getattr__


def __dir__() -> list[str]:
    """The public names (``require``, ``guard``... before their first use loads them), not this module's imports."""
    return sorted(__all__)


# The public functions load on first use (``import kernelguard`` stays cheap: the pytest plugin imports this package
# in every pytest session), each through its room's face.
_OFFERS = {"stack": ("check", "require"), "runtime": ("guard", "inspect")}

__getattr__ = lazy_face(__name__, _OFFERS)


if TYPE_CHECKING:
    from kernelguard.runtime import guard, inspect
    from kernelguard.stack import check, require
