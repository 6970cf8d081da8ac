"""The gate a run passes before any data work: one function, one report, refusal = exit 3.

On CUDA it first resolves the environment (``kernelguard check`` for this model, training, packed) before the
model is built: only the resolver knows that a present fast provider is wrong on this GPU/Triton/head-dim
combination (known-issue rows such as fla #640), and its child-process import probe catches an extension that
would crash the interpreter. Then the guard inspects the built model's call sites once, reporting and arming
its tripwires. A failure of either raises :class:`GuardRefused` carrying the whole text to print (both parts
when both refuse).
"""

from __future__ import annotations

from typing import Any

import torch

from kernelguard.errors import KernelFallbackError
from kernelguard.policy import AllowPolicy


class GuardRefused(KernelFallbackError):
    """The gate found a slow path or known-bad stack that was not allowed; ``report`` is what to print."""

    def __init__(self, report: str, **fields: Any) -> None:
        self.report = report
        super().__init__(report, **fields)


def check_stack(*, model_ref: str, policy: AllowPolicy, device: torch.device) -> str | None:
    """The resolver's verdict for this stack (CUDA only), BEFORE the model is built: building it imports the
    provider packages in this process, and ``check`` probes extensions in a child first, so one that crashes
    the interpreter on import is refused here instead of killing the job. Returns the refusal text, or None
    (after lifting fla's refusal for accepted rows)."""
    if device.type != "cuda":
        return None  # no GPU arch to check against; the guard still judges every call site
    return _check_environment(model_ref, policy)


def run_gate(model: Any, *, policy: AllowPolicy, stack_refusal: str | None = None) -> Any:
    """Guard ``model`` for packed training; return the armed GuardReport.

    Raises :class:`GuardRefused` with one report covering every refused kernel, the stack check's included."""
    sections = [stack_refusal] if stack_refusal else []
    report = _guard(model, policy)
    if report is not None and report.ok and not sections:
        return report
    if report is not None:
        sections.append(report.render())
        report.disarm()
    raise GuardRefused("\n\n".join(sections))


def _check_environment(model_ref: str, policy: AllowPolicy) -> str | None:
    """The resolver's verdict text when it refuses; otherwise lift fla's refusal for accepted rows."""
    from kernelguard.check import CheckOptions, run_check
    from kernelguard.report import render

    result = run_check(CheckOptions(model=model_ref, mode="training", allow=policy, packed=True))
    if not result.ok:
        return render(result)
    accepted = {issue for v in result.resolution.verdicts if v.selected for issue in v.selected.issues}
    lift_accepted_fla_refusal(accepted)
    return None


def _guard(model: Any, policy: AllowPolicy) -> Any:
    """One non-strict guard pass: the full per-layer table either way (the caller judges ``ok``)."""
    from kernelguard.guard import guard

    try:
        return guard(model, mode="training", packed=True, allow=policy.values(), strict=False)
    except KernelFallbackError as e:  # a guard that refuses even when not strict: its message is the report
        raise GuardRefused(str(e)) from e


def lift_accepted_fla_refusal(accepted: set[str]) -> list[str]:
    """Let fla run the backward that an accepted fla #640 row measured as correct (see kernelguard.fla_refusal)."""
    from kernelguard.fla_refusal import lift_for_accepted_issues

    return lift_for_accepted_issues(accepted)
