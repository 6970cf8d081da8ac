"""One ``Decision`` type: what serves a kernel (or a layer's call site), or why a candidate does not.

The resolver makes one per candidate provider of every required kernel (``layer`` empty); the guard makes one
per call site of a built model (``layer`` set). Both are rendered by :mod:`kernelguard.stack.report`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ACCEPTED", "ALLOWED", "FALLBACK", "REJECTED", "SELECTED", "SKIPPED", "Decision", "fix_alternatives", "split_fix"]

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
        command, note = split_fix(self.fix)
        return {
            **layer,
            "provider": self.provider,
            "kind": self.kind,
            "status": self.status,
            "reason": self.reason,
            "fix": command,
            "fix_note": note,
            "known_issues": list(self.issues),
        }


# A fix line starts with a shell command (or a sentence ending in ":" before one); what follows the command --
# a parenthesis (unquoted, a shell syntax error), or "; or" and another way out -- is prose about it.
_COMMAND_START = re.compile(r"(?:[A-Z][A-Z0-9_]*=\S+ )*(?:pip|pip3|python|python3|uv|conda|hf|kernelguard|export)\s")
_COMMAND_END = re.compile(r"\s+\(|; or |\s+#\s")


def split_fix(fix: str | None) -> tuple[str | None, str | None]:
    """(the shell command to paste, the prose around it) of a fix line; (None, the line) when it names no command.
    ``kernelguard check --json`` gives the two as ``fix`` and ``fix_note``; the text output puts the note on its
    own line, so the command line is never wrapped or mixed with prose."""
    if not fix:
        return None, None
    start = _COMMAND_START.search(fix)
    if start is None or (start.start() and not fix[: start.start()].rstrip().endswith(":")):
        return None, fix.strip()
    preface = fix[: start.start()].strip()
    rest = fix[start.start() :]
    end = _COMMAND_END.search(rest)
    command = (rest[: end.start()] if end else rest).strip()
    tail = rest[end.start() :].strip().removeprefix(";").strip() if end else ""
    if tail.startswith("(") and _closing(tail) == len(tail) - 1:
        tail = tail[1:-1]
    elif tail.startswith("("):
        close = _closing(tail)
        tail = tail[1:close] + tail[close + 1 :] if close > 0 else tail
    note = ". ".join(part.rstrip(":") for part in (preface, tail) if part)
    return command, note or None


def fix_alternatives(fix: str) -> list[str]:
    """A fix line's ways out, split at each top-level "; or " (never inside parentheses), "or" dropped."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(fix):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and fix.startswith("; or ", i):
            parts.append(fix[start:i])
            start = i + len("; or ")
    parts.append(fix[start:])
    return [p.strip() for p in parts if p.strip()]


def _closing(text: str) -> int:
    """The index of the parenthesis that closes ``text[0]``, or -1."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return -1
