"""The one home of kernelguard's process state, and the :func:`reset` that really forgets all of it.

Held here: the armed tripwire patches (and the disarmed ones kept for re-arming), the fallback events and
log-once keys, the import watchers, the layer paths, the per-module scan cache, and the function
``kernelguard_varlen`` attention calls. Facts the probes memoise (transformers' source tables in
:mod:`kernelguard.resolution.discovery`, the decorator probe and forward-name tables in
:mod:`kernelguard.resolution.transformers_compat`) stay beside the code that computes them, and :func:`reset` clears them
too, so a test (or a long-lived process whose environment changed) can start from nothing.

Modules above this one use the functions below (or :data:`REGISTRY`'s methods), never its attributes directly.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from kernelguard.errors import KernelFallbackError
from kernelguard.resolution import discovery, transformers_calls
from kernelguard.resolution import transformers_compat as compat

__all__ = [
    "REGISTRY",
    "FallbackEvent",
    "GuardRegistry",
    "ModuleScanCache",
    "ScannedSite",
    "VarlenBinding",
    "armed_sites",
    "clear_fallback_events",
    "fallback_events",
    "fitted",
    "layer_path",
    "log_once",
    "remember_layer_paths",
    "reset",
    "unwrapped",
]

logger = logging.getLogger("kernelguard")


class _Disarmable(Protocol):
    def disarm(self) -> None: ...


# ------------------------------------------------------------------------------------------- records ---
@dataclass(slots=True)
class FallbackEvent:
    """Entries into one reference path from one layer, recorded even when the exception was swallowed.

    Identical entries (same site, layer and allowance) since the registry's last window are one event with
    ``count`` incremented, so a long run or a test with many forwards does not grow the list.
    """

    layer: str
    kernel: str
    site: str  # "module.global_name" that was called
    allowed: bool
    message: str
    fix: str  # the install command of the missing provider
    reason: str
    time: float
    issues: tuple[str, ...] = ()  # known-issue IDs that explain the fallback
    count: int = 1

    def to_error(self) -> KernelFallbackError:
        fix = f"{self.fix}; or accept the slow path explicitly with allow=['{self.kernel}']"
        return KernelFallbackError(
            self.message, fix=fix, layer=self.layer, kernel=self.kernel, reason=self.reason,
            details={"site": self.site, "known_issues": list(self.issues)},
        )


@dataclass(frozen=True, slots=True)
class VarlenBinding:
    """The function ``kernelguard_varlen`` calls (torch's ``varlen_attn`` signature) and its parameter names."""

    impl: Callable[..., Any] | None = None
    params: frozenset[str] = frozenset()

    @classmethod
    def of(cls, fn: Callable[..., Any] | None) -> VarlenBinding:
        return cls(fn, frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset())


def unwrapped(value: Any) -> Any:
    """What a tripwire wraps (the object itself when it is not one of ours)."""
    info = getattr(value, compat.TRIPWIRE_ATTR, None) if callable(value) else None
    return value if info is None else info.original


# ------------------------------------------------------------------------------------------ scan cache ---
@dataclass(frozen=True, slots=True)
class ScannedSite:
    """A decorated kernel global of one module, with the object it held when scanned."""

    name: str
    value: Any
    site: compat.GlobalSite


class ModuleScanCache:
    """Kernel globals per transformers modeling module, scanned once per module object.

    ``scans`` counts module scans (the pytest plugin's per-test cost). The loaded-module list is re-read from
    ``sys.modules`` only when its size changed or a module holding kernel globals was replaced; a module
    imported while tripwires are armed is scanned by the import hook.
    """

    def __init__(self) -> None:
        self.scans = 0
        self._by_name: dict[str, tuple[ModuleType, tuple[ScannedSite, ...]]] = {}
        self._loaded: list[tuple[ModuleType, tuple[ScannedSite, ...]]] | None = None
        self._modules_len = -1

    @property
    def empty(self) -> bool:
        return not self._by_name and self._loaded is None

    def clear(self) -> None:
        self._by_name.clear()
        self._loaded = None
        self._modules_len = -1

    def sites(self, module: ModuleType, *, rescan: bool = False) -> tuple[ScannedSite, ...]:
        cached = self._by_name.get(module.__name__)
        if cached is not None and cached[0] is module and not rescan:
            return cached[1]
        self.scans += 1
        found = tuple(ScannedSite(s.name, unwrapped(vars(module).get(s.name)), s) for s in compat.module_sites(module))
        self._by_name[module.__name__] = (module, found)
        self._loaded = None
        return found

    def loaded(self) -> list[tuple[ModuleType, tuple[ScannedSite, ...]]]:
        """Loaded modeling modules that hold kernel globals, each with its (cached) sites."""
        if self._loaded is None or len(sys.modules) != self._modules_len or self._replaced(self._loaded):
            self._refresh()
            self._loaded = [(module, sites) for module, sites in self._by_name.values() if sites]
        return self._loaded

    @staticmethod
    def _replaced(loaded: list[tuple[ModuleType, tuple[ScannedSite, ...]]]) -> bool:
        modules = sys.modules
        return any(modules.get(module.__name__) is not module for module, _ in loaded)

    def _refresh(self) -> None:
        present = set()
        for module in compat.iter_modeling_modules():
            present.add(module.__name__)
            self.sites(module)
        for name in [n for n in self._by_name if n not in present]:
            del self._by_name[name]
        self._modules_len = len(sys.modules)


# ---------------------------------------------------------------------------------------- registry ---
class GuardRegistry:
    """Every piece of guard state in one place. ``reset()`` disarms everything and forgets it all."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.scan = ModuleScanCache()
        self.events: list[FallbackEvent] = []
        self._window: dict[tuple[str, str, bool], FallbackEvent] = {}
        self.logged_once: set[tuple[str, ...]] = set()
        # (id(owner), name) -> kernelguard.runtime.tripwires' patch record (that module owns the type).
        self.patches: dict[tuple[int, str], Any] = {}
        # Disarmed patches of module globals, re-installed as they are by the next arming (the plugin re-arms
        # the same globals for every test: no new wrapper per test).
        self.retired: dict[tuple[int, str], Any] = {}
        self.watchers: list[_Disarmable] = []
        # Layer module -> path: filled by guard(model), or from the root module when a tripwire fires.
        self.layer_paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.varlen = VarlenBinding()
        # key -> kernelguard.runtime.boundaries' watches armed now, and the per-model checks the compiled op looks up.
        self.boundary_watches: dict[str, Any] = {}
        self.boundary_checks: dict[str, Any] = {}

    def log_once(self, key: tuple[str, ...], message: str) -> None:
        """Log ``message`` once per process, and only on rank 0 of a torchrun/accelerate job (``RANK``): every
        rank takes the same decisions, so N copies of the line would only bury it."""
        with self.lock:
            if key in self.logged_once:
                return
            self.logged_once.add(key)
        if os.environ.get("RANK", "0").strip() in ("", "0"):
            logger.warning(message)

    def record(self, event: FallbackEvent) -> FallbackEvent:
        """Append ``event``, or count it on the identical event already recorded in this window."""
        key = (event.site, event.layer, event.allowed)
        with self.lock:
            seen = self._window.get(key)
            if seen is not None:
                seen.count += 1
                return seen
            self._window[key] = event
            self.events.append(event)
            return event

    def open_window(self) -> int:
        """Start counting identical events afresh (the plugin: one window per test); returns the events index."""
        with self.lock:
            self._window.clear()
            return len(self.events)

    def events_since(self, index: int) -> list[FallbackEvent]:
        with self.lock:
            return self.events[index:]

    def clear_events(self) -> None:
        with self.lock:
            self.events.clear()
            self._window.clear()
            self.logged_once.clear()

    def armed_sites(self) -> list[str]:
        with self.lock:
            return [p.site for p in self.patches.values()]

    def remember_layer_path(self, module: Any, path: str) -> None:
        try:
            self.layer_paths[module] = path
        except TypeError:  # an unhashable module subclass: errors fall back to the root-module lookup
            pass

    def layer_path(self, module: Any) -> str | None:
        try:
            return self.layer_paths.get(module)
        except TypeError:  # an unhashable module subclass
            return None

    def reset(self) -> None:
        """Disarm every tripwire (restoring originals still ours), drop events, paths, the scan cache and the
        varlen binding. Disarming also unwatches imports, which takes the import hook off ``sys.meta_path``."""
        with self.lock:
            holders = {id(h): h for p in self.patches.values() for h in p.holders}
            holders.update({id(w): w for w in self.watchers})
        for tripwires in holders.values():
            tripwires.disarm()
        for watch in list(self.boundary_watches.values()):
            watch.disarm()
        with self.lock:
            self.patches.clear()
            self.retired.clear()
            self.watchers.clear()
            self.layer_paths = weakref.WeakKeyDictionary()
            self.scan.clear()
            self.varlen = VarlenBinding()
            self.boundary_checks.clear()
        self.clear_events()


REGISTRY = GuardRegistry()


def reset() -> None:
    """Back to a fresh process: tripwires disarmed, every record and every memoised process fact forgotten."""
    REGISTRY.reset()
    discovery.clear_caches()
    compat.clear_caches()
    transformers_calls.clear_caches()


def fallback_events() -> list[FallbackEvent]:
    """Entries into reference paths since the last :func:`clear_fallback_events` (identical ones counted)."""
    return REGISTRY.events_since(0)


def clear_fallback_events() -> None:
    """Forget recorded events and the log-once keys (an allowed fallback is logged again afterwards)."""
    REGISTRY.clear_events()


def armed_sites() -> list[str]:
    """The sites (``module.global_name``) wrapped by a tripwire right now."""
    return REGISTRY.armed_sites()


LOG_WIDTH = 100  # a log line kernelguard writes fits this many columns (a terminal, a CI log viewer)


def fitted(message: str, width: int = LOG_WIDTH) -> str:
    """A one-line log message wrapped at ``width``, continuation lines indented (never inside a word: module
    paths and commands stay whole)."""
    import textwrap

    if len(message) <= width:
        return message
    return textwrap.fill(message, width=width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)


def log_once(key: tuple[str, ...], message: str) -> None:
    """Log ``message`` once per process (and per :func:`clear_fallback_events`), on rank 0 only."""
    REGISTRY.log_once(key, message)


def mark_logged(key: tuple[str, ...]) -> None:
    """Count ``key`` as logged (its caller said it another way): :func:`log_once` stays quiet for it."""
    with REGISTRY.lock:
        REGISTRY.logged_once.add(key)


def remember_layer_paths(pairs: Iterable[tuple[Any, str]]) -> None:
    """Record each (layer module, path) so a tripwire firing inside it names the layer by its path."""
    for module, path in pairs:
        REGISTRY.remember_layer_path(module, path)


def layer_path(module: Any) -> str | None:
    """The recorded path of a layer module, or None."""
    return REGISTRY.layer_path(module)
