"""The exit codes every command and `kernelguard train` end with (``errors.EXIT_CODES`` maps errors to them), what
each means to each command, in the words its ``--help`` prints, and the one line each start-up interruption
prints. Nothing is imported here: the console script reads these lines before its signal handlers exist."""

from __future__ import annotations

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAIL",
    "EXIT_GUARD",
    "EXIT_INTERRUPTED",
    "EXIT_MEANINGS",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "INTERRUPTED_LINES",
    "exit_codes_help",
]

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_GUARD = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143

_USAGE = "usage or configuration error"

# Command (as its --help names it) -> each code it can end with -> what that code means there.
EXIT_MEANINGS: dict[str, dict[int, str]] = {
    "kernelguard": {
        EXIT_OK: "every required kernel is served well",
        EXIT_FAIL: "a requirement fails",
        EXIT_USAGE: _USAGE,
        EXIT_GUARD: "kernelguard train refused to start (the guard found a slow fallback)",
    },
    "check": {EXIT_OK: "every required kernel is served", EXIT_FAIL: "a requirement fails", EXIT_USAGE: _USAGE},
    "lock": {EXIT_OK: "written", EXIT_FAIL: "the check fails (nothing written)", EXIT_USAGE: _USAGE},
    "train": {
        EXIT_OK: "ok",
        EXIT_USAGE: "usage, config or data error",
        EXIT_GUARD: "the guard refused (a slow fallback would run)",
        EXIT_DIVERGED: "training diverged: a NaN/inf loss (the last good checkpoint is kept)",
        EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
        EXIT_PREEMPTED: "stopped by SIGTERM after saving a checkpoint of the last finished step",
    },
}

# Command -> signal name -> the one line a command stopped by it while starting prints ("" any other command).
INTERRUPTED_LINES: dict[str, dict[str, str]] = {
    "train": {
        "SIGINT": "kernelguard train: interrupted before training started; nothing was written.",
        "SIGTERM": "kernelguard train: stopped by SIGTERM before training started; nothing was saved.",
    },
    "export": {"SIGINT": "kernelguard export: interrupted; nothing was written."},
    "": {"SIGINT": "kernelguard: interrupted."},
}


def exit_codes_help(command: str, *, capital: bool = False) -> str:
    """``exit codes: 0 ...; 1 ...`` for ``command``'s ``--help`` (EXIT_MEANINGS)."""
    words = "; ".join(f"{code} {meaning}" for code, meaning in EXIT_MEANINGS[command].items())
    return f"{'Exit' if capital else 'exit'} codes: {words}"
