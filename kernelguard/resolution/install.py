"""Every install fix kernelguard prints, built from the facts: the one home of ``pip install`` lines.

``install_command`` answers for a provider package (the build command for this torch / CUDA / archs), for
``triton`` (fla #640 needs Triton >= 3.7.1, but torch pins its Triton exactly, so the fix may be a newer torch
or tilelang) and for ``kernels`` (a window of transformers with no release in it says so and offers what
exists). Pure except for :func:`torch_triton_requirement`, which reads the installed torch's own metadata;
nothing here reaches the network: which releases exist comes from the dated tables below.

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
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .capability import ComputeCapability

__all__ = [
    "BUILD_TOOLS",
    "DISTRIBUTION",
    "FLA_REQUIREMENT",
    "FLA_SAFE_TRITON",
    "HUB_OFF_ALTERNATIVES",
    "KERNELS_RELEASES",
    "PACKAGES",
    "TORCH_TRITON",
    "TRANSFORMERS_KERNELS_WINDOWS",
    "InstallAdvice",
    "cuda_torch_command",
    "extra_command",
    "install_command",
    "torch_triton_requirement",
    "upgrade_command",
]

# This project's distribution name. The package index's `kernelguard` is another project, so the import package
# and the command are `kernelguard` but pip knows this one as `kernelguard-gdn`. A fix naming one of its extras
# works before any release too: pip satisfies `kernelguard-gdn[EXTRA]` from the installed checkout or wheel.
DISTRIBUTION = "kernelguard-gdn"

BUILD_TOOLS = "setuptools wheel ninja packaging"  # what these setup.py files import with build isolation off

# Known releases from 0.16 on, as PyPI listed them in 2026-12 (`pip index versions kernels`: no 0.18.0-0.18.2, no
# 0.19.0); kernelguard never asks the network at run time, so a newer release is unknown here until this table is
# updated (tests/resolution/test_fix_commands.py checks it against the index).
KERNELS_RELEASES = ("0.16.0", "0.16.1", "0.16.2", "0.17.0", "0.17.1", "0.17.2", "0.18.3", "0.19.1")
# transformers release -> the kernels window it accepts (its KERNELS_MIN_VERSION / KERNELS_MAX_VERSION), 2026-12.
TRANSFORMERS_KERNELS_WINDOWS = {"5.17.0": ("0.16", "0.17"), "5.23.0": ("0.18.2", "0.19"), "5.24.0": ("0.18.2", "0.19"),
                                "5.25.0": ("0.19.1", "0.20.0")}  # 5.25: kernels is a core dependency
# torch pins its Triton exactly (Requires-Dist of each Linux wheel, 2026-12); used when the torch in question is
# not the installed one, whose own metadata is read instead.
TORCH_TRITON = {"2.11": "==3.6.0", "2.12": "==3.7.0", "2.13": "==3.7.1", "2.14": "~=3.8.0"}
FLA_SAFE_TRITON = "3.7.1"  # fla #640: the gated backward on Hopper is refused / wrong below this Triton
_TILELANG = "pip install tilelang z3-solver"  # fla then runs its TileLang backward, whatever the Triton


@dataclass(frozen=True, slots=True)
class InstallAdvice:
    package: str  # the pip distribution name
    requirement: str  # what is installed, e.g. "causal-conv1d==1.7.0" (CI resolves exactly this)
    command: str  # one shell line to run in the job's environment
    notes: tuple[str, ...] = ()  # full sentences: what the command assumes, what it cannot give
    prebuilt_wheel: str | None = None  # the URL the package's setup.py tries before compiling
    offline_command: str | None = None  # the same without network access (compiles; never downloads)
    preface: str = ""  # a sentence the command follows, when the command alone would mislead
    alternatives: tuple[tuple[str, str], ...] = ()  # (another command that fixes it, what it does)

    def text(self) -> str:
        """The command, then its notes: what a fix line in a report shows."""
        return " ".join([self.command, *self.notes])

    @property
    def commands(self) -> tuple[str, ...]:
        """Every shell line this advice offers (CI resolves each with pip --dry-run)."""
        return (self.command, *(command for command, _ in self.alternatives))

    def fix_line(self) -> str:
        """The one format of a fix in check, guard, the callback and the trainer."""
        line = f"{self.preface} {self.command}" if self.preface else self.command
        if self.notes:
            line += f"  ({' '.join(self.notes)})"
        return line + "".join(f"; or {command} ({why})" for command, why in self.alternatives)


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
    kernels_core: bool = False,
    reinstall: bool = False,
) -> InstallAdvice:
    """How to install ``package`` (pip or import name, or "triton") into an environment with these facts.

    ``torch_version`` as torch reports it ("2.13.0+cu128"; None: torch missing), ``cuda_version`` torch's
    CUDA ("12.8"; None: a CPU/ROCm build), ``archs`` the target GPUs ("9.0", "sm_90a"), ``cxx11_abi``
    torch.compiled_with_cxx11_abi(), ``python_version`` "3.11", ``kernels_window`` the [min, max) of kernels
    this transformers accepts, ``kernels_core`` that transformers requires kernels itself (5.25+: pip installed a
    release of that window with it, so the window's requirement is the fix). ``reinstall`` replaces a broken build without touching its dependencies.
    "triton" means a Triton fla #640 accepts, next to this torch's own pin.
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
        return _kernels_advice(kernels_window, core=kernels_core)
    if name == "triton":
        return _triton_advice(torch_version)
    raise ValueError(f"install_command knows {', '.join(PACKAGES)}, triton (or their import names), not {package!r}")


TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"  # a CUDA 12.8 build: drivers >= 570 run it


def cuda_torch_command(torch_version: str | None) -> str:
    """Replace a CPU build of torch with the CUDA build of the same release (its local version, +cu128, is what
    makes pip replace the installed +cpu one); the note says which CUDA the index holds."""
    base = _base(torch_version)
    requirement = f"'torch=={base}+cu128'" if base else "torch"
    return (f"pip install {requirement} --index-url {TORCH_CUDA_INDEX}  (the CUDA 12.8 build, for drivers >= "
            "570; for CUDA 13 use cu130 in both places)")


def extra_command(extra: str) -> str:
    """Install one of this project's extras into the environment kernelguard runs in."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def upgrade_command(distribution: str, minimum: str) -> str:
    """Raise an installed distribution to the minimum something else requires."""
    return f"pip install -U '{distribution}>={minimum}'"


def _window_releases(window: tuple[str, str]) -> list[str]:
    spec = SpecifierSet(f">={window[0]},<{window[1]}")
    return [release for release in KERNELS_RELEASES if Version(release) in spec]


# transformers 5.25+ loads Hub kernels by default and raises without a usable kernels; these keep the user's
# transformers and load without the Hub, so the pip packages serve (`kernelguard check --no-hub` checks them).
HUB_OFF_ALTERNATIVES = (
    ("export USE_HUB_KERNELS=NO", ("transformers then loads without Hub kernels, as from_pretrained(..., "
                                   "use_kernels=False) does; kernelguard check --no-hub gives the pip packages' "
                                   "commands")),
)


def _kernels_advice(window: tuple[str, str] | None, *, core: bool = False) -> InstallAdvice:
    if window is None:
        return InstallAdvice("kernels", "kernels>=0.16,<0.20", extra_command("hub"))  # the hub extra's range
    spec = f"kernels>={window[0]},<{window[1]}"
    if core:  # transformers' own requirement: wherever it installed with its dependencies, this resolves
        return InstallAdvice("kernels", spec, f"pip install '{spec}'", alternatives=HUB_OFF_ALTERNATIVES)
    if _window_releases(window):
        return InstallAdvice("kernels", spec, f"pip install '{spec}'")
    # Offer the newest transformers whose window holds a release: the pair that does turn Hub kernels on.
    paired = [(t, w) for t, w in TRANSFORMERS_KERNELS_WINDOWS.items() if _window_releases(w)]
    transformers, (low, high) = max(paired, key=lambda pair: Version(pair[0]))
    working = f"kernels>={low},<{high}"
    series, kernels_series = (".".join(v.split(".")[:2]) for v in (transformers, low))
    preface = (
        f"no kernels release is inside [{window[0]}, {window[1]}) yet (newest known: {KERNELS_RELEASES[-1]}), so "
        f"Hub kernels stay off with this transformers; use transformers {series} with kernels {kernels_series}.x:"
    )
    instead = "or use the pip packages fla / causal-conv1d instead: `kernelguard check` without --hub gives their commands"
    command = f"pip install 'transformers=={transformers}' '{working}'"
    return InstallAdvice("kernels", working, command, (instead,), preface=preface)


def torch_triton_requirement(torch_version: str | None) -> str | None:
    """The Triton specifier this torch requires ("==3.6.0"): the installed torch's own metadata when it is that
    torch (CUDA builds declare it), else the dated table; None when neither knows."""
    base = _base(torch_version)
    if base is None:
        return None
    try:
        same = _base(metadata.version("torch")) == base
        requires = (metadata.requires("torch") or []) if same else []
    except metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name in ("triton", "pytorch-triton") and str(requirement.specifier):
            return str(requirement.specifier)
    return TORCH_TRITON.get(_release(torch_version) or "")


def _allows_safe_triton(pin: str) -> str | None:
    """The lowest Triton >= 3.7.1 this torch pin admits, as a requirement, or None."""
    try:
        spec = SpecifierSet(pin)
    except InvalidSpecifier:
        return None
    floors = [Version(s.version.replace(".*", "")) for s in spec if s.operator in ("==", "~=", ">=", "===")]
    if any(floor >= Version(FLA_SAFE_TRITON) and floor in spec for floor in floors):
        return f"triton{pin}"
    return f"triton{pin},>={FLA_SAFE_TRITON}" if Version(FLA_SAFE_TRITON) in spec else None


def _triton_advice(torch_version: str | None) -> InstallAdvice:
    pin = torch_triton_requirement(torch_version)
    tilelang = (_TILELANG, "fla then uses its TileLang backward")
    safe = _allows_safe_triton(pin) if pin else None
    if safe is not None:
        note = f"the Triton torch {torch_version} requires; fla needs >= {FLA_SAFE_TRITON} on Hopper"
        return InstallAdvice("triton", safe, f"pip install '{safe}'", (note,), alternatives=(tilelang,))
    newer = min((r for r, p in TORCH_TRITON.items() if _allows_safe_triton(p)), key=Version)
    requires = f"torch {torch_version} requires triton{pin}" if pin else f"torch {torch_version} pins its own Triton"
    note = (
        f"fla needs Triton >= {FLA_SAFE_TRITON} on Hopper and {requires}, so installing Triton alone breaks torch; "
        f"torch {newer} requires triton{TORCH_TRITON[newer]}: install it from the index of your CUDA build, then "
        "rebuild causal-conv1d against it"
    )
    return InstallAdvice("torch", f"torch>={newer}", f"pip install 'torch>={newer}'", (note,), alternatives=(tilelang,))


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


def _base(version: str | None) -> str | None:
    try:
        return Version(version).base_version if version else None
    except InvalidVersion:
        return None


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


# ----------------------------------------------------------------------------------- the lock's restores ---
_PYTORCH_INDEX = "https://download.pytorch.org/whl"


def pin_command(distribution: str, version: str | None) -> str:
    """The command that puts back exactly ``distribution==version`` (a stack lock's restore); ``version`` None:
    the lock has no such package, so remove it."""
    if version is None:
        return f"pip uninstall -y {distribution}"
    if distribution == "torch":
        base, _, local = version.partition("+")
        index = f" --index-url {_PYTORCH_INDEX}/{local}" if local else ""
        return f"pip install 'torch=={base}'{index}"
    if distribution in _COMPILED:
        # the exact build: no isolation (it compiles against the installed torch), nothing else reinstalled
        return (f"pip install {BUILD_TOOLS} && "
                + _pip(f"{distribution}=={version}", True, "--no-build-isolation", "--no-cache-dir"))
    return _pip(f"{distribution}=={version}", True)


def fla_backend_command(locked: str | None, here: str | None) -> str:
    """What makes fla choose the locked GDN backward backend again (kernelguard.resolution.fla_backend's names)."""
    if locked == "tilelang":
        return f"{_TILELANG} (and put nvcc on PATH: fla's TileLang backend compiles with it); unset FLA_TILELANG=0"
    if locked == "flash_qla":
        return "install the flash_qla build the lock was written with and unset FLA_FLASH_QLA=0"
    if here == "flash_qla":
        return "export FLA_FLASH_QLA=0 (or pip uninstall flash-qla)"
    if here == "tilelang":
        return "export FLA_TILELANG=0"
    return "unset FLA_DISABLE_BACKEND_DISPATCH and the FLA_* switches the image did not set"
