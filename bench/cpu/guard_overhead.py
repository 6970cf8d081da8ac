"""Per-forward cost of an armed guard vs none, on a mid-size hybrid model on CPU (no timing asserts).

    python -m pytest bench/cpu/guard_overhead.py -q --benchmark-columns=mean,stddev,rounds

Two situations:
* ``fast``: the (fake) fast providers were importable, so nothing is wrapped; the armed guard must cost 0.
* ``allowed-fallback``: transformers chose the torch reference and the run accepts it with ``allow=``;
  every call goes through a tripwire (one Python wrapper call and an allow check per call site).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))

import tiny_models

from kernelguard.runtime.model_guard import Tripwires, guard

pytestmark = pytest.mark.kernelguard(False)

# ~20M parameters: 6 GDN + 2 full-attention layers, hidden 512, 256 tokens.
SIZE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "vocab_size": 4096,
}
TOKENS = 256
ALLOW = ["chunk_gated_delta_rule", "causal_conv1d_fn"]


def _purge() -> dict[str, Any]:
    names = [n for n in sys.modules if n.startswith(("fla", "causal_conv1d", "transformers.models."))]
    return {n: sys.modules.pop(n) for n in names}


@pytest.fixture(params=["fast", "allowed-fallback"])
def situation(request: pytest.FixtureRequest) -> Iterator[str]:
    saved = _purge()
    if request.param == "fast":
        sys.path.insert(0, str(TESTS / "fake_providers"))
    try:
        yield str(request.param)
    finally:
        if request.param == "fast":
            sys.path.remove(str(TESTS / "fake_providers"))
        _purge()
        sys.modules.update(saved)


@pytest.mark.parametrize("armed", [False, True], ids=["unarmed", "armed"])
def test_forward_overhead(benchmark: Any, situation: str, armed: bool) -> None:
    torch.set_num_threads(2)
    model = tiny_models.tiny_model("qwen3_5", **SIZE)
    ids = torch.randint(0, SIZE["vocab_size"], (1, TOKENS))
    report = guard(model, packed=False, allow=ALLOW) if armed else None
    benchmark.group = situation
    benchmark.extra_info["wrapped_sites"] = len(report.tripwires.sites) if report else 0
    try:
        with torch.no_grad():
            model(ids)  # warm-up (and the one-time recording of an allowed fallback)
            benchmark.pedantic(model, args=(ids,), rounds=30, iterations=1, warmup_rounds=3)
    finally:
        if report is not None:
            report.disarm()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.mark.parametrize("through", ["bare", "tripwire"])
def test_wrapper_call_overhead(benchmark: Any, through: str) -> None:
    """The tripwire itself, isolated on a no-op: an allowed call through the wrapper vs the bare function.

    Per-forward overhead of an armed guard with an accepted fallback = (difference) x (wrapped calls per
    forward: 2 per GDN layer in training, causal_conv1d_fn and chunk_gated_delta_rule).
    """
    module = types.ModuleType("kernelguard_bench_dummy")
    module.fn = _noop  # type: ignore[attr-defined]
    tripwires = Tripwires(allow=["bench_kernel"])
    tripwires._arm(module, "fn", "bench_kernel", "kernelguard_bench_dummy.fn", None)
    try:
        fn = module.fn if through == "tripwire" else _noop  # type: ignore[attr-defined]
        fn()  # the one-time record of an allowed entry
        benchmark.group = "wrapper (ns scale)"
        benchmark(fn)
    finally:
        tripwires.disarm()
    assert module.fn is _noop  # type: ignore[attr-defined]
