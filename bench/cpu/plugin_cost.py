"""Per-test cost of the kernelguard pytest plugin on a suite that loads many transformers modeling modules.

    python -m pytest bench/cpu/plugin_cost.py -q -p no:randomly --benchmark-disable-gc \
        --benchmark-timer=time.process_time --benchmark-columns=mean,stddev,min,median,rounds

The situation of issue 14: transformers' own qwen3_next / qwen3_5 / qwen3_5_moe test files, where ~200
modeling modules are loaded and most tests are skipped or trivial. Here: ``KG_BENCH_MODULES`` (default 200)
modeling modules are imported once in this process (qwen3_5, qwen3_next and qwen3_5_moe first), then an inner
pytest run (pytester, in-process) of ``KG_BENCH_TESTS`` (default 400) tests that import those three modeling
modules — half pass, half call ``pytest.skip`` — is timed with the plugin on and off (on first: repeated
in-process runs slowly grow the process, which would otherwise count against the plugin).

Added cost per test = (mean[on] - mean[off]) / KG_BENCH_TESTS. The module scan happens once per process
(``ModuleScanCache``), so the runs after the first (what the mean reports with warm-up) show the per-test
arming cost; ``test_first_scan`` times that one-off scan separately. The bench only uses the command-line
interface, so it also measures an older kernelguard: put its checkout first on PYTHONPATH.
No timing is asserted.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from typing import Any

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.kernelguard(False)  # the outer run must not arm around the inner runs

N_MODULES = int(os.environ.get("KG_BENCH_MODULES", "200"))
N_TESTS = int(os.environ.get("KG_BENCH_TESTS", "400"))
ROUNDS = int(os.environ.get("KG_BENCH_ROUNDS", "10"))
FIRST = ("qwen3_5", "qwen3_next", "qwen3_5_moe")

SUITE = f"""
import pytest
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: F401
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: F401

@pytest.mark.parametrize("i", range({N_TESTS}))
def test_case(i):
    if i % 2:
        pytest.skip("like transformers' tests that skip on CPU")
"""


def _load_modeling_modules() -> int:
    from transformers import models

    names = list(FIRST) + sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.name not in FIRST)
    loaded = 0
    for name in names:
        if loaded >= N_MODULES:
            break
        try:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except Exception:  # noqa: BLE001, S112 - a model needing an optional dependency: skip it, load the next
            continue
        loaded += 1
    return sum(1 for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n)


@pytest.fixture(scope="module")
def loaded_modules() -> int:
    import torch  # noqa: F401 - never import torch's C extension inside an in-process inner run

    return _load_modeling_modules()


@pytest.fixture
def suite(pytester: pytest.Pytester, loaded_modules: int) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    return pytester


@pytest.mark.parametrize("plugin", ["on", "off"])
def test_suite_per_test_cost(benchmark: Any, suite: pytest.Pytester, loaded_modules: int, plugin: str) -> None:
    args = ["-q", "-p", "no:cacheprovider", "--benchmark-disable"] + (["--kernelguard"] if plugin == "on" else [])

    def run() -> None:
        result = suite.runpytest_inprocess(*args)
        result.assert_outcomes(passed=N_TESTS - N_TESTS // 2, skipped=N_TESTS // 2)

    run()  # warm: the first run pays the one-off module scan (timed in test_first_scan)
    benchmark.extra_info.update({"tests": N_TESTS, "modeling_modules_loaded": loaded_modules,
                                 "kernelguard": sys.modules["kernelguard"].__file__})
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1)


def test_first_scan(benchmark: Any, loaded_modules: int) -> None:
    """The one-off cost: scanning every loaded modeling module for kernel globals (new kernelguard only)."""
    tripwires = pytest.importorskip("kernelguard.runtime.tripwires")
    registry = tripwires.REGISTRY

    def scan_all() -> None:
        registry.scan.clear()
        registry.scan.loaded()

    benchmark.extra_info["modeling_modules_loaded"] = loaded_modules
    benchmark.pedantic(scan_all, rounds=3, iterations=1)


def test_arm_disarm_cycle(benchmark: Any, loaded_modules: int) -> None:
    """What the plugin adds per test once the scan is cached: arm on every loaded module, disarm."""
    tripwires = pytest.importorskip("kernelguard.runtime.tripwires")
    tripwires.REGISTRY.scan.loaded()

    def cycle() -> None:
        tripwires.arm_tripwires(on_fallback="record").disarm()

    benchmark.extra_info["modeling_modules_loaded"] = loaded_modules
    benchmark.extra_info["armed_sites"] = len(tripwires.arm_tripwires(on_fallback="record").sites)
    tripwires.REGISTRY.reset()
    benchmark(cycle)
