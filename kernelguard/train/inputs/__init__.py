"""Rows -> examples: data sources, row formats, chat-template rendering, assistant-only labels, the tokenizer folder,
the run's identity (what its inputs were).

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
