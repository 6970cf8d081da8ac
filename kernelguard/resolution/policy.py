"""What the user accepts: one ``AllowPolicy``, parsed once from wherever it was written.

Sources (all parse through :meth:`AllowPolicy.parse`): ``kernelguard check --allow``, ``[tool.kernelguard] allow``,
``require(allow=)``, ``guard(allow=)``, the pytest ``--kernelguard-allow`` option / ini / marker, and
``kernelguard train --allow``. An item is one of:

- a known-issue ID (``kernelguard issues`` lists them): accept a stack that row rejects;
- a kernel name (``chunk_gated_delta_rule``): accept that kernel's torch reference path;
- ``attention`` (also spelled ``varlen_attention``, the name of the row ``kernelguard check`` prints for it): accept
  an O(T^2) block-mask attention in packed training;
- ``untrusted-hub-repo``: accept Kernel Hub repositories outside the trusted organisations;
- ``packed-without-boundaries``: accept packed rows whose GDN kernels get no example boundaries (``cu_seqlens``,
  ``seq_idx``): state leaks across examples. Wrong results, not a slow path: only this item accepts it;
- ``*``: accept every slow path (debugging only; everything stays visible in reports); not the item above.

An unknown item is a usage error (exit 2) listing the valid ones: a typo must never silently allow nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kernelguard.errors import ConfigError

from .catalog import VARLEN_ATTENTION
from .known_issues import KNOWN_ISSUES, by_id
from .terms import nearest

__all__ = ["ALIASES", "ATTENTION", "EVERYTHING", "PACKED_WITHOUT_BOUNDARIES", "POLICY_ITEMS", "UNTRUSTED_HUB_REPO",
           "AllowPolicy", "known_kernel_names"]

ATTENTION = "attention"
UNTRUSTED_HUB_REPO = "untrusted-hub-repo"
PACKED_WITHOUT_BOUNDARIES = "packed-without-boundaries"
EVERYTHING = "*"
PACKED_WITHOUT_BOUNDARIES = "packed-without-boundaries"

POLICY_ITEMS: dict[str, str] = {
    ATTENTION: "accept sdpa/eager attention (O(T^2) block mask) in packed training",
    UNTRUSTED_HUB_REPO: "accept Kernel Hub repositories outside the trusted organisations",
    PACKED_WITHOUT_BOUNDARIES: "accept packed rows whose GDN kernels get no example boundaries (state leaks "
    "across examples; wrong, not slow: `*` does not include it)",
    EVERYTHING: "accept every slow path (debugging only)",
}
# Other spellings of a policy item: `check` names the attention row after what it needs (a varlen attention),
# the guard after the layer (attention); either word accepts the same thing.
ALIASES: dict[str, str] = {VARLEN_ATTENTION: ATTENTION}

# Kernel names are identifiers; known-issue IDs contain dashes. Used when transformers' source cannot be read.
_KERNEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def known_kernel_names() -> frozenset[str]:
    """Every kernel name a model family in the installed transformers wraps with a torch fallback."""
    from . import discovery

    try:
        families = discovery.families()
    except ConfigError:  # transformers not installed: nothing to validate kernel names against
        return frozenset()
    return frozenset(k.kernel for family in families.values() for k in family.kernels)


@dataclass(frozen=True, slots=True)
class AllowPolicy:
    issues: frozenset[str] = frozenset()
    kernels: frozenset[str] = frozenset()
    attention: bool = False
    untrusted_hub: bool = False
    everything: bool = False
    # Explicit only: `*` accepts slow paths, and this one is a wrong result.
    packed_without_boundaries: bool = False

    @classmethod
    def parse(
        cls,
        values: str | Iterable[str] | AllowPolicy | None,
        *,
        source: str = "--allow",
        kernel_names: Iterable[str] | None = None,
    ) -> AllowPolicy:
        """Parse allow items; ConfigError naming ``source`` and listing valid items for anything unknown."""
        if values is None:
            return cls()
        if isinstance(values, AllowPolicy):
            return values
        if isinstance(values, str):
            items: list[object] = [values]
        elif isinstance(values, Iterable):
            items = list(values)
        else:
            raise _unknown(values, source, None, expected_type=True)
        known = frozenset(kernel_names) if kernel_names is not None else None
        issues: set[str] = set()
        kernels: set[str] = set()
        flags = {ATTENTION: False, UNTRUSTED_HUB_REPO: False, EVERYTHING: False, PACKED_WITHOUT_BOUNDARIES: False}
        # "a,b" is two items wherever allow items are read (--allow a,b, KERNELGUARD_ALLOW, ini, markers): no ID
        # or kernel name holds a comma.
        for raw in [part for x in items for part in (x.split(",") if isinstance(x, str) else [x])]:
            if not isinstance(raw, str):
                raise _unknown(raw, source, known, expected_type=True)
            item = raw.strip()
            item = ALIASES.get(item, item)
            if not item:
                continue
            if item in flags:
                flags[item] = True
            elif by_id(item) is not None:
                issues.add(item)
            elif _is_kernel(item, known):
                kernels.add(item)
            else:
                raise _unknown(item, source, known if known is not None else known_kernel_names())
        return cls(frozenset(issues), frozenset(kernels), flags[ATTENTION], flags[UNTRUSTED_HUB_REPO], flags[EVERYTHING],
                   flags[PACKED_WITHOUT_BOUNDARIES])

    # ----------------------------------------------------------------------------------------- queries ---
    def allows_issue(self, issue_id: str) -> bool:
        return self.everything or issue_id in self.issues

    def allows_fallback(self, kernel: str) -> bool:
        """The torch reference path of ``kernel`` is accepted."""
        return self.everything or kernel in self.kernels

    def allows_attention(self) -> bool:
        return self.everything or self.attention

    def allows_untrusted_hub(self) -> bool:
        return self.everything or self.untrusted_hub

    def allows_packed_without_boundaries(self) -> bool:
        """Packed rows whose GDN kernels get no boundaries are accepted: by this explicit item only."""
        return self.packed_without_boundaries

    def allows_site(self, kernel: str, issue_ids: Iterable[str] = ()) -> bool:
        """A slow call site is accepted by its kernel name or by any known issue that explains it."""
        return self.allows_fallback(kernel) or any(self.allows_issue(i) for i in issue_ids)

    @property
    def lifts_fla_refusal(self) -> bool:
        """Accepting a row that marks fla's own refusal as conservative lifts it, so the accepted path runs."""
        return any((row := by_id(i)) is not None and row.lifts_fla_refusal for i in self.issues) or (
            self.everything and any(row.lifts_fla_refusal for row in KNOWN_ISSUES)
        )

    def merge(self, other: AllowPolicy) -> AllowPolicy:
        return AllowPolicy(
            self.issues | other.issues,
            self.kernels | other.kernels,
            self.attention or other.attention,
            self.untrusted_hub or other.untrusted_hub,
            self.everything or other.everything,
            self.packed_without_boundaries or other.packed_without_boundaries,
        )

    def values(self) -> list[str]:
        """The items as a user writes them, sorted (for reports, JSON and round-tripping)."""
        flags = [name for name, on in ((ATTENTION, self.attention), (UNTRUSTED_HUB_REPO, self.untrusted_hub),
                                       (EVERYTHING, self.everything),
                                       (PACKED_WITHOUT_BOUNDARIES, self.packed_without_boundaries)) if on]
        return sorted([*self.issues, *self.kernels, *flags])

    def __bool__(self) -> bool:
        return bool(self.issues or self.kernels or self.attention or self.untrusted_hub or self.everything
                    or self.packed_without_boundaries)

    def __str__(self) -> str:
        return ", ".join(self.values()) or "nothing"


def _is_kernel(item: str, known: frozenset[str] | None) -> bool:
    if known is None:
        known = known_kernel_names()
        if not known:  # no transformers to ask: accept identifier-shaped names
            return bool(_KERNEL_NAME.match(item))
    return item in known


def _unknown(item: object, source: str, kernels: frozenset[str] | None, *, expected_type: bool = False) -> ConfigError:
    issue_ids = ", ".join(issue.id for issue in KNOWN_ISSUES)
    kernel_list = ", ".join(sorted(kernels or ())) or "(kernel names of the installed transformers)"
    found = f"a {type(item).__name__} ({item!r})" if expected_type else repr(item)
    valid = [*sorted(kernels or ()), *(issue.id for issue in KNOWN_ISSUES), *POLICY_ITEMS]
    close = nearest(item, valid) if isinstance(item, str) else []
    if close:  # the nearest names, not every name (a list of some 600 characters hides the one meant)
        return ConfigError(
            f"{source}: {item!r} is not a known issue ID, kernel name or policy; did you mean {' or '.join(close)}?",
            # No fix of its own: `kernelguard train` puts its command line with the nearest name as the fix.
            details={"source": source, "value": repr(item), "replace": (item, close[0]), "flag": "--allow",
                     "nearest": close},
        )
    return ConfigError(
        f"{source}: {found} is not a known issue ID, kernel name or policy. Known issues: {issue_ids}. "
        f"Kernels: {kernel_list}. Policies: {', '.join(POLICY_ITEMS)} ({VARLEN_ATTENTION} = {ATTENTION}).",
        fix="`kernelguard issues` lists every known issue with what allowing it means",
        details={"source": source, "value": repr(item)},
    )
