"""`kernelguard train`: packed FSDP2 supervised fine-tuning that starts only once the guard passes.

Run as ``kernelguard train`` or ``torchrun ... -m kernelguard.train``. Its stages are the folders here, in the
order ARCHITECTURE.md gives (settings, inputs, step, model, output, startup, then the run itself: ``loop``,
``launch``, ``__main__``); docs/train.md is the user's guide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "build_parser",
    "check_destination",
    "DEFAULT_MAX_SHARD_SIZE",
    "exit_program",
    "export_checkpoint",
    "main",
    "not_a_checkpoint",
    "peak_flops",
]

# What this room offers the rest of kernelguard: each name and the module of this room that defines it
# ("module:" offers that module itself), loaded on first use.
_OFFERS = {
    "build_parser": "settings.config_cli",
    "check_destination": "output.export_checks",
    "DEFAULT_MAX_SHARD_SIZE": "settings.config_rules",
    "exit_program": "__main__",
    "export_checkpoint": "output.export",
    "main": "__main__",
    "not_a_checkpoint": "output.checkpoint_layout",
    "peak_flops": "output.metrics",
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .__main__ import exit_program, main
    from .output.checkpoint_layout import not_a_checkpoint
    from .output.export import export_checkpoint
    from .output.export_checks import check_destination
    from .output.metrics import peak_flops
    from .settings.config_cli import build_parser
    from .settings.config_rules import DEFAULT_MAX_SHARD_SIZE
