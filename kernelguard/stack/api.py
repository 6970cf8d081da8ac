"""The public ``check()`` and ``require()``: the import-time assertion for jobs, one line at the top of a script.

    import kernelguard
    kernelguard.require(model="qwen3_5", mode="training")

fails the job in its first seconds with the same decision trace ``kernelguard check`` prints, instead of
after hours on a slow fallback path.

Environment variables (for launchers such as torchrun/accelerate, where editing the script per cluster is
awkward): ``KERNELGUARD_LOCK`` (the image's ``kernelguard.lock``, enforced as ``lock=``), ``KERNELGUARD_ALLOW`` (comma-separated allow items, added to ``allow=``) and ``KERNELGUARD_ARCH``
(comma-separated compute capabilities, used when ``arch=`` is not given). Both are validated like their
arguments: a typo is a ``ConfigError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kernelguard.errors import ConfigError, ResolutionError
from kernelguard.resolution import PYTHON, AllowPolicy

from .compose import CheckOptions, CheckResult, run_check

__all__ = ["check", "require", "resolution_error"]


def check(
    model: str = "qwen3_5",
    *,
    mode: str = "training",
    arch: str | float | Iterable[str] | None = None,
    allow: Iterable[str] = (),
    packed: bool | None = None,
    hub: bool | None = None,
) -> CheckResult:
    """Resolve providers for ``model`` without raising on a failed requirement (see ``CheckResult.ok``)."""
    try:
        return run_check(
            CheckOptions(model=model, mode=mode, archs=_archs(arch), allow=_allow(allow), packed=packed, hub=hub)
        )
    except ConfigError as e:  # the check speaks CLI flags; a Python caller reads keyword arguments
        raise _in_python_terms(e) from None


def _in_python_terms(error: ConfigError) -> ConfigError:
    from kernelguard.resolution import in_terms

    details = {k: v for k, v in error.details.items() if k != "flag"}  # a flag to replace means nothing here
    fix = in_terms(error.fix, PYTHON) if error.fix else None
    return type(error)(in_terms(error.message, PYTHON), fix=fix, details=details)


def _archs(arch: object) -> tuple[object, ...]:
    from kernelguard.resolution import ComputeCapability, parse_all

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
    model: str | None = None,
    *,
    mode: str | None = None,
    arch: str | float | Iterable[str] | None = None,
    allow: Iterable[str] = (),
    packed: bool | None = None,
    hub: bool | None = None,
    lock: str | os.PathLike[str] | None = None,
) -> CheckResult:
    """Raise ``ResolutionError`` (with the full ``kernelguard check`` trace) unless every kernel is served.

    Defaults: ``model="qwen3_5"``, ``mode="training"``, ``hub=False``. ``lock`` (or ``KERNELGUARD_LOCK``): the
    ``kernelguard.lock`` the image was built with; this node's stack must match it (``LockMismatch``, one line per
    difference), and the check is the lock's model, mode and target: an explicit ``model``, ``mode``, ``arch``,
    ``packed`` or ``hub`` that contradicts the lock is a ``ConfigError`` (repeating the lock's value is not)."""
    from .stack_lock import lock_option, lock_path, verify_lock

    if lock_path(lock) is not None:
        items = list(allow) + [a for a in os.environ.get("KERNELGUARD_ALLOW", "").split(",") if a.strip()]
        given = {"model": model, "mode": mode, "arch": arch, "packed": packed, "hub": hub}
        result = verify_lock(lock_path(lock), allow=items or None, syntax=PYTHON,  # type: ignore[arg-type]
                             option=lock_option(lock, "lock="), given=given)
        if not result.ok:
            raise resolution_error(result)
        return result
    # None means require()'s default (no Hub); any other value goes to check() as given, which refuses a
    # non-bool ("no" is truthy) exactly as check(hub="no") does.
    result = check(model or "qwen3_5", mode=mode or "training", arch=arch, allow=allow, packed=packed,
                   hub=False if hub is None else hub)
    if not result.ok:
        raise resolution_error(result)
    return result


def resolution_error(result: CheckResult, *, syntax: str = PYTHON) -> ResolutionError:
    """The error ``require()`` raises for a failed ``result``: its verdict line, the failing kernels, the fix in
    ``syntax`` (Python keywords by default: ``allow=[...]``, ``packed=False``), the trace in the same terms."""
    from .report import fill, render, terminal_width, verdict_line

    model, mode = result.options.model, result.options.mode
    packed = result.resolution.requirements.packed
    failing = [v.kernel for v in result.resolution.verdicts if not v.ok]
    call = f"kernelguard.require({model!r}, mode={mode!r}, packed={packed})"
    return ResolutionError(
        f"{call}: {verdict_line(result, syntax=syntax).removeprefix('verdict: ')}",
        fix="\n  ".join(fill(f, terminal_width() - 5, 4) for f in _load_fixes(result, syntax)
                         + (_fixes(failing, packed_training=packed and mode == "training", syntax=syntax)
                            if failing or result.resolution.load_error is None else [])),
        details={"failing": failing},
        report=render(result, syntax=syntax),
    )


def _load_fixes(result: CheckResult, syntax: str) -> list[str]:
    """transformers 5.25+ raises at the model load itself: its fix comes before any kernel's."""
    from kernelguard.resolution import in_terms

    load = result.resolution.load_error
    return [in_terms(f"the model load: {load.fix}", syntax)] if load is not None and load.fix else []


def _fixes(failing: list[str], *, packed_training: bool, syntax: str) -> list[str]:
    """Install first; then only the allow items that can help: in packed training a GDN torch reference cannot
    keep the examples apart, so no allow makes it acceptable, and padded batches are the other way out."""
    from kernelguard.resolution import ATTENTION, VARLEN_ATTENTION, allow_hint, option_hint

    fixes = ["install the provider named in the fix line under each rejected provider below"]
    if not failing:  # a served kernel whose numerics disagree: nothing to allow
        return ["see the numerics above: a fast kernel that computes wrong values must not be used"]
    allowable = [ATTENTION if k == VARLEN_ATTENTION else k for k in failing
                 if k == VARLEN_ATTENTION or not packed_training]
    packed_only = [k for k in failing if k != VARLEN_ATTENTION and packed_training]
    if allowable:
        fixes.append(f"or accept the slow path explicitly: {allow_hint(allowable, syntax)}")
    if packed_only:
        fixes.append(f"or check padded (unpacked) training with {option_hint('packed', False, syntax)}: "
                     f"{', '.join(packed_only)} cannot run packed rows on the torch reference, whatever is allowed")
    return fixes
