"""Refusals and plans before anything is written: flags, paths, the first rows, model size, host memory, the run's
identity on --resume.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
