"""Human text and JSON from a check result, and the guard's per-layer table. Formatting only: no decisions are
made here.

JSON schema (``schema_version`` 1; additive changes keep the version, renames/removals bump it):
{
  "schema_version": 1,
  "ok": bool,                      # same as exit code 0
  "model": {"name", "family", "origin", "mode", "packed", "key_head_dim", "key_head_dim_source"},
  "transformers": str,
  "target": {"archs": [str], "source": str},
  "allow": [str],
  "kernels": [{"kernel", "ok", "selected": str|null,
               "candidates": [{"provider", "kind", "status", "reason", "fix", "known_issues": [str]}]}],
  "notes": [str], "unchecked": [str],
  "numerics": null | {... numerics.NumericsReport.to_dict()},
  "fla_backend": {arch or "": {"arch", "forward", "backward", "label", "reasons": [str], "source"}},
  "environment": {... env.Environment.to_dict(): every fact with its source}
}
``status`` is one of selected / accepted / rejected / skipped / fallback.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import TYPE_CHECKING, Any

from .decisions import ACCEPTED, ALLOWED, FALLBACK, REJECTED, SELECTED, SKIPPED, Decision
from .terms import CLI, in_terms

if TYPE_CHECKING:  # report formats what check produced; it must not depend on check at run time
    from .check import CheckResult

__all__ = [
    "SCHEMA_VERSION",
    "fill",
    "layer_summary",
    "render",
    "render_call_sites",
    "short_provider",
    "terminal_width",
    "to_dict",
    "to_json",
    "verdict_line",
    "why_fix_block",
]

SCHEMA_VERSION = 1

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


def _wrap(text: str, indent: int, width: int = 110) -> str:
    # Commands in fix lines must stay copyable: never split "--no-cache-dir" or a URL at a hyphen.
    return textwrap.fill(text, width=width, initial_indent=" " * indent, subsequent_indent=" " * indent,
                         break_on_hyphens=False, break_long_words=False)


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


def render(result: CheckResult, *, syntax: str = CLI) -> str:
    """``kernelguard check``'s text; ``syntax`` spells its hints for another caller (``"python"``: ``require()``)."""
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
        "",
    ]
    for verdict in res.verdicts:
        selected = verdict.selected
        if verdict.ok and selected is not None and selected.kind != "reference":
            head = f"OK    served by {selected.provider}"
        elif verdict.ok:
            head = "OK    torch reference, explicitly allowed"
        else:
            head = "FAIL  no fast provider: the torch reference path would run"
        lines.append(f"{verdict.kernel:<34} {head}")
        for decision in verdict.candidates:
            lines.append(f"  {_MARKS[decision.status]}  {decision.provider}")
            lines.append(_wrap(in_terms(decision.reason, syntax), 18))
            if decision.fix and decision.status in (REJECTED, FALLBACK):
                lines.append(_wrap(f"fix: {in_terms(decision.fix, syntax)}", 18))
        lines.append("")
    if result.numerics is not None:
        lines.append(result.numerics.render())
        lines.append("")
    for title, items in (("notes", res.notes), ("not checked here", res.unchecked)):
        if items:
            lines.append(f"{title}:")
            lines.extend(textwrap.fill(f"- {in_terms(item, syntax)}", width=110, initial_indent="  ",
                                       subsequent_indent="    ") for item in items)
            lines.append("")
    lines.append(verdict_line(result, syntax=syntax))
    return "\n".join(lines)


def verdict_line(result: CheckResult, *, syntax: str = CLI) -> str:
    """The last line of the report; the exit code it names is the CLI's only."""
    return in_terms(_verdict(result), syntax)


def _verdict(result: CheckResult) -> str:
    res = result.resolution
    failing = [v.kernel for v in res.verdicts if not v.ok]
    allowed = [v.kernel for v in res.verdicts if v.ok and v.selected is not None and v.selected.kind == "reference"]
    if failing:
        return (
            f"verdict: FAIL - {len(failing)} of {len(res.verdicts)} required kernels would run a slow fallback: "
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
    return [fill(f"{label} {text}", columns, 7) for label, items in (("why:", why), ("fix:", fixes))
            for text in items]


# A shell command wrapped onto two lines runs as two commands (and a wrapped `# comment` runs its tail).
_COMMAND = re.compile(r"^\s*(?:(?:why|fix):\s+)?(?:pip|uv|conda|python|apt-get|export)\b|\s#\s")


def fill(text: str, width: int, indent: int) -> str:
    """``text`` wrapped to ``width``, continuation lines indented; commands stay whole (no break at a hyphen,
    and a line that is a shell command is never wrapped)."""
    if len(text) <= width or _COMMAND.search(text):
        return text
    return textwrap.fill(text, width=width, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=False)


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
