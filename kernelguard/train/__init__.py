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
    "FINAL",
    "main",
    "make_tokenizer_folder",
    "not_a_checkpoint",
    "peak_flops",
]

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "common.run_folder": ("FINAL",),
    "inputs.tiktoken_folder": ("make_tokenizer_folder",),
    "__main__": ("exit_program", "main"),
    "output.checkpoint_layout": ("not_a_checkpoint",),
    "output.export": ("export_checkpoint",),
    "output.export_checks": ("check_destination",),
    "output.metrics": ("peak_flops",),
    "settings.config_cli": ("build_parser",),
    "settings.config_rules": ("DEFAULT_MAX_SHARD_SIZE",),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .__main__ import exit_program, main
    from .common.run_folder import FINAL
    from .inputs.tiktoken_folder import make_tokenizer_folder
    from .output.checkpoint_layout import not_a_checkpoint
    from .output.export import export_checkpoint
    from .output.export_checks import check_destination
    from .output.metrics import peak_flops
    from .settings.config_cli import build_parser
    from .settings.config_rules import DEFAULT_MAX_SHARD_SIZE
