"""The ``kernelguard`` program: its start-up handlers (``entry``), one module per command (``COMMANDS``), the
``kernelguard env`` block. Nothing is imported here: the console script's first code (``entry``) installs the
start-up handlers before any command's modules import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = ["COMMANDS", "entry", "main"]

# What this room offers the rest of kernelguard: each name and the module of this room that defines it
# ("module:" offers that module itself), loaded on first use.
_OFFERS = {
    "COMMANDS": "commands",
    "main": "commands",
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .commands import COMMANDS, main
