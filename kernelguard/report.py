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
  "numerics": null | {... smoke.NumericsReport.to_dict()},
  "environment": {... env.Environment.to_dict(): every fact with its source}
}
``status`` is one of selected / accepted / rejected / skipped / fallback.
"""

from __future__ import annotations

import json
import textwrap
from typing import TYPE_CHECKING, Any

from .decisions import ACCEPTED, ALLOWED, FALLBACK, REJECTED, SELECTED, SKIPPED, Decision
from .terms import CLI, in_terms

if TYPE_CHECKING:  # report formats what check produced; it must not depend on check at run time
    from .check import CheckResult

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
        "environment": result.env.to_dict(),
    }


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
        f"target: {', '.join(f'sm {a}' for a in res.target.archs) or 'GPU arch unknown'} "
        f"({in_terms(res.target.arch_source, syntax)})",
        _env_line(result),
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


def render_call_sites(header: str, rows: list[tuple[Decision, str]], *, notes: list[str] | None = None) -> str:
    """The guard's per-layer table: one row per call site (a Decision with ``layer`` set) and its status label."""
    table = [("layer", "kernel", "status", "provider", "implementation", "reason / fix")]
    for decision, label in rows:
        note = decision.reason
        if label != "fast" and decision.fix:
            note += f" | fix: {decision.fix}"
        table.append((decision.layer, decision.kernel, label, decision.kind, decision.provider, note))
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    lines = [header]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in table)
    lines.extend(f"note: {note}" for note in notes or ())
    return "\n".join(lines)
