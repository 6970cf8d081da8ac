"""Every install fix kernelguard can print resolves on PyPI: ``pip install --dry-run`` of each command.

A fix that names no existing release (a kernels window with nothing in it) or a Triton the installed torch refuses
("triton>=3.7.1" next to torch 2.11, which requires triton==3.6.0) fails here, and kernelguard's table of kernels
releases is checked against the index: a window it believes empty must not resolve, and one it believes holds a
release must. torch's pin is modelled as a pip
constraint (torch itself is not installed: gigabytes), and ``--no-deps`` keeps each resolve to metadata. The
CUDA extensions (causal-conv1d & co.) are sdists whose metadata needs a build against torch (about a minute
each): .ci/run resolves causal-conv1d's pinned requirement that way; here only their set is pinned down.
Skipped when PyPI is unreachable.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kernelguard.resolution.install import (
    DISTRIBUTION,
    KERNELS_RELEASES,
    PACKAGES,
    TORCH_TRITON,
    TRANSFORMERS_KERNELS_WINDOWS,
    extra_command,
    install_command,
    pin_command,
    upgrade_command,
)
from kernelguard.resolution.known_issues import by_id

pytestmark = pytest.mark.slow

FACTS = {"torch_version": "2.13.0+cu128", "cuda_version": "12.8", "cxx11_abi": True, "archs": ["9.0"]}


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


needs_pypi = pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is unreachable (offline machine)")


def requirements_of(command: str) -> list[str]:
    """The requirement strings of every `pip install` in a shell line; kernelguard's own extras expanded to
    what they require (kernelguard is installed from this checkout, not from PyPI)."""
    found: list[str] = []
    for part in command.split("&&"):
        words = [w for w in shlex.split(part) if not (w[:1].isupper() and "=" in w)]  # drop VAR=VALUE
        assert words[:2] == ["pip", "install"], command
        for word in words[2:]:
            if word.startswith("-"):
                continue
            requirement = Requirement(word)
            if requirement.name == DISTRIBUTION:
                found += _extra(requirement.extras)
            else:
                found.append(word)
    return found


def _extra(extras: set[str]) -> list[str]:
    out = []
    for line in metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker and any(marker.evaluate({"extra": e}) for e in extras) and requirement.name != DISTRIBUTION:
            requirement.marker = None
            out.append(str(requirement))
    return out


def dry_run(requirements: list[str], constraints: list[str], tmp_path: Path) -> str:
    """'' when pip resolves them (metadata only, nothing installed), else pip's error."""
    file = tmp_path / "constraints.txt"
    file.write_text("\n".join(constraints) + "\n")
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "-q", "--ignore-installed"]
    proc = subprocess.run(
        [*command, "-c", str(file), *requirements], capture_output=True, text=True, timeout=300, check=False
    )
    return "" if proc.returncode == 0 else proc.stderr[-2000:]


def _fixes() -> list[tuple[str, list[str]]]:
    """(command, pip constraints from the torch it runs next to) for every fix kernelguard builds."""
    out: list[tuple[str, list[str]]] = []
    for package in PACKAGES:
        for reinstall in (False, True):
            advice = install_command(package, reinstall=reinstall, **FACTS)  # type: ignore[arg-type]
            out += [(c, []) for c in advice.commands]
            if advice.offline_command:
                out.append((advice.offline_command, []))
    # Every transformers window kernelguard knows (as table and as transformers spells it: "0.19.0"), 5.25's as
    # its core requirement too, one above every known release (the advice then names another transformers), and
    # no window (the hub extra).
    windows: list[tuple[str, str] | None] = [*TRANSFORMERS_KERNELS_WINDOWS.values(), ("0.18.2", "0.19.0"), None]
    windows.append((_next_minor(KERNELS_RELEASES[-1]), _next_minor(_next_minor(KERNELS_RELEASES[-1]))))
    for window in windows:
        advice = install_command("kernels", torch_version=None, cuda_version=None, kernels_window=window)
        out += [(c, []) for c in advice.commands]
    core = install_command("kernels", torch_version=None, cuda_version=None,
                           kernels_window=TRANSFORMERS_KERNELS_WINDOWS["5.25.0"], kernels_core=True)
    out.append((core.command, []))  # its alternative is `export USE_HUB_KERNELS=NO`, nothing to install
    for release, pin in TORCH_TRITON.items():
        advice = install_command("triton", torch_version=f"{release}.0+cu128", cuda_version="12.8")
        for command in advice.commands:
            installs_torch = any(Requirement(r).name == "torch" for r in requirements_of(command))
            out.append((command, [] if installs_torch else [f"triton{pin}"]))
    out += [(upgrade_command("torch", "2.10"), []), (upgrade_command("flash-linear-attention", "0.2.2"), [])]
    out += [("pip install z3-solver", [])]  # tilelang-without-z3's fix
    # a stack lock's restores: the exact releases the H200 image carries
    out += [(pin_command("fla-core", "0.6.0"), []), (pin_command("causal-conv1d", "1.7.0"), [])]
    assert by_id("tilelang-without-z3") is not None and "pip install z3-solver" in by_id("tilelang-without-z3").fix
    for extra in ("hub", "train", "tensorboard", "wandb", "trackio", "trl"):  # the extras fixes name
        out.append((extra_command(extra), []))
    return out


def _next_minor(release: str) -> str:
    major, minor = Version(release).release[:2]
    return f"{major}.{minor + 1}.0"


_COMPILED = {"causal-conv1d", "flash-attn", "mamba-ssm"}


@needs_pypi
def test_every_fix_command_resolves(tmp_path: Path) -> None:
    groups: dict[tuple[str, ...], set[str]] = {}
    sdists: set[str] = set()
    for command, constraints in _fixes():
        for requirement in requirements_of(command):
            if Requirement(requirement).name in _COMPILED:
                sdists.add(requirement)
            else:
                groups.setdefault(tuple(constraints), set()).add(requirement)
    assert sdists == {"causal-conv1d==1.7.0", "flash-attn", "mamba-ssm"}
    failures = {
        (constraints, tuple(batch)): error
        for constraints, requirements in groups.items()
        for batch in _batches(requirements)
        if (error := dry_run(batch, list(constraints), tmp_path))
    }
    assert failures == {}


def _batches(requirements: set[str]) -> list[list[str]]:
    """The requirements in as few pip runs as possible, each distribution at most once per run: pip merges two
    requirements on one distribution (two transformers' kernels windows), and no single release need satisfy both."""
    batches: list[dict[str, str]] = []
    for requirement in sorted(requirements):
        name = Requirement(requirement).name
        batch = next((b for b in batches if name not in b), None)
        if batch is None:
            batch = {}
            batches.append(batch)
        batch[name] = requirement
    return [sorted(batch.values()) for batch in batches]


def _index_kernels_releases() -> list[str]:
    """The kernels releases the package index lists now (pip's own view, the one pip install resolves against)."""
    command = [sys.executable, "-m", "pip", "index", "versions", "kernels"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    [line] = [line for line in out.splitlines() if line.startswith("Available versions:")]
    return [v.strip() for v in line.removeprefix("Available versions:").split(",")]


def _empty_window(releases: list[str]) -> str:
    """A requirement strictly between the two newest releases on the index: nothing can satisfy it."""
    previous, newest = sorted(releases, key=Version)[-2:]
    return f"kernels>{previous},<{newest}"


@needs_pypi
def test_a_window_with_no_release_does_not_resolve(tmp_path: Path) -> None:
    # The check above can fail: pip refuses a kernels window the index has no release in (computed from the
    # index now, so a new release cannot make this window resolvable).
    requirement = _empty_window(_index_kernels_releases())
    error = dry_run([requirement], [], tmp_path)
    assert "No matching distribution found" in error or "ResolutionImpossible" in error, (requirement, error)


@needs_pypi
def test_a_triton_torch_refuses_does_not_resolve(tmp_path: Path) -> None:
    # ... and a Triton that torch 2.11's exact pin refuses.
    error = dry_run(["triton>=3.7.1"], [f"triton{TORCH_TRITON['2.11']}"], tmp_path)
    assert "No matching distribution found" in error or "ResolutionImpossible" in error, error


@needs_pypi
def test_known_kernels_releases_match_the_index(tmp_path: Path) -> None:
    """kernelguard's own table decides whether a transformers window holds a release; it must agree with pip."""
    listed = _index_kernels_releases()
    assert set(KERNELS_RELEASES) <= set(listed), set(KERNELS_RELEASES) - set(listed)
    for low, high in TRANSFORMERS_KERNELS_WINDOWS.values():
        requirement = f"kernels>={low},<{high}"
        believed = any(Version(r) in SpecifierSet(f">={low},<{high}") for r in KERNELS_RELEASES)
        resolves = dry_run([requirement], [], tmp_path) == ""
        assert resolves == believed, (
            f"{requirement}: kernelguard believes it {'holds' if believed else 'holds no'} release, pip "
            f"{'resolves' if resolves else 'does not resolve'} it; update kernelguard.resolution.install.KERNELS_RELEASES "
            f"(the index lists {', '.join(sorted(listed, key=Version)[-8:])})"
        )
