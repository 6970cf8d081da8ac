"""The training gate, the one used by ``kernelguard train`` and ``KernelGuardCallback`` alike: check, then guard.

1. :func:`check_stack`, BEFORE the model is built (CUDA only: it needs the GPU's arch): the resolver's verdict
   for this model, training, packed or not. Only the resolver knows that a present fast provider is wrong on this
   GPU/Triton/head-dim combination (known-issue rows such as fla #640), and its child-process import probe
   catches an extension that would crash the interpreter, which building the model would import in-process.
   A passing verdict lifts fla's own refusal for the rows it accepted, so the accepted path actually runs.
2. :func:`guard_model` on the built model: every call site's provider, tripwires armed on the reference paths.

How a refusal reaches the user is the caller's: :func:`run_gate` (``kernelguard train``) joins both parts into
one :class:`~kernelguard.errors.GuardRefused` that the trainer prints before exiting 3; the callback raises
the ``ResolutionError`` / ``KernelFallbackError`` out of ``trainer.train()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelguard.errors import GuardRefused, KernelFallbackError
from kernelguard.resolution import AllowPolicy

if TYPE_CHECKING:
    import torch

    from kernelguard.runtime.model_guard import GuardReport
    from kernelguard.stack import CheckResult

__all__ = [
    "accepted_issues",
    "allowed_line",
    "check_lock",
    "check_stack",
    "guard_model",
    "lift_accepted_fla_refusal",
    "model_device",
    "refusal_advice",
    "run_gate",
]


def model_device(model: Any) -> torch.device:
    """Where ``model`` lives: its first parameter's device (CPU for a model without parameters)."""
    import torch

    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def check_stack(
    model_ref: str,
    *,
    allow: AllowPolicy | Iterable[str],
    packed: bool,
    device: torch.device,
    env: bool = False,
    hub: bool | None = False,
) -> CheckResult | None:
    """The resolver's verdict for ``model_ref`` in training mode, or None off CUDA (no GPU arch to check
    against; the guard still judges every call site). ``env``: also read ``KERNELGUARD_ALLOW`` and
    ``KERNELGUARD_ARCH`` as ``kernelguard.require`` does. A passing verdict lifts fla's refusal for the rows it
    accepted; a failing one is returned for the caller to report. ``hub``: whether the model loads with Kernel Hub
    kernels (``kernelguard train`` never does: it loads with use_kernels=False; None: transformers' default)."""
    if device.type != "cuda":
        return None
    given = allow if isinstance(allow, AllowPolicy) else tuple(allow)
    if env:
        from kernelguard.stack import check

        items = given.values() if isinstance(given, AllowPolicy) else given
        result = check(model_ref, mode="training", allow=items, packed=packed, hub=hub)
    else:
        from kernelguard.stack import CheckOptions, run_check

        result = run_check(CheckOptions(model=model_ref, mode="training", allow=given, packed=packed, hub=hub))
    if result.ok:
        lift_accepted_fla_refusal(accepted_issues(result))
    return result


def check_lock(
    lock: str | Path | None, *, allow: AllowPolicy | Iterable[str] | None = None, syntax: str = "cli",
    option: str = "--lock",
) -> CheckResult | None:
    """Before the model is built, on any device: refuse a node whose stack differs from the lock
    (:class:`~kernelguard.errors.LockMismatch`, one line per difference). ``allow``: the run's items, which must be
    the lock's (None: the lock's own, for a caller that only checks).
    Returns the check (None without a lock); a failing verdict is the caller's to report, as for check_stack."""
    from kernelguard.stack import lock_option, lock_path, verify_lock

    path = lock_path(lock)
    if path is None:
        return None
    items = None if allow is None else (allow.values() if isinstance(allow, AllowPolicy) else list(allow))
    return verify_lock(path, allow=items, syntax=syntax, option=lock_option(lock, option))


def accepted_issues(result: CheckResult) -> set[str]:
    """The known-issue IDs the selected providers run with (each one allowed, or the verdict would fail)."""
    return {issue for v in result.resolution.verdicts if v.selected for issue in v.selected.issues}


def lift_accepted_fla_refusal(accepted: set[str]) -> list[str]:
    """Let fla run the backward that an accepted fla #640 row measured as correct (see kernelguard.resolution.fla_refusal)."""
    from kernelguard.resolution import lift_for_accepted_issues

    return lift_for_accepted_issues(accepted)


def guard_model(
    model: Any, *, allow: AllowPolicy | Iterable[str], packed: bool, strict: bool = False, first_row_probe: bool = True,
    log_allowed: bool = True,
) -> GuardReport:
    """``kernelguard.guard`` in training mode. Not strict: the full per-layer table, armed, whatever it says
    (the caller judges ``ok``); strict: raises ``KernelFallbackError`` naming every offending site instead."""
    from kernelguard.runtime.model_guard import guard

    allowed = allow.values() if isinstance(allow, AllowPolicy) else allow
    return guard(model, mode="training", packed=packed, allow=allowed, strict=strict, first_row_probe=first_row_probe,
                 log_allowed=log_allowed)


def run_gate(
    model: Any, *, policy: AllowPolicy, packed: bool = True, stack: CheckResult | None = None,
    first_row_probe: bool = True, command: Callable[[list[str]], str] | None = None,
) -> GuardReport:
    """Guard ``model`` (after :func:`check_stack` returned ``stack``); return the armed GuardReport.

    Raises :class:`GuardRefused` with one report covering every refusal: the stack check's trace when it
    failed, then the guard's per-layer table (disarmed) when the guard refused or the stack check did; its
    ``fix`` is :func:`refusal_advice`'s why / fix block (``command``: the run's own command line with the
    given arguments added, for a fix that pastes)."""
    sections: list[str] = []
    if stack is not None and not stack.ok:
        from kernelguard.stack import render

        sections.append(render(stack))
    try:
        # The trainer prints the table and says the allowed slow paths once (allowed_line), not per kernel.
        report = guard_model(model, allow=policy, packed=packed, first_row_probe=first_row_probe, log_allowed=False)
    except KernelFallbackError as e:  # a guard that refuses even when not strict: its message is the report
        raise GuardRefused(str(e)) from e
    if report.ok and not sections:
        return report
    # The table only: refusal_advice below is the trainer's why / fix block, in its flags.
    sections.append(report.render(syntax="cli", padded=UNPACKED_FLAG, why=False))
    report.disarm()
    advice = refusal_advice(report, stack, packed=packed, command=command)
    raise GuardRefused("\n\n".join(sections), fix=advice or None)


def allowed_line(report: GuardReport) -> str | None:
    """The one line that says which slow paths the run accepted (their reasons are the table's), or None."""
    kernels = list(dict.fromkeys(e.kernel for e in report.entries if e.allowed and not e.fast))
    if not kernels:
        return None
    return (f"allowed slow paths (--allow): {', '.join(kernels)} run their torch reference, correct but several "
            "times slower (the ALLOWED-SLOW rows above say why)")


# ------------------------------------------------------------------------------------------ why / fix ---
ADVICE_WIDTH = 100  # the why / fix block must read in a terminal, unlike the table above it
UNPACKED_FLAG = "--packing none"
_PACKED_WHY = ("packed: a torch reference of a recurrent kernel (GDN, KDA, Mamba scan, conv) cannot honour packed "
               "example boundaries (--allow cannot help)")


@dataclass(frozen=True, slots=True)
class _Refusal:
    """One refused kernel, from the stack check's verdict or the guard's call sites."""

    kernel: str
    layers: int  # call sites of the guard (0: the stack check's verdict)
    reason: str
    fixes: tuple[str, ...]
    issues: tuple[str, ...]  # known-issue IDs: an --allow of one accepts that provider as it is
    reference: bool  # the torch reference is what would run (nothing present to accept instead)
    provider: str = ""


def refusal_advice(
    report: GuardReport | None, stack: CheckResult | None, *, packed: bool,
    command: Callable[[list[str]], str] | None = None,
) -> str:
    """The short "why / fix" block that ends `kernelguard train`'s refusal, in its flags' terms: each
    refused kernel's real reason, then the commands that fix it, offering ``--allow`` only where an allow
    can make the run start; with ``command`` (the run's command line with arguments added) that offer is the
    whole command to paste. Every line fits ADVICE_WIDTH columns."""
    refusals = _stack_refusals(stack) + (_guard_refusals(report) if report is not None else [])
    by_kernel = {r.kernel: r for r in reversed(refusals)}  # the stack check's (more precise) reason wins
    ordered = [by_kernel[k] for k in dict.fromkeys(r.kernel for r in refusals)]
    if not ordered:
        return ""
    why, fix = ["why:"], ["fix:"]
    gdn = [r for r in ordered if r.kernel != "attention" and r.reference]
    if packed and gdn:  # the reason no flag of this run can get past: first
        why.append(_wrap(_PACKED_WHY, 2))
    for r in ordered:
        where = f" ({r.layers} layer{'s' * (r.layers != 1)})" if r.layers else ""
        why.append(_wrap(f"{r.kernel}{where}: {r.reason}", 2))
    for install in dict.fromkeys(c for r in ordered for c in r.fixes):
        fix.extend(_command_lines(install))
    fix.extend(_allow_lines(ordered, gdn, packed=packed) if command is None
               else _run_anyway_lines(ordered, gdn, packed=packed, command=command))
    return "\n".join(why + fix)


def _run_anyway_lines(
    ordered: list[_Refusal], gdn: list[_Refusal], *, packed: bool, command: Callable[[list[str]], str]
) -> list[str]:
    """The run's own command with what makes it start here on the slow paths: unpacked where a GDN torch
    reference would run (attention then needs no mask), every reference allowed; a kernel present but with a
    known issue keeps its own line (accepting it is a decision about that issue, not about speed)."""
    from kernelguard.resolution import command_lines

    names = [r.kernel for r in gdn]
    unpack = packed and bool(gdn)
    attention = next((r for r in ordered if r.kernel == "attention"), None)
    if attention is not None and not unpack:
        names.append("attention")
    lines = []
    if names:
        extra = [*(UNPACKED_FLAG.split() if unpack else []), "--allow", *names]
        lines.append("  or run here on the slow paths (correct, several times slower):")
        lines.extend("  " + line for line in command_lines(command(extra), ADVICE_WIDTH - 2))
    if attention is not None and not unpack:
        lines.append(_wrap("or, on a CUDA machine, keep attention fast: --attention varlen", 2))
    return lines + _accept_as_is_lines(ordered, packed=packed)


def _accept_as_is_lines(ordered: list[_Refusal], *, packed: bool) -> list[str]:
    """A kernel present but refused (a known issue, or unpacked where no reference runs): accepting it as it
    is, by name."""
    return [
        _wrap(f"or accept {r.kernel} as it is: --allow {' '.join(r.issues or (r.kernel,))}", 2)
        for r in ordered
        if r.kernel != "attention" and not r.reference and (r.issues or not packed)
    ]


def _allow_lines(ordered: list[_Refusal], gdn: list[_Refusal], *, packed: bool) -> list[str]:
    lines = []
    if gdn:
        names = " ".join(r.kernel for r in gdn)
        text = (
            f"or train unpacked with {UNPACKED_FLAG} and --allow {names}"
            if packed
            else f"or accept the slow torch references: --allow {names}"
        )
        lines.append(_wrap(text, 2))
    for r in ordered:
        if r.kernel == "attention":
            lines.append(
                _wrap(
                    f"attention: --attention varlen (torch's varlen attention, CUDA), or --allow attention "
                    f"to accept {r.provider or 'it'}",
                    2,
                )
            )
        else:
            lines.extend(_accept_as_is_lines([r], packed=packed))
    return lines


def _guard_refusals(report: GuardReport) -> list[_Refusal]:
    from kernelguard.resolution import REFERENCE

    grouped: dict[str, list[Any]] = {}
    for site in report.offending():
        grouped.setdefault(site.kernel, []).append(site)
    return [
        _Refusal(
            kernel,
            len(sites),
            _first_clause(sites[0].reason),
            # the attention site's fix is in Python terms; _allow_lines says it in the trainer's
            () if kernel == "attention" else tuple(dict.fromkeys(s.fix for s in sites if s.fix)),
            tuple(dict.fromkeys(i for s in sites for i in s.issues)),
            reference=sites[0].kind == REFERENCE,
            provider=sites[0].implementation,
        )
        for kernel, sites in grouped.items()
    ]


def _stack_refusals(stack: CheckResult | None) -> list[_Refusal]:
    from kernelguard.resolution import FALLBACK, REJECTED, VARLEN_ATTENTION

    if stack is None or stack.ok:
        return []
    out = []
    for verdict in stack.resolution.verdicts:
        if verdict.ok:
            continue
        refused = [d for d in verdict.candidates if d.status in (REJECTED, FALLBACK)]
        first = next((d for d in refused if d.status == REJECTED), refused[0] if refused else None)
        if first is None:
            continue
        issues = tuple(dict.fromkeys(i for d in refused for i in d.issues))
        fixes = tuple(dict.fromkeys(d.fix for d in refused if d.fix))
        reason = f"{first.provider}: {_first_clause(first.reason)}"
        # The check's varlen_attention row is what --allow calls attention.
        kernel = "attention" if verdict.kernel == VARLEN_ATTENTION else verdict.kernel
        reference = kernel != "attention" and not issues
        out.append(_Refusal(kernel, 0, reason, fixes, issues, reference=reference))
    return out


def _first_clause(reason: str) -> str:
    """The reason itself, without what the table adds after it (Hub status, the packed-mode note)."""
    return reason.split("; ")[0]


def _command_lines(command: str) -> list[str]:
    """A fix command as lines that each fit: one per ``&&`` step (each runs alone), then its note."""
    command, sep, note = command.partition("  (")
    lines = [_wrap(step.strip(), 2) for step in command.split(" && ")]
    if sep:
        lines.append(_wrap("(" + note, 4))
    return lines


def _wrap(text: str, indent: int) -> str:
    import textwrap

    # Commands must stay copyable: never split "--no-build-isolation" or a URL at a hyphen.
    return textwrap.fill(
        text,
        width=ADVICE_WIDTH,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent + 2),
        break_on_hyphens=False,
        break_long_words=False,
    )
