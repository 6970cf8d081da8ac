"""Per-layer call-site classification: what each kernel call site of a model will run, and why.

For every layer, :func:`collect_call_sites` finds the kernel call sites generically (see
:mod:`kernelguard.resolution.transformers_compat`) and classifies each as a :class:`CallSite` (a
:class:`~kernelguard.resolution.decisions.Decision` with ``layer`` set, kind ``package``, ``hub`` or ``reference``) under an
:class:`~kernelguard.resolution.policy.AllowPolicy`, plus what to arm and which layer paths to remember.
:func:`kernelguard.guard` turns the result into a report and arms it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from kernelguard.resolution import (
    ALLOWED,
    FALLBACK,
    HUB,
    PACKAGE,
    PACKED_REFERENCE,
    REFERENCE,
    REJECTED,
    SELECTED,
    AllowPolicy,
    Decision,
    is_decode_only,
)
from kernelguard.resolution import transformers_compat as compat
from kernelguard.runtime.attention import VARLEN_NAME

__all__ = [
    "VARLEN_ATTENTION_IMPLEMENTATIONS",
    "is_attention_layer",
    "CallSite",
    "Collected",
    "attention_site",
    "classify_closure",
    "collect_call_sites",
]

# Attention implementation names (config._attn_implementation) that take cu_seqlens directly, so packed rows
# need no O(T^2) mask. Not to be confused with catalog.VARLEN_ATTENTION, the *kernel* name `check` resolves.
VARLEN_ATTENTION_IMPLEMENTATIONS = frozenset(
    {"flash_attention_2", "flash_attention_3", "flash_attention_4", VARLEN_NAME}
)
_ATTENTION_FORWARD_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"})


# ------------------------------------------------------------------------------------------- records ---
@dataclass(frozen=True, slots=True)
class CallSite:
    """One kernel call site of one layer, as it will run: a :class:`Decision` with ``layer`` set."""

    decision: Decision
    required: bool = True  # False for decode-only kernels in training mode

    layer = property(lambda self: self.decision.layer)  # module path, e.g. "model.layers.3.linear_attn"
    kernel = property(lambda self: self.decision.kernel)  # e.g. "chunk_gated_delta_rule", or "attention"
    implementation = property(lambda self: self.decision.provider)  # "fla.ops....chunk_gated_delta_rule 0.6.0"
    kind = property(lambda self: self.decision.kind)  # "package" | "hub" | "reference"
    provider_kind = kind  # the name 0.1 used
    status = property(lambda self: self.decision.status)
    reason = property(lambda self: self.decision.reason)
    fix = property(lambda self: self.decision.fix or "")
    issues = property(lambda self: self.decision.issues)

    @property
    def fast(self) -> bool:
        return self.decision.status == SELECTED

    @property
    def allowed(self) -> bool:
        """A slow site the AllowPolicy accepts."""
        return self.decision.status == ALLOWED

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "kernel": self.kernel, "implementation": self.implementation,
                **self.decision.to_dict(), "fast": self.fast, "allowed": self.allowed, "required": self.required}


def _site(layer: str, kernel: str, impl: str, kind: str, status: str, reason: str, fix: str = "",
          issues: tuple[str, ...] = (), *, required: bool = True) -> CallSite:
    return CallSite(Decision(kernel, impl, kind, status, reason, fix or None, issues, layer), required)


def _slow(policy: AllowPolicy, kernel: str, issues: tuple[str, ...], status: str) -> str:
    return ALLOWED if policy.allows_site(kernel, issues) else status


# -------------------------------------------------------------------------------------- classification ---
def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def _version_of(fn: Any) -> str:
    top = sys.modules.get(str(getattr(fn, "__module__", "") or "").split(".")[0])
    version = getattr(top, "__version__", None)
    return f" {version}" if version else ""


def classify_closure(
    layer: str, closure: compat.FallbackClosure, device: str, *, required: bool, policy: AllowPolicy,
    packed_training: bool = False, hub_asked: bool = False,
) -> CallSite:
    kernel = closure.kernel
    hub = compat.hub_kernel(closure)
    if hub is not None:
        return _site(layer, kernel, hub, HUB, SELECTED, "kernelize() selected a Kernel Hub kernel", required=required)
    impl = closure.implementation
    if not closure.is_torch_reference:
        devices = compat.provider_devices(impl)
        name = _qualname(impl) + _version_of(impl)
        if device == "meta" or device in devices:
            reason = f"`{closure.package}` was importable when transformers chose"
            return _site(layer, kernel, name, PACKAGE, SELECTED, reason, required=required)
        reason = (
            f"`{closure.package}`{_version_of(impl)} is installed, but it does not run on device {device} "
            f"(runs on: {', '.join(devices)}; declare others with `{compat.DEVICES_ATTR}`)"
        )
        return _site(layer, kernel, name, PACKAGE, _slow(policy, kernel, (), REJECTED), reason,
                     f"move the model to {devices[0]} before training", required=required)
    failure = compat.import_failure(closure)
    hub_off = compat.kernels_hub_status() if hub_asked else None  # noise unless the model asked for the Hub
    reason = f"{failure.reason}; {hub_off}" if hub_off else failure.reason
    status = _slow(policy, kernel, failure.issues, FALLBACK)
    if packed_training and required and status == ALLOWED:
        status, reason = FALLBACK, f"{reason}; allowed, but {PACKED_REFERENCE}"
    return _site(layer, kernel, _qualname(closure.torch_function), REFERENCE, status, reason,
                 compat.pip_fix(closure.package), failure.issues, required=required)


def attention_site(layer: str, module: Any, model: Any, *, packed: bool, policy: AllowPolicy) -> CallSite:
    config = getattr(module, "config", None) or getattr(model, "config", None)
    impl = str(getattr(config, "_attn_implementation", None) or "eager")
    kind = HUB if "/" in impl else (REFERENCE if impl == "eager" else PACKAGE)
    varlen = impl in VARLEN_ATTENTION_IMPLEMENTATIONS or "/" in impl
    slow = ALLOWED if policy.allows_attention() else FALLBACK
    if impl == VARLEN_NAME and not _attention_registered(impl):
        reason = f"`{VARLEN_NAME}` is configured but not registered in transformers' AttentionInterface"
        return _site(layer, "attention", impl, PACKAGE, ALLOWED if policy.allows_attention() else REJECTED,
                     reason, f"AttentionInterface.register('{VARLEN_NAME}', fn) before building the model")
    if not packed or varlen:
        why = "varlen attention takes cu_seqlens directly" if varlen else "not in packed mode"
        return _site(layer, "attention", impl, kind, SELECTED, why)
    reason = (
        f"{impl} with packed position ids materialises an O(T^2) block mask over the whole packed row "
        "(slow, quadratic memory)"
    )
    fix = f"attn_implementation='flash_attention_2' (flash-attn) or register a varlen attention as '{VARLEN_NAME}'"
    return _site(layer, "attention", impl, kind, slow, reason, fix)


def is_attention_layer(module: Any) -> bool:
    """A module whose forward dispatches through transformers' attention functions (an attention layer)."""
    names, _ = compat.forward_code_names(type(module))
    return bool(_ATTENTION_FORWARD_NAMES.intersection(names))


def _attention_registered(name: str) -> bool:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    try:
        return name in ALL_ATTENTION_FUNCTIONS
    except TypeError:  # a mapping type that refuses `in` on some releases
        return False


# ------------------------------------------------------------------------------------------ collection ---
@dataclass(slots=True)
class Collected:
    """Call sites of one model, the reference globals to arm, and the layer paths to remember."""

    entries: list[CallSite]
    to_arm: list[tuple[Any, str, str, str, compat.FallbackClosure | None]]
    layer_paths: list[tuple[Any, str]]
    kernel_layers: int = 0


def _collect_decorator_sites(found: Collected, path: str, module: Any, device: str, mode: str,
                             policy: AllowPolicy, packed: bool = False, hub_asked: bool = False) -> None:
    for gsite in compat.layer_global_sites(module):
        closure = gsite.closure
        required = mode == "inference" or not is_decode_only(closure.kernel)
        found.entries.append(classify_closure(path, closure, device, required=required, policy=policy,
                                               packed_training=packed and mode == "training", hub_asked=hub_asked))
        # A decode-only kernel in training mode is not required (generate() inside a job may run its reference,
        # slowly): reported, never armed.
        if required and closure.is_torch_reference and compat.hub_kernel(closure) is None:
            owner = sys.modules.get(gsite.module)
            if owner is not None:
                found.to_arm.append((owner, gsite.name, closure.kernel, f"{gsite.module}.{gsite.name}", closure))
        found.layer_paths.append((module, path))
        found.kernel_layers += 1


def collect_call_sites(
    model: Any, mechanism: str, *, mode: str, packed: bool, policy: AllowPolicy, device: str
) -> Collected:
    """Every call site of every layer of ``model`` (``mechanism``: :func:`compat.selection_mechanism`, always
    "decorator" on the supported transformers releases)."""
    found = Collected([], [], [])
    hub_asked = bool(getattr(model, "use_kernels", False))  # from_pretrained(use_kernels=True) / kernelize()
    for path, module in model.named_modules():
        path = path or type(model).__name__
        _collect_decorator_sites(found, path, module, device, mode, policy, packed, hub_asked)
        if is_attention_layer(module):
            found.entries.append(attention_site(path, module, model, packed=packed, policy=policy))
    return found
