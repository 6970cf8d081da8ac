"""One ``Decision`` type: what serves a kernel (or a layer's call site), or why a candidate does not.

The resolver makes one per candidate provider of every required kernel (``layer`` empty); the guard makes one
per call site of a built model (``layer`` set). Both are rendered by :mod:`kernelguard.report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ACCEPTED", "ALLOWED", "FALLBACK", "REJECTED", "SELECTED", "SKIPPED", "Decision"]

# Status of one candidate.
SELECTED = "selected"  # accepted and first in order: this serves the kernel
ACCEPTED = "accepted"  # would work, but an earlier candidate wins
REJECTED = "rejected"
SKIPPED = "skipped"  # not considered in this configuration (e.g. Hub kernels not requested)
FALLBACK = "fallback"  # the torch reference path
ALLOWED = "allowed"  # a slow path the AllowPolicy accepts (still shown)


# Provider kinds.
PACKAGE, HUB, TORCH, REFERENCE = "package", "hub", "torch", "reference"


@dataclass(frozen=True, slots=True)
class Decision:
    kernel: str
    provider: str  # "fla (fla.ops.gated_delta_rule)", "hub kernels-community/fla", "torch reference"
    kind: str  # "package" | "hub" | "torch" | "reference"
    status: str
    reason: str
    fix: str | None = None
    issues: tuple[str, ...] = ()  # known-issue IDs that matched (allowed or not)
    layer: str = ""  # module path of the call site (guard); empty for a resolver candidate

    @property
    def usable(self) -> bool:
        return self.status in (SELECTED, ACCEPTED)

    def to_dict(self) -> dict[str, Any]:
        layer = {"layer": self.layer} if self.layer else {}
        return {
            **layer,
            "provider": self.provider,
            "kind": self.kind,
            "status": self.status,
            "reason": self.reason,
            "fix": self.fix,
            "known_issues": list(self.issues),
        }
