"""What a model folder needs besides its weights to chat: the chat template the run trained with,
``generation_config.json`` and the special token ids in ``config.json``.

The template written is the one people chat with: for a shipped training variant (``qwen3_5_think_training``)
its inference original, since the variant's ``{% generation %}`` markers and kept reasoning serve the loss mask
only; a template file or the tokenizer's own is written as it is. ``generation_config()`` stops on every token that
ends a turn: the tokenizer's eos and, for a ChatML template, ``<|im_end|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import chat_templates
from ..inputs.tokenizer import template_choice

__all__ = ["TURN_END", "fill_special_token_ids", "generation_config", "inference_template", "save_tokenizer"]

TURN_END = "<|im_end|>"  # ChatML's end of a turn: the token generation must stop on after an answer


def inference_template(tokenizer: Any) -> str | None:
    """The chat template to ship with the trained model (None: no template was trained with)."""
    choice = template_choice(tokenizer)
    if choice.text is None:
        return None
    original = chat_templates.inference_original(choice.name)
    if original is None:
        return choice.text  # a template file, a shipped original, or the tokenizer's own: as trained
    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if own and chat_templates.KNOWN.get(chat_templates.identify(own) or "", ("",))[0] == choice.name:
        return own  # the tokenizer's own original (as its model shipped it) is that variant's twin
    return chat_templates.read(original)


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained`` with the inference template (the tokenizer object is left as it was)."""
    before = tokenizer.chat_template
    template = inference_template(tokenizer)
    try:
        if template is not None:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
    finally:
        tokenizer.chat_template = before


def _token_ids(tokenizer: Any) -> dict[str, int | None]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad}


def fill_special_token_ids(config: Any, tokenizer: Any) -> None:
    """Set bos/eos/pad ids the config leaves unset (a config.json --model often has null) from the tokenizer
    the run trained with, on the config and its text config alike."""
    text = config.get_text_config()
    for target in {id(config): config, id(text): text}.values():
        for key, value in _token_ids(tokenizer).items():
            if value is not None and getattr(target, key, None) is None:
                setattr(target, key, value)


def generation_config(config: Any, tokenizer: Any) -> Any:
    """A GenerationConfig for a model folder that has none: the special ids, stopping at the end of a turn."""
    from transformers import GenerationConfig

    ids = _token_ids(tokenizer)
    text = config.get_text_config()
    configured = getattr(text, "eos_token_id", None)
    stops = [ids["eos_token_id"], *(configured if isinstance(configured, list) else [configured])]
    template = inference_template(tokenizer) or ""
    if TURN_END in template:
        stops.append(tokenizer.convert_tokens_to_ids(TURN_END))
    unknown = getattr(tokenizer, "unk_token_id", None)
    eos = list(dict.fromkeys(s for s in stops if isinstance(s, int) and s != unknown))
    return GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=ids["pad_token_id"],
    )
