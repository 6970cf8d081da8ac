"""kernelguard.diagnosis.recompiles: compiles after the warm-up steps are said (the slow path a busy GPU hides),
the warm-up's are not; read from dynamo's own counter, with a real torch.compile (the eager backend: dynamo's
guards and recompiles without a C++ compiler)."""

from __future__ import annotations

import torch

from kernelguard.diagnosis.recompiles import CompileWatch


def _compiled() -> object:
    return torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)


def test_a_compile_after_the_warmup_is_said_and_counted_and_the_warmups_are_not() -> None:
    f = _compiled()
    watch = CompileWatch()
    said = {}
    for step, n in enumerate((4, 5, 5, 5, 6, 6, 7, 8, 9), start=1):  # a new shape: a new graph (dynamic=False)
        f(torch.ones(n))
        said[step] = watch.step_done(step)
    assert [s for s, line in said.items() if line] == [5, 7, 8]  # steps 1-2 are the warm-up; at most three said
    assert said[5] is not None and said[5].startswith("warning: step 5 compiled 1 new graph(s) after the warm-up")
    assert said[8] is not None and said[8].endswith("(said for the first 3 such steps; the run's end counts them all)")
    assert watch.summary() == (
        "warning: torch.compile compiled 4 graph(s) in 4 step(s) after step 3: a steady run compiles nothing after "
        "its warm-up (TORCH_LOGS=recompiles names the guard that failed)"
    )


def test_a_steady_run_says_nothing() -> None:
    f = _compiled()
    watch = CompileWatch()
    for step in range(1, 9):
        f(torch.ones(3, 3))
        assert watch.step_done(step) is None
    assert watch.summary() is None
