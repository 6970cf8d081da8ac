"""A small file written whole or not at all: the run's records (run.json, train_config.json, error records)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["write_text_atomically"]


def write_text_atomically(path: Path, text: str) -> Path:
    """Write ``text`` beside ``path`` and rename it into place; on any failure (a full disk) the temporary file
    is removed and the error raised: never a half-written record, never a stray ``.tmp``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path
