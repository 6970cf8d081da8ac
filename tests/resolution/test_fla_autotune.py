"""kernelguard.resolution.fla_autotune: recording fla's autotune choices and pinning them in a later process, with a
stand-in Triton (the real one needs a GPU). Triton's ``Autotuner.run`` benchmarks only on a ``cache`` miss,
so a pinned key must land in exactly that dict, under exactly the key Triton builds."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kernelguard.resolution import fla_autotune
from kernelguard.resolution.fla_autotune import Stack

STACK = Stack("9.0", "3.6.0", "0.6.0")
KEY = (16, 32, 128, 128, 64, True, "torch.bfloat16")


class FakeConfig:
    def __init__(
        self,
        kwargs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 2,
        num_ctas: int = 1,
        maxnreg: int | None = None,
    ) -> None:
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages
        self.num_ctas, self.maxnreg = num_ctas, maxnreg


class FakeAutotuner:
    def __init__(self, n_configs: int) -> None:
        self.configs = [FakeConfig({"BV": 32 * (i + 1)}) for i in range(n_configs)]
        self.cache: dict[tuple[Any, ...], FakeConfig] = {}


class FakeHeuristics:  # triton.heuristics wraps the autotuner: reachable through .fn
    def __init__(self, fn: Any) -> None:
        self.fn = fn


@pytest.fixture
def fake_stack(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    triton = types.ModuleType("triton")
    triton.Config = FakeConfig  # type: ignore[attr-defined]
    autotuner_mod = types.ModuleType("triton.runtime.autotuner")
    autotuner_mod.Autotuner = FakeAutotuner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", autotuner_mod)
    fwd, bwd, single = FakeAutotuner(4), FakeAutotuner(6), FakeAutotuner(1)
    mod = types.ModuleType("fla.ops.common.chunk_o")
    mod.chunk_fwd_kernel_o = fwd  # type: ignore[attr-defined]
    mod.chunk_bwd_kernel_dqkwg = FakeHeuristics(bwd)  # type: ignore[attr-defined]
    mod.single = single  # type: ignore[attr-defined]
    mod.not_a_kernel = 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", mod)
    return {"fwd": fwd, "bwd": bwd, "single": single}


def test_record_then_pin_in_a_fresh_process_fills_exactly_the_autotune_cache(
    fake_stack: dict[str, Any], tmp_path: Path
) -> None:
    fake_stack["fwd"].cache[KEY] = FakeConfig({"BV": 64}, num_warps=8, num_stages=3)
    fake_stack["bwd"].cache[KEY[:-1] + ("torch.float32",)] = FakeConfig({"BK": 128}, num_warps=4)
    fake_stack["single"].cache[KEY] = FakeConfig({"BV": 32})
    entry = fla_autotune.record(STACK)
    assert entry["capability"] == "9.0" and entry["triton"] == "3.6.0" and entry["fla"] == "0.6.0"
    assert sorted(entry["kernels"]) == [
        "fla.ops.common.chunk_o.chunk_bwd_kernel_dqkwg",
        "fla.ops.common.chunk_o.chunk_fwd_kernel_o",
    ]  # the single-config kernel searches nothing: not pinned
    path = tmp_path / "pins.json"
    path.write_text(json.dumps(fla_autotune.merge_entry({"entries": []}, entry)))

    # "Next process": empty caches; pins go in under Triton's own tuple key.
    for tuner in fake_stack.values():
        tuner.cache.clear()
    assert fla_autotune.apply(fla_autotune.entry_for(STACK, fla_autotune.load_pins(path)) or {}) == 2
    pinned = fake_stack["fwd"].cache[KEY]
    assert (pinned.kwargs, pinned.num_warps, pinned.num_stages) == ({"BV": 64}, 8, 3)
    assert fake_stack["bwd"].cache[KEY[:-1] + ("torch.float32",)].kwargs == {"BK": 128}
    assert fake_stack["single"].cache == {}
    # Idempotent, and never overrides a choice already made in this process.
    fake_stack["fwd"].cache[KEY] = FakeConfig({"BV": 16})
    assert fla_autotune.apply(fla_autotune.load_pins(path)["entries"][0]) == 0
    assert fake_stack["fwd"].cache[KEY].kwargs == {"BV": 16}


def test_pins_are_used_only_on_the_exact_stack_they_were_recorded_on(fake_stack: dict[str, Any]) -> None:
    fake_stack["fwd"].cache[KEY] = FakeConfig({"BV": 64})
    pins = fla_autotune.merge_entry({"entries": []}, fla_autotune.record(STACK))
    assert fla_autotune.entry_for(STACK, pins) is not None
    for other in (
        Stack("8.0", "3.6.0", "0.6.0"),
        Stack("9.0", "3.7.1", "0.6.0"),
        Stack("9.0", "3.6.0", "0.6.1"),
    ):
        assert fla_autotune.entry_for(other, pins) is None


def test_merge_adds_keys_to_the_same_stack_and_keeps_other_stacks(fake_stack: dict[str, Any]) -> None:
    fake_stack["fwd"].cache[KEY] = FakeConfig({"BV": 64})
    first = fla_autotune.merge_entry({"entries": []}, fla_autotune.record(STACK))
    fake_stack["fwd"].cache[(8, 16, 128, 128, 64, False, "torch.bfloat16")] = FakeConfig({"BV": 32})
    both = fla_autotune.merge_entry(first, fla_autotune.record(STACK))
    other = fla_autotune.merge_entry(both, {**fla_autotune.record(STACK), "capability": "8.0"})
    assert len(other["entries"]) == 2
    rows = other["entries"][0]["kernels"]["fla.ops.common.chunk_o.chunk_fwd_kernel_o"]
    assert sorted(r["key"][0] for r in rows) == [8, 16]


def test_missing_or_broken_pins_file_means_no_pins(tmp_path: Path) -> None:
    assert fla_autotune.load_pins(tmp_path / "absent.json") == {"entries": []}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert fla_autotune.load_pins(bad) == {"entries": []}


def test_without_cuda_pinning_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA answer")
    assert fla_autotune.pin_for_this_gpu().startswith("fla autotune pins: not applicable")


def test_shipped_pins_file_is_well_formed() -> None:
    data = json.loads(fla_autotune.PINS_FILE.read_text())
    for entry in data["entries"]:
        assert {"capability", "triton", "fla", "kernels"} <= set(entry)
        for rows in entry["kernels"].values():
            for row in rows:
                assert isinstance(row["key"], list) and "kwargs" in row["config"]


def test_searches_that_missed_their_pins_are_named(fake_stack: dict[str, Any]) -> None:
    fake_stack["fwd"].cache[KEY] = FakeConfig({"BV": 64})
    entry = fla_autotune.record(STACK)
    other = KEY[:-1] + ("torch.float32",)
    fake_stack["fwd"].cache[other] = FakeConfig({"BV": 32})  # a shape the pins did not cover: searched
    fake_stack["bwd"].cache[KEY] = FakeConfig({"BK": 64})  # a kernel with no pin at all
    fake_stack["single"].cache[KEY] = FakeConfig({"BV": 32})  # one config: nothing was searched
    assert fla_autotune.searched_after_pinning(entry) == [
        f"chunk_bwd_kernel_dqkwg{list(KEY)}",
        f"chunk_fwd_kernel_o{list(other)}",
    ]
    assert fla_autotune.searched_after_pinning(fla_autotune.record(STACK)) == []


def test_search_results_are_kept_on_disk_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert fla_autotune.keep_search_results(env) is True
    assert env == {"TRITON_CACHE_AUTOTUNING": "1"}
    chosen = {"TRITON_CACHE_AUTOTUNING": "0"}
    assert fla_autotune.keep_search_results(chosen) is False
    assert chosen == {"TRITON_CACHE_AUTOTUNING": "0"}


def test_train_and_check_run_turn_the_search_cache_on_plain_check_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Triton reads the switch when fla's autotuners are created, so the commands that run fla's kernels set it
    at their entry, before anything imports a provider; a plain check runs no kernel and leaves it alone."""
    from kernelguard.cli import check as check_cli
    from kernelguard.train.__main__ import main as train_main

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "unset below")  # so the test's end removes what main sets
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    check_cli.main(["--model", "no_such_family"])
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ
    check_cli.main(["--model", "no_such_family", "--run"])
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    assert train_main(["--help"]) == 0
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    capsys.readouterr()


def test_pinning_first_imports_the_pinned_kernel_modules_of_a_process_using_fla(
    fake_stack: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers may import an fla kernel module only at its first call (the gate's probe): pinned then, it
    is never searched. Whichever modules the pins name are imported (l2norm's, KDA's: not a fixed list). A
    process that never imported fla is left without it."""
    import importlib

    modules = {name: types.ModuleType(name) for name in ("fla.modules.l2norm", "fla.ops.kda.chunk_intra")}
    for module in modules.values():
        module.kernel = FakeAutotuner(3)  # type: ignore[attr-defined]
    row = {"key": list(KEY), "config": {"kwargs": {"BT": 32}, "num_warps": 8}}
    entry = {**STACK.to_dict(), "kernels": {f"{name}.kernel": [row] for name in modules}}
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    real_import = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> Any:
        if name in modules:
            sys.modules[name] = modules[name]  # what importing the real package does
            return modules[name]
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert fla_autotune.apply(entry) == 0  # no fla in this process: nothing imported, nothing pinned
    assert not set(modules) & set(sys.modules)
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    assert fla_autotune.apply(entry) == 2
    assert all(module.kernel.cache[KEY].num_warps == 8 for module in modules.values())  # type: ignore[attr-defined]
    for name in modules:
        sys.modules.pop(name, None)
