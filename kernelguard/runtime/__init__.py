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

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "attention": ("register_varlen_attention", "VARLEN_NAME"),
    "boundaries": ("ModelCallWatch",),
    "gate": ("allowed_line", "check_lock", "check_stack", "run_gate"),
    "model_guard": ("guard", "inspect"),
    "registry": ("REGISTRY",),
    "tripwires": ("arm_tripwires", "fallback_events", "REFERENCE_RANGE"),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .attention import VARLEN_NAME, register_varlen_attention
    from .boundaries import ModelCallWatch
    from .gate import allowed_line, check_lock, check_stack, run_gate
    from .model_guard import guard, inspect
    from .registry import REGISTRY
    from .tripwires import REFERENCE_RANGE, arm_tripwires, fallback_events
