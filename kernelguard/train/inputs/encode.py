"""Validated items -> (input_ids, labels): chat rendering, assistant-token spans, tokenization.

How assistant tokens are found is described in kernelguard.train.inputs.rows's docstring: a ``{% generation %}``
template through transformers' assistant-token mask, any other template prefix by prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kernelguard.errors import ConfigError, DataError
from kernelguard.resolution import IGNORE_INDEX

from .. import chat_templates
from ..chat_templates import GENERATION, NO_TEMPLATE, TemplateChoice
from .rows import ChatItem, Item, Span, TextItem, data_error

__all__ = ["assistant_spans", "encode_items", "generation_examples"]


def _render(
    tokenizer: Any, template: str, item: ChatItem, messages: list[dict[str, Any]], *, prompt: bool
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=item.tools, chat_template=template, tokenize=False, add_generation_prompt=prompt
        )
    except Exception as e:  # noqa: BLE001 - a template's raise_exception, a TypeError in Jinja...: all mean "this row"
        raise _template_error(item, e) from None
    return text if isinstance(text, str) else str(text)


def _template_error(item: ChatItem, e: Exception) -> DataError:
    return data_error(
        item.row.file,
        item.row.row,
        item.where,
        f"the chat template could not render this conversation: {type(e).__name__}: {e}",
    )


def _unstable_error(item: ChatItem, i: int, template: str) -> DataError:
    hint = chat_templates.suggest(template)
    shipped = ", ".join(n for n in chat_templates.shipped_names() if n.endswith("_training"))
    looks = f"this template looks like {hint}'s original, so try --chat-template {hint}; " if hint else ""
    return data_error(
        item.row.file,
        item.row.row,
        f"{item.where}[{i - item.first_trained}]",  # prompt/completion rows: the index in the completion
        "the chat template does not render this conversation prefix-stably (it rewrites earlier turns, e.g. "
        "drops the reasoning of earlier assistant turns), so the assistant's tokens cannot be located",
        f"{looks}pass --chat-template FILE with a template that wraps assistant output in "
        f"{{% generation %}}...{{% endgeneration %}} (shipped: {shipped}), "
        "or train on all tokens with --all-tokens-loss",
    )


def assistant_spans(tokenizer: Any, item: ChatItem, template: str) -> tuple[str, list[Span]]:
    """The full rendering and the character spans of the trained assistant turns (prefix method)."""
    messages = item.messages
    full = _render(tokenizer, template, item, messages, prompt=False)
    spans: list[Span] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i < item.first_trained:
            continue
        before = _render(tokenizer, template, item, messages[:i], prompt=True) if i else ""
        upto = _render(tokenizer, template, item, messages[: i + 1], prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise _unstable_error(item, i, template)
        spans.append((len(before), len(upto)))
    return full, spans


def _prompt_boundary(tokenizer: Any, item: ChatItem, template: str) -> int:
    """Where a prompt/completion conversation's completion starts in its rendering (0: train every turn)."""
    if not item.first_trained:
        return 0
    prompt = _render(tokenizer, template, item, item.messages[: item.first_trained], prompt=False)
    if not _render(tokenizer, template, item, item.messages, prompt=False).startswith(prompt):
        raise _unstable_error(item, item.first_trained, template)
    return len(prompt)


def _masked_apply(tokenizer: Any, conversations: list[Any], tools: Any, template: str) -> Any:
    """transformers' own assistant mask from the template's {% generation %} blocks, for a batch of
    conversations sharing ``tools`` (one batched tokenizer call: the Rust tokenizer uses every core)."""
    return tokenizer.apply_chat_template(
        conversations,
        tools=tools,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        tokenizer_kwargs={"return_offsets_mapping": True},
    )


def generation_examples(
    tokenizer: Any,
    jobs: list[tuple[int, ChatItem, int]],
    template: str,
    on_error: Callable[[DataError], None],
) -> dict[int, tuple[list[int], list[int]]]:
    """(input_ids, labels) for each (position, item, boundary): the assistant mask, from ``boundary`` on."""
    groups: dict[str, list[tuple[int, ChatItem, int]]] = {}
    for job in jobs:  # batched by tool list: apply_chat_template takes one for the whole batch
        groups.setdefault(json.dumps(job[1].tools, sort_keys=True), []).append(job)
    out: dict[int, tuple[list[int], list[int]]] = {}
    for group in groups.values():
        try:
            enc = _masked_apply(
                tokenizer, [item.messages for _, item, _ in group], group[0][1].tools, template
            )
            encoded = list(zip(group, enc["input_ids"], enc["assistant_masks"], enc["offset_mapping"]))
        except Exception:  # noqa: BLE001 - some row breaks the template: find it (them) one by one
            encoded = []
            for job in group:
                try:
                    enc = _masked_apply(tokenizer, job[1].messages, job[1].tools, template)
                except Exception as e:  # noqa: BLE001 - see _render
                    on_error(_template_error(job[1], e))
                    continue
                encoded.append((job, enc["input_ids"], enc["assistant_masks"], enc["offset_mapping"]))
        for (pos, _item, boundary), ids, mask, offsets in encoded:
            ids = list(ids)
            keep = [bool(m) and start >= boundary for m, (start, _end) in zip(mask, offsets)]
            out[pos] = (ids, [t if k else IGNORE_INDEX for t, k in zip(ids, keep)])
    return out


def _labels_from_spans(ids: list[int], offsets: list[Span], spans: list[Span] | None) -> list[int]:
    if spans is None:
        return list(ids)
    labels = [IGNORE_INDEX] * len(ids)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        # end > start: tokens the tokenizer adds itself (BOS) have empty offsets and are never trained.
        if k < len(spans) and spans[k][0] <= start < spans[k][1] and end > start:
            labels[t] = ids[t]
    return labels


def encode_items(
    tokenizer: Any,
    items: list[Item],
    *,
    choice: TemplateChoice,
    assistant_only: bool,
    on_error: Callable[[DataError], None],
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) for every item, in order; an item that fails goes to ``on_error`` (which raises, or
    counts it and returns)."""
    texts: list[tuple[int, str, list[Span] | None, bool]] = []  # position, text, spans (None: all), specials
    generation: list[tuple[int, ChatItem, int]] = []  # position, item, where its loss may start
    template = ""
    for pos, item in enumerate(items):
        try:
            if isinstance(item, TextItem):
                spans = [(item.loss_from, len(item.text))] if assistant_only and item.loss_from else None
                texts.append((pos, item.text, spans, True))
                continue
            template = _chat_template_or_raise(choice, item)
            if not assistant_only:  # never locate assistant tokens: one plain rendering
                full = _render(tokenizer, template, item, item.messages, prompt=False)
                texts.append((pos, full, None, False))
            elif choice.method == GENERATION:
                generation.append((pos, item, _prompt_boundary(tokenizer, item, template)))
            else:
                full, spans = assistant_spans(tokenizer, item, template)
                texts.append((pos, full, spans, False))
        except DataError as e:
            on_error(e)
    done = generation_examples(tokenizer, generation, template, on_error) if generation else {}
    done.update(_tokenize(tokenizer, texts))
    return [done[pos] for pos in sorted(done)]


def _tokenize(
    tokenizer: Any, texts: list[tuple[int, str, list[Span] | None, bool]]
) -> dict[int, tuple[list[int], list[int]]]:
    done: dict[int, tuple[list[int], list[int]]] = {}
    for specials in (True, False):
        group = [t for t in texts if t[3] is specials]
        if not group:
            continue
        # Chat renderings already hold their special tokens (apply_chat_template tokenizes them the same way).
        enc = tokenizer([t[1] for t in group], add_special_tokens=specials, return_offsets_mapping=True)
        for (pos, _text, spans, _), ids, offsets in zip(group, enc["input_ids"], enc["offset_mapping"]):
            done[pos] = (list(ids), _labels_from_spans(list(ids), list(offsets), spans))
    return done


def _chat_template_or_raise(choice: TemplateChoice, item: ChatItem) -> str:
    if choice.method == NO_TEMPLATE or choice.text is None:
        shipped = ", ".join(n for n in chat_templates.shipped_names() if n.endswith("_training"))
        raise ConfigError(
            f"{item.row.file}: conversational rows need a chat template, and the tokenizer has none. Pass "
            f"--chat-template with a .jinja file or a shipped name ({shipped}), or use text rows.",
            fix=None,
        )
    return choice.text


# ----------------------------------------------------------------------------------------------- items ---
