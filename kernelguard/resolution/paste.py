"""A shell command printed for a person to paste: how to tell a line is one, and how to break it to fit a
terminal so that it still runs as one command."""

from __future__ import annotations

import re

__all__ = ["command_lines", "is_command", "with_value_replaced"]

# A line that is a command to paste; not a log line that names its program ("kernelguard train: ...").
_COMMAND = re.compile(r"^\s*(?:kernelguard|torchrun|pip|uv|conda|python3?|apt-get|export)\s(?!\S*:\s)")


def command_lines(command: str, width: int, indent: int = 4) -> list[str]:
    """``command`` as lines that still paste as one command: broken between arguments with `` \\``, the
    continuations indented; a quoted argument and a trailing ``# comment`` stay whole (a comment broken by
    ``\\`` would end at the line break and run its tail), and an argument wider than ``width`` stands alone."""
    words, word, quote = [], "", ""
    for i, ch in enumerate(command):
        if not quote and ch == "#" and (not word) and command[i - 1:i] in ("", " "):
            word = command[i:]  # the comment: one word to the end
            break
        if ch in "'\"" and (not quote or quote == ch):
            quote = "" if quote else ch
        if ch == " " and not quote:
            if word:
                words.append(word)
            word = ""
        else:
            word += ch
    if word:
        words.append(word)
    lines, line = [], ""
    for word in words:
        if line.strip() and len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = " " * indent + word
        else:
            line = f"{line} {word}" if line.strip() else line + word
    return [*lines, line]


def is_command(line: str) -> bool:
    """``line`` starts with a program a printed fix or resume line runs."""
    return _COMMAND.match(line) is not None


def with_value_replaced(argv: list[str], old: str, new: str, flag: str | None) -> list[str] | None:
    """``argv`` with the value ``old`` (alone, or as ``FLAG=old``) replaced by ``new``, for a fix that prints the
    corrected command; None when ``argv`` does not hold ``old``."""
    if not any(a in (old, f"{flag}={old}") for a in argv):
        return None
    return [new if a == old else (f"{flag}={new}" if a == f"{flag}={old}" else a) for a in argv]
