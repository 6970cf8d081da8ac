"""What `kernelguard check` costs, and how much of it is kernelguard's own work rather than importing torch.

    /work/venv/bin/python -m pytest bench/cpu/check_cost.py --benchmark-only -q -p no:kernelguard

Measured: the whole CLI (`python -m kernelguard check --json`, a fresh process), `python -c "import torch"`
(the floor: check imports torch once to read its facts), bare interpreter start-up, and `run_check` in-process
with torch already imported (what `kernelguard.require()` adds to a training script). No timing is asserted;
a summary line with kernelguard's share is printed at the end of the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROUNDS = int(os.environ.get("KG_BENCH_ROUNDS", "5"))
RESULTS: dict[str, float] = {}
PAIRED: list[float] = []  # (check --json) - (import torch), run back to back


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    return env


def _run(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode not in (0, 1):  # check exits 1 when a kernel falls back: still a full, valid run
        raise RuntimeError(f"{args} failed with {proc.returncode}: {proc.stderr[-2000:]}")


def _mean(benchmark: Any) -> float:
    return float(benchmark.stats.stats.mean)


@pytest.fixture(scope="module", autouse=True)
def summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not {"check_cli", "import_torch"} <= RESULTS.keys():
        return
    cli, torch_import = RESULTS["check_cli"], RESULTS["import_torch"]
    own = cli - torch_import
    lines = [
        "",
        "kernelguard check cost (means):",
        f"  python -m kernelguard check --json   {cli * 1e3:8.1f} ms",
        f"  python -c 'import torch'             {torch_import * 1e3:8.1f} ms",
        f"  python -c pass                       {RESULTS.get('startup', float('nan')) * 1e3:8.1f} ms",
        f"  kernelguard's own share of the CLI   {own * 1e3:8.1f} ms ({own / cli:.0%})",
    ]
    if PAIRED:  # interleaved runs: robust to load from other processes drifting between the two benchmarks
        diffs = sorted(PAIRED)
        median = diffs[len(diffs) // 2]
        lines.append(f"  ... paired median (check - torch)    {median * 1e3:8.1f} ms over {len(diffs)} pairs")
    if "run_check" in RESULTS:
        lines.append(
            f"  run_check in-process (torch loaded)  {RESULTS['run_check'] * 1e3:8.1f} ms  (catalog cached)"
        )
    if "run_check_cold" in RESULTS:
        lines.append(f"  run_check in-process, cold catalog   {RESULTS['run_check_cold'] * 1e3:8.1f} ms")
    # Module teardown runs under pytest's output capture: print past it, as capsys.disabled() does.
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


def test_cli_check_json(benchmark: Any, tmp_path: Path) -> None:
    benchmark.pedantic(
        _run,
        args=(["-m", "kernelguard", "check", "--json"], tmp_path),
        rounds=ROUNDS,
        iterations=1,
        warmup_rounds=1,
    )
    RESULTS["check_cli"] = _mean(benchmark)


def test_import_torch(benchmark: Any, tmp_path: Path) -> None:
    benchmark.pedantic(
        _run, args=(["-c", "import torch"], tmp_path), rounds=ROUNDS, iterations=1, warmup_rounds=1
    )
    RESULTS["import_torch"] = _mean(benchmark)


def _pair(cwd: Path) -> None:
    start = time.perf_counter()
    _run(["-m", "kernelguard", "check", "--json"], cwd)
    middle = time.perf_counter()
    _run(["-c", "import torch"], cwd)
    PAIRED.append((middle - start) - (time.perf_counter() - middle))


def test_check_minus_torch_paired(benchmark: Any, tmp_path: Path) -> None:
    """One round = the CLI then `import torch`, back to back; the summary prints the median difference."""
    benchmark.pedantic(_pair, args=(tmp_path,), rounds=ROUNDS, iterations=1)


def test_interpreter_startup(benchmark: Any, tmp_path: Path) -> None:
    benchmark.pedantic(_run, args=(["-c", "pass"], tmp_path), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    RESULTS["startup"] = _mean(benchmark)


def test_run_check_in_process(benchmark: Any) -> None:
    import torch  # noqa: F401 - the state of a training script that calls kernelguard.require()

    from kernelguard.stack.compose import CheckOptions, run_check

    result = benchmark.pedantic(run_check, args=(CheckOptions(),), rounds=20, iterations=1, warmup_rounds=2)
    assert result.resolution.verdicts  # it resolved something (not a timing assert)
    RESULTS["run_check"] = _mean(benchmark)


def _clear_catalog_caches() -> None:
    from kernelguard.resolution import discovery as catalog

    for cached in (
        catalog._families,
        catalog._hub_mapping,
        catalog._internal_paths,
        catalog._import_utils_text,
    ):
        cached.cache_clear()


def test_run_check_in_process_cold(benchmark: Any) -> None:
    """As above, but transformers' modeling sources are scanned again each round (a job's first call)."""
    import torch  # noqa: F401

    from kernelguard.stack.compose import CheckOptions, run_check

    benchmark.pedantic(
        run_check, args=(CheckOptions(),), setup=_clear_catalog_caches, rounds=10, iterations=1
    )
    RESULTS["run_check_cold"] = _mean(benchmark)
