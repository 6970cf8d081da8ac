"""What a run leaves: verified DCP checkpoints, the sharded Hugging Face export, metrics and trackers, progress and log
lines.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
