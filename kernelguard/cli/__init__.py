"""The ``kernelguard`` program: its start-up handlers (``entry``), one module per command (``COMMANDS``), the
``kernelguard env`` block. Nothing is imported here: the console script's first code (``entry``) installs the
start-up handlers before any command's modules import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = ["COMMANDS", "entry", "main"]

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "commands": ("COMMANDS", "main"),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .commands import COMMANDS, main
