"""The run's settings: TrainConfig's sections, the one rule table, argparse derived from them, config files, the
packing modes.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
