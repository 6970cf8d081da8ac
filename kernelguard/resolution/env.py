"""probe(): the facts of the live system, each with where it came from.

This is one of the two places (with ``providers``) that touch the live system. Everything here degrades into
a recorded fact or error: the probe never raises, so ``kernelguard check`` can explain a broken torch too.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import replace
from importlib import metadata
from typing import Any

from .capability import ComputeCapability
from .facts import Environment, Fact, Gpu

__all__ = ["WATCHED_DISTRIBUTIONS", "distribution_version", "probe", "with_gpus"]

# Distributions whose versions matter to kernel selection. Keys are distribution names as pip knows them.
WATCHED_DISTRIBUTIONS: tuple[str, ...] = (
    "torch",
    "triton",
    "transformers",
    "kernels",
    "fla-core",
    "flash-linear-attention",
    "causal-conv1d",
    "mamba-ssm",
    "flash-attn",
    "tilelang",
    "z3-solver",
    "flash-qla",  # fla hands it the whole GDN op when importable (known issue flash-qla-wrong-grads)
)


def distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _glibc() -> Fact:
    libc, version = platform.libc_ver()
    value = f"{libc} {version}".strip() or None
    return Fact(value, "platform.libc_ver()")


def _packages() -> dict[str, Fact]:
    facts = {name: Fact(distribution_version(name), "importlib.metadata") for name in WATCHED_DISTRIBUTIONS}
    # torch's own Triton ships as pytorch-triton in nightly/ROCm builds; record it only when present.
    nightly_triton = distribution_version("pytorch-triton")
    if nightly_triton:
        facts["pytorch-triton"] = Fact(nightly_triton, "importlib.metadata")
    return facts


def _torch_facts(read_gpus: bool) -> tuple[Fact, str | None, Fact, Fact, Fact, tuple[Gpu, ...]]:
    """Import torch once; a broken torch is a fact to report, not a crash."""
    missing = Fact(None, "import torch")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure is reported verbatim
        error = f"{type(exc).__name__}: {exc}"
        installed = distribution_version("torch")
        if installed is None:
            error = "torch is not installed"
        return Fact(installed, "importlib.metadata"), error, missing, missing, missing, ()
    version = Fact(torch.__version__, "torch.__version__")
    cuda = Fact(torch.version.cuda, "torch.version.cuda")
    hip = Fact(getattr(torch.version, "hip", None), "torch.version.hip")
    abi = Fact(bool(torch.compiled_with_cxx11_abi()), "torch.compiled_with_cxx11_abi()")
    return version, None, cuda, hip, abi, _visible_gpus(torch) if read_gpus else ()


def _visible_gpus(torch: Any) -> tuple[Gpu, ...]:
    try:
        if not torch.cuda.is_available():
            return ()
        gpus = []
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            gpus.append(
                Gpu(index, torch.cuda.get_device_name(index), ComputeCapability.from_tuple((major, minor)),
                    "torch.cuda.get_device_capability")
            )
        return tuple(gpus)
    except Exception:  # noqa: BLE001 - a CUDA init failure means "no usable GPU", which is what we report
        return ()


def _driver() -> Fact:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Fact(None, "nvidia-smi (not on PATH)")
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return Fact(None, "nvidia-smi (failed)")
    return Fact(out.splitlines()[0] if out else None, "nvidia-smi --query-gpu=driver_version")


def probe(*, import_torch: bool = True, read_gpus: bool = True) -> Environment:
    """Read the live system. ``import_torch=False`` gives a cheap probe from package metadata only;
    ``read_gpus=False`` leaves CUDA uninitialised (no GPUs, no driver yet: :func:`with_gpus` adds them)."""
    if import_torch:
        torch_version, torch_error, cuda, hip, abi, gpus = _torch_facts(read_gpus)
    else:
        unread = Fact(None, "not probed (import_torch=False)")
        torch_version = Fact(distribution_version("torch"), "importlib.metadata")
        torch_error, cuda, hip, abi, gpus = None, unread, unread, unread, ()
    return Environment(
        python=Fact(platform.python_version(), "platform.python_version()"),
        platform=Fact(sys.platform, "sys.platform"),
        machine=Fact(platform.machine(), "platform.machine()"),
        glibc=_glibc(),
        torch_version=torch_version,
        torch_error=torch_error,
        cuda_version=cuda,
        hip_version=hip,
        cxx11_abi=abi,
        gpus=gpus,
        driver=_driver_fact(gpus) if read_gpus else Fact(None, "not probed (read_gpus=False)"),
        packages=_packages(),
        transformers_error=_transformers_import_error() if import_torch else None,
    )


def _transformers_import_error() -> str | None:
    """Why ``import transformers`` fails although it is installed, or None. kernelguard reads transformers'
    files without importing it, so only this import shows a broken dependency (huggingface-hub, tokenizers...)
    that stops every job at its first line."""
    if distribution_version("transformers") is None:
        return None  # not installed: the report says so from the metadata
    try:
        import transformers  # noqa: F401 - the import is the probe
    except Exception as exc:  # noqa: BLE001 - any failure is reported verbatim
        return f"{type(exc).__name__}: {exc}"
    return None


def with_gpus(env: Environment) -> Environment:
    """``env`` with the visible GPUs and the driver, read now: reading a GPU's capability initialises CUDA, after
    which an import probe can no longer fork (``providers.installed``) and must start a fresh interpreter that
    imports torch again, so ``check`` probes the packages first."""
    if env.torch_error is not None or env.torch_version.source != "torch.__version__":
        return env
    import torch

    gpus = _visible_gpus(torch)
    return replace(env, gpus=gpus, driver=_driver_fact(gpus))


def _driver_fact(gpus: tuple[Gpu, ...]) -> Fact:
    return _driver() if gpus or os.environ.get("KERNELGUARD_PROBE_DRIVER") else Fact(None, "no GPU visible")
