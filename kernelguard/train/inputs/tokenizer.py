"""The run's tokenizer: its folder checked (one AutoTokenizer would refuse with a misleading message is refused
with the real one), loaded fast, the chat template to train with chosen and recorded on it, its pad id."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError

from .. import chat_templates
from ..chat_templates import TemplateChoice

__all__: list[str] = [
    "chat_template_name",
    "check_tokenizer_folder",
    "load_tokenizer",
    "pad_token_id",
    "set_chat_template",
    "template_choice",
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


def load_tokenizer(path: str, *, chat_template: str | Path | None = None) -> Any:
    """A fast tokenizer plus the chat template to train with (see ``chat_template_name``): ``chat_template`` (a
    .jinja file or a shipped template's name) if given, else the shipped training variant of a known Qwen
    template, else the tokenizer's own. The tokenizer's own ``chat_template`` is left as it is, so a saved
    checkpoint keeps the template people run inference with."""
    from transformers import AutoTokenizer

    check_tokenizer_folder(Path(path))
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(
            f"could not load a tokenizer from {path} (AutoTokenizer.from_pretrained: {e}); --tokenizer must be a "
            "folder holding tokenizer.json (and tokenizer_config.json), as a Hugging Face model ships it."
        ) from e
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"the tokenizer at {path} is not a fast tokenizer (no offsets).", fix="ship tokenizer.json"
        )
    set_chat_template(tok, chat_template)
    return tok


def set_chat_template(tokenizer: Any, chat_template: str | Path | None = None) -> TemplateChoice:
    """Choose (as ``load_tokenizer`` does) and record on ``tokenizer`` the chat template to train with."""
    own = _own_template(tokenizer)
    choice = chat_templates.choose(own, chat_template)
    tokenizer._kernelguard_template = choice
    return choice


def _own_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders plain conversations
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def template_choice(tokenizer: Any) -> TemplateChoice:
    """The chat template ``load_tokenizer`` chose (computed from the tokenizer's own for other tokenizers)."""
    choice = getattr(tokenizer, "_kernelguard_template", None)
    return choice if choice is not None else set_chat_template(tokenizer)


def chat_template_name(tokenizer: Any) -> str:
    """``qwen3_training`` (a shipped one), ``file:PATH``, ``tokenizer`` (its own) or ``none``."""
    return template_choice(tokenizer).name


def pad_token_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


# ------------------------------------------------------------------------------------------------ load ---
