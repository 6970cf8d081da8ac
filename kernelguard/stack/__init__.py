"""The verdict on a stack: ``check()`` and ``require()``, numerics on a GPU, the report, the stack lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "CheckOptions",
    "CheckResult",
    "check",
    "fit_line",
    "fit_lines",
    "fit_usage",
    "fix_lines",
    "fix_text",
    "fla_backends",
    "help_formatter",
    "kernelguard_version",
    "layer_summary",
    "load_pyproject_defaults",
    "lock_option",
    "lock_path",
    "read_by_a_person",
    "render",
    "render_call_sites",
    "require",
    "resolution_error",
    "run_check",
    "short_provider",
    "terminal_width",
    "to_json",
    "verdict_line",
    "verify_lock",
    "why_fix_block",
    "wrap_message",
    "wrap_text",
    "write_lock",
]

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "api": ("check", "require", "resolution_error"),
    "compose": ("CheckOptions", "CheckResult", "load_pyproject_defaults", "run_check"),
    "report": (
        "fit_line",
        "fit_lines",
        "fit_usage",
        "fix_lines",
        "fix_text",
        "fla_backends",
        "help_formatter",
        "layer_summary",
        "read_by_a_person",
        "render",
        "render_call_sites",
        "short_provider",
        "terminal_width",
        "to_json",
        "verdict_line",
        "why_fix_block",
        "wrap_message",
        "wrap_text",
    ),
    "stack_lock": ("kernelguard_version", "lock_option", "lock_path", "verify_lock", "write_lock"),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .api import check, require, resolution_error
    from .compose import CheckOptions, CheckResult, load_pyproject_defaults, run_check
    from .report import (
        fit_line,
        fit_lines,
        fit_usage,
        fix_lines,
        fix_text,
        fla_backends,
        help_formatter,
        layer_summary,
        read_by_a_person,
        render,
        render_call_sites,
        short_provider,
        terminal_width,
        to_json,
        verdict_line,
        why_fix_block,
        wrap_message,
        wrap_text,
    )
    from .stack_lock import kernelguard_version, lock_option, lock_path, verify_lock, write_lock
