"""Version comparisons the resolver makes, tolerant of local versions and of strings that are not versions."""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["base_version", "hub_ref", "torch_minor", "version_in"]


def version_in(version: str | None, spec: str | None) -> bool:
    """``version`` satisfies ``spec`` (no spec: always; no version or an unparsable one: never)."""
    if spec is None:
        return True
    if version is None:
        return False
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False


def base_version(version: str | None) -> str | None:
    """``2.11.0+cu130`` -> ``2.11.0``; an unparsable string comes back as it is."""
    try:
        return Version(version).base_version if version else None
    except InvalidVersion:
        return version


def torch_minor(version: str | None) -> str | None:
    """``2.11.0+cu130`` -> ``2.11``."""
    base = base_version(version)
    return ".".join(base.split(".")[:2]) if base else None


def hub_ref(version: int | None, revision: str | None) -> str:
    """The Hub ref kernels loads for a repository pinned by ``version`` (its ``vN`` branch) or ``revision``
    (kernels takes one of the two), else ``main``: what a download must fetch for the load to find it."""
    return f"v{version}" if version is not None else revision or "main"
