"""Training-ready chat templates for the Qwen3 / Qwen3.5 / Qwen3-Next families, and how one is picked.

Real Qwen templates drop the reasoning of earlier assistant turns, so a conversation cannot be rendered
prefix by prefix to find what the assistant said. The training variants here follow TRL's convention
(``trl/chat_templates/*_training.jinja``): the same rendering as the original, except that every assistant
turn keeps its ``<think>`` block and is wrapped in ``{% generation %}...{% endgeneration %}``, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly the assistant's tokens.

A tokenizer's template is recognised when it equals a known original after dropping Jinja comments and all
whitespace (so re-indented or re-wrapped copies still match). Files:

- originals (identification only; the Qwen team's templates, Apache-2.0): ``qwen3`` (Qwen3 hybrid-thinking,
  current revision) and ``qwen3_v0`` (its first release revision), ``qwen3_thinking_2507`` (Qwen3-*-Thinking-2507
  and Qwen3-Next-80B-A3B-Thinking), ``qwen3_instruct_2507`` (Qwen3-*-Instruct-2507 and
  Qwen3-Next-80B-A3B-Instruct), ``qwen3_5_think`` / ``qwen3_5_nothink`` (Qwen3.5), ``qwen3_6``, ``qwen3_8``.
- training variants: copied from huggingface/trl v1.16.0 (Apache-2.0) with a provenance comment;
  ``qwen3_thinking_2507_training`` is TRL's ``qwen3_training`` with that original's generation prompt.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from kernelguard.errors import ConfigError

__all__ = [
    "GENERATION",
    "KNOWN",
    "NO_TEMPLATE",
    "PREFIX",
    "TemplateChoice",
    "choose",
    "fingerprint",
    "has_generation_tags",
    "identify",
    "inference_original",
    "normalize",
    "read",
    "shipped_names",
    "suggest",
]

# original template -> (training template, the models that ship the original)
KNOWN: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3_training", "Qwen3 (hybrid thinking)"),
    "qwen3_v0": ("qwen3_training", "Qwen3 (hybrid thinking, first revision)"),
    "qwen3_thinking_2507": ("qwen3_thinking_2507_training", "Qwen3-Thinking-2507 / Qwen3-Next-Thinking"),
    "qwen3_instruct_2507": ("qwen3_instruct_2507_training", "Qwen3-Instruct-2507 / Qwen3-Next-Instruct"),
    "qwen3_5_think": ("qwen3_5_think_training", "Qwen3.5 (thinking by default)"),
    "qwen3_5_nothink": ("qwen3_5_nothink_training", "Qwen3.5 (non-thinking by default)"),
    "qwen3_6": ("qwen3_6_training", "Qwen3.6"),
    "qwen3_8": ("qwen3_8_training", "Qwen3.8"),
}

# Used by the error for an unknown template: which shipped template a Qwen-looking template probably wants.
_MARKERS: list[tuple[tuple[str, ...], str]] = [
    (("<|im_start|>", "reasoning_content", "<function=", "preserve_thinking"), "qwen3_6_training"),
    (("<|im_start|>", "reasoning_content", "<function="), "qwen3_5_think_training"),
    (("<|im_start|>", "reasoning_content", "<tool_call>"), "qwen3_training"),
    (("<|im_start|>", "<tool_call>"), "qwen3_instruct_2507_training"),
]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)

GENERATION = "generation"  # assistant tokens from the template's {% generation %} blocks
PREFIX = "prefix"  # assistant spans from rendering the conversation prefix by prefix
NO_TEMPLATE = "none"


@dataclass(frozen=True, slots=True)
class TemplateChoice:
    """The chat template `kernelguard train` renders with, and why.

    ``name``: a shipped template's name, ``file:PATH``, ``tokenizer`` or ``none``; ``text``: the Jinja source
    (None without a template); ``method``: GENERATION, PREFIX or NO_TEMPLATE; ``reason``: one sentence."""

    name: str
    text: str | None
    method: str
    reason: str


def shipped_names() -> list[str]:
    return sorted(p.name[: -len(".jinja")] for p in _files() if p.name.endswith(".jinja"))


def _files() -> list[Path]:
    return [Path(str(p)) for p in resources.files(__name__).iterdir()]


@cache
def read(name: str) -> str:
    """The text of the shipped template ``name`` (without ``.jinja``)."""
    try:
        return (resources.files(__name__) / f"{name}.jinja").read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(
            f"no shipped chat template named {name!r}.",
            fix=f"pass a template file, or one of: {', '.join(shipped_names())}",
        ) from e


def normalize(text: str) -> str:
    """Jinja comments and all whitespace removed: equal for re-indented or re-commented copies of a template."""
    return re.sub(r"\s+", "", _COMMENT.sub("", text))


def fingerprint(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()[:16]


@cache
def _known_fingerprints() -> dict[str, str]:
    return {fingerprint(read(original)): original for original in KNOWN}


def identify(text: str) -> str | None:
    """The known original this template is (after normalisation), or None."""
    return _known_fingerprints().get(fingerprint(text))


def inference_original(name: str) -> str | None:
    """The original a shipped training variant was made from (what to chat with after training on it), or None
    for a name that is not a shipped training variant. Two originals share ``qwen3_training``: the current one."""
    return next((original for original, (training, _) in KNOWN.items() if training == name), None)


def has_generation_tags(text: str) -> bool:
    return bool(_GENERATION_TAG.search(_COMMENT.sub("", text)))


def suggest(text: str) -> str | None:
    """A shipped training template that a Qwen-looking but unknown template probably corresponds to."""
    for markers, name in _MARKERS:
        if all(m in text for m in markers):
            return name
    return None


def choose(tokenizer_template: str | None, override: str | Path | None = None) -> TemplateChoice:
    """Which template to train with: an override (a file, or a shipped name), else a shipped training variant
    when the tokenizer's template is a known Qwen original, else the tokenizer's own."""
    if override is not None:
        name, text = _read_override(override)
        method = GENERATION if has_generation_tags(text) else PREFIX
        return TemplateChoice(name, text, method, f"--chat-template {override} was given.")
    if not tokenizer_template:
        return TemplateChoice(NO_TEMPLATE, None, NO_TEMPLATE, "the tokenizer has no chat template.")
    if has_generation_tags(tokenizer_template):
        reason = "the tokenizer's template already marks assistant output with {% generation %}."
        return TemplateChoice("tokenizer", tokenizer_template, GENERATION, reason)
    original = identify(tokenizer_template)
    if original is not None:
        training, family = KNOWN[original]
        reason = (
            f"the tokenizer's template is the {family} template ({original}); its training variant keeps every "
            "turn's reasoning and marks assistant output."
        )
        return TemplateChoice(training, read(training), GENERATION, reason)
    reason = "the tokenizer's template is not a known one and has no {% generation %} markers."
    return TemplateChoice("tokenizer", tokenizer_template, PREFIX, reason)


def _read_override(override: str | Path) -> tuple[str, str]:
    path = Path(override)
    if path.is_file():
        try:
            return f"file:{path}", path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"could not read chat template file {path}: {e}", fix="pass a UTF-8 .jinja file"
            ) from e
    name = str(override).removesuffix(".jinja")
    if name in shipped_names():
        return name, read(name)
    raise ConfigError(
        f"--chat-template {override}: no such file, and not a shipped template name.",
        fix=f"pass a .jinja file, or one of: {', '.join(n for n in shipped_names() if n.endswith('_training'))}",
    )
