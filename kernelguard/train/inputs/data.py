"""Training data -> (input_ids, labels) examples: sources, the eval split, tokenizers, counts.

Sources: a local ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a dataset name (``datasets``,
only where a hub is reachable). JSON files are read with the standard library, line by line, in strict
UTF-8, because Arrow's JSON reader can neither say which line broke nor survive a row whose field has the
wrong type; Parquet files and dataset names go through ``datasets.load_dataset`` (``sources``). Row formats and
validation are in ``rows``, assistant-only labels in ``encode``; the chat templates in ``chat_templates``.

Eval split: with ``eval_fraction`` F, a row is an eval row iff a hash of (seed, row index) falls below F: the
same split on every rank and every run, whatever the world size. Rows of the other split are not parsed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kernelguard.errors import ConfigError, DataError
from kernelguard.resolution import IGNORE_INDEX

from ..chat_templates import TemplateChoice
from ..settings.config import TrainConfig
from .encode import encode_items
from .rows import FORMATS, ChatItem, Item, columns_format, describe_format, detect_format, row_item
from .sources import iter_rows
from .tokenizer import load_tokenizer, pad_token_id, template_choice

__all__ = [
    "DataStats",
    "ExampleStore",
    "Inputs",
    "check_eval_overlap",
    "content_checker",
    "in_eval_split",
    "load_examples",
    "read_inputs",
]

TAKES = ("train", "eval", "all")


@dataclass(kw_only=True, slots=True)
class DataStats:
    rows: int = 0
    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_loss: int = 0
    dropped_template_only: int = 0  # loss only on template tokens (an empty answer's <|im_end|>): see below
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
            "dropped_template_only": self.dropped_template_only,
            "bad_rows": dict(self.bad_rows),
            "format": self.format,
            "template": self.template,
            "take": self.take,
            "held_out": self.held_out,
        }

    def render(self) -> str:
        bad = sum(self.bad_rows.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_rows.items()))
        kind = describe_format(self.format) or "?"
        if self.template:
            kind += f", chat template {self.template}"
        split = ""
        if self.held_out and self.take == "eval":
            split = f"eval split (held out from training: {self.rows} of {self.rows + self.held_out} rows); "
        elif self.held_out:
            split = f"{self.take} split ({self.held_out} rows held out for eval); "
        return (
            f"{kind}: {split}"
            f"{self.rows} rows -> {self.examples} examples ({self.tokens} tokens, {self.loss_tokens} with loss); "
            f"{self.truncated} truncated, {self.dropped_overlong} dropped as overlong, "
            f"{self.dropped_no_loss} dropped without loss tokens, {self.dropped_template_only} dropped with loss "
            f"only on template tokens (empty answers), {bad} bad rows skipped"
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


# ----------------------------------------------------------------------------------------------- sources ---
def check_eval_overlap(train: ExampleStore, evaluation: ExampleStore, *, source: str) -> str | None:
    """Refuse an eval set whose every example is, token for token, a training example (its loss would
    measure recall); return a warning when only some are."""
    seen = {hash(tuple(ids)) for ids, _ in train}
    shared = sum(hash(tuple(ids)) in seen for ids, _ in evaluation)
    if shared and shared == len(evaluation):
        raise DataError(
            f"every one of the {shared} eval examples is also a training example: the eval loss would measure "
            "memorisation, not generalisation.",
            fix="pass held-out rows as --eval-data, or --eval-fraction 0.05 to hold some out of --data",
            details={"file": source, "row": None, "field": None},
        )
    return f"{shared} of {len(evaluation)} eval examples are also training examples (same tokens)" if shared else None


def in_eval_split(index: int, *, seed: int, fraction: float) -> bool:
    """Whether row ``index`` is an eval row: a hash of (seed, index), uniform in [0, 1), below ``fraction``."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


# ------------------------------------------------------------------------------------------ the stage ---
@dataclass(slots=True)
class Inputs:
    """What a run trains and evaluates on, read in one call (:func:`read_inputs`)."""

    tokenizer: Any
    examples: ExampleStore
    lengths: list[int]  # tokens per example, in the store's order
    stats: DataStats
    pad_id: int
    eval_examples: ExampleStore | None = None  # None: no eval set
    eval_lengths: list[int] = field(default_factory=list)
    eval_stats: DataStats | None = None
    eval_overlap: str | None = None  # said when eval examples are also trained on


def read_inputs(cfg: TrainConfig) -> Inputs:
    """The run's tokenizer and examples: the training split (minus a held-out ``--eval-fraction``) and the eval
    set (that fraction, or every row of ``--eval-data``), each tokenized, labelled and counted."""
    assert cfg.model.tokenizer is not None
    tokenizer = load_tokenizer(cfg.model.tokenizer, chat_template=cfg.model.chat_template)
    pad_id, choice = pad_token_id(tokenizer), template_choice(tokenizer)
    read = {
        "tokenizer": tokenizer, "choice": choice, "max_length": cfg.packing.max_length, "overlong": cfg.packing.overlong,
        "column": cfg.data.messages_column, "skip_bad_rows": cfg.data.skip_bad_rows,
        "assistant_only": cfg.data.assistant_only_loss, "dataset_format": cfg.data.dataset_format,
        "columns": cfg.data.columns, "seed": cfg.training.seed,
    }
    ev = cfg.evaluation
    examples, stats = load_examples(data=cfg.data.data, split=cfg.data.split, eval_fraction=ev.eval_fraction,
                                    take="train", **read)
    inputs = Inputs(tokenizer, examples, examples.lengths(), stats, pad_id)
    if ev.eval_data:  # every file of an --eval-data folder is eval data
        inputs.eval_examples, inputs.eval_stats = load_examples(data=ev.eval_data, split=None, take="all", **read)
    elif ev.eval_fraction:
        inputs.eval_examples, inputs.eval_stats = load_examples(
            data=cfg.data.data, split=cfg.data.split, eval_fraction=ev.eval_fraction, take="eval", **read)
    if inputs.eval_examples is not None:
        inputs.eval_lengths = inputs.eval_examples.lengths()
        inputs.eval_overlap = check_eval_overlap(examples, inputs.eval_examples, source=ev.eval_data or cfg.data.data)
    return inputs


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
    max_length: int,
    column: str = "messages",
    split: str | None = "train",
    overlong: str = "truncate",
    skip_bad_rows: bool = False,
    assistant_only: bool = True,
    dataset_format: str = "auto",
    columns: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    take: str = "train",
    chunk: int = 2048,
    choice: TemplateChoice | None = None,
) -> tuple[ExampleStore, DataStats]:
    """Every usable example of the ``take`` split as (input_ids, labels) in an ExampleStore, plus counts.

    ``split`` is the dataset split read by name (``datasets``); ``take`` picks rows by the eval split
    (``eval_fraction`` > 0): "train" the others, "eval" the eval rows, "all" every row. Raises DataError on the first
    bad row unless ``skip_bad_rows``; raises DataError when nothing usable is left. ``choice``: the chat template
    (default: the one ``load_tokenizer`` recorded on ``tokenizer``)."""
    _check_args(dataset_format, take, eval_fraction, overlong)
    stats = DataStats(take=take)
    examples = ExampleStore()
    pending: list[Item] = []
    fmt = columns_format(columns) if columns else ("" if dataset_format == "auto" else dataset_format)
    eos = getattr(tokenizer, "eos_token", None)
    chats = False  # whether any row was a conversation (then the stats name the chat template)

    keep = _split_keeper(stats, take=take, seed=seed, fraction=eval_fraction)
    bad = _bad_row_handler(stats, skip=skip_bad_rows)
    teaches = content_checker(tokenizer)
    template = choice or template_choice(tokenizer)

    def flush() -> None:
        encoded = encode_items(tokenizer, pending, choice=template, assistant_only=assistant_only, on_error=bad)
        pending.clear()
        for ids, labels in encoded:
            _add_example(examples, stats, ids, labels, max_length=max_length, overlong=overlong, teaches=teaches)

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
    stats.format = fmt
    stats.template = template.name if chats else ""
    _finish_stats(examples, stats, data=data, column=column, take=take, fraction=eval_fraction)
    return examples, stats


def _split_keeper(stats: DataStats, *, take: str, seed: int, fraction: float) -> Callable[[int], bool]:
    """Whether row ``index`` belongs to the ``take`` split; counts the rows held out for the other one."""

    def keep(index: int) -> bool:
        is_eval = in_eval_split(index, seed=seed, fraction=fraction)
        kept = take == "all" or is_eval == (take == "eval")
        stats.held_out += not kept
        return kept

    return keep


def _bad_row_handler(stats: DataStats, *, skip: bool) -> Callable[[DataError], None]:
    """Raise a bad row's DataError, or (``--skip-bad-rows``) count it by reason."""

    def bad(e: DataError) -> None:
        if not skip:
            raise e
        stats.bad_rows[_bad_row_key(e)] += 1

    return bad


def _finish_stats(
    examples: ExampleStore, stats: DataStats, *, data: str, column: str, take: str, fraction: float = 0.0
) -> None:
    """Count the rows the reader skipped before parsing; refuse when nothing usable is left."""
    stats.rows += sum(stats.bad_rows[k] for k in ("not_utf8", "invalid_json"))
    if take == "eval" and stats.rows == 0 and stats.held_out:
        raise DataError(
            f"--eval-fraction {fraction:g} holds out none of the {stats.held_out:,} rows of {data} (about "
            f"{fraction * stats.held_out:.2g} expected): there is no eval set.",
            fix=f"raise --eval-fraction to at least {(least := min(0.5, 20 / stats.held_out)):.2g} (about "
            f"{round(least * stats.held_out)} rows), or pass held-out rows as --eval-data FILE",
            details={"file": data, "row": None, "field": None},
        )
    if len(examples) == 0:
        what = {"eval": "eval", "all": "usable"}.get(take, "usable training")
        raise DataError(
            f"no {what} examples in {data} ({stats.render()}).",
            fix="check the data, --dataset-format, --messages-column, --overlong and --eval-fraction",
            details={"file": data, "row": None, "field": column},
        )


def content_checker(tokenizer: Any) -> Callable[[int], bool]:
    """Whether a trained token carries content: not one of the tokenizer's added tokens (``<|im_end|>``,
    ``<think>``, ``<tool_call>``...: what a chat template writes around a turn) and not whitespace only
    (the newline after ``<|im_end|>``). An example whose every loss token fails this teaches nothing but
    "end the turn" (an empty or whitespace-only answer) and is dropped with a count. Memoised per token id."""
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    decode = getattr(tokenizer, "decode", None)
    memo: dict[int, bool] = {}

    def teaches(token: int) -> bool:
        if token in added:
            return False
        if token not in memo:
            try:
                memo[token] = decode is None or bool(str(decode([token])).strip())
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode: count it as content
                memo[token] = True
        return memo[token]

    return teaches


def _add_example(
    examples: ExampleStore,
    stats: DataStats,
    ids: list[int],
    labels: list[int],
    *,
    max_length: int,
    overlong: str,
    teaches: Callable[[int], bool] = lambda _: True,
) -> None:
    if len(ids) > max_length:
        if overlong == "drop":
            stats.dropped_overlong += 1
            return
        ids, labels = ids[:max_length], labels[:max_length]
        stats.truncated += 1
    loss_tokens = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
    if loss_tokens == 0:
        stats.dropped_no_loss += 1
        return
    if not any(teaches(x) for x in labels[1:] if x != IGNORE_INDEX):
        stats.dropped_template_only += 1
        return
    stats.examples += 1
    stats.tokens += len(ids)
    stats.loss_tokens += loss_tokens
    examples.append(ids, labels)
