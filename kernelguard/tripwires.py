"""Tripwires on transformers' torch reference paths, and the one registry that holds their state.

A tripwire replaces the module-level name a layer's forward looks up at call time with a wrapper that, on
entry into the torch reference, either raises
:class:`KernelFallbackError` (``on_fallback="raise"``: :func:`kernelguard.guard`) or records the entry and lets
it run (``"record"``: the pytest plugin, which then fails the test with one message naming every kernel). A
call goes through when any active arming allows it (:class:`kernelguard.policy.AllowPolicy`).

All state lives in :data:`REGISTRY` (one :class:`GuardRegistry`, ``reset()`` restores everything): the armed
patches, the fallback events, the log-once keys, the import watchers, layer paths, and the per-module scan
cache, so a suite of thousands of tests scans each transformers modeling module once.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from types import FrameType, ModuleType, TracebackType
from typing import Any

from kernelguard import transformers_compat as compat
from kernelguard.errors import ConfigError, KernelFallbackError
from kernelguard.policy import AllowPolicy

__all__ = [
    "REGISTRY",
    "FallbackEvent",
    "GuardRegistry",
    "Tripwires",
    "arm_tripwires",
    "clear_fallback_events",
    "fallback_events",
]

logger = logging.getLogger("kernelguard")

ON_FALLBACK = ("raise", "record")
SLOW_PATH_NOTE = (
    "The reference is correct but several times slower (launch-bound) and GPU utilization will not show it."
)
# How far up the stack the layer and its root module are looked for (nn.Module and transformers' decorators
# add a few frames per level; a 4-level model sits ~30 frames deep).
_MAX_FRAMES = 200


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

    def clear(self) -> None:
        self._by_name.clear()
        self._loaded = None
        self._modules_len = -1

    def sites(self, module: ModuleType, *, rescan: bool = False) -> tuple[ScannedSite, ...]:
        cached = self._by_name.get(module.__name__)
        if cached is not None and cached[0] is module and not rescan:
            return cached[1]
        self.scans += 1
        found = tuple(ScannedSite(s.name, _unwrapped(vars(module).get(s.name)), s) for s in compat.module_sites(module))
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
        self.patches: dict[tuple[int, str], _Patch] = {}
        # Disarmed patches of module globals, re-installed as they are by the next arming (the plugin re-arms
        # the same globals for every test: no new wrapper per test).
        self.retired: dict[tuple[int, str], _Patch] = {}
        self.watchers: list[Tripwires] = []
        # Layer module -> path: filled by guard(model), or from the root module when a tripwire fires.
        self.layer_paths: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

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

    def reset(self) -> None:
        """Disarm every tripwire (restoring originals still ours), drop events, paths and the scan cache."""
        with self.lock:
            holders = {id(h): h for p in self.patches.values() for h in p.holders}
            holders.update({id(w): w for w in self.watchers})
        for tripwires in holders.values():
            tripwires.disarm()
        with self.lock:
            self.patches.clear()
            self.retired.clear()
            self.watchers.clear()
            self.layer_paths = weakref.WeakKeyDictionary()
            self.scan.clear()
        self.clear_events()
        _sync_import_watcher()


REGISTRY = GuardRegistry()


def fallback_events() -> list[FallbackEvent]:
    """Entries into reference paths since the last :func:`clear_fallback_events` (identical ones counted)."""
    return REGISTRY.events_since(0)


def clear_fallback_events() -> None:
    """Forget recorded events and the log-once keys (an allowed fallback is logged again afterwards)."""
    REGISTRY.clear_events()


# ------------------------------------------------------------------------------------------ layer paths ---
def _is_module(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "_modules") and hasattr(obj, "named_modules")


def _known_path(module: Any) -> str | None:
    try:
        return REGISTRY.layer_paths.get(module)
    except TypeError:  # an unhashable module subclass
        return None


def _remember_paths(root: Any) -> None:
    for path, module in root.named_modules():
        if path:
            try:
                REGISTRY.layer_paths[module] = path
            except TypeError:
                continue


def layer_from_frames(frame: FrameType | None) -> str:
    """The path (``model.layers.1.linear_attn``) of the module whose forward made this call.

    The layer is the nearest ``self`` that is a module; its path is read from the outermost module on the
    stack (the model being run), once per model, so it works without ``guard(model)``.
    """
    layer = root = None
    depth = 0
    while frame is not None and depth < _MAX_FRAMES:
        candidate = frame.f_locals.get("self")
        if _is_module(candidate):
            if layer is None:
                layer = candidate
                path = _known_path(layer)
                if path is not None:
                    return path
            root = candidate
        frame = frame.f_back
        depth += 1
    if layer is None:
        return "<not inside a layer forward>"
    if root is not None and root is not layer:
        _remember_paths(root)
        path = _known_path(layer)
        if path is not None:
            return path
    idx = getattr(layer, "layer_idx", None)
    return f"{type(layer).__name__}" + (f" (layer_idx={idx})" if idx is not None else "")


# ----------------------------------------------------------------------------------------- tripwires ---
@dataclass(eq=False, slots=True)
class _Patch:
    """One replaced name: ``vars(owner)[name]`` for a module global, or an instance attribute."""

    owner: Any  # module (globals) or layer instance
    name: str
    original: Any
    kernel: str
    site: str
    closure: compat.FallbackClosure | None
    wrapper: Any = None
    holders: list[Tripwires] = field(default_factory=list)
    allowed_seen: bool = False  # an allowed entry is recorded (and logged) once per site, not per call
    _failure: compat.ImportFailure | None = None

    def failure(self) -> compat.ImportFailure:
        if self._failure is None:
            self._failure = (
                compat.import_failure(self.closure) if self.closure is not None
                else compat.ImportFailure(f"the layer chose the torch path at construction (`{self.name}`)")
            )
        return self._failure

    def allowed(self) -> bool:
        issues = self.failure().issues
        return any(h.policy.allows_site(self.kernel, issues) for h in self.holders)

    def raises(self) -> bool:
        return any(h.on_fallback == "raise" for h in self.holders)


class _TripwireInfo:
    __slots__ = ("patch",)

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    @property
    def original(self) -> Any:
        return self.patch.original


def _install_fix(patch: _Patch) -> str:
    return compat.pip_fix(patch.closure.package) if patch.closure else "upgrade transformers"


def _trip(patch: _Patch, frame: FrameType | None) -> None:
    failure = patch.failure()
    allowed = patch.allowed()
    layer = layer_from_frames(frame)
    message = f"{layer} entered the torch reference path of `{patch.kernel}` ({patch.site}): {failure.reason}. "
    event = REGISTRY.record(FallbackEvent(
        layer=layer, kernel=patch.kernel, site=patch.site, allowed=allowed, message=message + SLOW_PATH_NOTE,
        fix=_install_fix(patch), reason=failure.reason, time=time.time(), issues=failure.issues,
    ))
    if allowed:
        patch.allowed_seen = True
        REGISTRY.log_once(("trip", patch.kernel), f"kernelguard: allowed fallback: {event.message}")
    elif patch.raises():
        raise event.to_error()


def _make_wrapper(patch: _Patch) -> Callable[..., Any]:
    original = patch.original
    closure = patch.closure
    check_hub = closure is not None and closure.func_module is not None

    def kernelguard_tripwire(*args: Any, **kwargs: Any) -> Any:
        # No holders: disarmed, but someone kept a reference to the wrapper; it is a plain pass-through.
        # An allowed site already recorded costs one check, and nothing torch.compile cannot trace.
        # A Func module may have been kernelized onto a Hub kernel after arming: then nothing falls back.
        if (
            patch.holders
            and not (patch.allowed_seen and patch.allowed())
            and not (check_hub and closure is not None and compat.hub_kernel(closure))
        ):
            _trip(patch, sys._getframe(1))
        return original(*args, **kwargs)

    functools.update_wrapper(kernelguard_tripwire, original, updated=())
    kernelguard_tripwire.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(kernelguard_tripwire, compat.TRIPWIRE_ATTR, _TripwireInfo(patch))
    return kernelguard_tripwire


def _current(owner: Any, name: str) -> Any:
    return vars(owner).get(name)


def _install(owner: Any, name: str, kernel: str, site: str, closure: compat.FallbackClosure | None) -> _Patch:
    current = _current(owner, name)
    info = getattr(current, compat.TRIPWIRE_ATTR, None) if callable(current) else None
    if info is not None:  # a wrapper from a stale registry entry: wrap what it wraps
        current = info.original
    patch = _Patch(owner=owner, name=name, original=current, kernel=kernel, site=site, closure=closure)
    patch.wrapper = _make_wrapper(patch)
    setattr(owner, name, patch.wrapper)
    return patch


def _reinstall(owner: Any, name: str) -> _Patch | None:
    """The retired patch of ``owner.<name>``, put back, when the name still holds what it wrapped."""
    patch = REGISTRY.retired.pop((id(owner), name), None)
    if patch is None or patch.owner is not owner or _current(owner, name) is not patch.original:
        return None
    patch.allowed_seen = False
    patch._failure = None  # the reason is re-read on the next failure: the environment may have changed
    setattr(owner, name, patch.wrapper)
    return patch


class Tripwires:
    """A set of armed tripwires; ``disarm()`` (or leaving the ``with`` block) restores the originals."""

    def __init__(self, allow: Iterable[str] | AllowPolicy = (), *, on_fallback: str = "raise",
                 source: str = "allow= of kernelguard.arm_tripwires()") -> None:
        if on_fallback not in ON_FALLBACK:
            raise ConfigError(f"on_fallback must be one of {ON_FALLBACK}, got {on_fallback!r}")
        self.policy = AllowPolicy.parse(allow, source=source)
        self.on_fallback = on_fallback
        self._patches: list[_Patch] = []

    @property
    def allow(self) -> frozenset[str]:
        return frozenset(self.policy.values())

    @property
    def armed(self) -> bool:
        return bool(self._patches)

    @property
    def sites(self) -> list[str]:
        return [p.site for p in self._patches]

    def arm(self, owner: Any, name: str, kernel: str, site: str, closure: compat.FallbackClosure | None) -> None:
        """Wrap ``owner.<name>`` (idempotent; a wrapper already installed by another arming is shared)."""
        with REGISTRY.lock:
            key = (id(owner), name)
            patch = REGISTRY.patches.get(key)
            if patch is not None and _current(owner, name) is not patch.wrapper:
                del REGISTRY.patches[key]  # someone replaced our wrapper: it is no longer ours to manage
                patch = None
            if patch is None:
                patch = _reinstall(owner, name) or _install(owner, name, kernel, site, closure)
                REGISTRY.patches[key] = patch
            if self not in patch.holders:
                patch.holders.append(self)
                self._patches.append(patch)

    _arm = arm  # the name older callers used

    def disarm(self) -> None:
        """Restore every original this arming installed, by identity, and only where it is still ours."""
        _unwatch_imports(self)
        with REGISTRY.lock:
            for patch in self._patches:
                if self in patch.holders:
                    patch.holders.remove(self)
                if patch.holders:
                    continue
                key = (id(patch.owner), patch.name)
                if REGISTRY.patches.get(key) is patch:
                    del REGISTRY.patches[key]
                if _current(patch.owner, patch.name) is patch.wrapper:
                    setattr(patch.owner, patch.name, patch.original)
                    if isinstance(patch.owner, ModuleType):  # never keep a layer instance alive
                        REGISTRY.retired[key] = patch
            self._patches = []

    def __enter__(self) -> Tripwires:  # noqa: PYI034 - final in practice; py3.10 has no typing.Self
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.disarm()


def arm_tripwires(
    *, allow: Iterable[str] | AllowPolicy = (), on_fallback: str = "raise",
    source: str = "allow= of kernelguard.arm_tripwires()",
) -> Tripwires:
    """Model-independent arming: the fallback globals of every loaded transformers modeling module.

    Covers modules loaded now and, until disarmed, modules imported later (an import hook arms each
    ``transformers.models.*.modeling_*`` module right after it executes). Each module is scanned once per
    process (:class:`ModuleScanCache`); re-arming costs one ``setattr`` per fallback global.
    """
    if "transformers" in sys.modules:  # else nothing is loaded yet; the import hook arms what comes
        compat.selection_mechanism()  # refuses releases we do not understand
    tripwires = Tripwires(allow, on_fallback=on_fallback, source=source)
    with REGISTRY.lock:
        for module, sites in REGISTRY.scan.loaded():
            _arm_sites(tripwires, module, sites)
    _watch_imports(tripwires)
    return tripwires


def _arm_sites(tripwires: Tripwires, module: ModuleType, sites: tuple[ScannedSite, ...]) -> None:
    if any(not _unchanged(module, s) for s in sites):  # someone re-bound a kernel global since the scan
        sites = REGISTRY.scan.sites(module, rescan=True)
    for s in sites:
        if s.site.closure.is_torch_reference:
            tripwires.arm(module, s.name, s.site.closure.kernel, f"{s.site.module}.{s.name}", s.site.closure)


def _unwrapped(value: Any) -> Any:
    """What a tripwire wraps (the object itself when it is not one of ours)."""
    info = getattr(value, compat.TRIPWIRE_ATTR, None) if callable(value) else None
    return value if info is None else info.original


def _unchanged(module: ModuleType, scanned: ScannedSite) -> bool:
    return _unwrapped(vars(module).get(scanned.name)) is scanned.value


# -------------------------------------------------------------------------------------- import hook ---
def _is_modeling_module(name: str) -> bool:
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
            watchers = list(REGISTRY.watchers)
            sites = REGISTRY.scan.sites(module) if watchers else ()
            for tripwires in watchers:
                _arm_sites(tripwires, module, sites)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if not REGISTRY.watchers or not _is_modeling_module(fullname):
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


def _sync_import_watcher() -> None:
    with REGISTRY.lock:
        installed = IMPORT_WATCHER in sys.meta_path
        if REGISTRY.watchers and not installed:
            sys.meta_path.insert(0, IMPORT_WATCHER)
        elif not REGISTRY.watchers and installed:
            sys.meta_path.remove(IMPORT_WATCHER)


def _watch_imports(tripwires: Tripwires) -> None:
    with REGISTRY.lock:
        REGISTRY.watchers.append(tripwires)
    _sync_import_watcher()


def _unwatch_imports(tripwires: Tripwires) -> None:
    with REGISTRY.lock:
        if tripwires in REGISTRY.watchers:
            REGISTRY.watchers.remove(tripwires)
    _sync_import_watcher()
