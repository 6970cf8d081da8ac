"""Examples -> blocks (packing), the optimizer step, the loss, evaluation.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
