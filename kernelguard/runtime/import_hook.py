"""Arms tripwires on transformers modeling modules imported while an arming is active.

:func:`watch` puts one finder first on ``sys.meta_path``; it wraps the loader of every
``transformers.models.*.modeling_*`` module so that, right after the module executes, each watching arming
(:class:`kernelguard.runtime.tripwires.Tripwires`) arms its sites. The finder is removed when the last watcher
:func:`unwatch`-es, so an idle process pays nothing at import. The watcher list lives in
:data:`kernelguard.runtime.registry.REGISTRY`.
"""

from __future__ import annotations

import importlib.abc
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Protocol

from kernelguard.runtime.registry import REGISTRY, ScannedSite

__all__ = ["IMPORT_WATCHER", "is_modeling_module", "unwatch", "watch"]


class _Watcher(Protocol):
    def arm_module(self, module: ModuleType, sites: tuple[ScannedSite, ...]) -> None: ...

    def disarm(self) -> None: ...


def is_modeling_module(name: str) -> bool:
    return name.startswith("transformers.models.") and ".modeling_" in name


class _ArmingLoader:
    """Delegates to the real loader; arms the watchers' tripwires once the module has executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with REGISTRY.lock:
            watchers: list[Any] = list(REGISTRY.watchers)
            sites = REGISTRY.scan.sites(module) if watchers else ()
            for tripwires in watchers:
                tripwires.arm_module(module, sites)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if not REGISTRY.watchers or not is_modeling_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ArmingLoader(spec.loader)  # type: ignore[assignment]
                return spec
        return None


IMPORT_WATCHER = _ImportWatcher()


def _sync() -> None:
    with REGISTRY.lock:
        installed = IMPORT_WATCHER in sys.meta_path
        if REGISTRY.watchers and not installed:
            sys.meta_path.insert(0, IMPORT_WATCHER)
        elif not REGISTRY.watchers and installed:
            sys.meta_path.remove(IMPORT_WATCHER)


def watch(tripwires: _Watcher) -> None:
    """Arm ``tripwires`` on every modeling module imported from now on, until :func:`unwatch`."""
    with REGISTRY.lock:
        REGISTRY.watchers.append(tripwires)
    _sync()


def unwatch(tripwires: _Watcher) -> None:
    with REGISTRY.lock:
        if tripwires in REGISTRY.watchers:
            REGISTRY.watchers.remove(tripwires)
    _sync()
