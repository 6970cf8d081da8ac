"""A ``--tokenizer`` folder that AutoTokenizer would refuse with a misleading message, refused with the real one."""

from __future__ import annotations

import shlex
from pathlib import Path

from kernelguard.errors import ConfigError

__all__: list[str] = [
    "check_tokenizer_folder",
]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                    "special_tokens_map.json")


def check_tokenizer_folder(folder: Path) -> None:
    """A folder with a .tiktoken vocabulary and no tokenizer.json, or with no tokenizer file at all:
    AutoTokenizer's own error there asks for sentencepiece or tiktoken even when both are installed, so say what
    is missing and how to make it."""
    if not folder.is_dir() or (folder / "tokenizer.json").is_file():
        return
    files = sorted(p.name for p in folder.glob("*.tiktoken"))
    if files:
        raise ConfigError(
            f"tokenizer folder {folder} holds a .tiktoken vocabulary ({', '.join(files)}) but no tokenizer.json, "
            "which kernelguard train needs (a fast tokenizer). This writes it there, offline:",
            fix=f"kernelguard tokenizer {shlex.quote(str(folder))}",
        )
    if not any(p.is_file() and (p.name in _TOKENIZER_FILES or p.suffix == ".model") for p in folder.iterdir()):
        # AutoTokenizer's own error here speaks of sentencepiece and tiktoken, which are not what is missing.
        held = sorted(p.name for p in folder.iterdir())
        found = f"it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}" if held else "it is empty"
        raise ConfigError(
            f"tokenizer folder {folder} holds no tokenizer files ({found}); --tokenizer must be the folder of a "
            "Hugging Face model holding tokenizer.json (and tokenizer_config.json). The Qwen3.5 tokenizer, offline:",
            fix=f"kernelguard tokenizer --qwen3.5 {shlex.quote(str(folder))}",
        )
