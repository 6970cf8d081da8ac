"""Convert the `chitchat-dataset` package's conversations into the ``messages`` JSONL `kernelguard train` reads.

The package (MIT, BYU PCC lab) ships 7,168 real English chat conversations between two people as
``chitchat_dataset/dataset.json``: ``{id: {"messages": [[{"text", "sender", "timestamp"}, ...], ...], ...}}``,
where each inner list is a run of consecutive messages from one sender.

How a conversation becomes a training row (one JSON object per line: ``{"id": ..., "messages": [...]}``):

- The person who writes first is the ``user``, the other one the ``assistant``: the model learns to answer
  someone who opened a chat, and the loss (assistant-only, as `kernelguard train` does by default) is on the
  second speaker's turns.
- The messages of one run (and of two runs by the same sender in a row, which the data never has but a
  derived file might) join with a newline into one turn: people send a thought as several short messages,
  and a newline is how a chat client shows them, one under another. Blank messages are dropped.
- Conversations with a single speaker (no assistant turn, so nothing to train on) are skipped, and so are
  trailing user turns after the last assistant turn (they carry no loss). Both are counted on stderr.

Usage: ``python bench/quality/chitchat_to_jsonl.py --out chitchat.jsonl [--limit N] [--max-turns N]``; ``--dataset FILE``
reads another copy of dataset.json instead of the installed package's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["conversation_messages", "convert", "dataset_path", "main"]


def dataset_path() -> Path:
    """dataset.json of the installed ``chitchat-dataset`` package."""
    from importlib.util import find_spec

    spec = find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "chitchat-dataset is not installed: pip install chitchat-dataset (or pass --dataset)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "dataset.json"


def conversation_messages(
    runs: list[list[dict[str, Any]]], *, max_turns: int | None = None
) -> list[dict[str, str]] | None:
    """One conversation's runs of messages as user/assistant turns (the first ``max_turns`` of them), or None
    when it has no assistant turn."""
    turns: list[tuple[str, list[str]]] = []  # (sender, texts)
    for run in runs:
        texts = [m["text"].strip() for m in run if m.get("text", "").strip()]
        if not texts:
            continue
        sender = run[0]["sender"]
        if turns and turns[-1][0] == sender:
            turns[-1][1].extend(texts)
        else:
            turns.append((sender, texts))
    if len({sender for sender, _ in turns}) < 2 or max_turns == 1:
        return None
    first = turns[0][0]
    messages = [
        {"role": "user" if sender == first else "assistant", "content": "\n".join(texts)}
        for sender, texts in turns
    ][:max_turns]
    while messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages


def convert(
    data: dict[str, Any], *, limit: int | None = None, max_turns: int | None = None
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """Training rows in the file's order (``limit``: the first N usable conversations; ``max_turns``: the first
    N turns of each) and what was counted."""
    rows: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    for conv_id, conv in data.items():
        if limit is not None and len(rows) >= limit:
            break
        messages = conversation_messages(conv["messages"], max_turns=max_turns)
        if messages is None:
            counts["single_speaker"] += 1
            continue
        counts["turns"] += len(messages)
        rows.append({"id": conv_id, "messages": messages})
    counts["rows"] = len(rows)
    return rows, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument(
        "--dataset", type=Path, default=None, help="dataset.json (default: the installed package's)"
    )
    p.add_argument("--limit", type=int, default=None, help="write only the first N usable conversations")
    p.add_argument(
        "--max-turns", type=int, default=None, help="keep only the first N turns of each conversation"
    )
    args = p.parse_args(argv)
    data = json.loads((args.dataset or dataset_path()).read_text(encoding="utf-8"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows, c = convert(data, limit=args.limit, max_turns=args.max_turns)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(
        f"chitchat: {len(data)} conversations -> {c['rows']} rows ({c['turns']} turns) in {args.out}; "
        f"{c['single_speaker']} single-speaker conversations skipped",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
