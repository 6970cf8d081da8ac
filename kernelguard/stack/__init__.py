"""The verdict on a stack: ``check()`` and ``require()``, numerics on a GPU, the report, the stack lock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "check",
    "CheckOptions",
    "CheckResult",
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

# What this room offers the rest of kernelguard: each name and the module of this room that defines it
# ("module:" offers that module itself), loaded on first use.
_OFFERS = {
    "check": "api",
    "CheckOptions": "compose",
    "CheckResult": "compose",
    "fit_line": "report",
    "fit_lines": "report",
    "fit_usage": "report",
    "fix_lines": "report",
    "fix_text": "report",
    "fla_backends": "report",
    "help_formatter": "report",
    "kernelguard_version": "stack_lock",
    "layer_summary": "report",
    "load_pyproject_defaults": "compose",
    "lock_option": "stack_lock",
    "lock_path": "stack_lock",
    "read_by_a_person": "report",
    "render": "report",
    "render_call_sites": "report",
    "require": "api",
    "resolution_error": "api",
    "run_check": "compose",
    "short_provider": "report",
    "terminal_width": "report",
    "to_json": "report",
    "verdict_line": "report",
    "verify_lock": "stack_lock",
    "why_fix_block": "report",
    "wrap_message": "report",
    "wrap_text": "report",
    "write_lock": "stack_lock",
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
