"""The exit codes every command and `kernelguard train` end with (``errors.EXIT_CODES`` maps errors to them)."""

from __future__ import annotations

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAIL",
    "EXIT_GUARD",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
]

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_GUARD = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143
