"""The pieces every stage of `kernelguard train` uses: the run folder's names, log lines, the real cause of a failed
write, records written whole or not at all, the run-folder lock, ranks, the run's own command line.

Its modules are imported directly by the stages above it (ARCHITECTURE.md, `train/` stages)."""

__all__: list[str] = []
