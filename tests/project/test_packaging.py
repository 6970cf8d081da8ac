"""Packaging that installs: the extras in pyproject.toml, the exact install commands, and `check` without kernels.

The extras' resolution against PyPI is checked by .ci/run with `pip install --dry-run` (network); these tests
need no network.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kernelguard.errors import ConfigError
from kernelguard.resolution.install import (
    DISTRIBUTION,
    FLA_SAFE_TRITON,
    KERNELS_RELEASES,
    TORCH_TRITON,
    InstallAdvice,
    install_command,
)

ROOT = Path(__file__).resolve().parents[2]
WHEEL_BASE = "https://github.com/Dao-AILab/causal-conv1d/releases/download/v1.7.0/causal_conv1d-1.7.0"
CONV_COMMAND = (
    "pip install setuptools wheel ninja packaging && "
    "pip install --no-build-isolation --no-cache-dir 'causal-conv1d==1.7.0'"
)


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with (ROOT / "pyproject.toml").open("rb") as handle:
        data: dict[str, Any] = tomllib.load(handle)
    return data


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in names}


# ------------------------------------------------------------------------------------------- pyproject


def test_kernels_is_the_hub_extra_not_a_dependency() -> None:
    project = _pyproject()["project"]
    assert "kernels" not in _requirements(project["dependencies"])
    hub = _requirements(project["optional-dependencies"]["hub"])["kernels"]
    # Every window transformers accepts must be installable: 5.17 takes [0.16, 0.17), 5.23/5.24 [0.18.2, 0.19),
    # 5.25 [0.19.1, 0.20); a release the Hub provider was never tested against must not be.
    for version in ("0.16.2", "0.17.2", "0.18.3", "0.19.1"):
        assert hub.specifier.contains(version), version
    for version in ("0.15.9", "0.20.0"):
        assert not hub.specifier.contains(version), version
    # The README's test command installs [train,dev]: dev must bring kernels so the Hub tests run, and only a
    # release the hub extra allows (dev may be narrower, to steer pip to one transformers window).
    dev = _requirements(project["optional-dependencies"]["dev"])["kernels"]
    known = [*KERNELS_RELEASES, "0.15.9", "0.20.0", "0.21.0"]
    in_dev = [v for v in known if dev.specifier.contains(v)]
    assert in_dev, dev
    assert [v for v in in_dev if not hub.specifier.contains(v)] == [], (dev, hub)


def test_fast_extra_holds_only_wheels_that_install_anywhere_at_measured_floors() -> None:
    fast = _requirements(_pyproject()["project"]["optional-dependencies"]["fast"])
    # causal-conv1d builds in isolation against another torch: installed by install_command, never an extra.
    assert set(fast) == {"flash-linear-attention", "fla-core"}
    for requirement in fast.values():
        assert not requirement.specifier.contains("0.5.2"), requirement  # 0.6.0 is what was measured
        assert requirement.specifier.contains("0.6.0"), requirement


def test_the_distribution_is_ours_and_self_referencing_extras_name_existing_extras() -> None:
    project = _pyproject()["project"]
    # The index's `kernelguard` is another project: ours is DISTRIBUTION, the name every printed fix uses.
    assert project["name"] == DISTRIBUTION != "kernelguard"
    assert project["scripts"] == {"kernelguard": "kernelguard.cli.entry:main"}  # start-up signal handlers first
    extras = project["optional-dependencies"]
    selves = [
        (name, requirement)
        for name, requirements in extras.items()
        for requirement in map(Requirement, requirements)
        if requirement.name in (DISTRIBUTION, "kernelguard")
    ]
    assert [name for name, _ in selves] == ["tracking"]
    for name, requirement in selves:
        assert requirement.name == DISTRIBUTION, (name, str(requirement))  # never the other project's extras
        assert requirement.extras <= set(extras), (name, requirement.extras - set(extras))


# ------------------------------------------------------------------------------------- install_command


def test_causal_conv1d_on_an_h200_with_a_cuda_torch() -> None:
    advice = install_command(
        "causal_conv1d", torch_version="2.13.0+cu128", cuda_version="12.8", archs=["9.0"], cxx11_abi=True
    )
    wheel = f"{WHEEL_BASE}+cu12torch2.13cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
    assert advice == InstallAdvice(
        package="causal-conv1d",
        requirement="causal-conv1d==1.7.0",
        command=CONV_COMMAND,
        notes=(
            (f"It first tries the prebuilt wheel {wheel}, then compiles against the installed torch "
            "2.13.0+cu128 with nvcc from a CUDA 12.x toolkit (CUDA_HOME), which takes several minutes."),
        ),
        prebuilt_wheel=wheel,
        offline_command=(
            "pip install setuptools wheel ninja packaging && CAUSAL_CONV1D_FORCE_BUILD=TRUE "
            "pip install --no-build-isolation --no-cache-dir 'causal-conv1d==1.7.0'"
        ),
    )
    assert "--no-build-isolation" in advice.text() and wheel in advice.text()


@pytest.mark.parametrize(
    "torch, cuda, abi, python, machine, wheel",
    [
        ("2.11.0+cu130", "13.0", True, "3.12", "x86_64", "+cu13torch2.11cxx11abiTRUE-cp312-cp312-linux_x86_64"),
        ("2.6.0+cu118", "11.8", False, "3.10", "x86_64", "+cu11torch2.6cxx11abiFALSE-cp310-cp310-linux_x86_64"),
        ("2.9.1", "12.6", True, "3.11", "aarch64", "+cu12torch2.9cxx11abiTRUE-cp311-cp311-linux_aarch64"),
    ],
)
def test_prebuilt_wheel_name_follows_setup_py(
    torch: str, cuda: str, abi: bool, python: str, machine: str, wheel: str
) -> None:
    advice = install_command(
        "causal-conv1d", torch_version=torch, cuda_version=cuda, cxx11_abi=abi, python_version=python,
        machine=machine,
    )
    assert advice.prebuilt_wheel == f"{WHEEL_BASE}{wheel}.whl"


def test_no_wheel_guess_without_the_abi_or_for_an_unknown_cuda_major() -> None:
    unknown_abi = install_command("causal-conv1d", torch_version="2.13.0", cuda_version="12.8")
    assert unknown_abi.prebuilt_wheel is None
    assert unknown_abi.notes[0].startswith("It compiles against the installed torch 2.13.0")
    cuda14 = install_command("causal-conv1d", torch_version="2.13.0", cuda_version="14.0", cxx11_abi=True)
    assert cuda14.prebuilt_wheel is None


def test_archs_a_source_build_cannot_run_on() -> None:
    advice = install_command(
        "causal-conv1d", torch_version="2.11.0+cu126", cuda_version="12.6", archs=["10.0", "sm_90a", "8.9", "11.0"],
        cxx11_abi=True,
    )
    assert advice.notes[-1] == (
        "A source build of causal-conv1d 1.7.0 with CUDA 12.6 compiles sm_75, sm_80, sm_87, sm_90 (no PTX), which "
        "cannot run on compute capability 10.0, 11.0 (10.0 needs nvcc >= 12.8; 11.0 needs nvcc >= 13.0): use a "
        "torch and toolkit for that CUDA, or a prebuilt wheel that has it."
    )
    covered = install_command(
        "causal-conv1d", torch_version="2.13.0+cu130", cuda_version="13.0", archs=["10.0", "11.0", "12.1", "9.0"]
    )
    assert not any("cannot run" in note for note in covered.notes)


@pytest.mark.parametrize("torch, found", [(None, "torch is not installed"), ("2.13.0+cpu", "torch 2.13.0+cpu has no CUDA")])
def test_causal_conv1d_without_a_cuda_torch(torch: str | None, found: str) -> None:
    advice = install_command("causal-conv1d", torch_version=torch, cuda_version=None, archs=["9.0"])
    assert advice.command == CONV_COMMAND
    assert advice.notes == (
        (f"{found}: causal-conv1d is a CUDA extension compiled against the installed torch, so install a CUDA "
        "build of torch first, then run this command."),
    )
    assert advice.prebuilt_wheel is None


def test_reinstall_replaces_only_the_broken_package() -> None:
    advice = install_command("causal-conv1d", torch_version="2.13.0+cu128", cuda_version="12.8", reinstall=True)
    # --force-reinstall without --no-deps would download torch again (gigabytes).
    assert advice.command.endswith(
        "pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps 'causal-conv1d==1.7.0'"
    )


def test_fla_and_kernels_commands() -> None:
    fla = install_command("fla", torch_version="2.13.0+cu128", cuda_version="12.8")
    assert (fla.command, fla.notes) == ("pip install 'flash-linear-attention>=0.6.0,<1'", ())
    cpu = install_command("flash-linear-attention", torch_version="2.13.0+cpu", cuda_version=None)
    assert cpu.notes == (
        ("torch 2.13.0+cpu is a build without CUDA: fla installs, but its Triton kernels need a CUDA (or XPU) "
        "build of torch to run."),
    )
    window = install_command("kernels", torch_version=None, cuda_version=None, kernels_window=("0.16", "0.17"))
    assert window.fix_line() == "pip install 'kernels>=0.16,<0.17'"
    # A window above every release kernelguard knows: it names the newest transformers whose window holds one.
    empty = install_command("kernels", torch_version=None, cuda_version=None, kernels_window=("0.20.0", "0.21.0"))
    assert empty.commands == ("pip install 'transformers==5.25.0' 'kernels>=0.19.1,<0.20.0'",)
    assert empty.fix_line().startswith(
        "no kernels release is inside [0.20.0, 0.21.0) yet (newest known: 0.19.1), so Hub kernels stay off with "
        "this transformers; use transformers 5.25 with kernels 0.19.x: pip install"
    )
    assert install_command("hub", torch_version=None, cuda_version=None).command == "pip install 'kernelguard-gdn[hub]'"


def test_generic_compiled_packages_build_against_the_installed_torch() -> None:
    advice = install_command("flash_attn", torch_version="2.13.0+cu130", cuda_version="13.0", archs=["9.0"])
    assert advice.command == (
        "pip install setuptools wheel ninja packaging && pip install --no-build-isolation --no-cache-dir 'flash-attn'"
    )
    assert advice.prebuilt_wheel is None and advice.offline_command is None


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="install_command knows causal-conv1d, .*, triton .* not 'numpy'"):
        install_command("numpy", torch_version=None, cuda_version=None)
    with pytest.raises(ConfigError):
        install_command("causal-conv1d", torch_version="2.13.0", cuda_version="12.8", archs=["9.5"])


def test_the_pinned_causal_conv1d_is_the_measured_release() -> None:
    # bench/RESULTS.md and the Dockerfile measured 1.7.0; a newer pin must be measured before it goes here.
    requirement = Requirement(install_command("causal-conv1d", torch_version=None, cuda_version=None).requirement)
    assert requirement.specifier.contains(Version("1.7.0")) and str(requirement.specifier) == "==1.7.0"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG CAUSAL_CONV1D_VERSION=1.7.0" in dockerfile


# --------------------------------------------------------------------------- check without the hub extra

_WITHOUT_KERNELS = """
import sys
from importlib import metadata

sys.modules["kernels"] = None  # `import kernels` raises ImportError, find_spec says absent
_version = metadata.version


def version(name):
    if name.lower() == "kernels":
        raise metadata.PackageNotFoundError(name)
    return _version(name)


metadata.version = version
from kernelguard.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_check_without_kernels_reports_what_turns_hub_kernels_on(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_KERNELS")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_KERNELS, "check", "--model", "qwen3_5", "--hub", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert report["environment"]["packages"]["kernels"]["value"] is None
    hub = [c for k in report["kernels"] for c in k["candidates"] if c["kind"] == "hub"]
    assert hub, report["kernels"]
    for candidate in hub:
        assert candidate["status"] == "rejected"
        assert "not installed" in candidate["reason"]
        # The fix is the one install_command builds for this transformers' kernels window: a kernels release
        # inside it, or (no release inside, as for 5.23+) the pair of releases that does turn Hub kernels on.
        from kernelguard.resolution import discovery
        from kernelguard.resolution.decisions import split_fix
        from kernelguard.resolution.install import install_command

        window = discovery.kernels_version_window(discovery.transformers_source())
        expected = install_command("kernels", torch_version=None, cuda_version=None, kernels_window=window)
        assert (candidate["fix"], candidate["fix_note"]) == split_fix(expected.fix_line())
        assert candidate["fix"] == expected.command  # one command; its preface and notes are the note
        assert "kernelguard-gdn[hub]" not in candidate["fix"] or window is None


def test_the_docker_image_takes_the_triton_its_own_torch_requires() -> None:
    # torch pins Triton exactly: installing another Triton next to it breaks torch; the image's torch must bring
    # a Triton that fla #640 accepts on Hopper.
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert torch is not None
    pin = SpecifierSet(TORCH_TRITON[".".join(torch.group(1).split(".")[:2])])
    assert Version(FLA_SAFE_TRITON) in pin, (torch.group(1), str(pin))
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert not [line for line in installs if "triton" in line.lower()], installs


def test_the_wheel_holds_every_file_of_the_package(tmp_path: Path) -> None:
    """What a user installs from a wheel: every module and every data file under kernelguard/ (a data file that
    moves and is not named in package-data is left out of the wheel without a word)."""
    pytest.importorskip("setuptools", reason="builds the wheel without build isolation (no network)")
    import shutil
    import zipfile

    source = tmp_path / "source"  # what a fresh clone holds: no egg-info of an editable install to fill gaps from
    shutil.copytree(ROOT / "kernelguard", source / "kernelguard", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, check=False,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    inside = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    package = ROOT / "kernelguard"
    files = {p.relative_to(ROOT).as_posix() for p in package.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert files - inside == set()
