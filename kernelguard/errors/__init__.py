"""One exception hierarchy for everything kernelguard raises, and the one table of exit codes it maps to.

Every error is built from structured fields and stays picklable (``__reduce__`` rebuilds it from those
fields), so it survives pytest-xdist workers, torchrun children and multiprocessing pools intact.

Exit codes of ``kernelguard`` and ``kernelguard train`` (both read them from here):

=====================  ====  =============================================================================
``EXIT_OK``            0     every required kernel is served well; the run finished
``EXIT_FAIL``          1     a requirement fails (:class:`ResolutionError`, :class:`LockMismatch`, any other
                             ``KernelGuardError``)
``EXIT_USAGE``         2     usage or configuration error (:class:`ConfigError`, :class:`DataError`)
``EXIT_GUARD``         3     ``kernelguard train``: the gate refused to start (:class:`GuardRefused`)
``EXIT_DIVERGED``      4     ``kernelguard train``: a non-finite loss or gradient norm (:class:`TrainingDiverged`)
``EXIT_INTERRUPTED``   130   ``kernelguard train``: Ctrl-C (128 + SIGINT, as a shell reports it)
``EXIT_PREEMPTED``     143   ``kernelguard train``: SIGTERM; a checkpoint of the last finished step was saved
                             (128 + SIGTERM), so ``--resume`` continues exactly
=====================  ====  =============================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "EXIT_MEANINGS",
    "INTERRUPTED_LINES",
    "exit_codes_help",
    "children_start_with_interrupts_held",
    "end_startup_interrupts",
    "release_held_interrupts",
    "startup_interrupts",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EXIT_CODES",
    "EXIT_DIVERGED",
    "EXIT_FAIL",
    "EXIT_GUARD",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "GuardRefused",
    "KernelFallbackError",
    "KernelGuardError",
    "LockMismatch",
    "PackedWithoutBoundariesError",
    "Preempted",
    "ResolutionError",
    "TrainingDiverged",
    "UnsupportedTransformersError",
    "exit_code_for",
]

from .exit_codes import (
    EXIT_DIVERGED,
    EXIT_FAIL,
    EXIT_GUARD,
    EXIT_INTERRUPTED,
    EXIT_MEANINGS,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    INTERRUPTED_LINES,
    exit_codes_help,
)


class KernelGuardError(Exception):
    """Base class. ``message`` is a complete, human sentence; ``fix`` is the command or step that fixes it."""

    def __init__(self, message: str, *, fix: str | None = None, details: dict[str, Any] | None = None) -> None:
        self.message = message
        self.fix = fix
        self.details = dict(details or {})
        super().__init__(self._render())

    def _render(self) -> str:
        return self.message if not self.fix else f"{self.message}\nFix: {self.fix}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._state()))

    def _state(self) -> dict[str, Any]:
        return {"message": self.message, "fix": self.fix, "details": self.details}


def _rebuild(cls: type[KernelGuardError], state: dict[str, Any]) -> KernelGuardError:
    message = state.pop("message")
    return cls(message, **state)


class ConfigError(KernelGuardError):
    """Bad user input: an unknown model, a malformed config file, a bad flag value. CLI exit code 2."""


class ResolutionError(KernelGuardError):
    """A required kernel has no acceptable provider. Carries the whole decision trace in ``report``."""

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        details: dict[str, Any] | None = None,
        report: str = "",
    ) -> None:
        self.report = report
        super().__init__(message, fix=fix, details=details)

    def _render(self) -> str:
        base = super()._render()
        return f"{base}\n\n{self.report}" if self.report else base

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "report": self.report}


class LockMismatch(KernelGuardError):
    """This node's stack differs from a ``kernelguard.lock``: ``differences`` holds one line each (what the lock
    says, what is here, the command that restores it). Exit code 1 (``kernelguard check``), 3 (``kernelguard
    train``, as a refusal to start)."""

    def __init__(self, message: str, *, fix: str | None = None, details: dict[str, Any] | None = None,
                 differences: tuple[str, ...] = (), lock: str = "") -> None:
        self.differences = tuple(differences)
        self.lock = lock
        super().__init__(message, fix=fix, details=details)

    def _render(self) -> str:
        lines = [self.message, *(f"  - {d}" for d in self.differences)]
        return "\n".join(lines + ([f"Fix: {self.fix}"] if self.fix else []))

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "differences": self.differences, "lock": self.lock}


class UnsupportedTransformersError(KernelGuardError):
    """The installed transformers selects kernels in a way this kernelguard release does not understand."""


class KernelFallbackError(KernelGuardError):
    """A slow torch reference path was (or would be) entered.

    ``layer`` is the module path (``model.layers.3.linear_attn``), ``kernel`` the kernel name
    (``chunk_gated_delta_rule``), ``reason`` why the fast provider was not used.
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        details: dict[str, Any] | None = None,
        layer: str = "",
        kernel: str = "",
        reason: str = "",
    ) -> None:
        self.layer = layer
        self.kernel = kernel
        self.reason = reason
        super().__init__(message, fix=fix, details=details)

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "layer": self.layer, "kernel": self.kernel, "reason": self.reason}


class GuardRefused(KernelFallbackError):
    """``kernelguard train``'s gate refused to start: a slow path or known-bad stack that was not allowed.
    ``report`` is the whole text to print (the stack check's and the guard's parts); exit code 3."""

    def __init__(self, report: str, **fields: Any) -> None:
        self.report = report
        super().__init__(report, **fields)


class PackedWithoutBoundariesError(KernelGuardError):
    """A packed row (several examples, by its position ids or ``cu_seq_lens``) reached GDN layers whose kernels
    get no example boundaries (``cu_seqlens`` for the gated-delta kernels, ``seq_idx`` for the conv): recurrent
    and conv state would carry from one example into the next. Wrong results, not a slow path, so only the
    allow item ``packed-without-boundaries`` accepts it (``*`` does not).

    ``layer`` is the first GDN layer's path, ``examples`` the number of examples in the row, ``missing`` the
    boundary kwargs its kernels do not get (``("cu_seqlens", "seq_idx")``).
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        details: dict[str, Any] | None = None,
        layer: str = "",
        examples: int = 0,
        missing: tuple[str, ...] = (),
    ) -> None:
        self.layer = layer
        self.examples = examples
        self.missing = tuple(missing)
        super().__init__(message, fix=fix, details=details)

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "layer": self.layer, "examples": self.examples, "missing": self.missing}


class DataError(KernelGuardError):
    """Malformed training data: names the file, row and field."""


class CheckpointError(ConfigError):
    """A checkpoint or an output folder's run cannot be used as asked: names the file and what differs.
    A ConfigError, so the CLI exits 2 like every other bad input."""


class TrainingDiverged(KernelGuardError):
    """A training step's loss or gradient norm was NaN or infinite: the run stopped before applying it, so
    the weights and the newest checkpoint are the last good ones. Exit code 4."""


class Preempted(KernelGuardError):
    """``kernelguard train``: SIGTERM stopped the run; ``message`` says what was saved. Exit code 143."""


# The one table from an error to the exit code a command ends with: the first row the error is an instance of.
# `kernelguard check`, `lock`, `env`, `export` and `train` (each rank and the launcher) all read it.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (KeyboardInterrupt, EXIT_INTERRUPTED),
    (Preempted, EXIT_PREEMPTED),
    (GuardRefused, EXIT_GUARD),
    (TrainingDiverged, EXIT_DIVERGED),
    (ConfigError, EXIT_USAGE),  # CheckpointError too
    (DataError, EXIT_USAGE),
    (KernelGuardError, EXIT_FAIL),
)


def exit_code_for(error: BaseException) -> int:
    """The exit code a command ends with when ``error`` stops it (:data:`EXIT_CODES`; anything else 1)."""
    return next((code for kind, code in EXIT_CODES if isinstance(error, kind)), EXIT_FAIL)



# How a command ends when interrupted while it starts (errors.interrupts), loaded on first use: ``import kernelguard``
# imports this package before the console script's signal handlers exist (kernelguard.cli.entry).
_OFFERS = {
    "interrupts": (
        "children_start_with_interrupts_held",
        "end_startup_interrupts",
        "release_held_interrupts",
        "startup_interrupts",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _OFFERS["interrupts"]:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import interrupts

    return getattr(interrupts, name)


if TYPE_CHECKING:
    from .interrupts import (
        children_start_with_interrupts_held,
        end_startup_interrupts,
        release_held_interrupts,
        startup_interrupts,
    )
