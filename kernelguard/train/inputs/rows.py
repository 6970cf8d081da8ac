"""One row of training data -> a validated item (kernelguard.train.inputs.encode turns items into input_ids, labels).

Row formats (TRL's dataset conventions), detected from the columns of the first row unless given:

- ``messages``: a list of ``{"role", "content"}`` messages (column name configurable). ``content`` is a string
  or a list of text parts; assistant turns may carry ``reasoning_content`` (or ``reasoning``/``thinking``) and
  ``tool_calls``; ``tool`` messages answer them; an optional ``tools`` column lists the tool schemas.
  Loss on the assistant's tokens.
- ``prompt``/``completion``: two strings (concatenated, end-of-sequence token appended) or two message lists
  (rendered as one conversation). Loss on the completion only.
- ``text``: plain language modelling; loss on every token.
- ``sharegpt``: a ``conversations`` column of ``{"from", "value"}`` turns (``human``/``gpt``/``system``...), read
  as ``messages``; a ``from``/``value`` turn is read in any messages column.
- ``columns:ROLE=COLUMN,...``: other column names mapped to a ``[system?, user, assistant]`` conversation that
  trains like a ``messages`` row. The layouts users bring are detected (question/answer, Alpaca's
  instruction/input/output, prompt/response: :data:`LAYOUTS`); any other names by ``--columns`` (its syntax:
  ``config_rules.parse_columns``). The format string carries the mapping, so it travels where a format name
  does (the row reader, the data counts, the run's identity).

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
from dataclasses import dataclass
from typing import Any

from kernelguard.errors import DataError

from ..settings.config_rules import parse_columns

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
SHAREGPT = "sharegpt"  # a 'conversations' column of {"from", "value"} turns (ShareGPT, Vicuna, LLaMA-Factory)
FORMATS = ("messages", "prompt-completion", "text", SHAREGPT)
# ShareGPT's speaker names -> chat roles (what FastChat, Axolotl and LLaMA-Factory read them as).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool"}  # fmt: skip
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")

Span = tuple[int, int]

__all__ = [
    "COLUMNS_PREFIX",
    "FORMATS",
    "LAYOUTS",
    "REASONING_FIELDS",
    "ROLES",
    "SHAREGPT",
    "SHAREGPT_ROLES",
    "ChatItem",
    "Item",
    "Row",
    "Span",
    "TextItem",
    "columns_format",
    "data_error",
    "describe_format",
    "detect_format",
    "mapped_messages",
    "row_item",
    "validate_messages",
]


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
    """The dataset format a row's columns say (TRL conventions, then :data:`LAYOUTS`), or a DataError listing
    formats and columns."""
    if not isinstance(row.value, dict):
        raise data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    keys = set(row.value)
    if column in keys:
        return "messages"
    if column == "messages" and "conversations" in keys:  # the default column: ShareGPT's name for it
        return SHAREGPT
    if {"prompt", "completion"} <= keys:
        return "prompt-completion"
    if "text" in keys:
        return "text"
    if (layout := detect_layout(keys)) is not None:
        return layout[1]
    raise _format_error(row, f"no column of a known dataset format (columns: {_columns(row)})", column)


def _columns(row: Row) -> str:
    return ", ".join(sorted(map(str, row.value))) or "none"


def _format_error(row: Row, problem: str, column: str, field_name: str | None = None) -> DataError:
    formats = (
        f"messages (a {column!r} column of chat messages), prompt-completion ('prompt' and 'completion' "
        "columns), text (a 'text' column), sharegpt (a 'conversations' column of from/value turns), "
        "question/answer, instruction/input/output, prompt/response"
    )
    error = data_error(
        row.file,
        row.row,
        field_name or column,
        f"{problem}; known formats: {formats}; other columns map to a conversation with --columns "
        "user=COLUMN,assistant=COLUMN (a column of chat messages: --messages-column NAME)",
        f"--columns {_example(row)}",
    )
    error.details["add"] = ("--columns", _example(row))  # the command line's caller pastes the whole command
    return error


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
    if "role" not in msg and "from" in msg:  # a ShareGPT turn: {"from": "human", "value": "..."}
        who = msg["from"]
        if not isinstance(who, str) or who.lower() not in SHAREGPT_ROLES:
            raise data_error(f, r, f"{where}.from", f"unknown speaker {who!r}; expected one of "
                             f"{', '.join(SHAREGPT_ROLES)}")
        msg = {k: v for k, v in msg.items() if k not in ("from", "value")} | {
            "role": SHAREGPT_ROLES[who.lower()], "content": msg.get("value")}
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


def row_item(row: Row, fmt: str, *, column: str, assistant_only: bool, eos: str | None) -> Item:
    """The row as something to encode, or a DataError naming the field."""
    if not isinstance(row.value, dict):
        raise data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    if fmt in ("messages", SHAREGPT):
        column = "conversations" if fmt == SHAREGPT else column
        msgs = validate_messages(row, column, need_assistant=assistant_only)
        return ChatItem(row, msgs, _tools(row), 0, column)
    if fmt.startswith(COLUMNS_PREFIX):
        return ChatItem(row, mapped_messages(row, fmt), _tools(row), 0, "columns")
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


# ------------------------------------------------------------------------------------ mapped columns ---
COLUMNS_PREFIX = "columns:"

# (what the layout is called, the columns that identify it, the mapping); the first whose columns a row has wins.
# A ``system`` column, when present, becomes the system message.
LAYOUTS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("question/answer", frozenset({"question", "answer"}), "user=question,assistant=answer"),
    ("instruction/input/output (Alpaca)", frozenset({"instruction", "input", "output"}),
     "user=instruction+input,assistant=output"),
    ("instruction/output", frozenset({"instruction", "output"}), "user=instruction,assistant=output"),
    ("prompt/response", frozenset({"prompt", "response"}), "user=prompt,assistant=response"),
)


def columns_format(spec: str) -> str:
    """The format string of a ``--columns`` mapping (normalised: ``columns:user=a+b,assistant=c``)."""
    mapping = parse_columns(spec)
    return COLUMNS_PREFIX + ",".join(f"{role}={'+'.join(cols)}" for role, cols in mapping.items())


def detect_layout(keys: set[str]) -> tuple[str, str] | None:
    """(the layout's name, its format string) for a row with these columns, or None."""
    for name, needs, spec in LAYOUTS:
        if needs <= keys:
            return name, columns_format(spec + (",system=system" if "system" in keys else ""))
    return None


def describe_format(fmt: str) -> str:
    """``columns:user=question,assistant=answer`` -> ``a conversation mapped from columns (user=question,
    assistant=answer)``; another format as it is."""
    if fmt == SHAREGPT:
        return "ShareGPT conversations (a 'conversations' column of from/value turns)"
    if not fmt.startswith(COLUMNS_PREFIX):
        return fmt
    return f"a conversation mapped from columns ({fmt[len(COLUMNS_PREFIX):].replace(',', ', ')})"


def mapped_messages(row: Row, fmt: str) -> list[dict[str, Any]]:
    """The row's ``[system?, user, assistant]`` messages under the mapping ``fmt``; a DataError names a missing
    or non-string column. Several columns of one role are joined by a blank line, empty ones left out (an
    Alpaca row's empty ``input``)."""
    mapping = parse_columns(fmt[len(COLUMNS_PREFIX):])
    messages = []
    for role in ("system", "user", "assistant"):
        parts = []
        for column in mapping.get(role, ()):
            if column not in row.value:
                columns = ", ".join(sorted(map(str, row.value))) or "none"
                raise data_error(row.file, row.row, column, f"column {column!r} ({role}) is missing (columns: "
                                 f"{columns})", f"--columns {_example(row)}")
            value = row.value[column]
            if value is not None and not isinstance(value, str):
                raise data_error(row.file, row.row, column, f"expected a string for the {role} message, got "
                                 f"{type(value).__name__}")
            if value and value.strip():
                parts.append(value)
        if parts:
            messages.append({"role": role, "content": "\n\n".join(parts)})
    if not any(m["role"] == "assistant" for m in messages):
        answer = "+".join(mapping["assistant"])
        raise data_error(row.file, row.row, answer, "the assistant column is empty, so there is nothing to train on")
    return messages


def _example(row: Row) -> str:
    """A --columns value naming this row's own first two columns, to edit."""
    names = [str(k) for k in row.value][:2]
    names += ["USER_COLUMN", "ASSISTANT_COLUMN"][len(names):]
    return f"user={names[0]},assistant={names[1]}"
