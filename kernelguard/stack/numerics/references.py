"""The kernels ``check --run`` exercises, where transformers imports each, and its undecorated torch reference.

The reference is transformers' undecorated torch function (``inspect.unwrap`` of the module-level name;
``use_kernel_func_from_hub_with_fallback`` decorates with ``functools.wraps``, so ``__wrapped__`` leads to it).
Everything here comes from the catalog (one kernel table) and :mod:`kernelguard.resolution.transformers_compat` (the one
reader of transformers' closures and of which family a config belongs to).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelguard.resolution import family_of_model_type, geometry, hub_wrapper

__all__ = [
    "CHUNK",
    "CONV",
    "CONV_UPDATE",
    "FLA_KERNELS",
    "KDA_CHUNK",
    "KDA_KERNELS",
    "KDA_RECURRENT",
    "KERNELS",
    "RECURRENT",
    "KernelSource",
    "default_providers",
    "family_of",
    "kernel_gets_key_heads",
    "kernel_sources",
    "modeling_module_name",
    "torch_references",
    "undecorated",
]

CHUNK = "chunk_gated_delta_rule"
RECURRENT = "fused_recurrent_gated_delta_rule"
CONV = "causal_conv1d_fn"
CONV_UPDATE = "causal_conv1d_update"
# Kimi delta attention (kimi_linear, glm5_next, bailing_hybrid): the GDN call with a decay per key channel.
KDA_CHUNK = "chunk_kda"
KDA_RECURRENT = "fused_recurrent_kda"
KERNELS = (CHUNK, RECURRENT, KDA_CHUNK, KDA_RECURRENT, CONV, CONV_UPDATE)
FLA_KERNELS = (CHUNK, RECURRENT, KDA_CHUNK, KDA_RECURRENT)
KDA_KERNELS = (KDA_CHUNK, KDA_RECURRENT)

# Families whose modeling file is tried first for the references (when the model's own family is not known or
# lacks a kernel); any other catalog family that calls the kernel follows, alphabetically.
_PREFERRED_FAMILIES = ("qwen3_5", "qwen3_next", "kimi_linear")


@dataclass(frozen=True, slots=True)
class KernelSource:
    """Where one kernel under test and its torch reference live, read from the catalog (one kernel table)."""

    kernel: str
    provider_module: str  # what transformers imports, e.g. "fla.ops.gated_delta_rule"
    reference_name: str  # the decorated torch function, e.g. "torch_chunk_gated_delta_rule"
    reference_module: str  # "transformers.models.qwen3_5.modeling_qwen3_5"


def modeling_module_name(source: str) -> str:
    """``.../site-packages/transformers/models/qwen3_5/modeling_qwen3_5.py`` -> its import name."""
    parts = Path(source).with_suffix("").parts
    if "transformers" not in parts:
        raise ValueError(f"{source} is not inside a transformers package")
    start = len(parts) - 1 - parts[::-1].index("transformers")
    return ".".join(parts[start:])


def kernel_sources(kernel: str, *, family: str | None = None) -> list[KernelSource]:
    """Every catalog family that calls ``kernel``: ``family`` first, then Qwen3.5, Qwen3-Next, the rest."""
    from kernelguard.resolution import discovery

    known = discovery.families()
    order = [f for f in (family, *_PREFERRED_FAMILIES) if f in known]
    order += sorted(set(known) - set(order))
    out = []
    for name in dict.fromkeys(order):
        fam = known[name]
        for req in fam.kernels:
            if req.kernel == kernel and req.module:
                out.append(KernelSource(kernel, req.module, req.call_site, modeling_module_name(fam.source)))
    return out


def family_of(config: Any | None) -> str | None:
    """The catalog family of a model config (by model_type), for picking its own modeling module first."""
    return None if config is None else family_of_model_type(geometry.model_type(config))


def default_providers(
    kernels: Iterable[str], *, family: str | None = None
) -> tuple[dict[str, Callable[..., Any]], list[str]]:
    """Import each kernel from the module transformers imports it from (the catalog's ``module``); returns
    (providers, reasons for those that failed to import)."""
    providers: dict[str, Callable[..., Any]] = {}
    missing: list[str] = []
    for kernel in kernels:
        sources = kernel_sources(kernel, family=family)
        if not sources:
            missing.append(f"{kernel}: no transformers model family calls it (catalog)")
            continue
        module_name = sources[0].provider_module
        try:
            providers[kernel] = getattr(importlib.import_module(module_name), kernel)
        except Exception as exc:  # noqa: BLE001 - any import failure is a finding, not a crash
            missing.append(f"{kernel}: cannot import {module_name}.{kernel}: {type(exc).__name__}: {exc}")
    return providers, missing


def undecorated(obj: Any) -> Callable[..., Any] | None:
    """The undecorated torch function behind a decorated module-level name (``functools.wraps`` sets
    ``__wrapped__``), or None when it cannot be found."""
    wrapper = hub_wrapper(obj)
    return inspect.unwrap(wrapper) if wrapper is not None else None


def torch_references(
    kernels: Sequence[str] = KERNELS, *, family: str | None = None
) -> tuple[dict[str, Callable[..., Any]], str]:
    """The undecorated torch references of ``kernels``, all from ONE modeling module (the first, in the
    catalog's preference order, that defines every one of them), and that module's name. When no one module
    has them all (GDN and KDA kernels together), each group of kernels a module has comes from the first
    module that has it, and the names are joined."""
    names_by_module: dict[str, dict[str, str]] = {}
    for kernel in kernels:
        for src in kernel_sources(kernel, family=family):
            names_by_module.setdefault(src.reference_module, {})[kernel] = src.reference_name
    if not any(all(k in names for k in kernels) for names in names_by_module.values()):
        return _references_from_several(kernels, family)
    errors = []
    for module_name, names in names_by_module.items():
        if any(k not in names for k in kernels):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - try the next family's module
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        found = {k: undecorated(getattr(module, names[k], None)) for k in kernels}
        odd = [k for k, fn in found.items() if fn is None]
        if odd:  # e.g. a Kernel Hub wrapper without __wrapped__: never compare a kernel with itself
            errors.append(f"{module_name}: no undecorated torch function behind {odd}")
            continue
        return {k: fn for k, fn in found.items() if fn is not None}, module_name
    if not errors:
        errors.append(f"no model family calls all of {', '.join(kernels)}")
    raise RuntimeError("no transformers modeling module with the torch references: " + "; ".join(errors))


def _references_from_several(kernels: Sequence[str], family: str | None) -> tuple[dict[str, Callable[..., Any]], str]:
    found: dict[str, Callable[..., Any]] = {}
    modules: list[str] = []
    for kernel in kernels:
        if kernel in found:
            continue
        sources = kernel_sources(kernel, family=family)
        if not sources:
            raise RuntimeError(f"no transformers modeling module with the torch references: no model family calls {kernel}")
        module = sources[0].reference_module
        # Everything this module offers of what is still wanted, so kernels used together share a module.
        wanted = [k for k in kernels if k not in found and any(
            s.reference_module == module for s in kernel_sources(k, family=family))]
        refs, name = torch_references(wanted, family=family)
        found.update(refs)
        modules.append(name)
    return found, ", ".join(modules)


def kernel_gets_key_heads(chunk_reference: Callable[..., Any]) -> bool:
    """Does the layer hand the kernel q/k with *key* heads (GVA inside the kernel)?

    transformers <= 5.17 repeats q/k to the value heads in the layer before the call (its reference has no
    GVA support); newer releases pass key heads and the reference repeats internally. The reference's own
    code tells which convention this install uses.
    """
    try:
        return "repeat_interleave" in inspect.getsource(chunk_reference)
    except (OSError, TypeError):
        return True
