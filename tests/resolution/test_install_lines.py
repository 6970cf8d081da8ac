"""Every `pip install` line in README.md and docs/ installs this project or one of its real dependencies.

The package index's `kernelguard` is another project: a doc that tells users `pip install kernelguard` installs
that one. Each `pip install` found in the docs (fenced or inline) is split into its requirements: a checkout
(`.`, `-e '.[train]'`) or a wheel built from it must name existing extras (and the wheel this version's file
name); a named requirement must be our distribution (with existing extras) or a package this project depends
on or prints a fix for. No network: the resolution itself is .ci/run's `pip install --dry-run`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from kernelguard.resolution.install import BUILD_TOOLS, DISTRIBUTION, PACKAGES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PIP_INSTALL = re.compile(r"pip install (?P<rest>[^\n`]*)")
# Where a command ends inside a line of prose or output: a comment, the next command, a note in parentheses.
END = re.compile(r"\s#|&&|;|\|\||\s\(|  ")
TAKES_VALUE = {"-r", "-c", "-i", "-t", "-f", "--index-url", "--extra-index-url", "--target", "--find-links"}


def _project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        project: dict[str, Any] = tomllib.load(handle)["project"]
    return project


def _known_dependencies(project: dict[str, Any]) -> set[str]:
    """Every distribution this project requires, offers as an extra, or names in a fix it prints."""
    requirements = [*project["dependencies"], *(r for rs in project["optional-dependencies"].values() for r in rs)]
    names = {Requirement(r).name for r in requirements}
    names |= set(PACKAGES) | set(BUILD_TOOLS.split()) | {"triton", "tilelang", "z3-solver", "torch", "transformers"}
    return {canonicalize_name(n) for n in names} - {canonicalize_name(DISTRIBUTION)}


def problems(text: str, project: dict[str, Any]) -> list[str]:
    """Why each `pip install` in ``text`` would not install this project or a dependency of it."""
    extras = set(project["optional-dependencies"])
    wheel = f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl"
    known = _known_dependencies(project)
    found: list[str] = []
    for match in PIP_INSTALL.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        command = END.split(match.group("rest"))[0]
        try:
            words = shlex.split(command)
        except ValueError as exc:
            found.append(f"line {line}: `pip install {command}` is not one shell command ({exc})")
            continue
        skip = False
        for word in words:
            if skip or word in ("-e", "--editable"):
                skip = False
                continue
            if word.startswith("-"):
                skip = word in TAKES_VALUE
                continue
            target, _, extra_part = word.partition("[")
            asked = set(extra_part.rstrip("]").split(",")) - {""}
            if target in (".", "./") or target.endswith(".whl"):
                if target.endswith(".whl") and Path(target).name != wheel:
                    found.append(f"line {line}: {word}: this version's wheel is {wheel}")
                if asked - extras:
                    found.append(f"line {line}: {word}: no extra {sorted(asked - extras)} (extras: {sorted(extras)})")
                continue
            try:
                requirement = Requirement(word)
            except InvalidRequirement:
                found.append(f"line {line}: `{word}` in `pip install {command}` is not a requirement")
                continue
            name = canonicalize_name(requirement.name)
            if name == canonicalize_name(DISTRIBUTION):
                if requirement.extras - extras:
                    found.append(f"line {line}: {word}: no extra {sorted(requirement.extras - extras)}")
            elif name not in known:
                ours = " (the index's `kernelguard` is another project)" if name == "kernelguard" else ""
                found.append(
                    f"line {line}: `pip install {command}` installs {requirement.name}, which is neither "
                    f"{DISTRIBUTION} nor a dependency of it{ours}"
                )
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_pip_install_in_the_docs_installs_this_project_or_a_dependency(path: Path) -> None:
    assert problems(path.read_text(encoding="utf-8"), _project()) == []


def test_the_docs_install_this_project_from_a_checkout_and_under_its_own_name() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS)
    installs = [m.group("rest") for m in PIP_INSTALL.finditer(text)]
    assert any(r.startswith("-e '.[fast]'") for r in installs)
    assert any(".whl[train]" in r for r in installs)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("pip install kernelguard", "installs kernelguard, which is neither kernelguard-gdn nor a dependency of it"),
        ("pip install 'kernelguard[fast]'  # x", "the index's `kernelguard` is another project"),
        ("pip install -e '.[turbo]'", "no extra ['turbo']"),
        ("pip install 'kernelguard-gdn[turbo]'", "no extra ['turbo']"),
        ("pip install 'dist/kernelguard_gdn-0.0.1-py3-none-any.whl[train]'", "this version's wheel is"),
        ("`pip install requests`", "installs requests"),
    ],
)
def test_a_foreign_distribution_or_an_unknown_extra_is_caught(line: str, problem: str) -> None:
    found = problems(line, _project())
    assert len(found) == 1 and problem in found[0], found


def test_our_own_and_dependency_lines_pass() -> None:
    text = (
        "pip install -q torch==2.13.0 -e '.[train,dev]' && x\n"
        "pip install 'kernelguard-gdn[hub]' 'kernels>=0.16,<0.17'\n"
        "fix: pip install 'flash-linear-attention>=0.6.0,<1'  (a note)\n"
        "pip install --no-build-isolation --no-cache-dir causal-conv1d  # builds\n"
    )
    assert problems(text, _project()) == []
