"""Human text and JSON from a check result, and the guard's per-layer table. Formatting only: no decisions are
made here.

JSON schema (``schema_version`` 2; additive changes keep the version, renames/removals bump it):
{
  "schema_version": 2,
  "ok": bool,                      # same as exit code 0
  "model": {"name", "family", "origin", "mode", "packed", "key_head_dim", "key_head_dim_source"},
  "transformers": str,
  "target": {"archs": [str], "source": str},
  "allow": [str],
  "kernels": [{"kernel", "ok", "selected": str|null,
               "candidates": [{"provider", "kind", "status", "reason", "fix": str|null, "fix_note": str|null,
                               "known_issues": [str]}]}],
  "notes": [str], "unchecked": [str],
  "load_error": null | {"provider", "kind", "status", "reason", "fix", "fix_note", "known_issues"},
                                   # import transformers fails, or (5.25+) from_pretrained raises (version 2)
  "numerics": null | {... numerics.NumericsReport.to_dict()},
  "fla_backend": {arch or "": {"arch", "forward", "backward", "label", "reasons": [str], "source"}},
  "environment": {... env.Environment.to_dict(): every fact with its source}
}
``status`` is one of selected / accepted / rejected / skipped / fallback. ``fix`` is one shell command to paste
(or null); ``fix_note`` the prose about it: its caveats and the other ways out (version 1 had both in ``fix``).
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import TYPE_CHECKING, Any

from kernelguard.resolution import (
    ACCEPTED,
    ALLOWED,
    CLI,
    FALLBACK,
    PACKED_ROWS,
    REJECTED,
    SELECTED,
    SKIPPED,
    Decision,
    command_lines,
    fix_alternatives,
    in_terms,
    is_command,
    split_fix,
)

if TYPE_CHECKING:  # report formats what check produced; it must not depend on check at run time
    from .compose import CheckResult

__all__ = [
    "SCHEMA_VERSION",
    "fill",
    "fit_line",
    "fit_lines",
    "fit_usage",
    "fix_lines",
    "fix_text",
    "help_formatter",
    "layer_summary",
    "read_by_a_person",
    "render",
    "render_call_sites",
    "short_provider",
    "terminal_width",
    "to_dict",
    "to_json",
    "verdict_line",
    "why_fix_block",
    "wrap_message",
    "wrap_text",
]

SCHEMA_VERSION = 2

_MARKS = {SELECTED: "[x] selected", ACCEPTED: "[ ] accepted", REJECTED: "[-] rejected", SKIPPED: "[ ] skipped ",
          FALLBACK: "[!] fallback", ALLOWED: "[~] allowed "}


def to_json(result: CheckResult) -> str:
    return json.dumps(to_dict(result), indent=2, sort_keys=False)


def to_dict(result: CheckResult) -> dict[str, Any]:
    res = result.resolution
    req = res.requirements
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": result.ok,
        "model": {
            "name": result.options.model,
            "family": req.family.name,
            "origin": result.model_origin,
            "mode": req.mode,
            "packed": req.packed,
            "key_head_dim": req.key_head_dim,
            "key_head_dim_source": req.key_head_dim_source,
        },
        "transformers": req.transformers_version,
        "target": {"archs": [str(a) for a in res.target.archs], "source": res.target.arch_source},
        "allow": res.target.allow.values(),
        "kernels": [
            {
                "kernel": v.kernel,
                "ok": v.ok,
                "selected": v.selected.provider if v.selected else None,
                "candidates": [d.to_dict() for d in v.candidates],
            }
            for v in res.verdicts
        ],
        "notes": list(res.notes),
        "unchecked": list(res.unchecked),
        "load_error": res.load_error.to_dict() if res.load_error is not None else None,
        "numerics": result.numerics.to_dict() if result.numerics is not None else None,
        "fla_backend": {arch: b.to_dict() for arch, b in fla_backends(result).items()},
        "environment": result.env.to_dict(),
    }


def fla_backends(result: CheckResult) -> dict[str, Any]:
    """fla's GDN backend per target arch, as the check found it ({} when fla does not serve)."""
    return dict(result.facts.fla_backends) if result.facts is not None else {}


def fla_backend_lines(result: CheckResult) -> list[str]:
    return [
        f"fla backend for the GDN op{f' on sm {arch}' if arch else ''}: {b.label} ({b.source})"
        for arch, b in fla_backends(result).items()
    ]


def wrap_text(text: str, indent: int, width: int, *, hanging: int = 0) -> str:
    # Never split "--no-cache-dir" or a URL at a hyphen; commands themselves are never wrapped (fix_lines).
    return textwrap.fill(text, width=width, initial_indent=" " * indent, subsequent_indent=" " * (indent + hanging),
                         break_on_hyphens=False, break_long_words=False)


def fix_lines(fix: str, *, width: int, indent: int = 0, label: str = "fix:") -> list[str]:
    """A fix as printed lines: each way out's shell command on lines of its own, broken only between arguments
    with `` \\`` (:func:`kernelguard.resolution.paste.command_lines`), so it pastes as one command; the prose about it (caveats, what it assumes) on the lines under it, wrapped to ``width``."""
    lines: list[str] = []
    for i, part in enumerate(fix_alternatives(fix)):
        head = label if i == 0 else "or:"
        command, note = split_fix(part)
        hanging = len(head) + 1
        if command is None:
            lines.append(wrap_text(f"{head} {note}", indent, width, hanging=hanging))
            continue
        lead = f"{' ' * indent}{head} "
        parts = command_lines(command, width - len(lead))  # wider than the terminal: ` \` between arguments
        lines.extend([lead + parts[0], *(" " * len(lead) + part for part in parts[1:])])
        if note:
            lines.append(wrap_text(note, indent + hanging, width))
    return lines


def _env_line(result: CheckResult) -> str:
    env = result.env
    torch = env.torch_version.value or "not installed"
    if env.torch_error and env.torch_version.value:
        torch += " (import fails)"
    cuda = env.cuda_version.value or ("ROCm " + env.hip_version.value if env.hip_version.value else "no CUDA")
    abi = {True: "cxx11 ABI", False: "pre-cxx11 ABI"}.get(env.cxx11_abi.value, "ABI unknown")
    gpus = ", ".join(f"{g.name} (sm {g.capability})" for g in env.gpus) or "no GPU visible"
    return (
        f"torch {torch} ({cuda}, {abi}) | Triton {env.triton_version or 'not installed'} | "
        f"kernels {env.version_of('kernels') or 'not installed'} | Python {env.python.value} | {gpus}"
    )


def render(result: CheckResult, *, syntax: str = CLI, width: int | None = None) -> str:
    """``kernelguard check``'s text; ``syntax`` spells its hints for another caller (``"python"``: ``require()``).
    Every line fits ``width`` (:func:`terminal_width`) except a command, which is never broken."""
    columns = terminal_width(width)
    res = result.resolution
    req = res.requirements
    packed = ", packed sequences" if req.packed else ""
    lines = [
        (
            f"kernelguard check: {req.family.name} ({result.model_origin}), {req.mode}{packed}, "
            f"transformers {req.transformers_version}"
        ),
        (
            f"target: {', '.join(f'sm {a}' for a in res.target.archs) or 'GPU arch unknown'} "
            f"({in_terms(res.target.arch_source, syntax)})"
        ),
        _env_line(result),
        *fla_backend_lines(result),
    ]
    lines = [wrap_text(line, 0, columns, hanging=2) for line in lines] + [""]
    if res.load_error is not None:  # before any kernel: the load raises first
        load = res.load_error
        lines.append(wrap_text(f"{load.kernel:<34} FAIL  {load.provider} raises", 0, columns, hanging=35))
        lines.append(wrap_text(in_terms(load.reason, syntax), 18, columns))
        if load.fix:
            lines.extend(fix_lines(in_terms(load.fix, syntax), width=columns, indent=18))
        lines.append("")
    for verdict in res.verdicts:
        selected = verdict.selected
        if verdict.ok and selected is not None and selected.kind != "reference":
            head = f"OK    served by {selected.provider}"
        elif verdict.ok:
            head = "OK    torch reference, explicitly allowed"
        else:
            head = ("FAIL  packed examples would run into each other: wrong results" if verdict.kernel == PACKED_ROWS
                    else "FAIL  no fast provider: the torch reference path would run")
        lines.append(wrap_text(f"{verdict.kernel:<34} {head}", 0, columns, hanging=35))
        for decision in verdict.candidates:
            lines.append(wrap_text(f"{_MARKS[decision.status]}  {decision.provider}", 2, columns, hanging=14))
            lines.append(wrap_text(in_terms(decision.reason, syntax), 18, columns))
            if decision.fix and decision.status in (REJECTED, FALLBACK):
                lines.extend(fix_lines(in_terms(decision.fix, syntax), width=columns, indent=18))
        lines.append("")
    if result.numerics is not None:
        lines.append(result.numerics.render())
        lines.append("")
    for title, items in (("notes", res.notes), ("not checked here", res.unchecked)):
        if items:
            lines.append(f"{title}:")
            lines.extend(wrap_text(f"- {in_terms(item, syntax)}", 2, columns, hanging=2) for item in items)
            lines.append("")
    lines.append(wrap_text(verdict_line(result, syntax=syntax), 0, columns, hanging=2))
    return "\n".join(lines)


def verdict_line(result: CheckResult, *, syntax: str = CLI) -> str:
    """The last line of the report; the exit code it names is the CLI's only."""
    return in_terms(_verdict(result), syntax)


def _verdict(result: CheckResult) -> str:
    res = result.resolution
    failing = [v.kernel for v in res.verdicts if not v.ok]
    if res.load_error is not None:
        also = f"; then {len(failing)} of {len(res.verdicts)} required kernels fail too" if failing else ""
        return f"verdict: FAIL - the model load raises before any kernel runs (see model load above){also} (exit 1)"
    allowed = [v.kernel for v in res.verdicts if v.ok and v.selected is not None and v.selected.kind == "reference"]
    if failing:
        return (
            f"verdict: FAIL - {len(failing)} of {len(res.verdicts)} required kernels would run a slow fallback"
            f"{' or mix packed examples' if PACKED_ROWS in failing else ''}: "
            f"{', '.join(failing)} (exit 1)"
        )
    if result.numerics is not None and not result.numerics.ok:
        return "verdict: FAIL - a fast kernel disagrees with the torch reference (see numerics above) (exit 1)"
    tail = f"; allowed fallbacks: {', '.join(allowed)}" if allowed else ""
    unchecked = f"; {len(res.unchecked)} item(s) not checked here (see above)" if res.unchecked else ""
    return f"verdict: OK - all {len(res.verdicts)} required kernels are served{tail}{unchecked} (exit 0)"


def terminal_width(width: int | None = None) -> int:
    """Columns to fit: ``width``, else the terminal's (``COLUMNS`` first), 100 when not a terminal."""
    import shutil

    columns = width if width is not None else shutil.get_terminal_size((100, 24)).columns
    return max(60, min(int(columns), 200))


def fit_usage(usage: str, width: int) -> str:
    """argparse's usage block refilled when a line overflows: it aligns continuation lines under the program
    name and cannot move a long ``[--flag {a,b,c}]`` group, so narrow terminals overflow. Groups stay whole."""
    if all(len(line) <= width for line in usage.splitlines()):
        return usage
    groups = re.findall(r"\[(?:[^\[\]]|\[[^\]]*\])*\]|\S+", " ".join(usage.split()))
    lines, line = [], ""
    for group in groups:
        if line and len(line) + 1 + len(group) > width:
            lines.append(line)
            line = "    " + group
        else:
            line = f"{line} {group}" if line else group
    return "\n".join([*lines, line]) + "\n\n"


def fit_lines(text: str, width: int) -> str:
    """Lines argparse could not fit (an option with many names) wrapped at word boundaries, indented."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out.append(textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


def help_formatter(base: type[Any] | None = None) -> Any:
    """An argparse ``formatter_class`` that fits :func:`terminal_width` (argparse alone ignores a width it is not
    given once a subclass fixes one), usage block included."""
    import argparse

    cls = base or argparse.HelpFormatter

    class Fitted(cls):  # type: ignore[misc, valid-type]
        def _format_usage(self, *args: Any) -> str:
            return fit_usage(super()._format_usage(*args), self._width)

        def format_help(self) -> str:
            return fit_lines(super().format_help(), self._width)

    return lambda prog: Fitted(prog, width=terminal_width())


def fix_text(fixes: list[str], *, width: int | None = None) -> str:
    """An error's ``fix`` (printed after "Fix: ") from several fixes: each command alone on its line, never
    wrapped; its note under it, wrapped; a prose way out (an allow=) wrapped on its own."""
    columns = terminal_width(width)
    lines: list[str] = []
    for fix in fixes:
        for j, part in enumerate(fix_alternatives(fix)):
            command, note = split_fix(part)
            lead = ("  " if lines else "") + ("or: " if j else "")
            if command is None:
                lines.append(fill(f"{lead}{note}", columns, 4))
                continue
            lines.append(f"{lead}{command}")  # whole: this is the error's fix attribute, read by programs too
            if note:
                lines.append(wrap_text(note, 7, columns))
    return "\n".join(lines)


def wrap_message(text: str, *, width: int | None = None) -> str:
    """An error or refusal for the terminal: prose wrapped to ``width``; a ``Fix:`` line's command alone on its
    line (never wrapped), its prose under it. Without ``width``, only for a person: when stderr is a terminal or
    ``COLUMNS`` is set; in a log (a pipe, a file, a scheduler's capture) each sentence stays on one line, whole
    for grep and log tools."""
    if width is None and not read_by_a_person():
        return text
    columns = terminal_width(width)
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("Fix: "):
            lines.extend(fix_lines(line[len("Fix: "):], width=columns, label="Fix:"))
        else:
            lines.extend(_prose_then_command(line, columns))
    return "\n".join(lines)


def _prose_then_command(line: str, width: int) -> list[str]:
    """A line that ends in a shell command after a colon (``...; restore: pip install ...``): the prose wrapped,
    the command on lines of its own broken with `` \\`` so it pastes; any other line wrapped as prose."""
    command, _ = split_fix(line.strip())
    if len(line) <= width or command is None or not line.rstrip().endswith(command):
        return [fill(line, width, 2)]
    lead = len(line) - len(line.lstrip()) + 4
    prose = line[: line.rindex(command)].rstrip()
    return [fill(prose, width, 2), *(" " * lead + part for part in command_lines(command, width - lead, 4))]


def read_by_a_person() -> bool:
    """stderr is a terminal, or ``COLUMNS`` says how wide one is: fit lines to it (else a log keeps them whole)."""
    import os
    import sys

    return "COLUMNS" in os.environ or (sys.stderr is not None and sys.stderr.isatty())


def layer_summary(layers: list[str], *, shown: int = 6) -> str:
    """``layers`` named in full when few, else counted with the first and last (a 48-layer model has 36)."""
    if len(layers) <= shown:
        return ", ".join(layers)
    return f"{len(layers)} layers ({layers[0]}, {layers[1]} ... {layers[-1]})"


def short_provider(decision: Decision) -> str:
    """The provider as a person names it: ``fla 0.6.0``, ``torch reference``, ``sdpa``, a Hub repo."""
    if decision.kernel == "attention" or decision.kind == "hub":
        return decision.provider
    if decision.kind == "reference":
        return "torch reference"
    name, _, version = decision.provider.partition(" ")
    return f"{name.split('.')[0]} {version}".strip()


def render_call_sites(
    header: str, rows: list[tuple[Decision, str]], *, notes: list[str] | None = None, verbose: bool = False,
    width: int | None = None, why: list[str] | None = None, fixes: list[str] | None = None,
) -> str:
    """The guard's report: one line per kernel (status, provider, layer count; the reason under each slow one),
    or with ``verbose`` one row per call site (a Decision with ``layer`` set). ``why`` / ``fixes``: a refusal's
    closing block. Every line but the verbose table's fits ``width`` (see :func:`terminal_width`)."""
    columns = terminal_width(width)
    lines = [header]
    lines.extend(_table(rows) if verbose else _grouped(rows, columns))
    lines.extend(fill(f"note: {note}", columns, 6) for note in notes or ())
    if why or fixes:
        lines.extend(why_fix_block(why or [], fixes or [], width=columns))
    return "\n".join(lines)


def why_fix_block(why: list[str], fixes: list[str], *, width: int | None = None) -> list[str]:
    """The short block a refusal ends with: one ``why:`` line per reason, one ``fix:`` line per fix (an install
    command may end in a shell comment, so never two on one line)."""
    columns = terminal_width(width)
    return [fill(f"why: {text}", columns, 7) for text in why] + [
        line for text in fixes for line in fix_lines(text, width=columns)]


# A shell command wrapped onto two lines runs as two commands (and a wrapped `# comment` runs its tail).
_COMMAND = re.compile(r"^\s*(?:(?:why|fix):\s+)?(?:pip|uv|conda|python|apt-get|export)\b|\s#\s")


def fill(text: str, width: int, indent: int) -> str:
    """``text`` wrapped to ``width``, continuation lines indented; commands stay whole (no break at a hyphen,
    and a line that is a shell command is never wrapped)."""
    if len(text) <= width or _COMMAND.search(text):
        return text
    return textwrap.fill(text, width=width, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=False)


def fit_line(line: str, width: int, indent: int = 2) -> list[str]:
    """One line of a log for the terminal: a command broken with continuations (:func:`command_lines`),
    prose wrapped (:func:`fill`)."""
    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip())
    if is_command(line):
        return [" " * lead + part for part in command_lines(line.lstrip(), width - lead, 4)]
    return fill(line, width, lead + indent).split("\n")


# Under each accepted slow line, why it is slow; a refused (FALLBACK) line is explained by the why / fix block.
_SLOW_LABELS_WITH_REASON = ("ALLOWED-SLOW", "slow (warn)", "slow (ignore)")


def _grouped(rows: list[tuple[Decision, str]], width: int) -> list[str]:
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for decision, label in rows:
        groups.setdefault((decision.kernel, label, short_provider(decision), decision.reason), []).append(
            decision.layer or "")
    kernel_w = min(max((len(k[0]) for k in groups), default=6), 34)
    label_w = max((len(k[1]) for k in groups), default=6)
    lines = []
    for (kernel, label, provider, reason), layers in groups.items():
        count = len(dict.fromkeys(layers))
        tail = f"  {count:>3} {'layers' if count != 1 else 'layer'}"
        room = max(width - 2 - label_w - 2 - kernel_w - 2 - len(tail), 12)
        shown = provider if len(provider) <= room else provider[: room - 3] + "..."
        lines.append(f"  {label:<{label_w}}  {kernel:<{kernel_w}}  {shown:<{min(room, 40)}}{tail}".rstrip())
        if label in _SLOW_LABELS_WITH_REASON:
            lines.append(fill(" " * 6 + reason, width, 6))
    return lines


def _table(rows: list[tuple[Decision, str]]) -> list[str]:
    table = [("layer", "kernel", "status", "provider", "implementation", "reason / fix")]
    for decision, label in rows:
        note = decision.reason
        if label != "fast" and decision.fix:
            note += f" | fix: {decision.fix}"
        table.append((decision.layer or "", decision.kernel, label, decision.kind, decision.provider, note))
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in table]
