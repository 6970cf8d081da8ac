"""The run's inputs, checked before the stack check and the model build: the tokenizer loads, a chat template is
there for conversational rows, and the first rows of --data (and --eval-data) parse and render in a known
format. A wrong input is refused in seconds, not after the guard and a model build.

Only a sample is read (``SAMPLE_ROWS`` per source): the full pass comes later, with the counts and
--skip-bad-rows. A dataset given by name is not sampled here (reading it is the slow part).
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from typing import Any

from kernelguard.errors import DataError

from .config import TrainConfig
from .data import load_tokenizer, template_choice
from .encode import encode_items
from .rows import detect_format, row_item
from .sources import iter_rows, resolve_files

__all__ = ["SAMPLE_ROWS", "check_inputs_early", "check_rows"]

SAMPLE_ROWS = 16


def check_inputs_early(cfg: TrainConfig) -> Any:
    """The tokenizer (with its chosen chat template) once the sample of every data source encodes; raises
    ConfigError / DataError naming the input otherwise."""
    assert cfg.model.tokenizer is not None
    tokenizer = load_tokenizer(cfg.model.tokenizer, chat_template=cfg.model.chat_template)
    sources = [(cfg.data.data, cfg.data.split)]
    if cfg.evaluation.eval_data:
        sources.append((cfg.evaluation.eval_data, None))
    for data, split in sources:
        if resolve_files(data, split=split) is not None:
            check_rows(cfg, tokenizer, data, split=split)
    return tokenizer


def check_rows(cfg: TrainConfig, tokenizer: Any, data: str, *, split: str | None) -> None:
    """The first ``SAMPLE_ROWS`` rows of ``data`` in the run's format, encoded with the run's template."""
    skip = cfg.data.skip_bad_rows
    fmt = "" if cfg.data.dataset_format == "auto" else cfg.data.dataset_format
    column, assistant_only = cfg.data.messages_column, cfg.data.assistant_only_loss
    items = []
    for row in islice(iter_rows(data, split=split, skipped=Counter(), skip_bad=skip), SAMPLE_ROWS):
        try:
            fmt = fmt or detect_format(row, column)
            items.append(row_item(row, fmt, column=column, assistant_only=assistant_only, eos=tokenizer.eos_token))
        except DataError:
            if not skip:
                raise
    encode_items(tokenizer, items, choice=template_choice(tokenizer), assistant_only=assistant_only,
                 on_error=_ignore if skip else _raise)


def _raise(e: DataError) -> None:
    raise e


def _ignore(e: DataError) -> None:
    return None
