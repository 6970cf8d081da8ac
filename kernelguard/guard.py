"""Runtime guard: per-layer report of the kernel each call site will run, and tripwires on reference paths.

``guard(model)`` finds kernel call sites generically (see :mod:`kernelguard.transformers_compat`), reports
for every layer whether it runs a fast provider (installed package, Kernel Hub kernel) or transformers' torch
reference, and arms tripwires: the module-level name a layer's forward looks up at call time is replaced by a
wrapper that raises :class:`KernelFallbackError` on the first entry into a torch reference path. The import-time
choice is read before the first forward, so torch.compile and silenced logging cannot hide it.

``allow`` items, matched exactly: a kernel name (``"chunk_gated_delta_rule"``), ``"attention"`` (the packed
sdpa/eager slow path), a known-issue ID (matches a call site whose reason text contains it), or ``"*"``.
A tripwire lets a call through when any active arming (a guard or the pytest plugin) allows it.

Tripwires are installed only where transformers chose the torch reference at import; a site served by a
package is never wrapped (no overhead on the fast path). Layer paths in errors are found by walking the
caller frames for the layer ``self`` (no forward hooks, so nothing is added per forward).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib.machinery import ModuleSpec
from types import FrameType, ModuleType, TracebackType
from typing import Any

from kernelguard import transformers_compat as compat
from kernelguard.errors import ConfigError, KernelFallbackError

__all__ = [
    "CallSite",
    "FallbackEvent",
    "GuardReport",
    "Tripwires",
    "arm_tripwires",
    "clear_fallback_events",
    "fallback_events",
    "guard",
]

logger = logging.getLogger("kernelguard")

MODES = ("training", "inference")
ATTENTION_POLICIES = ("error", "warn", "ignore")
# Attention implementations that take cu_seqlens directly (no O(T^2) mask for packed rows).
VARLEN_ATTENTION = frozenset(
    {"flash_attention_2", "flash_attention_3", "flash_attention_4", "kernelguard_varlen"}
)
_ATTENTION_FORWARD_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"})
PROVIDER_KINDS = ("package", "hub", "torch-reference")


# ------------------------------------------------------------------------------------------- records ---
@dataclass(frozen=True, slots=True)
class CallSite:
    """One kernel call site of one layer, as it will run."""

    layer: str  # module path, e.g. "model.layers.3.linear_attn"
    kernel: str  # e.g. "chunk_gated_delta_rule", or "attention"
    implementation: str  # "fla.ops.gated_delta_rule.chunk_gated_delta_rule", "repo@revision", "sdpa", ...
    provider_kind: str  # "package" | "hub" | "torch-reference"
    fast: bool
    reason: str  # why this implementation (for a fallback: why the fast provider was not used)
    fix: str  # what makes it fast ("" when it already is)
    allowed: bool  # a slow site accepted through allow=
    required: bool = True  # False for decode-only kernels in training mode

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class FallbackEvent:
    """One entry into a torch reference path, recorded even when the exception was swallowed."""

    layer: str
    kernel: str
    site: str  # "module.global_name" that was called
    allowed: bool
    message: str
    fix: str
    reason: str
    time: float

    def to_error(self) -> KernelFallbackError:
        return KernelFallbackError(
            self.message, fix=self.fix, layer=self.layer, kernel=self.kernel, reason=self.reason
        )


_EVENTS: list[FallbackEvent] = []
_LOGGED_ONCE: set[tuple[str, ...]] = set()
_LOCK = threading.RLock()
# Layer module -> path, filled by guard(model) so errors name the layer as the user knows it.
_LAYER_PATHS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def fallback_events() -> list[FallbackEvent]:
    """Entries into reference paths since the last :func:`clear_fallback_events`.

    Every refused entry is recorded (even when the caller swallowed the exception); an allowed one is
    recorded once per call site, so a long run with an accepted fallback does not grow this list.
    """
    with _LOCK:
        return list(_EVENTS)


def clear_fallback_events() -> None:
    with _LOCK:
        _EVENTS.clear()


def _log_once(key: tuple[str, ...], message: str) -> None:
    with _LOCK:
        if key in _LOGGED_ONCE:
            return
        _LOGGED_ONCE.add(key)
    logger.warning(message)


def _matches_allow(allow: frozenset[str], kernel: str, reason: str) -> bool:
    if not allow:
        return False
    if "*" in allow or kernel in allow:
        return True
    return any(item and item in reason for item in allow if item not in ("attention",))


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
    _reason: str | None = None

    def reason(self) -> str:
        if self._reason is None:
            if self.closure is not None:
                self._reason = compat.why_not_imported(self.closure)
            else:
                self._reason = f"the layer chose the torch path at construction (`{self.name}`)"
        return self._reason

    def allowed(self) -> bool:
        return any(_matches_allow(h.allow, self.kernel, self.reason()) for h in self.holders)


_PATCHES: dict[tuple[int, str], _Patch] = {}


class _TripwireInfo:
    __slots__ = ("patch",)

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    @property
    def original(self) -> Any:
        return self.patch.original


def _layer_from_frames(frame: FrameType | None) -> str:
    first_module = None
    depth = 0
    while frame is not None and depth < 8:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "_modules"):
            try:
                path = _LAYER_PATHS.get(candidate)
            except TypeError:
                path = None
            if path is not None:
                return path
            if first_module is None:
                first_module = candidate
        frame = frame.f_back
        depth += 1
    if first_module is not None:
        idx = getattr(first_module, "layer_idx", None)
        suffix = f" (layer_idx={idx})" if idx is not None else ""
        return f"{type(first_module).__name__}{suffix} [run kernelguard.guard(model) to get its path]"
    return "<not inside a layer forward>"


def _trip(patch: _Patch, frame: FrameType | None) -> None:
    allowed = patch.allowed()
    layer = _layer_from_frames(frame)
    reason = patch.reason()
    fix = f"{compat.pip_fix(patch.closure.package) if patch.closure else 'upgrade transformers'}"
    message = (
        f"{layer} entered the torch reference path of `{patch.kernel}` ({patch.site}): {reason}. "
        "The reference is correct but several times slower (launch-bound) and GPU utilization will not show it."
    )
    full_fix = f"{fix}; or accept the slow path explicitly with allow=['{patch.kernel}']"
    event = FallbackEvent(
        layer=layer, kernel=patch.kernel, site=patch.site, allowed=allowed,
        message=message, fix=full_fix, reason=reason, time=time.time(),
    )
    with _LOCK:
        _EVENTS.append(event)
    if allowed:
        patch.allowed_seen = True
        _log_once(("trip", patch.kernel), f"kernelguard: allowed fallback: {message}")
        return
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


class Tripwires:
    """A set of armed tripwires; ``disarm()`` (or leaving the ``with`` block) restores the originals."""

    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.allow = frozenset(allow)
        self._patches: list[_Patch] = []

    @property
    def armed(self) -> bool:
        return bool(self._patches)

    @property
    def sites(self) -> list[str]:
        return [p.site for p in self._patches]

    def _arm(self, owner: Any, name: str, kernel: str, site: str, closure: compat.FallbackClosure | None) -> None:
        with _LOCK:
            key = (id(owner), name)
            patch = _PATCHES.get(key)
            if patch is not None and _current(owner, name) is not patch.wrapper:
                del _PATCHES[key]  # someone replaced our wrapper: it is no longer ours to manage
                patch = None
            if patch is None:
                current = _current(owner, name)
                info = getattr(current, compat.TRIPWIRE_ATTR, None) if callable(current) else None
                if info is not None:  # a wrapper from a stale registry entry: wrap what it wraps
                    current = info.original
                patch = _Patch(owner=owner, name=name, original=current, kernel=kernel, site=site,
                               closure=closure)
                patch.wrapper = _make_wrapper(patch)
                setattr(owner, name, patch.wrapper)
                _PATCHES[key] = patch
            if self not in patch.holders:
                patch.holders.append(self)
                self._patches.append(patch)

    def disarm(self) -> None:
        """Restore every original this arming installed, by identity, and only where it is still ours."""
        _unwatch_imports(self)
        with _LOCK:
            for patch in self._patches:
                if self in patch.holders:
                    patch.holders.remove(self)
                if patch.holders:
                    continue
                key = (id(patch.owner), patch.name)
                if _PATCHES.get(key) is patch:
                    del _PATCHES[key]
                if _current(patch.owner, patch.name) is patch.wrapper:
                    setattr(patch.owner, patch.name, patch.original)
            self._patches = []

    def __enter__(self) -> Tripwires:  # noqa: PYI034 - final in practice; py3.10 has no typing.Self
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.disarm()


def arm_tripwires(*, allow: Iterable[str] = ()) -> Tripwires:
    """Model-independent arming: the fallback globals of every transformers modeling module.

    Covers modules loaded now and, until disarmed, modules imported later (an import hook arms each
    ``transformers.models.*.modeling_*`` module right after it executes).
    """
    compat.selection_mechanism()  # refuses releases we do not understand
    tripwires = Tripwires(allow)
    for module in compat.iter_modeling_modules():
        _arm_module(tripwires, module)
    _watch_imports(tripwires)
    return tripwires


def _arm_module(tripwires: Tripwires, module: ModuleType) -> None:
    for site in compat.module_sites(module):
        if site.closure.is_torch_reference:
            tripwires._arm(module, site.name, site.closure.kernel, f"{site.module}.{site.name}", site.closure)


# Arming handles that also want modeling modules imported after they were armed.
_WATCHERS: list[Tripwires] = []


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
        with _LOCK:
            watchers = list(_WATCHERS)
        for tripwires in watchers:
            _arm_module(tripwires, module)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if not _WATCHERS or not _is_modeling_module(fullname):
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


_IMPORT_WATCHER = _ImportWatcher()


def _watch_imports(tripwires: Tripwires) -> None:
    with _LOCK:
        _WATCHERS.append(tripwires)
        if _IMPORT_WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _IMPORT_WATCHER)


def _unwatch_imports(tripwires: Tripwires) -> None:
    with _LOCK:
        if tripwires in _WATCHERS:
            _WATCHERS.remove(tripwires)
        if not _WATCHERS and _IMPORT_WATCHER in sys.meta_path:
            sys.meta_path.remove(_IMPORT_WATCHER)


# -------------------------------------------------------------------------------------- classification ---
def _model_device(model: Any) -> str:
    for param in model.parameters():
        return str(param.device.type)
    return "cpu"


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def _version_of(fn: Any) -> str:
    top = sys.modules.get(str(getattr(fn, "__module__", "") or "").split(".")[0])
    version = getattr(top, "__version__", None)
    return f" {version}" if version else ""


def _classify_closure(
    layer: str, closure: compat.FallbackClosure, device: str, *, required: bool, allow: frozenset[str]
) -> CallSite:
    hub = compat.hub_kernel(closure)
    if hub is not None:
        return CallSite(layer, closure.kernel, hub, "hub", True, "kernelize() selected a Kernel Hub kernel", "",
                        False, required)
    impl = closure.implementation
    if not closure.is_torch_reference:
        devices = compat.provider_devices(impl)
        name = _qualname(impl) + _version_of(impl)
        if device == "meta" or device in devices:
            return CallSite(layer, closure.kernel, name, "package", True,
                            f"`{closure.package}` was importable when transformers chose", "", False, required)
        reason = (
            f"`{closure.package}`{_version_of(impl)} is installed, but it does not run on device {device} "
            f"(runs on: {', '.join(devices)}; declare others with `{compat.DEVICES_ATTR}`)"
        )
        fix = f"move the model to {devices[0]} before training"
        return CallSite(layer, closure.kernel, name, "package", False, reason, fix,
                        _matches_allow(allow, closure.kernel, reason), required)
    reason = compat.why_not_imported(closure)
    hub_off = compat.kernels_hub_status()
    if hub_off:
        reason = f"{reason}; {hub_off}"
    return CallSite(layer, closure.kernel, _qualname(closure.torch_function), "torch-reference", False, reason,
                    compat.pip_fix(closure.package), _matches_allow(allow, closure.kernel, reason), required)


def _classify_instance(
    layer: str, site: compat.InstanceSite, device: str, *, required: bool, allow: frozenset[str]
) -> CallSite:
    if not site.is_torch_reference and site.value is not None:
        devices = compat.provider_devices(site.value)
        if device == "meta" or device in devices:
            return CallSite(layer, site.attr, _qualname(site.value), "package", True,
                            "chosen at layer construction", "", False, required)
        reason = f"`{site.package}` is installed, but it does not run on device {device}"
        return CallSite(layer, site.attr, _qualname(site.value), "package", False, reason,
                        f"move the model to {devices[0]}", _matches_allow(allow, site.attr, reason), required)
    impl = "inline torch code" if site.value is None else _qualname(site.value)
    reason = f"the layer chose the torch path at construction (`self.{site.attr}`); `{site.package}` missing"
    return CallSite(layer, site.attr, impl, "torch-reference", False, reason, compat.pip_fix(site.package),
                    _matches_allow(allow, site.attr, reason), required)


def _attention_site(layer: str, module: Any, model: Any, *, packed: bool, allow: frozenset[str]) -> CallSite:
    config = getattr(module, "config", None) or getattr(model, "config", None)
    impl = str(getattr(config, "_attn_implementation", None) or "eager")
    kind = "hub" if "/" in impl else ("torch-reference" if impl == "eager" else "package")
    varlen = impl in VARLEN_ATTENTION or "/" in impl
    if impl == "kernelguard_varlen" and not _attention_registered(impl):
        reason = "`kernelguard_varlen` is configured but not registered in transformers' AttentionInterface"
        return CallSite(layer, "attention", impl, "package", False, reason,
                        "AttentionInterface.register('kernelguard_varlen', fn) before building the model",
                        "attention" in allow, True)
    if not packed or varlen:
        why = "varlen attention takes cu_seqlens directly" if varlen else "not in packed mode"
        return CallSite(layer, "attention", impl, kind, True, why, "", False, True)
    reason = (
        f"{impl} with packed position ids materialises an O(T^2) block mask over the whole packed row "
        "(slow, quadratic memory)"
    )
    fix = "attn_implementation='flash_attention_2' (flash-attn) or register a varlen attention as 'kernelguard_varlen'"
    return CallSite(layer, "attention", impl, kind, False, reason, fix, "attention" in allow, True)


def _attention_registered(name: str) -> bool:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except Exception:  # noqa: BLE001
        return False
    try:
        return name in ALL_ATTENTION_FUNCTIONS
    except TypeError:
        return False


# ------------------------------------------------------------------------------------------- report ---
class GuardReport:
    """What every kernel call site of one model will run. A context manager: disarms on exit."""

    def __init__(
        self, entries: list[CallSite], tripwires: Tripwires, *, device: str, mode: str, packed: bool,
        attention: str, transformers_version: str, mechanism: str,
    ) -> None:
        self.entries = entries
        self.tripwires = tripwires
        self.device = device
        self.mode = mode
        self.packed = packed
        self.attention = attention
        self.transformers_version = transformers_version
        self.mechanism = mechanism

    def offending(self) -> list[CallSite]:
        """Required slow sites that nothing accepted (attention ones only under attention='error')."""
        return [e for e in self.entries if _is_offending(e, self.attention)]

    @property
    def ok(self) -> bool:
        return not self.offending()

    def disarm(self) -> None:
        self.tripwires.disarm()

    def __enter__(self) -> GuardReport:  # noqa: PYI034 - final in practice; py3.10 has no typing.Self
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.disarm()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "device": self.device,
            "mode": self.mode,
            "packed": self.packed,
            "attention_policy": self.attention,
            "transformers_version": self.transformers_version,
            "mechanism": self.mechanism,
            "armed_sites": self.tripwires.sites,
            "entries": [e.to_dict() for e in self.entries],
        }

    def render(self) -> str:
        header = (
            f"kernelguard: transformers {self.transformers_version} ({self.mechanism}), device {self.device}, "
            f"mode {self.mode}, packed={self.packed}: {'OK' if self.ok else 'SLOW PATHS'}"
        )
        rows = [("layer", "kernel", "status", "provider", "implementation", "reason / fix")]
        for e in self.entries:
            note = e.reason if e.fast else f"{e.reason}" + (f" | fix: {e.fix}" if e.fix else "")
            rows.append((e.layer, e.kernel, _status(e, self.attention), e.provider_kind, e.implementation, note))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [header]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<GuardReport ok={self.ok} entries={len(self.entries)} armed={self.tripwires.armed}>"


def _is_offending(e: CallSite, attention: str) -> bool:
    if e.fast or e.allowed or not e.required:
        return False
    return not (e.kernel == "attention" and attention != "error")


def _status(e: CallSite, attention: str) -> str:
    if e.fast:
        return "fast"
    if e.allowed:
        return "ALLOWED-SLOW"
    if not e.required:
        return "slow (decode-only)"
    if e.kernel == "attention" and attention != "error":
        return f"slow ({attention})"
    return "FALLBACK"


def _offending_error(offending: list[CallSite]) -> KernelFallbackError:
    groups: dict[tuple[str, str, str], list[str]] = {}
    for e in offending:
        groups.setdefault((e.kernel, e.implementation, e.reason), []).append(e.layer)
    lines = [f"kernelguard: {len(offending)} required kernel call site(s) would run a slow path:"]
    for (kernel, impl, reason), layers in groups.items():
        lines.append(f"  {kernel} -> {impl} in {', '.join(layers)}: {reason}")
    fixes = list(dict.fromkeys(e.fix for e in offending if e.fix))
    kernels = list(dict.fromkeys(e.kernel for e in offending))
    fixes.append(f"or accept explicitly: kernelguard.guard(model, allow={kernels!r})")
    first = offending[0]
    return KernelFallbackError(
        "\n".join(lines), fix="; ".join(fixes), layer=first.layer, kernel=first.kernel, reason=first.reason,
        details={"offending": [e.to_dict() for e in offending]},
    )


# -------------------------------------------------------------------------------------------- guard ---
def guard(
    model: Any,
    *,
    mode: str = "training",
    packed: bool = False,
    allow: Iterable[str] = (),
    strict: bool = True,
    attention: str = "error",
) -> GuardReport:
    """Report what every kernel call site of ``model`` runs and arm tripwires on its reference paths.

    Strict (default): raises :class:`KernelFallbackError` listing every offending layer when a required call
    site is slow and not allowed, and arms nothing. ``strict=False``: reports and arms; the first entry into a
    reference path still raises unless allowed.
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if attention not in ATTENTION_POLICIES:
        raise ConfigError(f"attention must be one of {ATTENTION_POLICIES}, got {attention!r}")
    if isinstance(allow, str):
        allow = (allow,)
    allowed = frozenset(allow)
    mechanism = compat.selection_mechanism()
    version = compat.transformers_version()
    device = _model_device(model)

    entries: list[CallSite] = []
    to_arm: list[tuple[Any, str, str, str, compat.FallbackClosure | None]] = []
    layer_paths: list[tuple[Any, str]] = []
    found_kernel_layer = False
    for path, module in model.named_modules():
        path = path or type(model).__name__
        names, _ = compat.forward_code_names(type(module))
        if mechanism == "decorator":
            for gsite in compat.layer_global_sites(module):
                found_kernel_layer = True
                required = mode == "inference" or gsite.closure.kernel not in compat.DECODE_ONLY_KERNELS
                entries.append(_classify_closure(path, gsite.closure, device, required=required, allow=allowed))
                if gsite.closure.is_torch_reference and compat.hub_kernel(gsite.closure) is None:
                    owner = sys.modules.get(gsite.module)
                    if owner is not None:
                        to_arm.append((owner, gsite.name, gsite.closure.kernel, f"{gsite.module}.{gsite.name}",
                                       gsite.closure))
                layer_paths.append((module, path))
        else:
            for isite in compat.instance_attribute_sites(module):
                found_kernel_layer = True
                required = mode == "inference" or isite.attr not in compat.DECODE_ONLY_KERNELS
                entries.append(_classify_instance(path, isite, device, required=required, allow=allowed))
                if isite.is_torch_reference and isite.value is not None:
                    to_arm.append((module, isite.attr, isite.attr, f"{path}.{isite.attr}", None))
                layer_paths.append((module, path))
        if _ATTENTION_FORWARD_NAMES.intersection(names):
            entries.append(_attention_site(path, module, model, packed=packed, allow=allowed))

    if mechanism == "instance-attribute" and not found_kernel_layer:
        raise compat.unsupported(
            version, f"no `{compat.DECORATOR_NAME}` decorator and no instance-attribute kernel pattern found"
        )

    tripwires = Tripwires(allowed)
    report = GuardReport(entries, tripwires, device=device, mode=mode, packed=packed, attention=attention,
                         transformers_version=version, mechanism=mechanism)
    _log_allowed_and_warned(report)
    offending = report.offending()
    if strict and offending:
        raise _offending_error(offending)
    for module, path in layer_paths:
        try:
            _LAYER_PATHS[module] = path
        except TypeError:
            pass
    for owner, name, kernel, site, closure in to_arm:
        tripwires._arm(owner, name, kernel, site, closure)
    return report


def _log_allowed_and_warned(report: GuardReport) -> None:
    for e in report.entries:
        if e.fast:
            continue
        if e.allowed:
            _log_once(("allowed", e.kernel, e.reason),
                      f"kernelguard: allowed slow path `{e.kernel}` -> {e.implementation} ({e.reason})")
        elif e.kernel == "attention" and report.attention == "warn":
            _log_once(("attention", e.implementation), f"kernelguard: slow attention: {e.reason}. Fix: {e.fix}")

