"""Runtime guard: per-layer report of the kernel each call site will run, and tripwires on reference paths.

``guard(model)`` finds kernel call sites generically (see :mod:`kernelguard.resolution.transformers_compat`), reports
for every layer whether it runs a fast provider (installed package, Kernel Hub kernel) or transformers' torch
reference, and arms tripwires (:mod:`kernelguard.runtime.tripwires`): the module-level name a layer's forward looks up
at call time is replaced by a wrapper that raises :class:`KernelFallbackError` on the first entry into a torch
reference path. The import-time choice is read before the first forward, so torch.compile and silenced logging
cannot hide it.

``allow`` is parsed once into an :class:`~kernelguard.resolution.policy.AllowPolicy` (an unknown item is a ConfigError
listing the valid ones). A slow site is accepted by its kernel name (``"chunk_gated_delta_rule"``), by a
known-issue ID that explains it (an ``undefined symbol`` import error: ``extension-built-for-other-torch``;
fla's #640 refusal: ``fla-640-refusal``; ...), ``"attention"`` (the packed sdpa/eager slow path) or ``"*"``.

Each call site is a :class:`~kernelguard.resolution.decisions.Decision` with ``layer`` set (kind ``package``, ``hub`` or
``reference``), rendered by :func:`kernelguard.stack.report.render_call_sites`.

``guard()`` also arms :mod:`kernelguard.runtime.boundaries` on the model: a packed row whose GDN kernels get no example
boundaries raises :class:`~kernelguard.errors.PackedWithoutBoundariesError` at that forward (allow item
``packed-without-boundaries``).

Strict mode (the default) raises :class:`ConfigError` for a module with no kernel call site and no attention
layer (``nn.Sequential``, a sub-module, a wrapper that hides the model): guarding nothing is almost surely a
mistake. ``strict=False`` returns the report, which says "no gated-delta call sites found".
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from kernelguard.errors import ConfigError, KernelFallbackError
from kernelguard.resolution import MODES, PYTHON, REFERENCE, AllowPolicy, allow_hint, option_hint
from kernelguard.resolution import transformers_compat as compat
from kernelguard.runtime import registry
from kernelguard.runtime.boundaries import watch_boundaries
from kernelguard.runtime.layer_guard import VARLEN_ATTENTION_IMPLEMENTATIONS, CallSite, collect_call_sites
from kernelguard.runtime.registry import FallbackEvent, clear_fallback_events, fallback_events
from kernelguard.runtime.tripwires import Tripwires, arm_tripwires
from kernelguard.stack import (
    fix_text,
    layer_summary,
    render_call_sites,
    short_provider,
    terminal_width,
    why_fix_block,
)

__all__ = [
    "VARLEN_ATTENTION_IMPLEMENTATIONS",
    "CallSite",
    "FallbackEvent",
    "GuardReport",
    "Tripwires",
    "arm_tripwires",
    "clear_fallback_events",
    "fallback_events",
    "guard",
    "inspect",
    "quiet_transformers_duplicates",
]

ALLOW_SOURCE = "allow= of kernelguard.guard()"
ATTENTION_POLICIES = ("error", "warn", "ignore")
NO_SITES = "no gated-delta call sites found"


def _model_device(model: Any) -> str:
    for param in model.parameters():
        return str(param.device.type)
    return "cpu"



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
        self.fla_backend: Any = None  # kernelguard.resolution.facts.FlaBackend when fla serves a GDN site on a GPU
        self.boundaries: Any = None  # kernelguard.runtime.boundaries.BoundaryWatch, armed by guard()

    @property
    def kernel_sites(self) -> list[CallSite]:
        """Call sites of fallback-wrapped kernels (GDN, conv, ...): everything but attention."""
        return [e for e in self.entries if e.kernel != "attention"]

    @property
    def notes(self) -> list[str]:
        if self.kernel_sites:
            backend = self.fla_backend
            return [f"fla runs the GDN op on its {backend.label} backend ({backend.source})"] if backend else []
        checked = "only attention was checked" if self.entries else "nothing was checked"
        return [f"{NO_SITES}: no layer calls a transformers kernel with a torch fallback; {checked}"]

    def offending(self) -> list[CallSite]:
        """Required slow sites that nothing accepted (attention ones only under attention='error')."""
        return [e for e in self.entries if _is_offending(e, self.attention)]

    @property
    def ok(self) -> bool:
        return not self.offending()

    def disarm(self) -> None:
        self.tripwires.disarm()
        if self.boundaries is not None:
            self.boundaries.disarm()

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
            "kernel_call_sites": len(self.kernel_sites),
            "notes": self.notes,
            "fla_backend": self.fla_backend.to_dict() if self.fla_backend else None,
            "armed_sites": self.tripwires.sites,
            "entries": [e.to_dict() for e in self.entries],
        }

    def render(
        self, *, verbose: bool = False, width: int | None = None, syntax: str = PYTHON, call: str | None = None,
        padded: str | None = None, fixes: bool = True, why: bool = True,
    ) -> str:
        """One line per kernel (status, provider, layer count), or with ``verbose`` the per-layer table; a
        report with slow paths ends with a "why / fix" block spelled for ``syntax`` (see :mod:`kernelguard.resolution.terms`).
        Lines fit ``width`` (default: the terminal's, 100 when not a terminal); ``call`` and ``padded`` as in
        :meth:`why_and_fix`; ``fixes=False`` leaves the fix lines to the error that carries them, ``why=False`` the
        why lines too (for a caller that prints its own block)."""
        verdict = "OK" if self.ok else "SLOW PATHS"
        if not self.kernel_sites:
            verdict += f" ({NO_SITES})"
        header = (
            f"kernelguard: transformers {self.transformers_version} ({self.mechanism}), device {self.device}, "
            f"mode {self.mode}, packed={self.packed}: {verdict}"
        )
        rows = [(e.decision, _status(e, self.attention)) for e in self.entries]
        whys, fix = self.why_and_fix(syntax=syntax, call=call, padded=padded) if not self.ok else ([], [])
        return render_call_sites(header, rows, notes=self.notes, verbose=verbose, width=width,
                                 why=whys if why else [], fixes=fix if fixes and why else [])

    def why_and_fix(
        self, *, syntax: str = PYTHON, call: str | None = None, padded: str | None = None
    ) -> tuple[list[str], list[str]]:
        """Why the offending sites are refused, and the fixes: install commands first, then an allow only for
        what an allow can accept (``call`` wraps it, e.g. ``"KernelGuardCallback({})"``), then padded batches
        (``padded``) for GDN references that no allow makes right in packed training."""
        return _why_and_fix(self.offending(), packed_training=self.packed and self.mode == "training", syntax=syntax,
                            call=call, padded=padded)

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


def _why_and_fix(
    offending: list[CallSite], *, packed_training: bool, syntax: str = PYTHON, call: str | None = None,
    padded: str | None = None,
) -> tuple[list[str], list[str]]:
    groups: dict[tuple[str, str, str], list[str]] = {}
    for e in offending:
        groups.setdefault((e.kernel, short_provider(e.decision), e.reason), []).append(e.layer)
    why = [f"{kernel} -> {provider} in {layer_summary(layers)}: {reason}"
           for (kernel, provider, reason), layers in groups.items()]
    fixes = list(dict.fromkeys(e.fix for e in offending if e.fix))
    # A GDN torch reference cannot keep packed rows apart: no allow makes it acceptable, padded batches do.
    packed_only = sorted({e.kernel for e in offending if packed_training and e.kind == REFERENCE
                          and e.kernel != "attention"})
    allowable = list(dict.fromkeys(e.kernel for e in offending if e.kernel not in packed_only))
    if allowable:
        template = call or ("kernelguard.guard(model, {})" if syntax == PYTHON else "{}")
        fixes.append(f"or accept explicitly: {template.format(allow_hint(allowable, syntax))}")
    if packed_only:
        fixes.append(f"or train on padded batches ({padded or option_hint('packed', False, syntax)}): "
                     f"{', '.join(packed_only)} cannot keep packed rows apart on the torch reference, whatever "
                     "is allowed")
    return why, fixes


def _offending_error(offending: list[CallSite], *, packed_training: bool) -> KernelFallbackError:
    why, fixes = _why_and_fix(offending, packed_training=packed_training)
    width = terminal_width()
    lines = [f"kernelguard: {len(offending)} required kernel call site(s) would run a slow path:",
             *why_fix_block(why, [], width=width)]
    first = offending[0]
    # One command per line: an install command may end in a shell comment. "Fix: " comes first (5 columns).
    return KernelFallbackError(
        "\n".join(lines), fix=fix_text(fixes, width=width), layer=first.layer,
        kernel=first.kernel, reason=first.reason,
        details={"offending": [e.to_dict() for e in offending]},
    )


# -------------------------------------------------------------------------------------------- guard ---
def _require_module(model: Any) -> None:
    torch = sys.modules.get("torch")
    module_type = getattr(getattr(torch, "nn", None), "Module", None)
    if module_type is not None and isinstance(model, module_type):
        return
    shown = repr(model)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ConfigError(
        f"kernelguard.guard(model): expected a torch.nn.Module (a transformers model such as "
        f"Qwen3_5ForCausalLM), got {type(model).__name__} {shown}",
        fix="pass the model object itself: model = AutoModelForCausalLM.from_pretrained(...); "
        "kernelguard.guard(model)",
        details={"found": type(model).__name__},
    )


def _validate(
    model: Any, mode: str, attention: str, allow: Iterable[str] | AllowPolicy, **switches: Any
) -> AllowPolicy:
    _require_module(model)
    for name, value in switches.items():  # "no" is truthy: a string would silently mean True
        if not isinstance(value, bool):
            raise ConfigError(
                f"{name} must be True or False, got {value!r} ({type(value).__name__}).",
                fix=f"kernelguard.guard(model, {name}=True)",
            )
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if attention not in ATTENTION_POLICIES:
        raise ConfigError(f"attention must be one of {ATTENTION_POLICIES}, got {attention!r}")
    return AllowPolicy.parse(allow, source=ALLOW_SOURCE)


def _nothing_to_guard(model: Any) -> ConfigError:
    return ConfigError(
        f"kernelguard.guard({type(model).__name__}): {NO_SITES} and no attention layer: no layer of this "
        "module calls a transformers kernel with a torch fallback, so there is nothing to guard.",
        fix="pass the whole transformers model (e.g. Qwen3_5ForCausalLM), not a sub-module or a wrapper that "
        "hides it; strict=False returns the empty report instead",
    )


def _collect(model: Any, *, mode: str, packed: bool | None, allow: Iterable[str] | AllowPolicy, attention: str,
             strict: bool) -> tuple[GuardReport, Any]:
    # packed=None means "the default for this mode"; anything else must be a real bool ("no" is truthy).
    switches = {"strict": strict} if packed is None else {"packed": packed, "strict": strict}
    policy = _validate(model, mode, attention, allow, **switches)
    packed = mode == "training" if packed is None else packed
    mechanism = compat.selection_mechanism()
    version = compat.transformers_version()
    device = _model_device(model)
    found = collect_call_sites(model, mechanism, mode=mode, packed=packed, policy=policy, device=device)
    if strict and not found.entries:
        raise _nothing_to_guard(model)
    report = GuardReport(found.entries, Tripwires(policy, source=ALLOW_SOURCE), device=device, mode=mode,
                         packed=packed, attention=attention, transformers_version=version, mechanism=mechanism)
    report.fla_backend = _fla_backend(model, report, mode)
    return report, found


def _fla_backend(model: Any, report: GuardReport, mode: str) -> Any:
    """fla's own choice of GDN backend on this GPU, when an fla kernel serves a site (kernelguard.resolution.fla_backend)."""
    if report.device == "cpu" or not any(e.fast and e.implementation.startswith("fla") for e in report.kernel_sites):
        return None
    from kernelguard.resolution import ComputeCapability, distribution_version, fla_backend, geometry

    torch = sys.modules["torch"]
    dims = geometry.gdn_dims(getattr(model, "config", None) or {})
    shape = fla_backend.GdnShape(dims.key_dim, dims.value_dim, dims.num_k_heads, dims.num_v_heads) if dims else \
        fla_backend.GdnShape(None, None)
    try:
        arch = ComputeCapability.from_tuple(torch.cuda.get_device_capability())
    except Exception:  # noqa: BLE001 - not a CUDA device after all: no backend to name
        return None
    triton = distribution_version("triton") or distribution_version("pytorch-triton")
    return fla_backend.probe([arch], training=mode == "training", shape=shape, triton_version=triton).get(str(arch))


def inspect(
    model: Any,
    *,
    mode: str = "training",
    packed: bool | None = None,
    allow: Iterable[str] | AllowPolicy = (),
    attention: str = "error",
) -> GuardReport:
    """What every kernel call site of ``model`` runs, without arming anything or raising on a slow site: the
    report of :func:`guard` (``.ok``, ``.render()``, ``.to_dict()``) for a look, a log line or a CI artifact."""
    report, _ = _collect(model, mode=mode, packed=packed, allow=allow, attention=attention, strict=False)
    return report


def guard(
    model: Any,
    *,
    mode: str = "training",
    packed: bool | None = None,
    allow: Iterable[str] | AllowPolicy = (),
    strict: bool = True,
    attention: str = "error",
    first_row_probe: bool = True,
    log_allowed: bool = True,
) -> GuardReport:
    """Report what every kernel call site of ``model`` runs and arm tripwires on its reference paths.

    ``packed``: ``None`` (default) means packed for ``mode="training"``, as ``kernelguard check`` and
    ``kernelguard.require()`` assume (kernelguard's own trainer packs); pass ``packed=False`` for padded batches.
    Strict (default): raises :class:`KernelFallbackError` listing every offending layer when a required call
    site is slow and not allowed, and arms nothing; raises :class:`ConfigError` when ``model`` has no kernel
    call site and no attention layer. ``strict=False``: reports and arms; the first entry into a reference
    path still raises unless allowed. The tripwires stay armed for the process until ``disarm()`` (or the end
    of a ``with`` block); :func:`inspect` reports without arming.

    Packed rows are checked where they reach the decoder stack (:mod:`kernelguard.runtime.boundaries`);
    ``first_row_probe`` (default True) also runs the first packed row example by example and refuses when a
    decoder layer's output differs from the examples' own (:mod:`kernelguard.runtime.equivalence`; its cost: one extra
    forward of that row and of up to three of its examples, again only when autograd, train/eval or a wrapper
    below the stack changes).

    ``log_allowed=False``: the caller says which slow paths were allowed itself (`kernelguard train`: its table
    and one line), so neither the guard nor the tripwires log a line per allowed kernel.
    """
    if not isinstance(first_row_probe, bool):
        raise ConfigError(f"first_row_probe must be True or False, got {first_row_probe!r}.",
                          fix="kernelguard.guard(model, first_row_probe=False)")
    report, found = _collect(model, mode=mode, packed=packed, allow=allow, attention=attention, strict=strict)
    _log_allowed_and_warned(report, say_allowed=log_allowed)
    offending = report.offending()
    if strict and offending:
        raise _offending_error(offending, packed_training=report.packed and mode == "training")
    registry.remember_layer_paths(found.layer_paths)
    quiet_transformers_duplicates()
    for owner, name, kernel, site, closure in found.to_arm:
        report.tripwires.arm(owner, name, kernel, site, closure)
    report.boundaries = watch_boundaries(model, report.tripwires.policy, mode=mode,
                                         probe=first_row_probe and report.packed)
    return report


# transformers (>= 5.24) logs its own warning on a hub-wrapped function's first fallback call. An allowed
# fallback that kernelguard already logged (with the layer and the reason) would read twice; only those records
# are dropped, so a fallback kernelguard did not report keeps transformers' line.
_TRANSFORMERS_FALLBACK = re.compile(r"^`([^`]+)` is falling back to its reference PyTorch implementation")
_HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"


class _ReportedByKernelguard(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        match = _TRANSFORMERS_FALLBACK.match(str(record.msg))
        return match is None or ("trip", match.group(1)) not in registry.REGISTRY.logged_once


def quiet_transformers_duplicates() -> None:
    """Install (once) the filter that drops transformers' fallback warning for calls kernelguard logged."""
    target = logging.getLogger(_HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _ReportedByKernelguard) for f in target.filters):
        target.addFilter(_ReportedByKernelguard())


def _log_allowed_and_warned(report: GuardReport, *, say_allowed: bool = True) -> None:
    for e in report.entries:
        if e.fast:
            continue
        if e.allowed and not say_allowed:  # said by the caller: the first call's line would repeat it
            registry.mark_logged(("allowed", e.kernel, e.reason))
            registry.mark_logged(("trip", e.kernel))
        elif e.allowed:
            registry.log_once(("allowed", e.kernel, e.reason), registry.fitted(
                f"kernelguard: allowed slow path `{e.kernel}` -> {e.implementation} ({e.reason})"))
        elif e.kernel == "attention" and report.attention == "warn":
            registry.log_once(("attention", e.implementation),
                              registry.fitted(f"kernelguard: slow attention: {e.reason}. Fix: {e.fix}"))
