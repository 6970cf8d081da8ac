"""Steady-state compiles: a second slow path that GPU utilisation does not show.

``torch.compile`` compiles a new graph whenever a guard of the old ones fails (a shape, a dtype, a Python value
it specialised on). In the first steps that is expected (the forward, the backward, a shape that varies turning
dynamic); after them, a batch whose shape changes every step — a varlen ``max_seqlen`` given as a tensor, a
kernel cache keyed on the row's segment count — recompiles every few steps, seconds each, while the GPU reads
busy. The count is dynamo's own (``counters["stats"]["unique_graphs"]``, process-wide and monotonic), read once
per step: nothing is traced or synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WARMUP_STEPS", "CompileWatch", "compiled_graphs"]

# Step 1 compiles the forward and the backward; step 2 may recompile once when a varying size turns dynamic.
WARMUP_STEPS = 3
SAID_AT_MOST = 3


def compiled_graphs() -> int:
    """Graphs dynamo compiled so far in this process (0 when torch has no dynamo)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


@dataclass(slots=True)
class CompileWatch:
    """Call :meth:`step_done` after each optimizer step; it returns a warning for a step past the warm-up that
    compiled, said at most ``SAID_AT_MOST`` times; :meth:`summary` counts them all at the end."""

    after_step: int = WARMUP_STEPS
    last: int | None = None
    steps_compiled: int = 0
    graphs_after_warmup: int = 0

    def step_done(self, step: int) -> str | None:
        now = compiled_graphs()
        last, self.last = self.last, now
        if last is None or now <= last or step <= self.after_step:
            return None
        self.steps_compiled += 1
        self.graphs_after_warmup += now - last
        if self.steps_compiled > SAID_AT_MOST:
            return None
        last_word = " (said for the first 3 such steps; the run's end counts them all)" if (
            self.steps_compiled == SAID_AT_MOST) else ""
        return (
            f"warning: step {step} compiled {now - last} new graph(s) after the warm-up ({now} in this process): "
            "torch.compile recompiles when a shape, a dtype or a value it specialised on changes, seconds each, "
            "while the GPU reads busy; rerun with TORCH_LOGS=recompiles to see which guard failed" + last_word
        )

    def summary(self) -> str | None:
        if not self.steps_compiled:
            return None
        return (
            f"warning: torch.compile compiled {self.graphs_after_warmup} graph(s) in {self.steps_compiled} step(s) "
            f"after step {self.after_step}: a steady run compiles nothing after its warm-up "
            "(TORCH_LOGS=recompiles names the guard that failed)"
        )
