"""What the installed ``kernels`` release offers, found by feature detection rather than by version.

transformers 5.17 accepts kernels [0.16, 0.17), 5.23/5.24 accept [0.18.2, 0.19), and 0.16 and 0.17 lay out
their private helpers differently (0.17: ``kernels.load``, ``kernels.validate``, ``kernels._rust``; 0.16:
``kernels.utils``, ``kernels.minver``, ``kernels_data``; 0.19 keeps every module but ``kernels._rust`` under
``kernels._internals``, names unchanged). Only ``kernels`` and its variant and backend modules are required;
each private helper is looked up here and a missing one is None, which :mod:`kernelguard.resolution.providers.hub` turns
into a note, never an import error.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

__all__ = ["KernelsRelease", "import_kernels"]


@dataclass(frozen=True, slots=True)
class KernelsRelease:
    """What the installed kernels release offers, found by feature detection.

    The public modules are required; each private helper is optional (None when this release lacks it)
    and its absence only weakens one check, which the probe then says in a note.
    """

    version: str
    variants: ModuleType
    backends: ModuleType
    metadata_type: Any  # kernels.Metadata: public in every release (kernels_data's or kernels._rust's)
    parse_local_kernels: Callable[[str], dict[str, Path]] | None
    versions: ModuleType | None  # kernels._versions: cached vN refs
    supports_capability: Callable[[list[str], tuple[int, int]], bool] | None
    minver_problem: Callable[[Any, Path], str | None] | None
    minver_refuses: bool = False  # True: this release refuses to load such a variant (0.16 only warns)
    # kernels' own lookup of ``<variant>.layers.<name>`` (its messages), wherever this release keeps it
    get_kernel_layer: Callable[[Any, ModuleType], Any] | None = None
    # kernels' check of a variant's declared Python dependencies ("python-depends"), as its message (None: met)
    python_deps_problem: Callable[[Any], str | None] | None = None


def import_kernels() -> KernelsRelease:
    """The installed kernels release, its optional helpers found by feature detection (raises if absent)."""
    # Lazy: importing kernels is not free, and kernelguard must work (with a note) without it.
    import kernels

    variants, backends = _required("variants"), _required("backends")
    minver_problem, minver_refuses = _minver_checker()
    return KernelsRelease(
        version=str(getattr(kernels, "__version__", "(unknown version)")),
        variants=variants,
        backends=backends,
        metadata_type=kernels.Metadata,
        # 0.17 parses LOCAL_KERNELS in kernels.load, 0.16 in kernels.utils; same syntax and errors.
        parse_local_kernels=_private_function(_internal("load", "utils"), "_parse_local_kernel_overrides"),
        versions=_first_module(_internal("_versions")),
        supports_capability=_private_function(_internal("archs"), "_supports_cuda_capability"),
        minver_problem=minver_problem,
        minver_refuses=minver_refuses,
        get_kernel_layer=_private_function(_internal("layer.layer", "layer"), "_get_kernel_layer"),
        python_deps_problem=_python_deps_checker(),
    )


def _internal(*names: str) -> tuple[str, ...]:
    """Each private module where 0.16-0.18 keep it (``kernels.X``), then where 0.19 keeps it under the same name
    (``kernels._internals.X``: ``kernels._internals._versions``, ``kernels._internals.layer.layer``)."""
    return tuple(f"kernels.{n}" for n in names) + tuple(f"kernels._internals.{n}" for n in names)


def _required(name: str) -> ModuleType:
    found = _first_module((f"kernels.{name}", f"kernels._internals.{name}"))
    if found is None:
        raise ImportError(f"kernels {getattr(__import__('kernels'), '__version__', '')} has no kernels.{name}")
    return found


def _first_module(names: tuple[str, ...]) -> ModuleType | None:
    return next((m for m in map(_optional_module, names) if m is not None), None)


def _optional_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent in this release, or broken: either way we do without it
        return None


def _private_function(modules: tuple[str, ...], name: str) -> Any:
    for module_name in modules:
        found = getattr(_optional_module(module_name), name, None)
        if callable(found):
            return found
    return None


def _python_deps_checker() -> Callable[[Any], str | None] | None:
    """kernels' own check that a variant's declared Python dependencies import (0.18+ refuse to load it with
    "Kernel module `fla` requires Python dependency `einops`"), for the backend the variant was built for (its
    metadata's), not this machine's: a CUDA variant's CUDA-only dependencies are judged as on the GPU node."""
    validate = _private_function(_internal("python_deps"), "validate_dependencies")
    if validate is None:
        return None

    def problem(metadata: Any) -> str | None:
        depends = list(getattr(metadata, "python_depends", None) or ())
        if not depends:
            return None
        backend_type = getattr(getattr(metadata, "backend", None), "backend_type", None)
        backend = SimpleNamespace(name=str(getattr(backend_type, "value", "")).lower())  # all validate reads
        try:
            validate(metadata.name.python_name, depends, backend)
        except (ImportError, ValueError) as exc:  # missing, or a dependency this kernels does not know
            return str(exc)
        return None

    return problem


def _minver_checker() -> tuple[Callable[[Any, Path], str | None] | None, bool]:
    """kernels' own "kernels-minver" check of a variant's metadata, as a message (None: satisfied), and whether
    this release refuses such a variant (0.17+) or only warns (0.16)."""
    validator = getattr(_first_module(_internal("validate")), "MinverValidator", None)
    if validator is not None:  # kernels >= 0.17 refuses to load such a variant

        def refuses(metadata: Any, variant_path: Path) -> str | None:
            try:
                validator().validate_metadata(metadata=metadata, variant=variant_path.name)
            except RuntimeError as exc:
                return str(exc)
            return None

        return refuses, True
    warn = getattr(_first_module(_internal("minver")), "_warn_if_below_minver", None)
    if not callable(warn):
        return None, False

    def warns(metadata: Any, variant_path: Path) -> str | None:  # kernels 0.16 warns and loads anyway
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn(metadata, variant_path)
        if not caught:
            return None
        return f"{caught[0].message} (this kernels release only warns and loads it anyway)"

    return warns, False
