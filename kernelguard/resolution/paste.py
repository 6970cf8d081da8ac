"""A shell command printed for a person to paste: how to tell a line is one, how to break it to fit a
terminal so that it still runs as one command, and the one home of the corrected command a refusal prints as its
fix (:func:`with_corrected_command`, for every kernelguard command)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["command_lines", "corrected_command", "is_command", "with_corrected_command", "with_value_replaced"]

E = TypeVar("E", bound=Exception)

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
    """``argv`` with the value ``old`` (alone, or as ``FLAG=old``; a path spelled another way, ``./x`` or
    ``~/x``, is the same path) replaced by ``new``; None when ``argv`` does not hold ``old``."""
    def same(arg: str) -> bool:
        return arg == old or (bool(arg) and not arg.startswith("-") and Path(arg).expanduser() == Path(old))

    if not any(same(a) or a == f"{flag}={old}" for a in argv):
        return None
    return [new if same(a) else (f"{flag}={new}" if a == f"{flag}={old}" else a) for a in argv]


def corrected_command(program: str, argv: list[str], details: Mapping[str, Any], *,
                      fix: str | None = None) -> str | None:
    """``kernelguard PROGRAM ARGV`` corrected as a refusal says, a line that pastes; None where it says nothing
    this line can show. From the refusal's ``details``: ``replace`` (old, new), with ``flag``: ``new`` in place
    of ``old`` (see :func:`with_value_replaced`); where ``new`` is on the line already (the name meant was given
    too) the typo goes, with its flag when that is left without a value. ``add`` (flag, values...): appended
    when that flag is not on the line (and a ``replace`` was made, if one was named). A ``fix`` that is one flag and its values (``--master-port 29500``):
    that flag set so on the line."""
    old, new = details.get("replace", (None, None))
    flag = details.get("flag")
    fixed: list[str] | None = None
    if old is not None and new in argv and old in argv:  # the name meant is there already: drop the typo
        at = argv.index(old)
        fixed = argv[:at] + argv[at + 1:]
        if at and argv[at - 1] == flag and (at + 1 == len(argv) or argv[at + 1].startswith("-")):
            fixed = argv[:at - 1] + argv[at + 1:]  # and its flag, now without a value
    elif old is not None and (replaced := with_value_replaced(argv, old, new, flag)) is not None:
        fixed = replaced
    elif (setting := _flag_setting(fix)) is not None:
        fixed = [*_without_flag(argv, setting[0]), *setting]
    add = details.get("add")
    if add and add[0] not in argv and (fixed is not None or old is None):  # not onto a line still wrong
        fixed = [*(fixed if fixed is not None else argv), *add]
    return None if fixed is None else f"kernelguard {program} {shlex.join(fixed)}"


def with_corrected_command(error: E, program: str, argv: list[str], *, details: Mapping[str, Any] | None = None,
                           flag_fix: bool = False) -> E:
    """``error`` with :func:`corrected_command` as its fix (``error`` itself when there is none): a kernelguard
    error (``message``, ``fix``, ``details``). ``details`` in place of the error's own; ``flag_fix``: read a fix
    that is one flag's value as a change to the line."""
    said = getattr(error, "details", None) or {}
    line = corrected_command(program, argv, said if details is None else details,
                             fix=getattr(error, "fix", None) if flag_fix else None)
    if line is None:
        return error
    return type(error)(error.message, fix=line, details=said)  # type: ignore[attr-defined,call-arg]


def _flag_setting(fix: str | None) -> list[str] | None:
    """``fix`` as one flag and its values (``--master-port 29500``), or None where it says anything more."""
    if not fix or not re.fullmatch(r"--[a-z][a-z0-9-]*( [^ ,;()]+)*", fix.strip()):
        return None
    words = shlex.split(fix)
    return words if all(not w.startswith("--") for w in words[1:]) else None


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` less every occurrence of ``flag`` with its values (up to the next option)."""
    out, skipping = [], False
    for arg in argv:
        if arg == flag or arg.startswith(flag + "="):
            skipping = arg == flag
            continue
        if skipping and not arg.startswith("-"):
            continue
        skipping = False
        out.append(arg)
    return out
