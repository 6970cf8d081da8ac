"""The run's inputs, checked before the stack check and the model build: the tokenizer loads, a chat template is
there for conversational rows, and the first rows of --data (and --eval-data) parse and render in a known
format. A wrong input is refused in seconds, not after the guard and a model build.

Only a sample is read (``SAMPLE_ROWS`` per source): the full pass comes later, with the counts and
--skip-bad-rows. A dataset given by name is not sampled here (reading it is the slow part).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import islice
from typing import Any

from kernelguard.errors import DataError

from ..inputs.encode import encode_items
from ..inputs.rows import COLUMNS_PREFIX, Item, columns_format, describe_format, detect_format, row_item
from ..inputs.sources import iter_rows, resolve_files
from ..inputs.tokenizer import load_tokenizer, template_choice
from ..settings.config import TrainConfig

__all__ = ["SAMPLE_ROWS", "check_inputs_early", "check_row_formats", "check_rows"]

SAMPLE_ROWS = 16


def check_inputs_early(cfg: TrainConfig) -> Any:
    """The tokenizer (with its chosen chat template) once the sample of every data source encodes; raises
    ConfigError / DataError naming the input otherwise."""
    assert cfg.model.tokenizer is not None
    tokenizer = load_tokenizer(cfg.model.tokenizer, chat_template=cfg.model.chat_template)
    for data, split, _ in _local_sources(cfg):
        check_rows(cfg, tokenizer, data, split=split)
    return tokenizer


def check_row_formats(cfg: TrainConfig, say: Callable[[str], None] = lambda line: None) -> None:
    """The first ``SAMPLE_ROWS`` rows of every local data source parse in a known format. Needs neither the
    tokenizer nor torch, so a wrong data file is refused within a second or two of the command. ``say`` gets
    one line per source whose columns were mapped to a conversation (detected or by --columns), saying how."""
    for data, split, flag in _local_sources(cfg):
        fmt = _sample_items(cfg, data, split=split, eos=None)[1]
        if fmt.startswith(COLUMNS_PREFIX):
            how = "by --columns" if cfg.data.columns else "detected; other names: --columns ROLE=COLUMN,..."
            say(f"{flag} {data}: rows read as {describe_format(fmt)} ({how})")


def check_rows(cfg: TrainConfig, tokenizer: Any, data: str, *, split: str | None) -> None:
    """The first ``SAMPLE_ROWS`` rows of ``data`` in the run's format, encoded with the run's template."""
    items = _sample_items(cfg, data, split=split, eos=tokenizer.eos_token)[0]
    encode_items(tokenizer, items, choice=template_choice(tokenizer), assistant_only=cfg.data.assistant_only_loss,
                 on_error=_ignore if cfg.data.skip_bad_rows else _raise)


def _local_sources(cfg: TrainConfig) -> list[tuple[str, str | None, str]]:
    sources = [(cfg.data.data, cfg.data.split, "--data")]
    if cfg.evaluation.eval_data:
        sources.append((cfg.evaluation.eval_data, None, "--eval-data"))
    return [(data, split, flag) for data, split, flag in sources
            if resolve_files(data, split=split, flag=flag) is not None]


def _sample_items(cfg: TrainConfig, data: str, *, split: str | None, eos: str | None) -> tuple[list[Item], str]:
    """The first rows of ``data`` as items, and the format they were read in."""
    skip = cfg.data.skip_bad_rows
    fmt = columns_format(cfg.data.columns) if cfg.data.columns else (
        "" if cfg.data.dataset_format == "auto" else cfg.data.dataset_format)
    column, assistant_only = cfg.data.messages_column, cfg.data.assistant_only_loss
    items = []
    for row in islice(iter_rows(data, split=split, skipped=Counter(), skip_bad=skip), SAMPLE_ROWS):
        try:
            fmt = fmt or detect_format(row, column)
            items.append(row_item(row, fmt, column=column, assistant_only=assistant_only, eos=eos))
        except DataError:
            if not skip:
                raise
    return items, fmt


def _raise(e: DataError) -> None:
    raise e


def _ignore(e: DataError) -> None:
    return None
