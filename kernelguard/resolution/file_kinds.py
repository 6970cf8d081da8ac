"""What a path a user passed actually is, when it is not what was asked for: a dangling symbolic link, a GGUF
or safetensors weight file, a PyTorch zip checkpoint, a ``datasets`` ``save_to_disk`` folder. Errors name it
(in the caller's terms) instead of "not valid JSON" or "does not exist"; reads at most 16 bytes."""

from __future__ import annotations

import os
import struct
from pathlib import Path

__all__ = ["dangling_link", "file_kind", "saved_dataset"]

_MAGIC = {
    b"GGUF": "a GGUF file (llama.cpp's format, not a transformers config or model folder)",
    b"PK\x03\x04": "a zip archive (a PyTorch checkpoint such as pytorch_model.bin is one)",
    b"PAR1": "a Parquet file",
    b"\x89HDF": "an HDF5 file (Keras / TensorFlow weights)",
}


def dangling_link(path: str | Path) -> str | None:
    """``PATH is a symbolic link to TARGET, which does not exist`` for a broken link, else None."""
    p = Path(path)
    if not p.is_symlink() or p.exists():
        return None
    try:
        target = os.readlink(p)
    except OSError:
        target = "?"
    return f"{p} is a symbolic link to {target}, which does not exist"


def file_kind(path: str | Path) -> str | None:
    """What a file is by its first bytes (GGUF, safetensors, zip, Parquet, HDF5), or None."""
    try:
        with Path(path).open("rb") as f:
            head = f.read(16)
    except OSError:
        return None
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return kind
    if len(head) >= 10 and head[8:10] == b'{"':
        (length,) = struct.unpack("<Q", head[:8])
        if 0 < length < 1 << 28:
            return "a safetensors weight file (a model folder holds it next to its config.json)"
    return None


def saved_dataset(path: str | Path) -> str | None:
    """``a datasets save_to_disk folder`` (a Dataset or a DatasetDict) for such a folder, else None."""
    p = Path(path)
    if (p / "dataset_dict.json").is_file():
        return "a datasets save_to_disk folder holding a DatasetDict"
    if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        return "a datasets save_to_disk folder"
    return None
