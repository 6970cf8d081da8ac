"""How the installed transformers selects kernel implementations, found generically.

transformers >= 5.15 decorates each reference function (``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``,
...) in a modeling module with ``use_kernel_func_from_hub_with_fallback(func_name, package)``. The decorator
tries ``import package`` once, at module import, and returns a closure ``wrapped`` whose cells hold
``implementation`` (the package function, or the torch function on failure) and ``torch_function``. With the
``kernels`` package active, ``wrapped`` is further turned into a kernels ``Func`` module instance that
``kernelize()`` may point at a Hub kernel. Layers look the module-level name up at call time.

No model class is named here: a layer is any module whose class ``forward`` references (``co_names``) a module
global that unpacks to such a closure. This module is the one reader of those closures (:func:`closure_cells`)
and of a family's call sites (:func:`call_sites` for a loaded modeling module, :func:`family_of_model_type` for
a config). Only the standard library is imported at module import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

from kernelguard.errors import UnsupportedTransformersError
from kernelguard.resolution import kernels_funcs
from kernelguard.resolution.catalog import PACKAGES, KernelRequirement
from kernelguard.resolution.hub_load import kernels_hub_status, transformers_package_devices
from kernelguard.resolution.known_issues import KNOWN_ISSUES, KnownIssue

__all__ = [
    "DECORATOR_NAME",
    "DEFAULT_DEVICES",
    "DEVICES_ATTR",
    "MIN_TRANSFORMERS",
    "TRIPWIRE_ATTR",
    "FallbackClosure",
    "GlobalSite",
    "ImportFailure",
    "call_sites",
    "closure_cells",
    "family_of_model_type",
    "forward_code_names",
    "hub_kernel",
    "hub_wrapper",
    "import_failure",
    "internal_path",
    "iter_modeling_modules",
    "kernels_hub_status",
    "known_issue_ids",
    "layer_global_sites",
    "loaded_sites",
    "module_sites",
    "pip_fix",
    "provider_devices",
    "selection_mechanism",
    "transformers_version",
    "unpack_closure",
    "unsupported",
]

MIN_TRANSFORMERS = (5, 0)
DECORATOR_NAME = "use_kernel_func_from_hub_with_fallback"
TRIPWIRE_ATTR = "__kernelguard_tripwire__"
DEVICES_ATTR = "__kernelguard_devices__"
# Devices a provider is assumed to run on when neither it (__kernelguard_devices__) nor the catalog says.
DEFAULT_DEVICES: tuple[str, ...] = ("cuda",)

# Used when transformers' own table (`_KERNELS_INTERNAL_PATH_MAPPINGS`) is absent.
_DEFAULT_INTERNAL_PATHS = {
    "chunk_gated_delta_rule": "ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "ops.gated_delta_rule",
    "chunk_kda": "ops.kda",
    "fused_recurrent_kda": "ops.kda",
}


@dataclass(frozen=True, slots=True)
class FallbackClosure:
    """What one decorated function decided at import time."""

    kernel: str  # transformers' func_name, e.g. "chunk_gated_delta_rule"
    package: str  # import name tried, e.g. "fla"
    implementation: Callable[..., Any]
    torch_function: Callable[..., Any]
    wrapped: Callable[..., Any]  # transformers' closure (calls `implementation`)
    func_module: Any = None  # the kernels `Func` instance, when kernels turned `wrapped` into a module
    layer_func: Any = None  # the calling layer's own copy of it (kernels >= 0.18), which kernelize() changes

    @property
    def is_torch_reference(self) -> bool:
        return self.implementation is self.torch_function

    @property
    def internal_module(self) -> str:
        internal = internal_path(self.kernel)
        return self.package if internal is None else f"{self.package}.{internal}"


@dataclass(frozen=True, slots=True)
class GlobalSite:
    """A module-level name (``module.__dict__[name]``) that a layer forward calls."""

    module: str  # module whose globals the forward reads, e.g. transformers.models.qwen3_5.modeling_qwen3_5
    name: str  # e.g. "torch_chunk_gated_delta_rule"
    closure: FallbackClosure


# --------------------------------------------------------------------------------------------- versions ---
def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def _hub_kernels_module() -> ModuleType | None:
    try:
        return importlib.import_module("transformers.integrations.hub_kernels")
    except ImportError:  # absent: treated as "no decorator"
        return None


@functools.lru_cache(maxsize=8)
def _probe_decorator(version: str) -> str | None:
    """Decorate a dummy with the real decorator and check the closure layout we rely on.

    Returns None when understood, else a sentence saying what differs. Cached per transformers version.
    """
    hub = _hub_kernels_module()
    decorator = getattr(hub, DECORATOR_NAME, None) if hub is not None else None
    if decorator is None:
        return f"transformers.integrations.hub_kernels has no `{DECORATOR_NAME}`"

    def _kernelguard_probe(x: Any) -> Any:
        return x

    try:
        decorated = decorator("kernelguard_probe", "kernelguard_probe_missing_package")(_kernelguard_probe)
    except Exception as exc:  # noqa: BLE001 - re-raised by selection_mechanism as UnsupportedTransformersError
        return f"`{DECORATOR_NAME}` failed on a probe function: {type(exc).__name__}: {exc}"
    closure = unpack_closure(decorated)
    if closure is None or closure.torch_function is not _kernelguard_probe or not closure.is_torch_reference:
        return f"`{DECORATOR_NAME}` no longer returns a closure holding `implementation` and `torch_function`"
    return None


def selection_mechanism() -> str:
    """``"decorator"``: the one mechanism of the transformers releases kernelguard supports; refuses others."""
    version = transformers_version()
    if _version_tuple(version) < MIN_TRANSFORMERS:
        raise UnsupportedTransformersError(
            f"unsupported transformers version {version}: kernelguard needs transformers >= 5.0.",
            fix="pip install -U 'transformers>=5.17,<6'",
        )
    hub = _hub_kernels_module()
    if hub is None or not hasattr(hub, DECORATOR_NAME):
        raise unsupported(version, f"transformers.integrations.hub_kernels has no `{DECORATOR_NAME}`")
    problem = _probe_decorator(version)
    if problem is not None:
        raise unsupported(version, problem)
    return "decorator"


def unsupported(version: str, why: str) -> UnsupportedTransformersError:
    return UnsupportedTransformersError(
        f"unsupported transformers version {version}: {why}; kernelguard cannot tell which kernel "
        "implementation its layers run, and refuses to guess.",
        fix="use a transformers release kernelguard is tested with (5.17 - 5.23), or upgrade kernelguard",
    )


# ------------------------------------------------------------------------------------------ unpacking ---
def closure_cells(fn: Any) -> dict[str, Any]:
    """A function's closure variables by name (empty cells and non-closures give ``{}``).

    The one place that reads closures: transformers' ``wrapped`` (``implementation``, ``torch_function``, ...)
    and the kernels ``Func`` module's class forward (``func``). numerics and the guard both go through here.
    """
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, closure):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # empty cell
            continue
    return out


def unpack_closure(obj: Any, _depth: int = 0) -> FallbackClosure | None:
    """The decorator's decision behind ``obj`` (a wrapped function, a kernels Func module, or our tripwire)."""
    if obj is None or _depth > 4:
        return None
    tripwire = getattr(obj, TRIPWIRE_ATTR, None) if callable(obj) else None
    if tripwire is not None:
        return unpack_closure(tripwire.original, _depth + 1)
    cells = closure_cells(obj)
    if "implementation" in cells and "torch_function" in cells:
        return FallbackClosure(
            kernel=str(cells.get("func_name", getattr(cells["torch_function"], "__name__", "?"))),
            package=str(cells.get("package", "?")),
            implementation=cells["implementation"],
            torch_function=cells["torch_function"],
            wrapped=obj,
        )
    if hasattr(obj, "kernel_layer_name") and not isinstance(obj, (FunctionType, type)):
        # kernels' `Func` module: its class forward closes over `func` (transformers' `wrapped`).
        inner = closure_cells(type(obj).forward).get("func")
        found = unpack_closure(inner, _depth + 1)
        if found is not None:
            return FallbackClosure(
                kernel=found.kernel, package=found.package, implementation=found.implementation,
                torch_function=found.torch_function, wrapped=found.wrapped, func_module=obj,
            )
    return None


def hub_wrapper(obj: Any) -> Callable[..., Any] | None:
    """transformers' ``wrapped`` function behind a module-level kernel name: the name itself when it is a
    function, or the function a kernels ``Func`` module's forward closes over (``kernels`` active)."""
    if isinstance(obj, FunctionType):
        return obj
    forward = getattr(type(obj), "forward", None)
    inner = closure_cells(forward).get("func") if isinstance(forward, FunctionType) else None
    return inner if isinstance(inner, FunctionType) else None


def hub_kernel(closure: FallbackClosure) -> str | None:
    """``repo@revision`` when ``kernelize()`` pointed the kernels Func serving this site at a Hub kernel."""
    func = hub_func(closure)
    return None if func is None else kernels_funcs.hub_kernel_of(func)


def hub_func(closure: FallbackClosure) -> Any | None:
    """The kernels Func whose ``forward`` kernelize() replaced for this site (module-level, or the layer's own
    copy: :mod:`kernelguard.resolution.kernels_funcs`), or None when the site is not served by the Hub."""
    if closure.func_module is None:
        return None
    own = (closure.layer_func,) if closure.layer_func is not None else ()
    return kernels_funcs.serving_func(closure.func_module, own)


def internal_path(kernel: str) -> str | None:
    hub = _hub_kernels_module()
    table = getattr(hub, "_KERNELS_INTERNAL_PATH_MAPPINGS", None) if hub is not None else None
    if isinstance(table, dict):
        return table.get(kernel, _DEFAULT_INTERNAL_PATHS.get(kernel))
    return _DEFAULT_INTERNAL_PATHS.get(kernel)


# ---------------------------------------------------------------------------------------- discovery ---
def iter_modeling_modules() -> Iterator[ModuleType]:
    """Every loaded transformers model module (no import is triggered)."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("transformers.models.") and ".modeling_" in name:
            yield module


def module_sites(module: ModuleType) -> list[GlobalSite]:
    """The decorated kernel globals defined in (or imported into) one module."""
    sites = []
    for name, value in list(vars(module).items()):
        if name.startswith("__") or not callable(value):
            continue
        closure = unpack_closure(value)
        if closure is not None:
            sites.append(GlobalSite(module=module.__name__, name=name, closure=closure))
    return sites


def loaded_sites() -> list[GlobalSite]:
    return [site for module in iter_modeling_modules() for site in module_sites(module)]


def forward_code_names(cls: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Names the class forward looks up, and the globals dict it looks them up in."""
    return _forward_names(cls)


@functools.lru_cache(maxsize=1024)
def _forward_names(cls: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    forward = getattr(cls, "forward", None)
    if forward is None:
        return (), {}
    with contextlib.suppress(ValueError):
        forward = inspect.unwrap(forward)
    code, globals_ = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
    if code is None:
        return (), {}
    # One level into the module's own helpers: 5.25 calls causal_conv1d_fn / _update via causal_conv1d_forward.
    names = [(n, *_helper_names(globals_.get(n), globals_.get("__name__"))) for n in code.co_names]
    return tuple(dict.fromkeys(name for group in names for name in group)), globals_  # in call order


def _helper_names(value: Any, module: Any) -> tuple[str, ...]:
    """The names a plain function of the modeling module itself looks up (never a kernel wrapper's); with
    kernels importable, 5.25's ``causal_conv1d_forward`` is a kernels Func module around that function."""
    if value is not None and not isinstance(value, FunctionType) and hasattr(value, "kernel_layer_name"):
        value = hub_wrapper(value)
    if not isinstance(value, FunctionType) or value.__module__ != module or unpack_closure(value) is not None:
        return ()
    return tuple(getattr(getattr(inspect.unwrap(value), "__code__", None), "co_names", ()))


def layer_global_sites(layer: Any) -> list[GlobalSite]:
    """Decorated globals the layer's class forward calls (empty for modules that are not kernel layers)."""
    names, globals_ = forward_code_names(type(layer))
    module_name = str(globals_.get("__name__", "?"))
    sites = []
    for name in names:
        value = globals_.get(name)
        if value is None or not callable(value):
            continue
        closure = unpack_closure(value)
        if closure is not None:
            own = kernels_funcs.layer_copy(layer, closure.func_module) if closure.func_module is not None else None
            if own is not None:
                closure = dataclasses.replace(closure, layer_func=own)
            sites.append(GlobalSite(module=module_name, name=name, closure=closure))
    return sites


# ------------------------------------------------------------------------------------- call sites ---
def call_sites(module: ModuleType) -> tuple[KernelRequirement, ...]:
    """The kernels a loaded modeling module's layers call, each with its module-level name (``call_site``):
    the requirements of the catalog family whose modeling file is this module's file; () for any other."""
    from kernelguard.resolution import discovery

    file = getattr(module, "__file__", None)
    if not file:
        return ()
    here = Path(file).resolve()
    for family in discovery.families().values():
        if Path(family.source).resolve() == here:
            return family.kernels
    return ()


def family_of_model_type(model_type: str | None) -> str | None:
    """The catalog family a config's ``model_type`` belongs to (``qwen3_5_text`` -> ``qwen3_5``), or None."""
    if not model_type:
        return None
    from kernelguard.resolution import discovery

    for name, family in discovery.families().items():
        if model_type == name or model_type in family.model_types:
            return name
    return None


# ------------------------------------------------------------------------------------------ reasons ---
@dataclass(frozen=True, slots=True)
class ImportFailure:
    """Why transformers chose the torch reference: the sentence, and the known issues that explain it."""

    reason: str
    issues: tuple[str, ...] = ()  # known-issue IDs (kernelguard.resolution.known_issues) an allow item may name


# Text of fla's own refusal of the gated backward on Hopper (fla issue 640), wherever it surfaces.
_FLA_640_TEXT = re.compile(r"Triton >= ?3\.4\S* and < ?3\.7\.1 on Hopper|flash-linear-attention/issues/640")


def known_issue_ids(error_text: str) -> tuple[str, ...]:
    """Known-issue IDs whose signature is in an import error's text (what ``allow`` can name for the site)."""
    return tuple(issue.id for issue in KNOWN_ISSUES if _explains(issue, error_text))


def _explains(issue: KnownIssue, error_text: str) -> bool:
    if issue.detector == "undefined-symbol":
        return "undefined symbol" in error_text
    if issue.id == "tilelang-without-z3":
        return "libz3" in error_text
    return issue.id == "fla-640-refusal" and bool(_FLA_640_TEXT.search(error_text))


def import_failure(closure: FallbackClosure) -> ImportFailure:
    """Re-run the import the decorator made and report what it raised (or that it works now)."""
    try:
        module = importlib.import_module(closure.package)
        if getattr(module, closure.kernel, None) is None:
            module = importlib.import_module(closure.internal_module)
    except Exception as exc:  # noqa: BLE001 - exactly what transformers' decorator swallows (`except Exception`)
        text = f"{type(exc).__name__}: {exc}"
        return ImportFailure(f"`import {closure.internal_module}` failed: {text}", known_issue_ids(text))
    if getattr(module, closure.kernel, None) is None:
        return ImportFailure(
            f"`{closure.internal_module}` imports but has no `{closure.kernel}` "
            f"({closure.package} {getattr(module, '__version__', '')} too old?)"
        )
    return ImportFailure(
        f"`{closure.internal_module}` imports now, but did not when the modeling module was imported; "
        "restart the process (or import the provider before transformers models)"
    )


def pip_fix(package: str) -> str:
    """The install command for a provider, built by kernelguard.resolution.install from the running torch (the same
    command `kernelguard check` prints); a package install does not know: its import name as a pip name."""
    import platform

    from kernelguard.resolution.install import install_command

    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    abi = getattr(torch, "compiled_with_cxx11_abi", None)
    try:
        return install_command(
            package, torch_version=getattr(torch, "__version__", None), cuda_version=cuda,
            cxx11_abi=abi() if callable(abi) else None, python_version=platform.python_version(),
            machine=platform.machine(),
        ).fix_line()
    except ValueError:
        return f"pip install {package.replace('_', '-')}"


def provider_devices(implementation: Any) -> tuple[str, ...]:
    """Devices a provider declares via ``__kernelguard_devices__`` on its top-level package (else its package's
    default, e.g. fla: cuda and xpu), narrowed to those transformers 5.25+ hands it (others take the torch path)."""
    top = str(getattr(implementation, "__module__", "") or "").split(".")[0]
    declared = getattr(sys.modules.get(top), DEVICES_ATTR, None)
    spec = PACKAGES.get(top)
    devices = tuple(map(str, declared)) if declared is not None else spec.default_devices if spec else DEFAULT_DEVICES
    handed = transformers_package_devices(top)
    return devices if handed is None else tuple(d for d in devices if d in handed)


def clear_caches() -> None:
    """Forget the decorator probe and forward-name tables (kernelguard.runtime.registry.reset() calls this)."""
    _probe_decorator.cache_clear()
    _forward_names.cache_clear()
