"""Where training rows come from: a local ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a dataset
name (see kernelguard.train.data's docstring for why JSON is read line by line with the standard library)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError

from .rows import Row, data_error

__all__ = ["JSON_SUFFIXES", "PARQUET_SUFFIXES", "Keep", "iter_rows", "resolve_files"]

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


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
            raise data_error(
                name, 0, "<file>", f"not valid UTF-8 at byte {e.start}", "re-encode the file as UTF-8"
            )
        except json.JSONDecodeError as e:
            raise data_error(name, 0, "<file>", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
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
            err = data_error(name, lineno, "<line>", f"not valid UTF-8 at byte {e.start} of the line")
            if not skip_bad:
                raise err from None
            skipped["not_utf8"] += 1
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if not skip_bad:
                raise data_error(
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
                raise data_error(
                    str(path), 0, "<file>", f"unreadable Parquet: {e}", "rewrite the file"
                ) from e
            yield from _iter_dataset(ds, str(path), counter)
