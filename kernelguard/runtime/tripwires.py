"""Tripwires on transformers' torch reference paths: the wrappers, and arming them.

A tripwire replaces the module-level name a layer's forward looks up at call time with a wrapper that, on
entry into the torch reference, either raises
:class:`KernelFallbackError` (``on_fallback="raise"``: :func:`kernelguard.guard`) or records the entry and lets
it run (``"record"``: the pytest plugin, which then fails the test with one message naming every kernel). A
call goes through when any active arming allows it (:class:`kernelguard.resolution.policy.AllowPolicy`).

Cost: an entry is recorded (and an allowed one logged) once per site per arming; after that an allowed site
costs one flag read per call, and no frame is read. Under ``torch.compile`` (fullgraph or not) dynamo traces
the wrapper: the verdict is taken once, at trace time, when the reference is chosen for the graph (a refusal
is raised to the caller as :class:`KernelFallbackError`; an allowed or recorded entry is recorded once per
trace), and a graph traced under one arming is traced again under the next.

Their state (armed and retired patches, events, layer paths, the scan cache) lives in
:mod:`kernelguard.runtime.registry`; modules imported while armed are armed by :mod:`kernelguard.runtime.import_hook`.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType, ModuleType, TracebackType
from typing import Any

from kernelguard.errors import ConfigError, KernelFallbackError
from kernelguard.resolution import AllowPolicy, kernels_funcs
from kernelguard.resolution import transformers_compat as compat
from kernelguard.runtime import import_hook
from kernelguard.runtime.registry import (
    REGISTRY,
    FallbackEvent,
    ScannedSite,
    clear_fallback_events,
    fallback_events,
    fitted,
    layer_path,
    remember_layer_paths,
    unwrapped,
)

__all__ = [
    "ON_FALLBACK",
    "REFERENCE_RANGE",
    "SLOW_PATH_NOTE",
    "FallbackEvent",
    "Tripwires",
    "arm_tripwires",
    "clear_fallback_events",
    "compiled_error",
    "fallback_events",
    "layer_from_frames",
]

ON_FALLBACK = ("raise", "record")
# While a torch profiler records, an allowed call into a torch reference runs inside a profiler range named
# REFERENCE_RANGE + "<reference function>@<layer>", so the step diagnosis can attribute the kernels it
# launches (kernelguard.diagnosis.verdict). Outside a profiler it costs one flag read.
REFERENCE_RANGE = "kernelguard.reference:"
SLOW_PATH_NOTE = (
    "The reference is correct but several times slower (launch-bound) and GPU utilization will not show it."
)
# How far up the stack the layer and its root module are looked for (nn.Module and transformers' decorators
# add a few frames per level; a 4-level model sits ~30 frames deep).
_MAX_FRAMES = 200
_MAX_TRACING_FRAMES = 2000  # dynamo adds ~15 frames of its own per function it inlines


# ------------------------------------------------------------------------------------------ layer paths ---
def _is_module(obj: Any) -> bool:
    # A kernels Func (5.25 calls the conv from inside one) is a module but never the layer.
    return (obj is not None and hasattr(obj, "_modules") and hasattr(obj, "named_modules")
            and not kernels_funcs.is_func_module(obj))


def layer_from_frames(frame: FrameType | None) -> str:
    """The path (``model.layers.1.linear_attn``) of the module whose forward made this call.

    The layer is the nearest ``self`` that is a module; its path is read from the outermost module on the
    stack (the model being run), once per model, so it works without ``guard(model)``.
    """
    return _layer_of(_frame_selves(frame))


def _frame_selves(frame: FrameType | None, limit: int = _MAX_FRAMES) -> Iterator[Any]:
    depth = 0
    while frame is not None and depth < limit:
        yield frame.f_locals.get("self")
        frame = frame.f_back
        depth += 1


def _traced_selves() -> Iterator[Any]:
    """While dynamo traces: the ``self`` of each function it is inlining, innermost first, then the real stack.

    The functions dynamo inlines have no frames; the translator that traces the tripwire is the nearest frame
    whose ``self`` has ``symbolic_locals`` and ``parent``, and its parents trace the callers. The real stack
    past dynamo's own frames holds the callers of the frame being compiled (when dynamo compiles a frame
    below the model's, after it ran the outer ones eagerly). Best effort: dynamo's internals may change, and
    then the layer is found on the real stack only, or reported unknown.
    """
    frames = sys._getframe(1)
    tx = next((s for s in _frame_selves(frames, _MAX_TRACING_FRAMES)
               if hasattr(s, "symbolic_locals") and hasattr(s, "parent")), None)
    while tx is not None:
        var = getattr(tx, "symbolic_locals", {}).get("self")
        module = getattr(var, "value", None)  # an unspecialized (inlined) module
        key = getattr(var, "module_key", None)  # a specialized one is named by its key in the traced graph
        if module is None and key is not None:
            try:
                module = tx.output.get_submodule(key)
            except Exception:  # noqa: BLE001 - best effort, see above
                module = None
        yield module
        tx = getattr(tx, "parent", None)
    yield from _frame_selves(frames, _MAX_TRACING_FRAMES)


def _layer_of(selves: Iterable[Any]) -> str:
    layer = root = None
    for candidate in selves:
        if not _is_module(candidate):
            continue
        candidate = getattr(candidate, "_orig_mod", candidate)  # torch.compile's wrapper: the model it wraps
        if layer is None:
            layer = candidate
            path = layer_path(layer)
            if path is not None:
                return path
        root = candidate
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
    # Nothing to do on a call: no holders, or the entry was allowed and recorded (and logged) under the current
    # holders. The one flag the eager hot path reads; any change of holders clears it.
    quiet: bool = True
    # A new value whenever the holders change. The compiled path passes it to the trace-time verdict, so
    # dynamo guards the graph on it: a graph traced under an earlier arming is traced again. A string: dynamo
    # compares it by value (an object would be compared by id, which a later object may reuse; an int may
    # become a dynamic input).
    arming: str = field(default_factory=lambda: _new_arming())
    served: bool = False  # kernelized onto a Hub kernel after arming: its calls are not the reference
    _failure: compat.ImportFailure | None = None
    _failure_key: tuple[Any, ...] = ()

    def failure(self) -> compat.ImportFailure:
        """Why the reference runs: the import re-run once per process, again only if the import state changed
        (``sys.path``, or the provider's entry in ``sys.modules``): a failing import of a large package
        re-executes all of it up to the error, too slow for every test."""
        package = self.closure.package if self.closure is not None else ""
        key = (tuple(sys.path), id(sys.modules.get(package)))
        if self._failure is None or key != self._failure_key:
            self._failure_key = key
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

    def holders_changed(self) -> None:
        self.quiet = not self.holders
        self.arming = _new_arming()


_ARMINGS = itertools.count()


def _new_arming() -> str:
    return f"arming-{next(_ARMINGS)}"


class _TripwireInfo:
    __slots__ = ("patch",)

    def __init__(self, patch: _Patch) -> None:
        self.patch = patch

    @property
    def original(self) -> Any:
        return self.patch.original


def _install_fix(patch: _Patch) -> str:
    return compat.pip_fix(patch.closure.package) if patch.closure else "upgrade transformers"


def _trip(patch: _Patch, layer: Callable[[], str], *, tracing: bool = False) -> None:
    """Record the entry; raise when refused and an arming raises. ``layer`` names the caller (called once)."""
    # Kernelized after arming (the module-level Func, or the copy the calling layer dispatches to now).
    if patch.closure is not None and patch.closure.func_module is not None and compat.hub_kernel(patch.closure):
        patch.quiet = patch.served = True
        return
    failure = patch.failure()
    allowed = patch.allowed()
    where = layer()
    message = f"{where} entered the torch reference path of `{patch.kernel}` ({patch.site}): {failure.reason}. "
    event = REGISTRY.record(FallbackEvent(
        layer=where, kernel=patch.kernel, site=patch.site, allowed=allowed, message=message + SLOW_PATH_NOTE,
        fix=_install_fix(patch), reason=failure.reason, time=time.time(), issues=failure.issues,
    ))
    if allowed:
        patch.quiet = True
        REGISTRY.log_once(("trip", patch.kernel), fitted(f"kernelguard: allowed fallback: {event.message}"))
    elif patch.raises():
        error = event.to_error()
        raise compiled_error(error) if tracing else error


def _make_wrapper(patch: _Patch) -> Callable[..., Any]:
    original = patch.original
    is_compiling = _is_compiling_function()

    def decide_while_tracing(arming: str) -> None:
        # Marked for dynamo as a constant: it runs once, at trace time, when the reference is chosen for the
        # compiled graph, and nothing in it is traced. A refusal is raised from here (see compiled_error).
        if not patch.quiet and arming == patch.arming:
            _trip(patch, lambda: _layer_of(_traced_selves()), tracing=True)

    decide_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]

    function = patch.closure.torch_function.__name__ if patch.closure is not None else patch.name

    def kernelguard_tripwire(*args: Any, **kwargs: Any) -> Any:
        # Compiled: the only code dynamo traces here is the constant call and the original. Eager: two flag
        # reads per call once the site is allowed and recorded; frames are read only on a recorded entry, or
        # while a profiler records (to name the layer in the range).
        if is_compiling():
            decide_while_tracing(patch.arming)
            return original(*args, **kwargs)
        if not patch.quiet:
            _trip(patch, functools.partial(layer_from_frames, sys._getframe(1)))
        profiler_state = sys.modules.get("torch.autograd.profiler")
        if profiler_state is not None and profiler_state._is_profiler_enabled and not patch.served:
            name = f"{REFERENCE_RANGE}{function}@{layer_from_frames(sys._getframe(1))}"
            with profiler_state.record_function(name):
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    functools.update_wrapper(kernelguard_tripwire, original, updated=())
    kernelguard_tripwire.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(kernelguard_tripwire, compat.TRIPWIRE_ATTR, _TripwireInfo(patch))
    return kernelguard_tripwire


def _is_compiling_function() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (dynamo folds it to True while tracing), without importing torch: a
    modeling module being armed has imported it already."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    return getattr(compiler, "is_compiling", None) or _never


def _never() -> bool:
    return False


def compiled_error(error: KernelFallbackError) -> KernelFallbackError:
    """``error`` as raised while dynamo traces: also a ``torch._dynamo.exc.UserError``, which dynamo hands to
    the caller as it is (anything else it re-wraps as an internal error). Under ``fullgraph=True`` that is
    the only way a refusal leaves the compiled region; without it dynamo runs the frame eagerly, where the
    tripwire raises the plain error."""
    cls = _compiled_error_type()
    return error if cls is None else cls(error.message, fix=error.fix, details=error.details, layer=error.layer,
                                         kernel=error.kernel, reason=error.reason)


@functools.cache
def _compiled_error_type() -> type[KernelFallbackError] | None:
    try:
        from torch._dynamo.exc import TorchDynamoException, UserError, UserErrorType
        from torch._guards import TracingContext
    except ImportError:
        return None

    class _DynamoUserError(UserError):
        def __init__(self, rendered: str) -> None:
            # UserError's fields, set here: its __init__ would also replace our `message` with the rendered text.
            TorchDynamoException.__init__(self, rendered)
            self.real_stack = TracingContext.extract_stack()
            self.skip_frame = False
            self.logged = False
            self.error_type = UserErrorType.ANTI_PATTERN
            self.msg = rendered

    class CompiledKernelFallbackError(KernelFallbackError, _DynamoUserError):
        """A :class:`KernelFallbackError` raised while torch.compile traced the call."""

        def __reduce__(self) -> tuple[Any, ...]:  # a local class: travels as the plain error
            return KernelFallbackError(self.message, fix=self.fix, details=self.details, layer=self.layer,
                                       kernel=self.kernel, reason=self.reason).__reduce__()

    return CompiledKernelFallbackError


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


def _retrace_compiled_graphs() -> None:
    """Drop dynamo's compiled code (only that: CUDA graphs stay) so each region is traced again, through the
    tripwire: see :func:`kernelguard.resolution.kernels_funcs.compiled_graphs_miss_rebinding`."""
    dynamo = sys.modules.get("torch._dynamo")
    convert_frame = getattr(dynamo, "convert_frame", None)
    if dynamo is not None and getattr(getattr(convert_frame, "input_codes", None), "seen", None):
        dynamo.reset_code_caches()


def _reinstall(owner: Any, name: str) -> _Patch | None:
    """The retired patch of ``owner.<name>``, put back, when the name still holds what it wrapped."""
    patch = REGISTRY.retired.pop((id(owner), name), None)
    if patch is None or patch.owner is not owner or _current(owner, name) is not patch.original:
        return None
    setattr(owner, name, patch.wrapper)
    return patch


class Tripwires:
    """A set of armed tripwires; ``disarm()`` (or leaving the ``with`` block) restores the originals."""

    def __init__(self, allow: Iterable[str] | AllowPolicy = (), *, on_fallback: str = "raise",
                 source: str = "allow= of kernelguard.runtime.arm_tripwires()") -> None:
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
                if kernels_funcs.compiled_graphs_miss_rebinding(patch.original):
                    _retrace_compiled_graphs()
            if self not in patch.holders:
                patch.holders.append(self)
                patch.holders_changed()
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
                    patch.holders_changed()
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
    source: str = "allow= of kernelguard.runtime.arm_tripwires()",
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
