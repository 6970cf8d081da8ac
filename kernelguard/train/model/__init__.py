"""The model: meta build, FSDP2, sharded Hugging Face load (headers checked first), compile, fused norms, the
activation-memory plan and its probe.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
