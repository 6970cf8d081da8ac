"""One row of training data -> a validated item -> (input_ids, labels).

Row formats (TRL's dataset conventions), detected from the columns of the first row unless given:

- ``messages``: a list of ``{"role", "content"}`` messages (column name configurable). ``content`` is a string
  or a list of text parts; assistant turns may carry ``reasoning_content`` (or ``reasoning``/``thinking``) and
  ``tool_calls``; ``tool`` messages answer them; an optional ``tools`` column lists the tool schemas.
  Loss on the assistant's tokens.
- ``prompt``/``completion``: two strings (concatenated, end-of-sequence token appended) or two message lists
  (rendered as one conversation). Loss on the completion only.
- ``text``: plain language modelling; loss on every token.

``assistant_only=False`` (``--all-tokens-loss``) trains every token of every format and never locates
assistant tokens.

Assistant tokens, for conversations: with a chat template that marks assistant output with
``{% generation %}`` (the shipped Qwen training templates, see ``chat_templates``; picked automatically for
known Qwen templates) transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives
them. Any other template is rendered prefix by prefix: assistant message i spans the characters between
``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])``, which works only for
templates that never rewrite earlier turns; the others are refused with a DataError naming the row and the
fixes (``--chat-template``, ``--all-tokens-loss``). A token is trained when its first character is in a span,
so a span includes the turn's end token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernelguard.errors import ConfigError, DataError

from . import chat_templates
from .chat_templates import GENERATION, NO_TEMPLATE, TemplateChoice
from .packing import IGNORE_INDEX

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
FORMATS = ("messages", "prompt-completion", "text")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Row:
    file: str
    row: int  # 1-based line for JSONL, 0-based index for JSON arrays / Parquet / datasets
    value: Any
    index: int = 0  # 0-based position among all rows of the data (all files, bad rows included)


def data_error(file: str, row: int, field_name: str, problem: str, fix: str | None = None) -> DataError:
    return DataError(
        f"{file}, row {row}, field {field_name!r}: {problem}",
        fix=fix or "fix or remove that row, or pass --skip-bad-rows to skip malformed rows with a count",
        details={"file": file, "row": row, "field": field_name},
    )


# ------------------------------------------------------------------------------------------- validation ---
def detect_format(row: Row, column: str = "messages") -> str:
    """The dataset format a row's columns say (TRL conventions), or a DataError listing formats and columns."""
    if not isinstance(row.value, dict):
        raise data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    keys = set(row.value)
    if column in keys:
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt-completion"
    if "text" in keys:
        return "text"
    raise _format_error(row, f"no column of a known dataset format (columns: {_columns(row)})", column)


def _columns(row: Row) -> str:
    return ", ".join(sorted(map(str, row.value))) or "none"


def _format_error(row: Row, problem: str, column: str, field_name: str | None = None) -> DataError:
    formats = (
        f"messages (a {column!r} column of chat messages), prompt-completion ('prompt' and 'completion' "
        "columns), text (a 'text' column)"
    )
    return data_error(
        row.file,
        row.row,
        field_name or column,
        f"{problem}; known formats: {formats}",
        f"pass --messages-column NAME or --dataset-format FORMAT for this data (columns: {_columns(row)})",
    )


def validate_messages(row: Row, column: str, *, need_assistant: bool) -> list[dict[str, Any]]:
    """The row's conversation as a list of message dicts ready for a chat template, or a DataError naming the
    field. Text parts are joined into one string; reasoning under any common name becomes ``reasoning_content``."""
    if not isinstance(row.value, dict):
        raise data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    if column not in row.value:
        cols = _columns(row)
        raise data_error(
            row.file,
            row.row,
            column,
            f"column {column!r} is missing (columns: {cols})",
            f"pass --messages-column NAME (one of: {cols}) or --dataset-format FORMAT",
        )
    out = _message_list(row, row.value[column], column)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise data_error(row.file, row.row, column, "no assistant message, so there is nothing to train on")
    return out


def _message_list(row: Row, messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise data_error(
            row.file, row.row, where, f"expected a list of messages, got {type(messages).__name__}"
        )
    if not messages:
        raise data_error(row.file, row.row, where, "the conversation is empty")
    return [_message(row, msg, f"{where}[{i}]") for i, msg in enumerate(messages)]


def _message(row: Row, msg: Any, where: str) -> dict[str, Any]:
    f, r = row.file, row.row
    if not isinstance(msg, dict):
        raise data_error(f, r, where, f"expected an object with role and content, got {type(msg).__name__}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise data_error(
            f, r, f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(sorted(ROLES))}"
        )
    # Keys set to None are dropped, as transformers does: templates handle a missing key, not a None one.
    out = {k: v for k, v in msg.items() if v is not None and k not in REASONING_FIELDS}
    if msg.get("tool_calls") is not None:
        if role != "assistant":
            raise data_error(
                f, r, f"{where}.tool_calls", f"only assistant messages make tool calls, not {role}"
            )
        out["tool_calls"] = _tool_calls(row, msg["tool_calls"], f"{where}.tool_calls")
    content = msg.get("content")
    if content is None and "tool_calls" in out:
        content = ""  # OpenAI-style: a message that only calls tools has null content
    out["content"] = _content(row, content, f"{where}.content")
    for name in REASONING_FIELDS:
        value = msg.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise data_error(
                f, r, f"{where}.{name}", f"reasoning must be a string, got {type(value).__name__}"
            )
        out["reasoning_content"] = value
        break
    return out


def _content(row: Row, content: Any, where: str) -> str:
    """A string. A list of text parts is joined as Qwen3.5's template joins them; templates that read only string
    content (Qwen3's) would otherwise render such a message as empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise data_error(
                    row.file,
                    row.row,
                    where,
                    f'part {j} is {kind!r}; expected text parts ({{"type": "text", "text": "..."}}): '
                    "kernelguard train reads text only",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise data_error(
        row.file,
        row.row,
        where,
        f"content must be a string or a list of text parts, got {type(content).__name__}",
    )


def _tool_calls(row: Row, calls: Any, where: str) -> list[dict[str, Any]]:
    """Tool calls as ``{"type": "function", "function": {"name", "arguments": {...}}}`` (a bare
    ``{"name", "arguments"}`` is accepted). Arguments given as a JSON string (OpenAI style) are decoded: chat
    templates expect an object, and Qwen3.5's cannot render a string at all."""
    if not isinstance(calls, (list, tuple)):
        raise data_error(
            row.file, row.row, where, f"expected a list of tool calls, got {type(calls).__name__}"
        )
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise data_error(
                row.file,
                row.row,
                f"{where}[{j}]",
                'expected {"type": "function", "function": {"name": ..., "arguments": {...}}}',
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                args = e  # reported below
        if not isinstance(args, dict):
            raise data_error(
                row.file,
                row.row,
                f"{where}[{j}].arguments",
                "arguments must be an object or a JSON object string",
            )
        out.append(
            {**call, "function": {**fn, "arguments": args}}
            if "function" in call
            else {**fn, "arguments": args}
        )
    return out


def _tools(row: Row) -> list[dict[str, Any]] | None:
    """The row's optional ``tools`` column (a list of JSON schemas, or that list as a JSON string)."""
    tools = row.value.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise data_error(row.file, row.row, "tools", f"not valid JSON: {e.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise data_error(row.file, row.row, "tools", "expected a list of tool schemas (objects)")
    return tools or None


# ---------------------------------------------------------------------------------------------- encoding ---
@dataclass(frozen=True, slots=True)
class ChatItem:
    """A conversation to render; assistant turns from message ``first_trained`` on carry the loss."""

    row: Row
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    first_trained: int = 0
    where: str = "messages"


@dataclass(frozen=True, slots=True)
class TextItem:
    """Plain text; characters from ``loss_from`` on carry the loss (all of them at 0)."""

    row: Row
    text: str
    loss_from: int = 0


Item = ChatItem | TextItem


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
        raise ConfigError(
            f"{item.row.file}: conversational rows need a chat template, and the tokenizer has none.",
            fix="pass --chat-template FILE (or a shipped name, e.g. qwen3_training), or use text rows",
        )
    return choice.text


# ----------------------------------------------------------------------------------------------- items ---
def row_item(row: Row, fmt: str, *, column: str, assistant_only: bool, eos: str | None) -> Item:
    """The row as something to encode, or a DataError naming the field."""
    if not isinstance(row.value, dict):
        raise data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    if fmt == "messages":
        msgs = validate_messages(row, column, need_assistant=assistant_only)
        return ChatItem(row, msgs, _tools(row), 0, column)
    if fmt == "text":
        text = _required(row, "text", column)
        if not isinstance(text, str) or not text:
            raise data_error(row.file, row.row, "text", "expected a non-empty string")
        return TextItem(row, _with_eos(text, eos))
    prompt, completion = _required(row, "prompt", column), _required(row, "completion", column)
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise data_error(
                row.file, row.row, "completion", "the completion is empty, so there is nothing to train on"
            )
        return TextItem(row, prompt + _with_eos(completion, eos), len(prompt))
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        p, c = _message_list(row, prompt, "prompt"), _message_list(row, completion, "completion")
        if assistant_only and not any(m["role"] == "assistant" for m in c):
            raise data_error(
                row.file, row.row, "completion", "no assistant message, so there is nothing to train on"
            )
        return ChatItem(row, p + c, _tools(row), len(p), "completion")
    raise data_error(
        row.file,
        row.row,
        "completion",
        f"prompt and completion must both be strings or both be message lists, got {type(prompt).__name__} "
        f"and {type(completion).__name__}",
    )


def _required(row: Row, name: str, column: str) -> Any:
    if name not in row.value:
        raise _format_error(row, f"column {name!r} is missing", column, name)
    return row.value[name]


def _with_eos(text: str, eos: str | None) -> str:
    """Text rows end with the end-of-sequence token (as TRL does), so the model learns to stop."""
    return text if not eos or text.endswith(eos) else text + eos
