"""The public ``check()`` and ``require()``: the import-time assertion for jobs, one line at the top of a script.

    import kernelguard
    kernelguard.require(model="qwen3_5", mode="training")

fails the job in its first seconds with the same decision trace ``kernelguard check`` prints, instead of
after hours on a slow fallback path.

Environment variables (for launchers such as torchrun/accelerate, where editing the script per cluster is
awkward): ``KERNELGUARD_ALLOW`` (comma-separated allow items, added to ``allow=``) and ``KERNELGUARD_ARCH``
(comma-separated compute capabilities, used when ``arch=`` is not given). Both are validated like their
arguments: a typo is a ``ConfigError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .check import CheckOptions, CheckResult, run_check
from .errors import ResolutionError
from .policy import AllowPolicy

__all__ = ["check", "require", "resolution_error"]


def check(
    model: str = "qwen3_5",
    *,
    mode: str = "training",
    arch: str | float | Iterable[str] | None = None,
    allow: Iterable[str] = (),
    packed: bool | None = None,
    hub: bool = False,
) -> CheckResult:
    """Resolve providers for ``model`` without raising on a failed requirement (see ``CheckResult.ok``)."""
    return run_check(
        CheckOptions(model=model, mode=mode, archs=_archs(arch), allow=_allow(allow), packed=packed, hub=hub)
    )


def _archs(arch: object) -> tuple[object, ...]:
    from .capability import ComputeCapability, parse_all

    if arch is None and os.environ.get("KERNELGUARD_ARCH", "").strip():
        items = [a for a in os.environ["KERNELGUARD_ARCH"].split(",") if a.strip()]
        return parse_all(items, source="KERNELGUARD_ARCH")
    # One capability or several; parse_all raises a ConfigError naming arch= for anything else.
    if arch is not None and not isinstance(arch, (str, int, float, ComputeCapability, list, tuple)):
        arch = list(arch) if isinstance(arch, Iterable) else arch
    return parse_all(arch if arch is not None else [], source="arch=")


def _allow(allow: object) -> AllowPolicy:
    policy = AllowPolicy.parse(allow, source="allow=")  # type: ignore[arg-type]
    from_env = os.environ.get("KERNELGUARD_ALLOW", "")
    if from_env.strip():
        policy = policy.merge(AllowPolicy.parse(from_env.split(","), source="KERNELGUARD_ALLOW"))
    return policy


def require(
    model: str = "qwen3_5",
    *,
    mode: str = "training",
    arch: str | float | Iterable[str] | None = None,
    allow: Iterable[str] = (),
    packed: bool | None = None,
    hub: bool = False,
) -> CheckResult:
    """Raise ``ResolutionError`` (with the full ``kernelguard check`` trace) unless every kernel is served."""
    result = check(model, mode=mode, arch=arch, allow=allow, packed=packed, hub=hub)
    if not result.ok:
        raise resolution_error(result)
    return result


def resolution_error(result: CheckResult) -> ResolutionError:
    """The error ``require()`` raises for a failed ``result``: its verdict line, the failing kernels, the trace."""
    from .report import render, verdict_line

    model, mode = result.options.model, result.options.mode
    failing = [v.kernel for v in result.resolution.verdicts if not v.ok]
    return ResolutionError(
        f"kernelguard.require({model!r}, mode={mode!r}): {verdict_line(result).removeprefix('verdict: ')}",
        fix="see the fix line under each rejected provider below, or accept a fallback with allow=[...]",
        details={"failing": failing},
        report=render(result),
    )
