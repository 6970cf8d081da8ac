"""The runtime guard: what each call site of a model runs, the tripwires, the packed-row checks, the training gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "allowed_line",
    "arm_tripwires",
    "check_lock",
    "check_stack",
    "fallback_events",
    "gate",
    "guard",
    "inspect",
    "ModelCallWatch",
    "REFERENCE_RANGE",
    "register_varlen_attention",
    "REGISTRY",
    "run_gate",
    "VARLEN_NAME",
]

# What this room offers the rest of kernelguard: each name and the module of this room that defines it
# ("module:" offers that module itself), loaded on first use.
_OFFERS = {
    "allowed_line": "gate",
    "arm_tripwires": "tripwires",
    "check_lock": "gate",
    "check_stack": "gate",
    "fallback_events": "tripwires",
    "guard": "model_guard",
    "inspect": "model_guard",
    "ModelCallWatch": "boundaries",
    "REFERENCE_RANGE": "tripwires",
    "register_varlen_attention": "attention",
    "REGISTRY": "registry",
    "run_gate": "gate",
    "VARLEN_NAME": "attention",
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .attention import register_varlen_attention, VARLEN_NAME
    from .boundaries import ModelCallWatch
    from .gate import allowed_line, check_lock, check_stack, run_gate
    from .model_guard import guard, inspect
    from .registry import REGISTRY
    from .tripwires import arm_tripwires, fallback_events, REFERENCE_RANGE
