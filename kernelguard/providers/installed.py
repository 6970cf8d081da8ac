"""Facts about an installed provider package: version, the exact import transformers makes, its .so files.

Live probing lives here (and in ``hub``); judging the facts is the pure resolver's job.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from importlib import metadata
from pathlib import Path

from ..catalog import PackageSpec
from ..facts import ExtensionFacts, PackageFacts


def _installed_distribution(spec: PackageSpec) -> tuple[str | None, str | None]:
    for name in spec.distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def _built_for_torch(distribution: str, version: str) -> str | None:
    """Prebuilt CUDA wheels name their torch in the file name (``...+cu12torch2.6cxx11abiTRUE``)."""
    candidates = [version]
    try:
        direct_url = metadata.distribution(distribution).read_text("direct_url.json")
    except (metadata.PackageNotFoundError, FileNotFoundError):
        direct_url = None
    if direct_url:
        try:
            candidates.append(json.loads(direct_url).get("url", ""))
        except json.JSONDecodeError:
            pass
    for text in candidates:
        found = re.search(r"torch(\d+\.\d+)", text)
        if found:
            return found.group(1)
    return None


def _extension_files(distribution: str) -> list[Path]:
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for record in files:
        if record.name.endswith(".so") or ".so." in record.name:
            found.append(Path(str(record.locate())).resolve())
    return found


def _module_name(path: Path, distribution: str) -> str | None:
    """``site-packages/causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so`` -> ``causal_conv1d_cuda``."""
    for entry in sys.path:
        try:
            relative = path.relative_to(Path(entry).resolve())
        except (ValueError, OSError):
            continue
        parts = list(relative.parts)
        parts[-1] = parts[-1].split(".", 1)[0]
        return ".".join(parts)
    return None


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load_extension(path: Path, distribution: str) -> str | None:
    module = _module_name(path, distribution)
    if module is None:
        return None
    try:
        # Extensions link against libtorch: load torch first so a failure means *this* .so is wrong.
        import torch  # noqa: F401

        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - includes SystemExit from misbehaving extension inits
        return _error_text(exc)
    return None


def _read_archs(path: Path) -> tuple[frozenset[str], frozenset[str], str | None, str | None]:
    try:
        from .cuda_arch import read_cuda_targets
    except ImportError as exc:  # pragma: no cover - shipped together
        return frozenset(), frozenset(), f"arch reader unavailable: {exc}", None
    targets = read_cuda_targets(path)
    return targets.sass, targets.ptx, targets.error, targets.method


def probe_package(spec: PackageSpec, module: str, attribute: str, *, load_extensions: bool = True) -> PackageFacts:
    """Everything knowable about ``spec`` without a GPU. Never raises."""
    distribution, version = _installed_distribution(spec)
    import_error: str | None = None
    devices, devices_source = spec.default_devices, "kernelguard default for this package"
    try:
        imported = importlib.import_module(module)
        if getattr(imported, attribute, None) is None:
            import_error = f"AttributeError: module {module!r} has no attribute {attribute!r}"
        root = sys.modules.get(spec.import_name)
        declared = getattr(root, "__kernelguard_devices__", None)
        if declared:
            devices, devices_source = tuple(declared), f"{spec.import_name}.__kernelguard_devices__"
    except BaseException as exc:  # noqa: BLE001 - transformers catches everything here too
        import_error = _error_text(exc)
    if version is None and import_error is None:
        # Importable without a distribution (a source checkout on PYTHONPATH): read its own version.
        version = getattr(sys.modules.get(spec.import_name), "__version__", None)
    extensions: list[ExtensionFacts] = []
    if distribution and spec.compiled:
        for path in _extension_files(distribution):
            load_error = _load_extension(path, distribution) if load_extensions else None
            sass, ptx, arch_error, method = _read_archs(path)
            extensions.append(
                ExtensionFacts(
                    path=str(path),
                    module=_module_name(path, distribution) or path.name,
                    load_error=load_error,
                    sass=sass,
                    ptx=ptx,
                    arch_error=arch_error,
                    arch_method=method,
                )
            )
    return PackageFacts(
        import_name=spec.import_name,
        distribution=distribution,
        version=version,
        module=module,
        attribute=attribute,
        import_error=import_error,
        devices=devices,
        devices_source=devices_source,
        built_for_torch=_built_for_torch(distribution, version) if distribution and version else None,
        extensions=tuple(extensions),
    )
