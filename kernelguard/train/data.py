"""Training data -> validated rows -> (input_ids, labels) examples.

Sources: a local ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a dataset name (``datasets``,
only where a hub is reachable). JSON files are read with the standard library, line by line, in strict
UTF-8, because Arrow's JSON reader can neither say which line broke nor survive a row whose field has the
wrong type; Parquet files and dataset names go through ``datasets.load_dataset``.

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

Eval split: with ``eval_fraction`` F, a row is an eval row iff a hash of (seed, row index) falls below F: the
same split on every rank and every run, whatever the world size. Rows of the other split are not parsed.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError, DataError

from . import chat_templates
from .chat_templates import GENERATION, NO_TEMPLATE, TemplateChoice
from .packing import IGNORE_INDEX

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
FORMATS = ("messages", "prompt-completion", "text")
TAKES = ("train", "eval", "all")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")

Span = tuple[int, int]


@dataclass(kw_only=True, slots=True)
class DataStats:
    rows: int = 0
    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_loss: int = 0
    bad_rows: Counter[str] = field(default_factory=Counter)
    format: str = ""  # one of FORMATS, as detected or given
    template: str = ""  # chat template used (chat_templates.TemplateChoice.name); "" for plain text
    take: str = "all"  # which split these examples are: train, eval or all
    held_out: int = 0  # rows of the other split (not parsed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "examples": self.examples,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "truncated": self.truncated,
            "dropped_overlong": self.dropped_overlong,
            "dropped_no_loss": self.dropped_no_loss,
            "bad_rows": dict(self.bad_rows),
            "format": self.format,
            "template": self.template,
            "take": self.take,
            "held_out": self.held_out,
        }

    def render(self) -> str:
        bad = sum(self.bad_rows.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_rows.items()))
        kind = self.format or "?"
        if self.template:
            kind += f", chat template {self.template}"
        split = (
            f"{self.take} split ({self.held_out} rows held out for the other split); "
            if self.held_out
            else ""
        )
        return (
            f"{kind}: {split}"
            f"{self.rows} rows -> {self.examples} examples ({self.tokens} tokens, {self.loss_tokens} with loss); "
            f"{self.truncated} truncated, {self.dropped_overlong} dropped as overlong, "
            f"{self.dropped_no_loss} dropped without loss tokens, {bad} bad rows skipped"
            + (f" ({reasons})" if bad else "")
        )


class ExampleStore:
    """Tokenized examples in two flat int32 arrays (4 bytes a token, not a Python int object each).

    ``store[i]`` is ``(input_ids, labels)`` as lists; ``lengths()`` feeds the packer."""

    def __init__(self) -> None:
        self._ids = array("i")
        self._labels = array("i")
        self._offsets = array("q", [0])

    def append(self, ids: list[int], labels: list[int]) -> None:
        self._ids.extend(ids)
        self._labels.extend(labels)
        self._offsets.append(len(self._ids))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        a, b = self._offsets[i], self._offsets[i + 1]
        return self._ids[a:b].tolist(), self._labels[a:b].tolist()

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> list[int]:
        off = self._offsets
        return [off[i + 1] - off[i] for i in range(len(self))]


@dataclass(frozen=True, slots=True)
class Row:
    file: str
    row: int  # 1-based line for JSONL, 0-based index for JSON arrays / Parquet / datasets
    value: Any
    index: int = 0  # 0-based position among all rows of the data (all files, bad rows included)


def _data_error(file: str, row: int, field_name: str, problem: str, fix: str | None = None) -> DataError:
    return DataError(
        f"{file}, row {row}, field {field_name!r}: {problem}",
        fix=fix or "fix or remove that row, or pass --skip-bad-rows to skip malformed rows with a count",
        details={"file": file, "row": row, "field": field_name},
    )


# ----------------------------------------------------------------------------------------------- sources ---
def resolve_files(data: str) -> list[Path] | None:
    """Local files to read, or None when ``data`` is not a local path (then it is a dataset name)."""
    path = Path(data)
    if path.is_file():
        if path.suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
            raise ConfigError(
                f"data file {path} has suffix {path.suffix!r}; expected .jsonl, .json or .parquet.",
                fix="convert it to JSON lines or Parquet",
            )
        return [path]
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in JSON_SUFFIXES + PARQUET_SUFFIXES
        )
        if not files:
            raise ConfigError(
                f"data folder {path} holds no .jsonl, .json or .parquet files.", fix="check --data"
            )
        return files
    if path.suffix in JSON_SUFFIXES + PARQUET_SUFFIXES or data.startswith((".", "/")):
        raise ConfigError(f"data path {data} does not exist.", fix="check --data")
    return None


Keep = Callable[[int], bool]


class _Counter:
    """Row indices across files; ``keep`` decides (before any parsing) whether a row belongs to this split."""

    def __init__(self, keep: Keep | None) -> None:
        self.next = 0
        self.keep = keep

    def take(self) -> tuple[int, bool]:
        index, self.next = self.next, self.next + 1
        return index, self.keep is None or self.keep(index)


def _iter_json_file(path: Path, skipped: Counter[str], skip_bad: bool, counter: _Counter) -> Iterator[Row]:
    name = str(path)
    raw = path.read_bytes()
    if raw.lstrip()[:1] == b"[":
        try:
            items = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _data_error(
                name, 0, "<file>", f"not valid UTF-8 at byte {e.start}", "re-encode the file as UTF-8"
            )
        except json.JSONDecodeError as e:
            raise _data_error(name, 0, "<file>", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
        for i, item in enumerate(items):
            index, keep = counter.take()
            if keep:
                yield Row(name, i, item, index)
        return
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        index, keep = counter.take()
        if not keep:
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            err = _data_error(name, lineno, "<line>", f"not valid UTF-8 at byte {e.start} of the line")
            if not skip_bad:
                raise err from None
            skipped["not_utf8"] += 1
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if not skip_bad:
                raise _data_error(
                    name, lineno, "<line>", f"invalid JSON at column {e.colno}: {e.msg}"
                ) from None
            skipped["invalid_json"] += 1
            continue
        yield Row(name, lineno, value, index)


def _iter_dataset(ds: Any, name: str, counter: _Counter) -> Iterator[Row]:
    for i, item in enumerate(ds):
        index, keep = counter.take()
        if keep:
            yield Row(name, i, item, index)


def iter_rows(
    data: str, *, split: str = "train", skipped: Counter[str], skip_bad: bool, keep: Keep | None = None
) -> Iterator[Row]:
    """Every row of ``data`` whose index ``keep`` accepts (all rows without ``keep``)."""
    counter = _Counter(keep)
    files = resolve_files(data)
    if files is None:
        try:
            import datasets
        except ImportError as e:
            raise ConfigError(
                "reading a dataset by name needs `datasets`.", fix="pip install 'kernelguard[train]'"
            ) from e
        try:
            ds = datasets.load_dataset(data, split=split)
        except Exception as e:
            raise ConfigError(
                f"could not load dataset {data!r} (split {split!r}): {e}", fix="check --data"
            ) from e
        yield from _iter_dataset(ds, data, counter)
        return
    for path in files:
        if path.suffix in JSON_SUFFIXES:
            yield from _iter_json_file(path, skipped, skip_bad, counter)
        else:
            import datasets

            try:
                ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train")
            except Exception as e:
                raise _data_error(
                    str(path), 0, "<file>", f"unreadable Parquet: {e}", "rewrite the file"
                ) from e
            yield from _iter_dataset(ds, str(path), counter)


def in_eval_split(index: int, *, seed: int, fraction: float) -> bool:
    """Whether row ``index`` is an eval row: a hash of (seed, index), uniform in [0, 1), below ``fraction``."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


# ------------------------------------------------------------------------------------------- validation ---
def detect_format(row: Row, column: str = "messages") -> str:
    """The dataset format a row's columns say (TRL conventions), or a DataError listing formats and columns."""
    if not isinstance(row.value, dict):
        raise _data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
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
    return _data_error(
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
        raise _data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    if column not in row.value:
        cols = _columns(row)
        raise _data_error(
            row.file,
            row.row,
            column,
            f"column {column!r} is missing (columns: {cols})",
            f"pass --messages-column NAME (one of: {cols}) or --dataset-format FORMAT",
        )
    out = _message_list(row, row.value[column], column)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise _data_error(row.file, row.row, column, "no assistant message, so there is nothing to train on")
    return out


def _message_list(row: Row, messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise _data_error(
            row.file, row.row, where, f"expected a list of messages, got {type(messages).__name__}"
        )
    if not messages:
        raise _data_error(row.file, row.row, where, "the conversation is empty")
    return [_message(row, msg, f"{where}[{i}]") for i, msg in enumerate(messages)]


def _message(row: Row, msg: Any, where: str) -> dict[str, Any]:
    f, r = row.file, row.row
    if not isinstance(msg, dict):
        raise _data_error(f, r, where, f"expected an object with role and content, got {type(msg).__name__}")
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _data_error(
            f, r, f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(sorted(ROLES))}"
        )
    # Keys set to None are dropped, as transformers does: templates handle a missing key, not a None one.
    out = {k: v for k, v in msg.items() if v is not None and k not in REASONING_FIELDS}
    if msg.get("tool_calls") is not None:
        if role != "assistant":
            raise _data_error(
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
            raise _data_error(
                f, r, f"{where}.{name}", f"reasoning must be a string, got {type(value).__name__}"
            )
        out["reasoning_content"] = value
        break
    return out


def _content(row: Row, content: Any, where: str) -> str:
    """A string. Lists of text parts are joined as Qwen3.5's template joins them; templates that read only string
    content (Qwen3's) would otherwise render such a message as empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or kind != "text" or not isinstance(part.get("text"), str):
                raise _data_error(
                    row.file,
                    row.row,
                    f"{where}[{j}]",
                    f"content part of type {kind!r}; kernelguard train reads text parts "
                    '({"type": "text", "text": "..."}) only',
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _data_error(
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
        raise _data_error(
            row.file, row.row, where, f"expected a list of tool calls, got {type(calls).__name__}"
        )
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _data_error(
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
            raise _data_error(
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
            raise _data_error(row.file, row.row, "tools", f"not valid JSON: {e.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _data_error(row.file, row.row, "tools", "expected a list of tool schemas (objects)")
    return tools or None


# ------------------------------------------------------------------------------------------- tokenizers ---
def load_tokenizer(path: str, *, chat_template: str | Path | None = None) -> Any:
    """A fast tokenizer plus the chat template to train with (see ``chat_template_name``): ``chat_template`` (a
    .jinja file or a shipped template's name) if given, else the shipped training variant of a known Qwen
    template, else the tokenizer's own. The tokenizer's own ``chat_template`` is left as it is, so a saved
    checkpoint keeps the template people run inference with."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"could not load a tokenizer from {path}: {e}", fix="pass --tokenizer DIR") from e
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"the tokenizer at {path} is not a fast tokenizer (no offsets).", fix="ship tokenizer.json"
        )
    set_chat_template(tok, chat_template)
    return tok


def set_chat_template(tokenizer: Any, chat_template: str | Path | None = None) -> TemplateChoice:
    """Choose (as ``load_tokenizer`` does) and record on ``tokenizer`` the chat template to train with."""
    choice = chat_templates.choose(_own_template(tokenizer), chat_template)
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
    return _data_error(
        item.row.file,
        item.row.row,
        item.where,
        f"the chat template could not render this conversation: {type(e).__name__}: {e}",
    )


def _unstable_error(item: ChatItem, i: int, template: str) -> DataError:
    hint = chat_templates.suggest(template)
    shipped = ", ".join(n for n in chat_templates.shipped_names() if n.endswith("_training"))
    looks = f"this template looks like {hint}'s original, so try --chat-template {hint}; " if hint else ""
    return _data_error(
        item.row.file,
        item.row.row,
        f"{item.where}[{i}]",
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


def _generation_example(tokenizer: Any, item: ChatItem, template: str) -> tuple[list[int], list[int]]:
    """transformers' own assistant mask from the template's {% generation %} blocks; for a prompt/completion
    conversation, only the part after the prompt's rendering."""
    boundary = 0
    if item.first_trained:
        prompt = _render(tokenizer, template, item, item.messages[: item.first_trained], prompt=False)
        if not _render(tokenizer, template, item, item.messages, prompt=False).startswith(prompt):
            raise _unstable_error(item, item.first_trained, template)
        boundary = len(prompt)
    try:
        enc = tokenizer.apply_chat_template(
            item.messages,
            tools=item.tools,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"return_offsets_mapping": True},
        )
    except Exception as e:  # noqa: BLE001 - see _render
        raise _template_error(item, e) from None
    ids = list(enc["input_ids"])
    trained = [
        bool(m) and start >= boundary
        for m, (start, _end) in zip(enc["assistant_masks"], enc["offset_mapping"])
    ]
    return ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, trained)]


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
    tokenizer: Any, items: list[Item], *, assistant_only: bool, on_error: Callable[[DataError], None]
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) for every item, in order; an item that fails goes to ``on_error`` (which raises, or
    counts it and returns)."""
    choice = template_choice(tokenizer)
    done: dict[int, tuple[list[int], list[int]]] = {}
    texts: list[tuple[int, str, list[Span] | None, bool]] = []  # position, text, spans (None: all), specials
    for pos, item in enumerate(items):
        try:
            if isinstance(item, TextItem):
                spans = [(item.loss_from, len(item.text))] if assistant_only and item.loss_from else None
                texts.append((pos, item.text, spans, True))
                continue
            template = _chat_template_or_raise(choice, item)
            if not assistant_only:  # never locate assistant tokens: one plain rendering
                texts.append(
                    (pos, _render(tokenizer, template, item, item.messages, prompt=False), None, False)
                )
            elif choice.method == GENERATION:
                done[pos] = _generation_example(tokenizer, item, template)
            else:
                full, spans = assistant_spans(tokenizer, item, template)
                texts.append((pos, full, spans, False))
        except DataError as e:
            on_error(e)
    for specials in (True, False):
        group = [t for t in texts if t[3] is specials]
        if not group:
            continue
        # Chat renderings already hold their special tokens (apply_chat_template tokenizes them the same way).
        enc = tokenizer([t[1] for t in group], add_special_tokens=specials, return_offsets_mapping=True)
        for (pos, _text, spans, _), ids, offsets in zip(group, enc["input_ids"], enc["offset_mapping"]):
            done[pos] = (list(ids), _labels_from_spans(list(ids), list(offsets), spans))
    return [done[pos] for pos in sorted(done)]


def _chat_template_or_raise(choice: TemplateChoice, item: ChatItem) -> str:
    if choice.method == NO_TEMPLATE or choice.text is None:
        raise ConfigError(
            f"{item.row.file}: conversational rows need a chat template, and the tokenizer has none.",
            fix="pass --chat-template FILE (or a shipped name, e.g. qwen3_training), or use text rows",
        )
    return choice.text


# ------------------------------------------------------------------------------------------------ rows ---
def row_item(row: Row, fmt: str, *, column: str, assistant_only: bool, eos: str | None) -> Item:
    """The row as something to encode, or a DataError naming the field."""
    if not isinstance(row.value, dict):
        raise _data_error(row.file, row.row, "<row>", f"expected an object, got {type(row.value).__name__}")
    if fmt == "messages":
        msgs = validate_messages(row, column, need_assistant=assistant_only)
        return ChatItem(row, msgs, _tools(row), 0, column)
    if fmt == "text":
        text = _required(row, "text", column)
        if not isinstance(text, str) or not text:
            raise _data_error(row.file, row.row, "text", "expected a non-empty string")
        return TextItem(row, _with_eos(text, eos))
    prompt, completion = _required(row, "prompt", column), _required(row, "completion", column)
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise _data_error(
                row.file, row.row, "completion", "the completion is empty, so there is nothing to train on"
            )
        return TextItem(row, prompt + _with_eos(completion, eos), len(prompt))
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        p, c = _message_list(row, prompt, "prompt"), _message_list(row, completion, "completion")
        if assistant_only and not any(m["role"] == "assistant" for m in c):
            raise _data_error(
                row.file, row.row, "completion", "no assistant message, so there is nothing to train on"
            )
        return ChatItem(row, p + c, _tools(row), len(p), "completion")
    raise _data_error(
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


# ------------------------------------------------------------------------------------------------ load ---
def _check_args(dataset_format: str, take: str, eval_fraction: float, overlong: str) -> None:
    if dataset_format not in ("auto", *FORMATS):
        raise ConfigError(
            f"unknown dataset format {dataset_format!r}.", fix=f"use one of: auto, {', '.join(FORMATS)}"
        )
    if take not in TAKES:
        raise ConfigError(f"unknown split {take!r} to take.", fix=f"use one of: {', '.join(TAKES)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(
            f"eval fraction {eval_fraction} is outside [0, 1).", fix="pass e.g. --eval-fraction 0.05"
        )
    if take == "eval" and eval_fraction <= 0:
        raise ConfigError(
            "taking the eval split needs an eval fraction above 0.", fix="pass --eval-fraction F"
        )
    if overlong not in ("truncate", "drop"):
        raise ConfigError(f"unknown overlong policy {overlong!r}.", fix="use truncate or drop")


def _bad_row_key(e: DataError) -> str:
    name = str(e.details.get("field", "row"))
    return name.rsplit(".", 1)[-1] if "." in name else name.split("[")[0]


def load_examples(
    *,
    data: str,
    tokenizer: Any,
    block_size: int,
    column: str = "messages",
    split: str = "train",
    overlong: str = "truncate",
    skip_bad_rows: bool = False,
    assistant_only: bool = True,
    dataset_format: str = "auto",
    eval_fraction: float = 0.0,
    seed: int = 0,
    take: str = "train",
    chunk: int = 2048,
) -> tuple[ExampleStore, DataStats]:
    """Every usable example of the ``take`` split as (input_ids, labels) in an ExampleStore, plus counts.

    ``split`` is the dataset split read by name (``datasets``); ``take`` picks rows by the eval split
    (``eval_fraction`` > 0): "train" the others, "eval" the eval rows, "all" every row. Raises DataError on the first
    bad row unless ``skip_bad_rows``; raises DataError when nothing usable is left."""
    _check_args(dataset_format, take, eval_fraction, overlong)
    stats = DataStats(take=take)
    examples = ExampleStore()
    pending: list[Item] = []
    fmt = "" if dataset_format == "auto" else dataset_format
    eos = getattr(tokenizer, "eos_token", None)
    chats = False  # whether any row was a conversation (then the stats name the chat template)

    def keep(index: int) -> bool:
        is_eval = in_eval_split(index, seed=seed, fraction=eval_fraction)
        kept = take == "all" or is_eval == (take == "eval")
        stats.held_out += not kept
        return kept

    def bad(e: DataError) -> None:
        if not skip_bad_rows:
            raise e
        stats.bad_rows[_bad_row_key(e)] += 1

    def flush() -> None:
        encoded = encode_items(tokenizer, pending, assistant_only=assistant_only, on_error=bad)
        pending.clear()
        for ids, labels in encoded:
            _add_example(examples, stats, ids, labels, block_size=block_size, overlong=overlong)

    for row in iter_rows(data, split=split, skipped=stats.bad_rows, skip_bad=skip_bad_rows, keep=keep):
        stats.rows += 1
        try:
            fmt = fmt or detect_format(row, column)
            item = row_item(row, fmt, column=column, assistant_only=assistant_only, eos=eos)
        except DataError as e:
            bad(e)
            continue
        chats |= isinstance(item, ChatItem)
        pending.append(item)
        if len(pending) >= chunk:
            flush()
    flush()
    stats.rows += sum(stats.bad_rows[k] for k in ("not_utf8", "invalid_json"))
    stats.format = fmt
    stats.template = chat_template_name(tokenizer) if chats else ""
    if len(examples) == 0:
        what = {"eval": "eval", "all": "usable"}.get(take, "usable training")
        raise DataError(
            f"no {what} examples in {data} ({stats.render()}).",
            fix="check the data, --dataset-format, --messages-column, --overlong and --eval-fraction",
            details={"file": data, "row": None, "field": column},
        )
    return examples, stats


def _add_example(
    examples: ExampleStore,
    stats: DataStats,
    ids: list[int],
    labels: list[int],
    *,
    block_size: int,
    overlong: str,
) -> None:
    if len(ids) > block_size:
        if overlong == "drop":
            stats.dropped_overlong += 1
            return
        ids, labels = ids[:block_size], labels[:block_size]
        stats.truncated += 1
    loss_tokens = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
    if loss_tokens == 0:
        stats.dropped_no_loss += 1
        return
    stats.examples += 1
    stats.tokens += len(ids)
    stats.loss_tokens += loss_tokens
    examples.append(ids, labels)
