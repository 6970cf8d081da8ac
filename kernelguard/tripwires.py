"""Tripwires on transformers' torch reference paths: the wrappers, and arming them.

A tripwire replaces the module-level name a layer's forward looks up at call time with a wrapper that, on
entry into the torch reference, either raises
:class:`KernelFallbackError` (``on_fallback="raise"``: :func:`kernelguard.guard`) or records the entry and lets
it run (``"record"``: the pytest plugin, which then fails the test with one message naming every kernel). A
call goes through when any active arming allows it (:class:`kernelguard.policy.AllowPolicy`).

Their state (armed and retired patches, events, layer paths, the scan cache) lives in
:mod:`kernelguard.registry`; modules imported while armed are armed by :mod:`kernelguard.import_hook`.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType, ModuleType, TracebackType
from typing import Any

from kernelguard import import_hook
from kernelguard import transformers_compat as compat
from kernelguard.errors import ConfigError
from kernelguard.policy import AllowPolicy
from kernelguard.registry import (
    REGISTRY,
    FallbackEvent,
    ScannedSite,
    clear_fallback_events,
    fallback_events,
    layer_path,
    remember_layer_paths,
    unwrapped,
)

__all__ = [
    "ON_FALLBACK",
    "SLOW_PATH_NOTE",
    "FallbackEvent",
    "Tripwires",
    "arm_tripwires",
    "clear_fallback_events",
    "fallback_events",
    "layer_from_frames",
]

ON_FALLBACK = ("raise", "record")
SLOW_PATH_NOTE = (
    "The reference is correct but several times slower (launch-bound) and GPU utilization will not show it."
)
# How far up the stack the layer and its root module are looked for (nn.Module and transformers' decorators
# add a few frames per level; a 4-level model sits ~30 frames deep).
_MAX_FRAMES = 200


# ------------------------------------------------------------------------------------------ layer paths ---
def _is_module(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "_modules") and hasattr(obj, "named_modules")


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
                path = layer_path(layer)
                if path is not None:
                    return path
            root = candidate
        frame = frame.f_back
        depth += 1
    if layer is None:
        return "<not inside a layer forward>"
    if root is not None and root is not layer:
        remember_layer_paths((module, path) for path, module in root.named_modules() if path)
        path = layer_path(layer)
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

    def arm_module(self, module: ModuleType, sites: tuple[ScannedSite, ...]) -> None:
        """Arm the torch-reference globals among ``sites`` of ``module`` (rescanned if re-bound since)."""
        if any(not _unchanged(module, s) for s in sites):  # someone re-bound a kernel global since the scan
            sites = REGISTRY.scan.sites(module, rescan=True)
        for s in sites:
            if s.site.closure.is_torch_reference:
                self.arm(module, s.name, s.site.closure.kernel, f"{s.site.module}.{s.name}", s.site.closure)

    def disarm(self) -> None:
        """Restore every original this arming installed, by identity, and only where it is still ours."""
        import_hook.unwatch(self)
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
            tripwires.arm_module(module, sites)
    import_hook.watch(tripwires)
    return tripwires


def _unchanged(module: ModuleType, scanned: ScannedSite) -> bool:
    return unwrapped(vars(module).get(scanned.name)) is scanned.value
