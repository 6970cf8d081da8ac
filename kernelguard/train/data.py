"""Chat data -> validated conversations -> (input_ids, labels) examples.

Sources: a local ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a dataset name (``datasets``,
only where a hub is reachable). JSON files are read with the standard library, line by line, in strict
UTF-8, because Arrow's JSON reader can neither say which line broke nor survive a row whose field has the
wrong type; Parquet files and dataset names go through ``datasets.load_dataset``.

Rows use the UltraChat / TRL convention: a ``messages`` column (name configurable) holding a list of
``{"role": ..., "content": str}``.

Assistant-only loss finds assistant spans by rendering the chat template incrementally: for assistant
message i, its span is the characters between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i+1])`` (each a string prefix of the full rendering). The full text is tokenized once
with offsets and a token is trained when its first character lies in a span — so the span includes the
turn's end token. This works with any template whose renderings are prefix-stable; templates that rewrite
earlier turns (e.g. strip reasoning from history) are rejected with a DataError naming the row.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError, DataError

from .packing import IGNORE_INDEX

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


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
        }

    def render(self) -> str:
        bad = sum(self.bad_rows.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_rows.items()))
        return (
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


def _iter_json_file(path: Path, skipped: Counter[str], skip_bad: bool) -> Iterator[Row]:
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
            yield Row(name, i, item)
        return
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
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
        yield Row(name, lineno, value)


def _iter_dataset(ds: Any, name: str) -> Iterator[Row]:
    for i, item in enumerate(ds):
        yield Row(name, i, item)


def iter_rows(data: str, *, split: str = "train", skipped: Counter[str], skip_bad: bool) -> Iterator[Row]:
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
        yield from _iter_dataset(ds, data)
        return
    for path in files:
        if path.suffix in JSON_SUFFIXES:
            yield from _iter_json_file(path, skipped, skip_bad)
        else:
            import datasets

            try:
                ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train")
            except Exception as e:
                raise _data_error(
                    str(path), 0, "<file>", f"unreadable Parquet: {e}", "rewrite the file"
                ) from e
            yield from _iter_dataset(ds, str(path))


# ------------------------------------------------------------------------------------------- validation ---
def validate_messages(row: Row, column: str, *, need_assistant: bool) -> list[dict[str, str]]:
    """The row's conversation as a list of {"role", "content"} dicts, or a DataError naming the field."""
    f, r = row.file, row.row
    if not isinstance(row.value, dict):
        raise _data_error(f, r, "<row>", f"expected an object, got {type(row.value).__name__}")
    if column not in row.value:
        cols = ", ".join(sorted(map(str, row.value))) or "none"
        raise _data_error(
            f,
            r,
            column,
            f"column {column!r} is missing (columns: {cols})",
            f"pass --messages-column NAME (one of: {cols})",
        )
    messages = row.value[column]
    if not isinstance(messages, (list, tuple)):
        raise _data_error(f, r, column, f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise _data_error(f, r, column, "the conversation is empty")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"{column}[{i}]"
        if not isinstance(msg, dict):
            raise _data_error(
                f, r, where, f"expected an object with role and content, got {type(msg).__name__}"
            )
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _data_error(
                f, r, f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(sorted(ROLES))}"
            )
        content = msg.get("content")
        if not isinstance(content, str):
            raise _data_error(
                f, r, f"{where}.content", f"content must be a string, got {type(content).__name__}"
            )
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise _data_error(f, r, column, "no assistant message, so there is nothing to train on")
    return out


# ----------------------------------------------------------------------------------------- tokenization ---
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"could not load a tokenizer from {path}: {e}", fix="pass --tokenizer DIR") from e
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"the tokenizer at {path} has no chat_template.", fix="use a tokenizer with a chat template"
        )
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"the tokenizer at {path} is not a fast tokenizer (no offsets).", fix="ship tokenizer.json"
        )
    return tok


def pad_token_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return text if isinstance(text, str) else str(text)


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], row: Row
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of every assistant turn in it (see module docstring)."""
    full = _render(tokenizer, messages, generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise _data_error(
                row.file,
                row.row,
                f"messages[{i}]",
                "the chat template does not render this conversation prefix-stably (it rewrites earlier turns), "
                "so assistant spans cannot be located",
                "use a template without history rewriting, or train on all tokens with --all-tokens-loss",
            )
        spans.append((len(before), len(upto)))
    return full, spans


def tokenize_conversations(
    tokenizer: Any, conversations: list[tuple[Row, list[dict[str, str]]]], *, assistant_only: bool
) -> list[tuple[list[int], list[int]]]:
    rendered = [assistant_spans(tokenizer, msgs, row) for row, msgs in conversations]
    if not rendered:
        return []
    enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out: list[tuple[list[int], list[int]]] = []
    for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered):
        if not assistant_only:
            out.append((list(ids), list(ids)))
            continue
        labels = [IGNORE_INDEX] * len(ids)
        k = 0
        for t, (start, _end) in enumerate(offsets):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                labels[t] = ids[t]
        out.append((list(ids), labels))
    return out


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
    chunk: int = 2048,
) -> tuple[ExampleStore, DataStats]:
    """Every usable example as (input_ids, labels) in an ExampleStore, plus counts. Raises DataError on the first bad row
    unless ``skip_bad_rows``; raises DataError when nothing usable is left."""
    stats = DataStats()
    examples = ExampleStore()
    pending: list[tuple[Row, list[dict[str, str]]]] = []

    def flush() -> None:
        for ids, labels in tokenize_conversations(tokenizer, pending, assistant_only=assistant_only):
            if len(ids) > block_size:
                if overlong == "drop":
                    stats.dropped_overlong += 1
                    continue
                ids, labels = ids[:block_size], labels[:block_size]
                stats.truncated += 1
            loss_tokens = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
            if loss_tokens == 0:
                stats.dropped_no_loss += 1
                continue
            stats.examples += 1
            stats.tokens += len(ids)
            stats.loss_tokens += loss_tokens
            examples.append(ids, labels)
        pending.clear()

    for row in iter_rows(data, split=split, skipped=stats.bad_rows, skip_bad=skip_bad_rows):
        stats.rows += 1
        try:
            msgs = validate_messages(row, column, need_assistant=assistant_only)
        except DataError as e:
            if not skip_bad_rows:
                raise
            field_name = str(e.details.get("field", "row"))
            stats.bad_rows[
                field_name.rsplit(".", 1)[-1] if "." in field_name else field_name.split("[")[0]
            ] += 1
            continue
        pending.append((row, msgs))
        if len(pending) >= chunk:
            flush()
    flush()
    stats.rows += sum(stats.bad_rows[k] for k in ("not_utf8", "invalid_json"))
    if len(examples) == 0:
        raise DataError(
            f"no usable training examples in {data} ({stats.render()}).",
            fix="check the data, --messages-column and --overlong",
            details={"file": data, "row": None, "field": column},
        )
    return examples, stats
