"""The exact command that installs a provider package for the detected torch / CUDA / archs. Pure: no I/O.

Why a function and not a fixed string: causal-conv1d (like flash-attn and mamba-ssm) ships only an sdist on
PyPI whose build-system requires an *unpinned* torch. A plain ``pip install causal-conv1d`` builds it in an
isolated environment holding the newest torch from PyPI (gigabytes), and the extension compiled there -- or
the prebuilt wheel its setup.py downloads for *that* torch -- fails against the torch you run with
``undefined symbol``, the very failure ``kernelguard check`` diagnoses. So the command always builds with
``--no-build-isolation`` against the installed torch, without pip's wheel cache (a wheel cached for another
torch would be reused), after the build tools setup.py imports.

What causal-conv1d 1.7.0's setup.py does (read from its sdist): it first downloads
``causal_conv1d-<v>+cu<CUDA major>torch<major.minor>cxx11abi<TRUE|FALSE>-cp<py>-cp<py>-linux_<machine>.whl``
from its GitHub release; when that wheel does not exist it compiles with nvcc for a fixed list of archs that
depends only on the nvcc version (its ``-gencode`` flags make torch ignore ``TORCH_CUDA_ARCH_LIST``).
Offline, the download raises instead of falling back: ``CAUSAL_CONV1D_FORCE_BUILD=TRUE`` skips it
(``InstallAdvice.offline_command``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from .capability import ComputeCapability

BUILD_TOOLS = "setuptools wheel ninja packaging"  # what these setup.py files import with build isolation off


@dataclass(frozen=True, slots=True)
class InstallAdvice:
    package: str  # the pip distribution name
    requirement: str  # what is installed, e.g. "causal-conv1d==1.7.0" (CI resolves exactly this)
    command: str  # one shell line to run in the job's environment
    notes: tuple[str, ...] = ()  # full sentences: what the command assumes, what it cannot give
    prebuilt_wheel: str | None = None  # the URL the package's setup.py tries before compiling
    offline_command: str | None = None  # the same without network access (compiles; never downloads)

    def text(self) -> str:
        """The command, then its notes: what a fix line in a report shows."""
        return " ".join([self.command, *self.notes])


@dataclass(frozen=True, slots=True)
class _Compiled:
    distribution: str
    version: str  # the release kernelguard measured, pinned so the prebuilt-wheel URL is exact
    wheel: str | None  # the URL template its setup.py downloads, when verified
    force_build: str | None  # the variable that skips that download (needed offline)
    sass_from_nvcc: tuple[tuple[str, tuple[str, ...]], ...]  # (minimum nvcc, archs it then compiles)


_CAUSAL_CONV1D = _Compiled(
    distribution="causal-conv1d",
    version="1.7.0",
    wheel=(
        "https://github.com/Dao-AILab/causal-conv1d/releases/download/v{version}/"
        "causal_conv1d-{version}+cu{cuda_major}torch{torch}cxx11abi{abi}-{py}-{py}-linux_{machine}.whl"
    ),
    force_build="CAUSAL_CONV1D_FORCE_BUILD",
    sass_from_nvcc=(
        ("11.6", ("7.5", "8.0", "8.7")),
        ("11.8", ("9.0",)),
        ("12.8", ("10.0", "12.0")),
        ("13.0", ("10.3", "11.0", "12.1")),
    ),
)
_COMPILED = {
    "causal-conv1d": _CAUSAL_CONV1D,
    # Not read as closely: no wheel URL or arch table is claimed for these, only the build that works.
    "flash-attn": _Compiled("flash-attn", "", None, None, ()),
    "mamba-ssm": _Compiled("mamba-ssm", "", None, None, ()),
}
FLA_REQUIREMENT = "flash-linear-attention>=0.6.0,<1"  # 0.6.0: the release measured on the H200
_ALIASES = {
    "causal_conv1d": "causal-conv1d",
    "flash_attn": "flash-attn",
    "mamba_ssm": "mamba-ssm",
    "fla": "flash-linear-attention",
    "fla-core": "flash-linear-attention",
    "hub": "kernels",
}
PACKAGES = ("causal-conv1d", "flash-attn", "mamba-ssm", "flash-linear-attention", "kernels")


def install_command(
    package: str,
    *,
    torch_version: str | None,
    cuda_version: str | None,
    archs: Sequence[str | ComputeCapability] = (),
    cxx11_abi: bool | None = None,
    python_version: str = "3.11",
    machine: str = "x86_64",
    kernels_window: tuple[str, str] | None = None,
    reinstall: bool = False,
) -> InstallAdvice:
    """How to install ``package`` (pip or import name) into an environment with these facts.

    ``torch_version`` as torch reports it ("2.13.0+cu128"; None: torch missing), ``cuda_version`` torch's
    CUDA ("12.8"; None: a CPU/ROCm build), ``archs`` the target GPUs ("9.0", "sm_90a"), ``cxx11_abi``
    torch.compiled_with_cxx11_abi(), ``python_version`` "3.11", ``kernels_window`` the [min, max) of kernels
    this transformers accepts. ``reinstall`` replaces a broken build without touching its dependencies.
    """
    name = _ALIASES.get(package, package)
    capabilities = tuple(ComputeCapability.parse(a, source="install_command(archs=...)") for a in archs)
    if name in _COMPILED:
        return _compiled_advice(
            _COMPILED[name], torch_version, cuda_version, capabilities, cxx11_abi, python_version, machine,
            reinstall,
        )
    if name == "flash-linear-attention":
        return _fla_advice(torch_version, cuda_version, reinstall)
    if name == "kernels":
        spec = f"kernels>={kernels_window[0]},<{kernels_window[1]}" if kernels_window else None
        command = f"pip install '{spec}'" if spec else "pip install 'kernelguard[hub]'"
        return InstallAdvice("kernels", spec or "kernels>=0.16,<0.19", command)
    raise ValueError(f"install_command knows {', '.join(PACKAGES)} (or their import names), not {package!r}")


def _pip(requirement: str, reinstall: bool, *extra: str) -> str:
    # --force-reinstall alone would also reinstall torch (gigabytes): --no-deps keeps it to this package.
    flags = [*extra, *(("--force-reinstall", "--no-deps") if reinstall else ())]
    return " ".join(["pip install", *flags, f"'{requirement}'"])


def _fla_advice(torch_version: str | None, cuda_version: str | None, reinstall: bool) -> InstallAdvice:
    notes = []
    if torch_version is None:
        notes.append("Install torch first: fla's Triton kernels run on it.")
    elif cuda_version is None:
        notes.append(
            f"torch {torch_version} is a build without CUDA: fla installs, but its Triton kernels need a "
            "CUDA (or XPU) build of torch to run."
        )
    return InstallAdvice("flash-linear-attention", FLA_REQUIREMENT, _pip(FLA_REQUIREMENT, reinstall), tuple(notes))


def _compiled_advice(
    spec: _Compiled,
    torch_version: str | None,
    cuda_version: str | None,
    archs: tuple[ComputeCapability, ...],
    cxx11_abi: bool | None,
    python_version: str,
    machine: str,
    reinstall: bool,
) -> InstallAdvice:
    requirement = f"{spec.distribution}=={spec.version}" if spec.version else spec.distribution
    command = f"pip install {BUILD_TOOLS} && " + _pip(requirement, reinstall, "--no-build-isolation", "--no-cache-dir")
    torch_release = _release(torch_version)
    if torch_release is None or cuda_version is None:
        found = "torch is not installed" if torch_version is None else f"torch {torch_version} has no CUDA"
        note = (
            f"{found}: {spec.distribution} is a CUDA extension compiled against the installed torch, so install "
            "a CUDA build of torch first, then run this command."
        )
        return InstallAdvice(spec.distribution, requirement, command, (note,))
    wheel = _wheel_url(spec, torch_release, cuda_version, cxx11_abi, python_version, machine)
    first = f"It first tries the prebuilt wheel {wheel}, then " if wheel else "It "
    notes = [
        (
            f"{first}compiles against the installed torch {torch_version} with nvcc from a CUDA "
            f"{cuda_version.split('.')[0]}.x toolkit (CUDA_HOME), which takes several minutes."
        )
    ]
    notes += _arch_notes(spec, cuda_version, archs)
    offline = None
    if spec.force_build:
        # Offline, setup.py's download raises instead of falling back to compiling.
        offline = command.replace(" && pip install", f" && {spec.force_build}=TRUE pip install", 1)
    return InstallAdvice(spec.distribution, requirement, command, tuple(notes), wheel, offline)


def _release(version: str | None) -> str | None:
    """"2.13.0+cu128" -> "2.13" (what wheel names carry); None when absent or unreadable."""
    if version is None:
        return None
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def _wheel_url(
    spec: _Compiled, torch: str, cuda: str, abi: bool | None, python_version: str, machine: str
) -> str | None:
    cuda_major = cuda.split(".")[0]
    if spec.wheel is None or abi is None or cuda_major not in ("11", "12", "13"):
        return None  # setup.py knows only these CUDA majors; without the ABI the name is a guess
    py = "cp" + "".join(python_version.split(".")[:2])
    return spec.wheel.format(
        version=spec.version, cuda_major=cuda_major, torch=torch, abi=str(abi).upper(), py=py, machine=machine
    )


def _compiled_sass(spec: _Compiled, cuda_version: str) -> tuple[ComputeCapability, ...]:
    nvcc = Version(cuda_version)
    return tuple(
        ComputeCapability.parse(arch, source="install table")
        for minimum, archs in spec.sass_from_nvcc
        if nvcc >= Version(minimum)
        for arch in archs
    )


def _runs_on(sass: ComputeCapability, gpu: ComputeCapability) -> bool:
    # SASS runs on the same major at an equal or higher minor; there is no PTX in these builds.
    return sass.major == gpu.major and sass.minor <= gpu.minor


def _arch_notes(spec: _Compiled, cuda_version: str, archs: tuple[ComputeCapability, ...]) -> list[str]:
    if not spec.sass_from_nvcc or not archs:
        return []
    built = _compiled_sass(spec, cuda_version)
    missing = [a for a in archs if not any(_runs_on(s, a.base) for s in built)]
    if not missing:
        return []
    needs = []
    for arch in missing:
        enough = next(
            (minimum for minimum, listed in spec.sass_from_nvcc
             if any(_runs_on(ComputeCapability.parse(s, source="install table"), arch.base) for s in listed)),
            None,
        )
        needs.append(f"{arch} needs nvcc >= {enough}" if enough else f"{arch} is not in its build at all")
    compiled = ", ".join(c.sm for c in built) or "nothing"
    message = (
        f"A source build of {spec.distribution} {spec.version} with CUDA {cuda_version} compiles {compiled} "
        f"(no PTX), which cannot run on compute capability {', '.join(str(a) for a in missing)} "
        f"({'; '.join(needs)}): use a torch and toolkit for that CUDA, or a prebuilt wheel that has it."
    )
    return [message]
