"""Where training rows come from: a local ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a dataset
name (see kernelguard.train.inputs.data's docstring for why JSON is read line by line with the standard library)."""

from __future__ import annotations

import difflib
import gzip
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import (
    dangling_link,
    extra_command,
    offline_setting,
    saved_dataset,
    unreachable_hub,
)

from ..common.run_folder import CONFIG_FILE, METRICS_FILE, RUN_FILE
from .rows import Row, data_error

__all__ = [
    "JSON_SUFFIXES",
    "PARQUET_SUFFIXES",
    "SPLIT_NAMES",
    "Keep",
    "hub_offline_error",
    "iter_rows",
    "looks_local",
    "missing_path_error",
    "resolve_files",
]

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


# A file or folder name token that marks its split, as datasets' data-file patterns do (train.jsonl,
# data/test-00000.parquet, valid/...). A folder with such names is read split by split, never all at once.
SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
# Files in a data folder that are never rows: a saved dataset's metadata, a run's own outputs.
_NOT_DATA = {"dataset_info.json", "state.json", "dataset_dict.json", METRICS_FILE, RUN_FILE, CONFIG_FILE,
             "config.json"}


def _data_suffix(path: Path) -> str:
    """``.jsonl`` for ``x.jsonl`` and ``x.jsonl.gz`` (gzip is read transparently); else the last suffix."""
    suffixes = path.suffixes[-2:]
    return suffixes[0] if len(suffixes) == 2 and suffixes[1] == ".gz" and suffixes[0] in JSON_SUFFIXES else path.suffix


def _split_of(path: Path, root: Path) -> str | None:
    tokens = {t for part in path.relative_to(root).parts for t in re.split(r"[-._ 0-9]+", part.lower()) if t}
    found = [name for name, spellings in SPLIT_NAMES.items() if tokens & set(spellings)]
    return found[0] if len(found) == 1 else None


def resolve_files(data: str, *, split: str | None = "train", flag: str = "--data") -> list[Path] | None:
    """Local files to read, or None when ``data`` is not a local path (then it is a dataset name). In a
    folder, files named by split (train.jsonl, test/...) are read for ``split`` only; hidden files and
    metadata are skipped. ``split`` None: every file (an --eval-data folder is all eval data)."""
    path = Path(data).expanduser()
    known = JSON_SUFFIXES + PARQUET_SUFFIXES
    if path.is_file():
        if _data_suffix(path) not in known:
            raise _suffix_error(path, known)
        if split not in ("train", None):
            raise ConfigError(
                f"--split {split}: {path} is one file, which has no splits.",
                fix="pass the file of that split as --data, or leave --split out",
            )
        return [path]
    if path.is_dir() and (saved := saved_dataset(path)):
        raise ConfigError(
            f"--data {path} is {saved}; kernelguard train reads JSON lines, JSON or Parquet files.",
            fix=f"python -c \"import datasets; d = datasets.load_from_disk('{path}'); "
            + ("d['train']" if "DatasetDict" in saved else "d") + f".to_json('{path}.jsonl')\" then --data "
            f"{path}.jsonl",
        )
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and _data_suffix(p) in known and p.name not in _NOT_DATA
            and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts)
        )
        if not files:
            held = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
            said = f" (it holds {', '.join(held[:5])}{' ...' if len(held) > 5 else ''})" if held else " (it is empty)"
            raise ConfigError(f"data folder {path} holds no .jsonl, .json or .parquet files{said}.")
        return files if split is None else _files_of_split(files, path, split)
    if (broken := dangling_link(path)) is not None:
        raise ConfigError(f"--data {broken}.")
    if looks_local(data):
        raise missing_path_error(data, flag=flag)
    return None


def _suffix_error(path: Path, known: tuple[str, ...]) -> ConfigError:
    """A data file of another suffix: a near one is a typo (the rename is the fix); CSV/TSV converts with
    `datasets` (a train extra); anything else has no command that would surely convert it."""
    import shlex

    expected = "expected .jsonl, .json or .parquet (or .jsonl.gz)"
    close = difflib.get_close_matches(path.suffix, known, n=1, cutoff=0.6)
    if close:
        renamed = path.with_suffix(close[0])
        return ConfigError(
            f"data file {path} has suffix {path.suffix!r}; {expected}. Did you mean {close[0]}? Rename it, then "
            f"pass --data {renamed}.", fix=f"mv {shlex.quote(str(path))} {shlex.quote(str(renamed))}")
    if path.suffix.lower() in (".csv", ".tsv"):
        out = path.with_suffix(".jsonl")
        sep = ", delimiter='\\t'" if path.suffix.lower() == ".tsv" else ""
        return ConfigError(
            f"data file {path} has suffix {path.suffix!r}; {expected}. Convert it, then pass --data {out}.",
            fix=f"python -c \"import datasets; datasets.load_dataset('csv', data_files='{path}'{sep})['train']"
            f".to_json('{out}')\"")
    return ConfigError(f"data file {path} has suffix {path.suffix!r}; {expected}: convert it to JSON lines "
                       "(one JSON object per line) or Parquet.")


# Suffixes that make a name a file name, never a Hub dataset id (Hub ids are ``owner/name`` or a bare name, and
# a dot followed by letters is all but unknown in them).
_FILE_SUFFIXES = ("jsonl", "json", "parquet", "csv", "tsv", "txt", "gz", "zst", "bz2", "xz", "zip", "arrow",
                  "ndjson", "jsonlines", "pq", "yaml", "yml", "xlsx", "md")
_LETTER_SUFFIX = re.compile(r"\.([A-Za-z][A-Za-z0-9]{0,9})$")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


def looks_local(data: str) -> bool:
    """Whether ``data`` (a --data / --eval-data value that does not exist) was meant as a local path, so it must
    be refused at once instead of being tried as a Hub dataset name (45 s of network retries when offline): it
    starts with ``.``, ``/`` or ``~``, has more than one ``/`` or a ``\\``, sits in a folder that exists
    (``data/chat.jsnol``), or ends in a file-like suffix (``chitchat.jsnol``; after an ``owner/`` only a
    data-file suffix or a near miss of one, since a Hub id may hold a dot)."""
    if data.startswith((".", "/", "~")) or "\\" in data or data.count("/") > 1:
        return True
    if "/" in data and _exists(Path(data).parent):
        return True
    match = _LETTER_SUFFIX.search(data)
    if match is None:
        return False
    suffix = match.group(1).lower()
    return "/" not in data or suffix in _FILE_SUFFIXES or bool(
        difflib.get_close_matches(suffix, ("jsonl", "json", "parquet"), n=1, cutoff=0.6))


def missing_path_error(data: str, *, flag: str) -> ConfigError:
    """``flag DATA`` names no file or folder: say so, with the nearest existing name in its folder. The value
    to put instead is in ``details["replace"]`` (the command line's caller pastes the corrected command)."""
    path = Path(data).expanduser()
    folder = path.parent
    if not _exists(folder):
        return ConfigError(f"{flag} {data}: no such file or folder ({folder} does not exist either); a local path "
                           "is never looked up on the Hugging Face Hub.")
    try:
        names = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
    except OSError:
        names = []
    # near in the whole name and in the stem: `nope.jsonl` is not "nearly" `nocol.jsonl` for sharing `.jsonl`
    stem = path.name.split(".")[0]
    alike = [n for n in names if difflib.SequenceMatcher(None, stem, n.split(".")[0]).ratio() >= 0.6]
    close = difflib.get_close_matches(path.name, alike, n=1, cutoff=0.6)
    if not close:
        where = "the current folder" if str(folder) == "." else folder
        return ConfigError(f"{flag} {data}: no such file or folder in {where}; a local path is never looked up on "
                           "the Hugging Face Hub.")
    suggestion = close[0] if str(folder) == "." and not data.startswith("./") else str(Path(data).parent / close[0])
    return ConfigError(f"{flag} {data}: no such file or folder; did you mean {suggestion}?",
                       fix=f"{flag} {suggestion}", details={"flag": flag, "replace": (data, suggestion)})


def hub_offline_error(data: str, *, flag: str = "--data") -> ConfigError | None:
    """One line when ``data`` (a dataset name) would be read from the Hub while the Hub is off
    (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) or its host does not resolve, and the dataset is not in the
    local cache; None otherwise. Said before the guard runs, never after retries. A cached dataset with no
    network is read from the cache: ``HF_HUB_OFFLINE=1`` is set for this process and the ranks it starts."""
    setting = offline_setting()
    offline = f"{setting} is set" if setting else None
    if offline is None and (reason := unreachable_hub()) is not None:
        offline = f"the Hub cannot be reached from this machine ({reason})"
        if _in_hub_cache(data):
            os.environ["HF_HUB_OFFLINE"] = "1"  # read the cached copy without six retries first
    if offline is None or _in_hub_cache(data):
        return None
    return ConfigError(
        f"{flag} {data} is no local file or folder, so it would be read from the Hugging Face Hub, but "
        f"{offline} and the dataset is not in the local cache.",
        fix=f"hf download --repo-type dataset {data}   (with network; or pass a local file as {flag})",
    )


def _in_hub_cache(data: str) -> bool:
    """Whether a copy of dataset ``data`` is in Hugging Face's caches (hub snapshots or datasets' own)."""
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    cached = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    return _exists(hub / ("datasets--" + data.replace("/", "--"))) or _exists(cached / data.replace("/", "___"))


def _files_of_split(files: list[Path], root: Path, split: str) -> list[Path]:
    splits = {p: _split_of(p, root) for p in files}
    named = sorted({s for s in splits.values() if s})
    if not named:
        if split != "train":
            raise ConfigError(
                f"--split {split}: no file in {root} is named for a split, so every file is training data.",
                fix="name the files by split (train.jsonl, test.jsonl), or leave --split out",
            )
        return files
    chosen = [p for p, s in splits.items() if s == split]
    if not chosen:
        raise ConfigError(
            f"--split {split}: {root} has files for the split(s) {', '.join(named)}, none for {split}.",
            fix=f"--split {named[0]}",
        )
    return chosen


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
    raw = _decompressed(path, path.read_bytes())
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
    if raw.lstrip()[:1] == b"{":
        _refuse_one_object(name, raw)
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


def _refuse_one_object(name: str, raw: bytes) -> None:
    """A file that is one JSON object spread over lines (or an object of rows keyed by id) is not JSON lines:
    name it, instead of an "invalid JSON at column 2" on its first line or one row with odd columns."""
    lines = [line for line in raw.split(b"\n") if line.strip()]
    try:
        whole = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(whole, dict):
        return
    rows_by_key = len(whole) > 1 and all(isinstance(v, dict) for v in whole.values())
    if len(lines) == 1 and not rows_by_key:
        return  # one JSON line: a file of one row
    keys = ", ".join(repr(k) for k in list(whole)[:3]) + (", ..." if len(whole) > 3 else "")
    raise data_error(
        name, 0, "<file>",
        f"this file is one JSON object (keys {keys}), not rows: expected one JSON object per line (JSON lines) "
        "or a JSON array of rows",
        "python -c \"import json,sys; d=json.load(open(sys.argv[1])); "
        "[print(json.dumps(r)) for r in d.values()]\" FILE > rows.jsonl   (when each value is one row)",
    )


# Magic bytes of compressed files, so a compressed file is named as such instead of "not valid UTF-8".
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ": "xz",
               b"PK\x03\x04": "zip"}


def _decompressed(path: Path, raw: bytes) -> bytes:
    kind = next((k for magic, k in _COMPRESSED.items() if raw.startswith(magic)), None)
    if kind == "gzip" and path.suffix == ".gz":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise data_error(str(path), 0, "<file>", f"a damaged gzip file ({e})", "re-create the file") from None
    if kind is not None:
        fix = "name it .jsonl.gz (read as is) or decompress it" if kind == "gzip" else "decompress it"
        raise data_error(str(path), 0, "<file>", f"this file is {kind}-compressed, not JSON text", fix)
    return raw


def _iter_dataset(ds: Any, name: str, counter: _Counter) -> Iterator[Row]:
    for i, item in enumerate(ds):
        index, keep = counter.take()
        if keep:
            yield Row(name, i, item, index)


def iter_rows(
    data: str, *, split: str | None = "train", skipped: Counter[str], skip_bad: bool, keep: Keep | None = None
) -> Iterator[Row]:
    """Every row of ``data`` whose index ``keep`` accepts (all rows without ``keep``)."""
    counter = _Counter(keep)
    files = resolve_files(data, split=split)
    if files is None:
        try:
            import datasets
        except ImportError as e:
            raise ConfigError(
                "reading a dataset by name needs `datasets`.", fix=extra_command("train")
            ) from e
        try:
            ds = datasets.load_dataset(data, split=split or "train")
        except Exception as e:
            raise ConfigError(
                f"could not load dataset {data!r} (split {split!r}): {e}"
            ) from e
        yield from _iter_dataset(ds, data, counter)
        return
    for path in files:
        if _data_suffix(path) in JSON_SUFFIXES:
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
