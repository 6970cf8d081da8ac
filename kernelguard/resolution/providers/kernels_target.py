"""A :class:`HubTarget` as the arguments kernels' variant resolver takes for a system other than this one.

kernels' ``_resolve_variant_for_system`` takes every system fact as an argument, and each release takes a
different set (0.17 added the macOS version; 0.19 the Python version, whether it is free-threaded and whether
MLX is installed). The arguments are built here from the target, passed only where the installed release's
resolver takes them, and a fact the target states that the release cannot consider becomes a note.

Where the target leaves an interpreter fact unset, the Python running kernelguard is meant: kernels' own
defaults (a GIL-enabled Python 3.15 with MLX) would accept variants this interpreter cannot load.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import sysconfig
from typing import Any

from ..facts import HubTarget
from .kernels_release import KernelsRelease

__all__ = ["resolver_arguments"]

# What a note calls each fact a target can state but an older release's resolver does not take.
_CONSIDERED = {
    "macos_version": "the macOS version",
    "python_version": "the Python version",
    "free_threaded": "whether Python is free-threaded",
    "has_mlx": "whether MLX is installed",
}


def resolver_arguments(kernels: KernelsRelease, target: HubTarget, accepted: set[str]
                       ) -> tuple[dict[str, Any], list[str]]:
    """The system facts of ``target`` the installed resolver takes (``accepted``: its parameter names), and a
    note for each fact the target states that this release does not consider."""
    from packaging.version import Version

    linux = target.os == "linux"  # kernels only looks at the C++ ABI on Linux
    arguments: dict[str, Any] = {
        "selected_backend": _target_backend(kernels, target),
        "cpu": target.cpu,
        "os": target.os,
        "torch_version": _major_minor(target.torch_version),
        "torch_cxx11_abi": target.cxx11_abi if linux else None,
        "tvm_ffi_version": _major_minor(target.tvm_ffi_version),
        "macos_version": Version(target.macos_version) if target.macos_version else None,
        "python_version": _major_minor(target.python_version or _running_python()),
        "free_threaded": _running_free_threaded() if target.free_threaded is None else target.free_threaded,
        "has_mlx": importlib.util.find_spec("mlx") is not None if target.has_mlx is None else target.has_mlx,
    }
    stated = {"macos_version": target.macos_version, "python_version": target.python_version,
              "free_threaded": target.free_threaded, "has_mlx": target.has_mlx}
    notes = [f"kernels {kernels.version} does not consider {_CONSIDERED[name]} when choosing a variant."
             for name, value in stated.items() if value is not None and name not in accepted]
    return {name: value for name, value in arguments.items() if name in accepted}, notes


def _running_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _running_free_threaded() -> bool:
    # The same build flag kernels reads for the live system.
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _target_backend(kernels: KernelsRelease, target: HubTarget) -> Any:
    from packaging.version import Version

    if target.cuda_version is not None and target.backend is not None:
        raise ValueError("HubTarget takes either cuda_version or backend, not both")
    if target.cuda_version is not None:
        return kernels.backends.CUDA(version=Version(target.cuda_version))
    parse = kernels.backends.parse_backend
    token = target.backend or "cpu"
    # 0.19 parses a variant name's backend parts (["rocm64"]), earlier releases the token itself.
    return parse([token]) if "parts" in inspect.signature(parse).parameters else parse(token)


def _major_minor(version: str | None) -> Any:
    # kernels strips patch and local tags ("2.13.0+cu128" -> 2.13) before comparing.
    if version is None:
        return None
    from packaging.version import Version

    release = Version(version).release
    return Version(f"{release[0]}.{release[1] if len(release) > 1 else 0}")
