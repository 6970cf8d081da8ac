"""Which known-issue rows (:mod:`kernelguard.resolution.known_issues`) match a candidate provider, from the facts
alone: the pure resolver's matching, shared by its package and Hub candidates."""

from __future__ import annotations

from dataclasses import replace

from .capability import ComputeCapability
from .catalog import Requirements
from .facts import Facts
from .fla_backend import backward_for
from .known_issues import KNOWN_ISSUES, KnownIssue
from .target import Target
from .versions import base_version as _base_version
from .versions import version_in as _version_in

__all__ = ["handed_issues", "issue_matches", "issue_sentence"]


def issue_matches(
    issue: KnownIssue, kernel: str, provider: str | None, provider_version: str | None, facts: Facts, target: Target,
    requirements: Requirements,
) -> tuple[bool, str | None]:
    """(matches, unknown) — unknown names the missing fact when the row cannot be decided here."""
    if issue.detector is not None:
        return False, None
    if issue.provider is not None and issue.provider != provider:
        return False, None
    if issue.kernels and kernel not in issue.kernels:
        return False, None
    if issue.modes and requirements.mode not in issue.modes:
        return False, None
    if any(facts.env.version_of(d) is None for d in issue.requires_installed) or issue.installed_version and \
            not _version_in(_base_version(facts.env.version_of(issue.installed_version[0])), issue.installed_version[1]):
        return False, None
    if any(facts.env.version_of(d) is not None for d in issue.unless_installed):
        return False, None
    if issue.triton is not None and not _version_in(_base_version(facts.env.triton_version), issue.triton):
        return False, None
    if issue.provider_version is not None and not _version_in(_base_version(provider_version), issue.provider_version):
        return False, None
    if issue.fla_backends and backward_for(facts, issue.archs, target.archs,
                                           training=requirements.mode == "training") not in issue.fla_backends:
        return False, None
    key_dim = requirements.key_head_dim
    if issue.key_head_dim_max is not None or issue.key_head_dim_min is not None:
        if key_dim is None:
            return False, f"known issue {issue.id} depends on the key head dim (pass --model CONFIG.json)"
        if issue.key_head_dim_max is not None and key_dim > issue.key_head_dim_max:
            return False, None
        if issue.key_head_dim_min is not None and key_dim < issue.key_head_dim_min:
            return False, None
    if issue.archs:
        if not target.archs:
            return False, f"known issue {issue.id} applies on compute capability {', '.join(issue.archs)} (pass --arch)"
        # An arch-specific target (sm_90a) is the same chip as 9.0 for a known issue.
        if not {ComputeCapability.parse(a, source=f"known issue {issue.id}") for a in issue.archs} & {
            arch.base for arch in target.archs
        }:
            return False, None
    return True, None


def issue_sentence(issue: KnownIssue, allowed: bool) -> str:
    verdict = "allowed by --allow" if allowed else "rejected"
    measured = f" (measured: {issue.evidence})" if issue.evidence else ""
    return f"known issue {issue.id} ({issue.source}): {issue.effect}{measured}; {verdict}"


def handed_issues(kernel: str, hands_to: tuple[str, ...], facts: Facts, target: Target, requirements: Requirements
                   ) -> tuple[list[KnownIssue], str]:
    """The known issues of the backends a Hub build hands its op to (``hands_to``) that match here, and the
    sentences saying so: such a backend brings its issues onto the Hub path."""
    handed = [i for i in KNOWN_ISSUES if set(i.fla_backends) & set(hands_to) and issue_matches(
        replace(i, provider=None, fla_backends=()), kernel, None, None, facts, target, requirements)[0]]
    return handed, "".join(f"; it hands the op to {', '.join(hands_to)} when that imports: "
                           f"{issue_sentence(i, target.allow.allows_issue(i.id))}" for i in handed)
