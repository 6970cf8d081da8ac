"""fla's GDN backend (kernelguard.resolution.fla_backend): fla 0.6.0's dispatch rules, its registry when fla is imported,
and the known-issue rows that match on the backend (fla #640 lives only in the Triton backward)."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any, ClassVar

import pytest
from check_helpers import find, make_env, make_pkg

from kernelguard.resolution import catalog, discovery, fla_backend
from kernelguard.resolution.capability import ComputeCapability
from kernelguard.resolution.decisions import REJECTED, SELECTED
from kernelguard.resolution.facts import Facts, FlaBackend
from kernelguard.resolution.fla_backend import Candidate, GdnShape, decide
from kernelguard.resolution.resolver import Target, resolve

QWEN35 = GdnShape(key_dim=128, value_dim=128, num_k_heads=16, num_v_heads=32)
ON, OFF = Candidate(True, None), Candidate(False, None, "flash_qla is not importable")
H200 = ComputeCapability(9, 0)


def _decide(arch: ComputeCapability | None = H200, *, training: bool = True, shape: GdnShape = QWEN35,
            triton: str = "3.6.0", qla: Candidate = OFF, tile: Candidate = OFF, disabled: bool = False) -> FlaBackend:
    return decide(arch, training=training, shape=shape, triton_version=triton, flash_qla=qla, tilelang=tile,
                  dispatch_disabled=disabled, source="test")


def test_flash_qla_takes_the_whole_op_at_head_dim_128_on_hopper() -> None:
    chosen = _decide(qla=ON, tile=ON)
    assert (chosen.forward, chosen.backward, chosen.label) == ("flash_qla", "flash_qla", "flash_qla")


@pytest.mark.parametrize(
    ("arch", "shape", "training", "qla", "why"),
    [
        (H200, replace(QWEN35, key_dim=64), True, ON, "FlashQLA requires K=128 and V=128, the model has K=64, V=128"),
        (ComputeCapability(8, 0), QWEN35, True, ON, "FlashQLA requires NVIDIA SM90, SM100/SM103 or SM120, target is 8.0"),
        (ComputeCapability(12, 0), QWEN35, True, ON,
         "FlashQLA on SM120 implements the forward pass only, but training needs the backward"),
        (H200, QWEN35, True, Candidate(True, False), "FLA_FLASH_QLA=0"),
        (H200, QWEN35, True, OFF, "flash_qla is not importable"),
    ],
)
def test_flash_qla_is_passed_over_with_fla_s_own_reason(
    arch: ComputeCapability, shape: GdnShape, training: bool, qla: Candidate, why: str
) -> None:
    chosen = _decide(arch, shape=shape, training=training, qla=qla)
    assert chosen.forward == "triton" and chosen.reasons[0] == f"flash_qla: passed over ({why})"


def test_sm120_inference_may_use_flash_qla() -> None:
    assert _decide(ComputeCapability(12, 0), training=False, qla=ON).forward == "flash_qla"


@pytest.mark.parametrize(
    ("arch", "triton", "tile", "backward"),
    [
        (H200, "3.6.0", ON, "tilelang"),  # fla's default: Hopper with Triton >= 3.4 (the #640 stacks)
        (H200, "3.3.1", ON, "triton"),
        (ComputeCapability(8, 0), "3.6.0", ON, "triton"),
        (ComputeCapability(8, 0), "3.6.0", Candidate(True, True), "tilelang"),  # FLA_TILELANG=1
        (H200, "3.6.0", Candidate(True, False), "triton"),  # FLA_TILELANG=0
        (H200, "3.6.0", Candidate(False, None, "tilelang is installed but no usable nvcc was found"), "triton"),
    ],
)
def test_the_tilelang_backward_follows_fla_s_default_and_switch(
    arch: ComputeCapability, triton: str, tile: Candidate, backward: str
) -> None:
    chosen = _decide(arch, triton=triton, tile=tile)
    assert (chosen.forward, chosen.backward) == ("triton", backward)


def test_no_nvcc_is_said_and_dispatch_off_means_triton_everywhere() -> None:
    chosen = _decide(tile=Candidate(False, None, "tilelang is installed but no usable nvcc was found"))
    assert chosen.reasons[-1] == "tilelang: passed over (tilelang is installed but no usable nvcc was found)"
    off = _decide(qla=ON, tile=ON, disabled=True)
    assert (off.forward, off.backward) == ("triton", "triton")
    assert _decide(training=False, tile=ON).backward is None


class _Backend:
    def __init__(self, available: bool, enabled: bool) -> None:
        self.available, self.enabled = available, enabled

    def is_available(self) -> bool:
        return self.available

    def is_enabled(self) -> bool:
        return self.enabled


def _fake_fla(monkeypatch: pytest.MonkeyPatch, registries: dict[str, Any], disabled: bool = False) -> None:
    backends = types.ModuleType("fla.backends")
    backends._operation_registries = {  # type: ignore[attr-defined]
        op: types.SimpleNamespace(_backends=found) for op, found in registries.items()
    }
    backends._DISPATCH_DISABLED = disabled  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.backends", backends)
    monkeypatch.setattr(fla_backend, "_find", lambda name: name == "fla")


def test_probe_asks_fla_s_registered_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fla(monkeypatch, {"gated_delta_rule": {"flash_qla": _Backend(False, True)},
                            "common": {"tilelang": _Backend(True, True)}})
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    [(arch, chosen)] = fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0").items()
    assert arch == "9.0" and chosen.label == "triton (backward: tilelang)"
    assert chosen.source == "fla's registered backends; verifier conditions applied to target 9.0"
    assert chosen.reasons[0] == ("flash_qla: passed over (fla's _Backend.is_available() is False: flash_qla is not "
                                 "importable)")
    # fla's own switch reading wins when the variable is set
    monkeypatch.setenv("FLA_TILELANG", "0")
    _fake_fla(monkeypatch, {"common": {"tilelang": _Backend(True, False)}})
    assert fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0")["9.0"].backward == "triton"
    _fake_fla(monkeypatch, {"common": {"tilelang": _Backend(True, True)}}, disabled=True)
    assert fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0")["9.0"].reasons == (
        "FLA_DISABLE_BACKEND_DISPATCH=1: fla bypasses every backend",)


def test_fla_0_5_2_registers_its_backends_at_first_call_and_is_asked_so(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = types.SimpleNamespace(_backends={"flash_qla": _Backend(True, True)})

    class BackendRegistry:  # fla 0.5.2's fla.ops.backends: registries fill on ensure_initialized
        _registries: ClassVar[dict[str, Any]] = {}

        @classmethod
        def ensure_initialized(cls, operation: str) -> None:
            if operation == "gated_delta_rule":
                cls._registries[operation] = registry

    module = types.ModuleType("fla.ops.backends")
    module.BackendRegistry = BackendRegistry  # type: ignore[attr-defined]
    monkeypatch.delitem(sys.modules, "fla.backends", raising=False)
    monkeypatch.setitem(sys.modules, "fla.ops.backends", module)
    monkeypatch.setattr(fla_backend, "_find", lambda name: name == "fla")
    monkeypatch.setattr(fla_backend, "_live_arch", lambda: None)
    chosen = fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0")["9.0"]
    assert chosen.label == "flash_qla" and chosen.source.startswith("fla's registered backends")


def test_probe_without_fla_reads_the_same_facts_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "fla.backends", raising=False)
    monkeypatch.delitem(sys.modules, "fla.ops.backends", raising=False)
    monkeypatch.setattr(fla_backend, "_find", lambda name: name in ("fla", "tilelang"))
    monkeypatch.setattr(fla_backend, "_usable_nvcc", lambda: False)
    chosen = fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0")["9.0"]
    assert chosen.label == "triton" and chosen.source == "fla's dispatch rules; verifier conditions applied to target 9.0"
    assert chosen.reasons[-1] == "tilelang: passed over (tilelang is installed but no usable nvcc was found)"
    monkeypatch.setattr(fla_backend, "_find", lambda name: False)
    assert fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0") == {}


# ---------------------------------------------------------------------------------- known issues on it ---
def _resolve(backward: str | None, *, tilelang: bool = False, kernels: str = "0.16.2", hub: bool = False) -> Any:
    spec = discovery.resolve_model("qwen3_5", discovery.transformers_source())
    requirements = catalog.requirements(spec, "training", packed=True, transformers_version="5.23.0")
    facts = Facts(
        env=make_env(gpus=("9.0",), triton="3.6.0", kernels=kernels,
                     packages={"tilelang": "0.1.6", "z3-solver": "4.15.0"} if tilelang else {}),
        packages={"fla.ops.gated_delta_rule": make_pkg("fla", "0.6.0")},
        kernels_window=("0.16", "0.17"),  # transformers 5.17's
        fla_backends={"9.0": FlaBackend("9.0", "triton", backward, (), "test")} if backward else {},
    )
    return resolve(facts, requirements, Target(archs=("9.0",), use_hub=hub))


def test_fla_640_applies_only_where_fla_runs_its_triton_backward() -> None:
    # tilelang installed but fla runs Triton (no nvcc): the refusal is real, whatever is installed
    refused = find(_resolve("triton", tilelang=True), "chunk_gated_delta_rule", "package")
    assert refused.status == REJECTED and refused.issues == ("fla-640-refusal",)
    assert find(_resolve("tilelang"), "chunk_gated_delta_rule", "package").status == SELECTED
    assert find(_resolve("flash_qla"), "chunk_gated_delta_rule").selected.provider.startswith("fla (")
    # without a probed backend (made-up facts), fla's default on the facts: TileLang when installed
    assert find(_resolve(None, tilelang=True), "chunk_gated_delta_rule").selected is not None
    assert find(_resolve(None), "chunk_gated_delta_rule", "package").status == REJECTED


def test_kernels_before_0_14_finds_no_hub_kernel() -> None:
    hub = find(_resolve("tilelang", kernels="0.13.0", hub=True), "chunk_gated_delta_rule", "hub")
    assert hub.status == REJECTED and hub.issues == ("kernels-before-0.14",)
    assert hub.reason.startswith("known issue kernels-before-0.14 (https://github.com/huggingface/kernels/issues/757")
    assert hub.fix == "pip install 'kernels>=0.16,<0.17'"
    assert find(_resolve("tilelang", kernels="0.16.2", hub=True), "chunk_gated_delta_rule", "hub").issues == ()
    assert find(_resolve("tilelang"), "chunk_gated_delta_rule").selected.status == SELECTED


def test_the_guard_names_fla_s_backend_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import torch

    guard_module = importlib.import_module("kernelguard.runtime.model_guard")

    site = types.SimpleNamespace(fast=True, implementation="fla.ops.gated_delta_rule.chunk_gated_delta_rule 0.6.0",
                                 kernel="chunk_gated_delta_rule")
    report = guard_module.GuardReport([site], types.SimpleNamespace(sites=[]), device="cuda:0", mode="training", packed=True,  # type: ignore[list-item, arg-type]
                                      attention="error", transformers_version="5.23.0", mechanism="call-time")
    model = types.SimpleNamespace(config=types.SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32,
                                                               linear_key_head_dim=128, linear_value_head_dim=128))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    _fake_fla(monkeypatch, {"gated_delta_rule": {"flash_qla": _Backend(True, True)}})
    monkeypatch.setattr(fla_backend, "_live_arch", lambda: None)  # no real GPU to run fla's verifier on
    report.fla_backend = guard_module._fla_backend(model, report, "training")
    assert report.notes == [("fla runs the GDN op on its flash_qla backend (fla's registered backends; "
                             "verifier conditions applied to target 9.0)")]
    assert report.fla_backend.backward == "flash_qla"
    report.device = "cpu"
    assert guard_module._fla_backend(model, report, "training") is None


def test_an_fla_without_backend_dispatch_runs_triton(fake_providers: Any) -> None:
    import fla  # the test double: an fla with no fla.backends, as releases before 0.5.2

    assert fla.__version__
    chosen = fla_backend.probe([H200], training=True, shape=QWEN35, triton_version="3.6.0")["9.0"]
    assert (chosen.forward, chosen.backward) == ("triton", "triton")
    assert chosen.reasons == (f"fla {fla.__version__} has no backend dispatch: its own Triton kernels run",)
