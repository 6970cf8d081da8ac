"""One vocabulary, spelled in each caller's syntax: how a fix or hint reads on the CLI, in Python, under pytest.

Every entry point names the same things (allow items, the target arch, packed or padded batches); only the
syntax differs. A user of ``kernelguard.require()`` must read ``allow=['attention']`` and ``packed=False``, never
``--allow attention`` or ``--no-packed``, and never an exit code. So:

- :func:`allow_hint` spells "accept these allow items" for a syntax (``cli``: ``--allow X``; ``python``:
  ``allow=['X']``; ``pytest``: ``@pytest.mark.kernelguard(allow=['X'])``; ``pytest-option``:
  ``--kernelguard-allow X``; ``pytest-ini``: ``kernelguard_allow = X``);
- :func:`option_hint` spells one option (``arch``, ``packed``, ``hub``, ``model``);
- :func:`in_terms` rewrites a sentence written in CLI terms (the resolver's reasons and fixes are written for
  ``kernelguard check``, its first audience) into another syntax. Text between backticks is a literal command
  (``kernelguard check --run ...``) and stays as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["CLI", "PYTEST", "PYTHON", "SYNTAXES", "allow_hint", "in_terms", "nearest", "nearest_slip", "option_hint",
           "usage_suggestion"]

CLI = "cli"
PYTHON = "python"
PYTEST = "pytest"
SYNTAXES = (CLI, PYTHON, PYTEST, "pytest-option", "pytest-ini")


def _check(syntax: str) -> None:
    if syntax not in SYNTAXES:
        raise ValueError(f"syntax must be one of {SYNTAXES}, got {syntax!r}")


def allow_hint(items: Iterable[str], syntax: str) -> str:
    """``items`` accepted, in ``syntax``: the words a user of that entry point types."""
    _check(syntax)
    names = list(dict.fromkeys(items))
    if syntax == CLI:
        return " ".join(f"--allow {i}" for i in names)
    if syntax == "pytest-option":
        return " ".join(f"--kernelguard-allow {i}" for i in names)
    if syntax == "pytest-ini":
        return "\n".join(["kernelguard_allow ="] + [f"    {i}" for i in names])
    if syntax == PYTEST:
        return f"@pytest.mark.kernelguard(allow={names!r})"
    return f"allow={names!r}"


_OPTIONS_CLI: dict[tuple[str, object], str] = {("packed", False): "--no-packed", ("packed", True): "--packed", ("hub", True): "--hub"}


def option_hint(name: str, value: object, syntax: str) -> str:
    """One option in ``syntax``: ``option_hint("arch", "9.0", "cli")`` is ``--arch 9.0``, in Python ``arch='9.0'``."""
    _check(syntax)
    if syntax == CLI:
        flag = _OPTIONS_CLI.get((name, value))
        return flag if flag is not None else f"--{name} {value}"
    return f"{name}={value!r}"


# CLI spellings of the shared options, as the resolver writes them. Item: an allow item or ID (no dots, so a
# sentence's full stop is not taken for part of it).
_ITEM = r"[A-Za-z0-9_*](?:[\w*-]*[\w*])?"
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r" \(exit \d+\)"), ""),
    (re.compile(r"--no-packed\b"), "packed=False"),
    (re.compile(r"--packed\b"), "packed=True"),
    (re.compile(r"--no-hub\b"), "hub=False"),
    (re.compile(r"--hub\b"), "hub=True"),
    (re.compile(r"no --arch\b(?! given)"), "no arch= given"),
    (re.compile(r"--arch (\d+\.\d+a?)"), r"arch='\1'"),
    (re.compile(r"--arch\b"), "arch="),
    (re.compile(r"--model (\S+?)(?=[),;]|$| )"), r"model='\1'"),
)
_ALLOW = re.compile(rf"--allow(?: ({_ITEM}))?(?![\w-])")


def in_terms(text: str, syntax: str) -> str:
    """``text`` written in CLI terms, rewritten for ``syntax`` (identity for ``cli``)."""
    _check(syntax)
    if syntax == CLI or "-" not in text:
        return text
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside backticks
        parts[i] = _rewrite(parts[i], syntax)
    return "`".join(parts)


def _rewrite(text: str, syntax: str) -> str:
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    allow_syntax = "pytest-option" if syntax.startswith(PYTEST) else PYTHON

    def allow(match: re.Match[str]) -> str:
        item = match.group(1)
        if item is None:
            return "--kernelguard-allow" if allow_syntax == "pytest-option" else "allow="
        return allow_hint([item], allow_syntax)

    return _ALLOW.sub(allow, text)


def nearest(name: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """The valid names closest to a mistyped ``name`` (at most ``n``, best first); [] when none is close."""
    import difflib

    return difflib.get_close_matches(name, list(dict.fromkeys(valid)), n=n, cutoff=0.6)


def nearest_slip(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` is a slip of (see :func:`_is_slip`), or None: a suggestion that never turns one
    name into another (``llama`` is not a slip of ``zamba``, though difflib finds them close)."""
    return next((n for n in nearest(name, valid) if _is_slip(name, n)), None)


def _is_slip(typed: str, meant: str) -> bool:
    """A typo rather than another word: at most one edit per four letters (a letter left out, added, replaced, or
    two swapped), at least one allowed."""
    return _edits(typed, meant) <= max(1, len(meant) // 4)


def _edits(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent swaps."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (.*)$")
_INVALID_CHOICE = re.compile(r"^argument ([^:]+): invalid choice: '?([^']*?)'? \(choose from (.*)\)$")


def usage_suggestion(message: str, options: Iterable[str]) -> tuple[str, tuple[str, str] | None, str | None]:
    """argparse's refusal of a mistyped flag or choice with the nearest valid name ("did you mean"), which
    argparse before Python 3.12 never offers. Returns the message, the (typed, meant) pair to put in the
    command line when there is one nearest name, and the flag that pair belongs to."""
    if (choice := _INVALID_CHOICE.match(message)) is not None:
        flag, typed = choice.group(1).split("/")[0], choice.group(2)
        valid = [c.strip().strip("'") for c in choice.group(3).split(",")]
        close = nearest(typed, valid)
        if not close:
            return message, None, None
        said = f"{flag}: {typed!r} is not one of {', '.join(valid)}; did you mean {' or '.join(close)}?"
        return said, ((typed, close[0]) if len(close) == 1 else None), flag
    if (unknown := _UNRECOGNIZED.match(message)) is not None:
        flags = [a for a in unknown.group(1).split() if a.startswith("--")]
        if len(flags) != 1:
            return message, None, None
        typed, eq, value = flags[0].partition("=")
        flags_by_name = {o[2:]: o for o in options if o.startswith("--")}  # "--" would make every flag close
        # A flag's corrected command runs another job when the guess is wrong (--nope 3 -> --nnodes 3, a
        # 3-node launch): only a slip of a few letters is corrected.
        close = [flags_by_name[n] for n in nearest(typed[2:], flags_by_name) if _is_slip(typed[2:], n)]
        if not close:
            return message, None, None
        said = f"unrecognized argument {typed}; did you mean {' or '.join(close)}?"
        return said, ((flags[0], close[0] + eq + value) if len(close) == 1 else None), None
    return message, None, None
