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

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kernelguard.errors import GuardRefused, KernelFallbackError
from kernelguard.policy import AllowPolicy

if TYPE_CHECKING:
    import torch

    from kernelguard.check import CheckResult
    from kernelguard.guard import GuardReport

__all__ = [
    "accepted_issues",
    "check_stack",
    "guard_model",
    "lift_accepted_fla_refusal",
    "model_device",
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
) -> CheckResult | None:
    """The resolver's verdict for ``model_ref`` in training mode, or None off CUDA (no GPU arch to check
    against; the guard still judges every call site). ``env``: also read ``KERNELGUARD_ALLOW`` and
    ``KERNELGUARD_ARCH`` as ``kernelguard.require`` does. A passing verdict lifts fla's refusal for the rows it
    accepted; a failing one is returned for the caller to report."""
    if device.type != "cuda":
        return None
    given = allow if isinstance(allow, AllowPolicy) else tuple(allow)
    if env:
        from kernelguard.api import check

        items = given.values() if isinstance(given, AllowPolicy) else given
        result = check(model_ref, mode="training", allow=items, packed=packed)
    else:
        from kernelguard.check import CheckOptions, run_check

        result = run_check(CheckOptions(model=model_ref, mode="training", allow=given, packed=packed))
    if result.ok:
        lift_accepted_fla_refusal(accepted_issues(result))
    return result


def accepted_issues(result: CheckResult) -> set[str]:
    """The known-issue IDs the selected providers run with (each one allowed, or the verdict would fail)."""
    return {issue for v in result.resolution.verdicts if v.selected for issue in v.selected.issues}


def lift_accepted_fla_refusal(accepted: set[str]) -> list[str]:
    """Let fla run the backward that an accepted fla #640 row measured as correct (see kernelguard.fla_refusal)."""
    from kernelguard.fla_refusal import lift_for_accepted_issues

    return lift_for_accepted_issues(accepted)


def guard_model(
    model: Any, *, allow: AllowPolicy | Iterable[str], packed: bool, strict: bool = False
) -> GuardReport:
    """``kernelguard.guard`` in training mode. Not strict: the full per-layer table, armed, whatever it says
    (the caller judges ``ok``); strict: raises ``KernelFallbackError`` naming every offending site instead."""
    from kernelguard.guard import guard

    allowed = allow.values() if isinstance(allow, AllowPolicy) else allow
    return guard(model, mode="training", packed=packed, allow=allowed, strict=strict)


def run_gate(
    model: Any, *, policy: AllowPolicy, packed: bool = True, stack: CheckResult | None = None
) -> GuardReport:
    """Guard ``model`` (after :func:`check_stack` returned ``stack``); return the armed GuardReport.

    Raises :class:`GuardRefused` with one report covering every refusal: the stack check's trace when it
    failed, then the guard's per-layer table (disarmed) when the guard refused or the stack check did."""
    sections: list[str] = []
    if stack is not None and not stack.ok:
        from kernelguard.report import render

        sections.append(render(stack))
    try:
        report = guard_model(model, allow=policy, packed=packed)
    except KernelFallbackError as e:  # a guard that refuses even when not strict: its message is the report
        raise GuardRefused(str(e)) from e
    if report.ok and not sections:
        return report
    sections.append(report.render(syntax="cli"))  # `kernelguard train` prints it: fixes in its flags
    report.disarm()
    raise GuardRefused("\n\n".join(sections))
