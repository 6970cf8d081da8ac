"""Cost of the kernelguard pytest plugin on tests that run real model forwards, every fallback allowed.

    PYTHONPATH=. python bench/cpu/bench_plugin_calls.py [--rounds 7] [--tests 40] [--forwards 3]

The README's CPU-CI recipe (``kernelguard = true`` plus an allow list of ``causal_conv1d_fn`` and
``chunk_gated_delta_rule``) on a suite shaped like transformers' model tests: each test builds a tiny
Qwen3.5 text model (tests/tiny_models.py: 4 layers, 3 of them GDN) and runs a few forwards through the torch
references, so every forward goes through armed tripwires; as many tests do nothing at all. The suite runs as
an inner, in-process pytest (``pytest.main``), alternately with the plugin off and on, ``--rounds`` times each;
the module scan is paid once, in a warm-up round. A third suite (``--compile-tests``) compiles the model in
default mode (backend ``eager``: dynamo's tracing is where a tripwire costs, or breaks the graph). Reported: median wall time per round off/on, the added time
in percent, per test that calls, and per test that calls nothing (from a second suite of empty tests only).
A micro-benchmark beside it times one forward of one model unarmed, the first forward after arming (the one
that records and logs) and later forwards (allowed and recorded: the steady state), to give the cost per
tripwire call. Times are CPU time of this process (``time.process_time``) with one torch thread, so other
jobs on a shared machine do not count; run it on a quiet machine for wall-time figures. Nothing is asserted; the figures are printed (and written as JSON with ``--json PATH``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# CPU time of this process (one torch thread): on a machine shared with other jobs, wall time measures them too.
CLOCK = time.process_time
TESTS = ROOT / "tests"
ALLOW = ("causal_conv1d_fn", "chunk_gated_delta_rule")

SUITE = """
import pytest
import torch
import tiny_models

@pytest.mark.parametrize("i", range({tests}))
def test_forward(i):
    model = tiny_models.tiny_model("qwen3_5", seed=i)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(i))
    with torch.no_grad():
        for _ in range({forwards}):
            model(ids)
"""
COMPILED = """
import pytest
import torch
import tiny_models

@pytest.mark.parametrize("i", range({tests}))
def test_compiled_forward(i):
    torch._dynamo.reset()  # every test compiles afresh, as transformers' compile tests do
    model = tiny_models.tiny_model("qwen3_5", seed=i)
    compiled = torch.compile(model, backend="eager")  # default mode: graph breaks allowed
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(i))
    with torch.no_grad():
        for _ in range({forwards}):
            compiled(ids)
"""
EMPTY = """
import pytest

@pytest.mark.parametrize("i", range({tests}))
def test_nothing(i):
    pass
"""


def _run(path: Path, plugin_on: bool) -> float:
    import pytest

    args = [str(path), "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--import-mode=importlib",
            "-o", "addopts=", "--no-header", "--tb=line", "-rN", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if plugin_on:
        args += ["--kernelguard"] + [a for k in ALLOW for a in ("--kernelguard-allow", k)]
    gc.collect()
    start = CLOCK()
    code = pytest.main(args)
    elapsed = CLOCK() - start
    if code != 0:
        raise SystemExit(f"inner pytest run failed (exit {code}, plugin {'on' if plugin_on else 'off'})")
    return elapsed


def _suite_rounds(path: Path, rounds: int, *, warm_up: bool = True) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    if warm_up:  # imports, the one module scan, torch's first-call costs
        _run(path, True)
        _run(path, False)
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):  # alternate: drift hits both alike
            times[mode].append(_run(path, mode == "on"))
    return times


def _forward_micro(blocks: int, per_block: int = 10) -> dict[str, float]:
    import tiny_models
    import torch

    from kernelguard.runtime.tripwires import arm_tripwires

    model = tiny_models.tiny_model("qwen3_5")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    calls_per_forward = 3 * 2  # 3 GDN layers x (causal_conv1d_fn, chunk_gated_delta_rule)

    def timed(first_after_arming: bool) -> float:
        """CPU time of one forward: the first under a fresh arming, or the mean of ``per_block`` later ones."""
        with torch.no_grad():
            if first_after_arming:
                start = CLOCK()
                model(ids)
                return CLOCK() - start
            start = CLOCK()
            for _ in range(per_block):
                model(ids)
            return (CLOCK() - start) / per_block

    with torch.no_grad():
        model(ids)
    off: list[float] = []
    first: list[float] = []
    steady: list[float] = []
    for _ in range(blocks):  # interleaved, so drift of the machine hits all three alike
        off.append(timed(False))
        tripwires = arm_tripwires(allow=ALLOW, on_fallback="record")
        try:
            first.append(timed(True))
            steady.append(timed(False))  # allowed and recorded: what every later call pays
        finally:
            tripwires.disarm()
    off_ms, first_ms, steady_ms = (statistics.median(x) * 1e3 for x in (off, first, steady))
    return {
        "forward_off_ms": off_ms, "forward_first_after_arming_ms": first_ms, "forward_steady_armed_ms": steady_ms,
        "per_call_first_after_arming_us": (first_ms - off_ms) * 1e3 / calls_per_forward,
        "per_call_steady_us": (steady_ms - off_ms) * 1e3 / calls_per_forward,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tests", type=int, default=40, help="tests per suite (the forward suite and the empty one)")
    parser.add_argument("--forwards", type=int, default=3, help="forwards per test of the forward suite")
    parser.add_argument("--empty-tests", type=int, default=300, help="tests of the suite that calls nothing")
    parser.add_argument("--micro", type=int, default=40, help="blocks of the one-forward micro-benchmark")
    parser.add_argument("--compile-tests", type=int, default=1,
                        help="tests of a third suite that torch.compile (default mode) the model; 0: none")
    parser.add_argument("--compile-rounds", type=int, default=2, help="rounds of the compile suite (slow)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    import kernelguard

    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        forward_suite = Path(tmp) / "test_forward_suite.py"
        forward_suite.write_text(SUITE.format(tests=args.tests, forwards=args.forwards))
        empty_suite = Path(tmp) / "test_empty_suite.py"
        empty_suite.write_text(EMPTY.format(tests=args.empty_tests))
        fwd = _suite_rounds(forward_suite, args.rounds)
        empty = _suite_rounds(empty_suite, args.rounds)
        suites = [("forward", fwd), ("empty", empty)]
        if args.compile_tests:
            compile_suite = Path(tmp) / "test_compile_suite.py"
            compile_suite.write_text(COMPILED.format(tests=args.compile_tests, forwards=args.forwards))
            suites.append(("compile", _suite_rounds(compile_suite, args.compile_rounds, warm_up=False)))
    micro = _forward_micro(args.micro)
    med = {f"{suite}_{mode}_s": statistics.median(t[mode]) for suite, t in suites for mode in ("off", "on")}
    result = {
        "kernelguard": kernelguard.__file__, "threads": args.threads, "tests": args.tests, "forwards": args.forwards, "rounds": args.rounds,
        **med,
        "forward_added_pct": 100 * (med["forward_on_s"] - med["forward_off_s"]) / med["forward_off_s"],
        "forward_added_ms_per_test": 1e3 * (med["forward_on_s"] - med["forward_off_s"]) / args.tests,
        "empty_added_ms_per_test": 1e3 * (med["empty_on_s"] - med["empty_off_s"]) / args.empty_tests,
        **({"compile_added_pct": 100 * (med["compile_on_s"] - med["compile_off_s"]) / med["compile_off_s"]}
           if args.compile_tests else {}),
        **micro,
        "raw": dict(suites),
    }
    for key, value in result.items():
        if key != "raw":
            print(f"{key:34s} {value:.4g}" if isinstance(value, float) else f"{key:34s} {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
