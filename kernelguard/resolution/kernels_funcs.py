"""kernels' ``Func`` modules: which one a layer calls, and whether ``kernelize()`` pointed it at a Hub kernel.

When ``kernels`` is importable, transformers turns each decorated kernel function into a kernels ``Func``
module. Two layouts exist, told apart by what is there rather than by version:

- one ``Func`` per function, at module level (kernels 0.16, 0.17): ``kernelize()`` sets that object's
  ``forward``;
- a private copy per layer instance as well (kernels 0.18 on, ``layer._kernel_funcs``): ``kernelize()`` sets
  the copy's ``forward``, and the module-level ``Func`` dispatches each call to the calling layer's copy
  through a context variable the layer's forward sets. The module-level object never changes, so asking it
  alone would call every kernelized layer a fallback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

__all__ = [
    "compiled_graphs_miss_rebinding", "hub_kernel_of", "is_func_module", "kernels_layer_module", "layer_copy",
    "serving_func",
]

# kernels' private layer module, wherever the installed release keeps it (0.19: under ``_internals``).
_LAYER_MODULES = ("kernels.layer.layer", "kernels._internals.layer.layer")


def kernels_layer_module() -> ModuleType | None:
    """kernels' layer module (its layer cache and dispatch state), or None without kernels."""
    for name in _LAYER_MODULES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        return module
    return None


def is_func_module(obj: Any) -> bool:
    """A kernels Func: a function turned into a module, never the layer that calls it."""
    return "_create_func_module" in type(obj).__qualname__ and hasattr(obj, "kernel_layer_name")


def layer_copy(layer: Any, func_module: Any) -> Any | None:
    """``layer``'s own copy of ``func_module`` (kernels >= 0.18), or None: each copy is an instance of the
    same per-function class, made when the layer was built."""
    copies = getattr(layer, "__dict__", {}).get("_kernel_funcs")
    if not isinstance(copies, dict):
        return None
    return next((c for c in copies.values() if type(c) is type(func_module)), None)


def _active_copy(func_module: Any) -> Any | None:
    """The copy the module-level Func would dispatch to right now (inside a kernelized layer's forward)."""
    dispatch = getattr(kernels_layer_module(), "_ACTIVE_KERNEL_FUNCS", None)
    try:
        active = dispatch.get() if dispatch is not None else None
    except LookupError:  # a bare ContextVar outside any layer forward
        active = None
    entry = active.get(id(func_module)) if isinstance(active, dict) else None
    return entry[0] if isinstance(entry, tuple) and entry else None


def serving_func(func_module: Any, copies: Iterable[Any] = ()) -> Any | None:
    """The Func that ``kernelize()`` pointed at a Hub kernel for this call, or None: the module-level Func,
    else one of ``copies`` (a layer's own, found when the layer was read), else the copy dispatched to now."""
    candidates = [func_module, *copies, _active_copy(func_module)]
    return next((c for c in candidates if c is not None and _kernelized_forward(c) is not None), None)


def hub_kernel_of(func: Any) -> str:
    """``repo@revision`` of the Hub kernel a kernelized Func runs (``<module>.<class>@unknown`` if not cached):
    kernels' public ``get_kernelized_layers`` (0.18+) asked about the Func itself, else its layer cache."""
    impl = _kernelized_forward(func)
    repo = _public_repo(func)
    if repo is None:
        layer_module = kernels_layer_module()
        cached = dict(getattr(layer_module, "_CACHED_LAYER", None) or {})
        repo = next((r for r, cls in cached.items() if getattr(cls, "forward", None) is impl), None)
    if repo is not None:
        repo_id = getattr(repo, "repo_id", None) or getattr(repo, "_repo_id", None) or str(repo)
        version = getattr(repo, "_version", None)
        revision = getattr(repo, "revision", None) or getattr(repo, "_revision", None) or (
            f"v{version}" if version is not None else "unknown")
        return f"{repo_id}@{revision}"
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}@unknown"


def _public_repo(func: Any) -> Any | None:
    """The repository kernels' ``get_kernelized_layers`` reports for ``func`` (a module of its own: its root)."""
    kernels = sys.modules.get("kernels")
    getter = getattr(kernels, "get_kernelized_layers", None)
    if getter is None:
        return None
    try:
        layer = getter(func).layers.get("")
    except Exception:  # noqa: BLE001 - an older or odd kernels: the layer cache answers instead
        return None
    return getattr(layer, "repo", None)


def _kernelized_forward(func: Any) -> Any | None:
    """The function kernelize() bound as ``func.forward``, or None while the class forward runs."""
    forward = getattr(func, "__dict__", {}).get("forward")
    impl = getattr(forward, "__func__", None)
    return None if impl is None or impl is type(func).forward else impl


def compiled_graphs_miss_rebinding(func_module: Any) -> bool:
    """True for the per-layer layout: dynamo reaches a module-level Func that dispatches through a context
    variable without guarding the module global that holds it, so a graph traced while the global held the
    Func keeps calling it after the global is re-bound (to a tripwire)."""
    forward = getattr(type(func_module), "forward", None)
    return "_ACTIVE_KERNEL_FUNCS" in getattr(getattr(forward, "__code__", None), "co_names", ())
