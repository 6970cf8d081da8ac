"""The guard across model.train() / model.eval(), and what transformers 5.25 changed under it (CPU).

transformers 5.25 re-kernelizes on a mode change (``PreTrainedModel.train`` sets ``kernels_mode``) when the
model was loaded with Hub kernels and a kernels inside its window is installed. No such kernels can be
installed here (0.19.x is not on the package index), so what runs here is the mode change itself on a model
loaded without the Hub (``use_kernels=False``, as ``kernelguard train`` loads): the per-layer report must still
describe what runs, and the tripwires must still fire, after every switch.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
import torch
from packaging.version import Version

from kernelguard.errors import KernelFallbackError
from kernelguard.runtime.model_guard import clear_fallback_events, fallback_events
from kernelguard.runtime.model_guard import guard as _guard
from kernelguard.runtime.registry import REGISTRY

pytestmark = pytest.mark.kernelguard(False)  # these tests enter fallbacks on purpose
GDN_LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]
TRANSFORMERS_525 = Version(metadata.version("transformers")) >= Version("5.25.0")


@pytest.fixture(autouse=True)
def _disarmed_after() -> Any:
    clear_fallback_events()
    yield
    REGISTRY.reset()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))


def _table(report: Any) -> list[tuple[str, str, str, bool]]:
    return sorted((e.kernel, e.layer, e.kind, e.fast) for e in report.entries)


def test_report_and_fast_path_hold_across_train_and_eval(fake_providers: Any, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with _guard(model, packed=False, mode="training") as report:
        before = _table(report)
        for switch in (model.eval, model.train, model.eval, model.train):
            switch()
            model(_ids())
            assert _table(_guard(model, packed=False, mode="training", strict=False)) == before
        assert report.ok and fallback_events() == []


def test_tripwires_still_fire_after_train_and_eval(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with _guard(model, packed=False, mode="training", allow=["*"]) as report:
        assert not any(e.fast for e in report.entries if e.kernel == "chunk_gated_delta_rule")
        model.eval()
        model.train()
        model(_ids())
        assert {e.kernel for e in fallback_events()} >= {"chunk_gated_delta_rule"}  # recorded after two switches
    with _guard(model, packed=False, mode="training", strict=False):
        model.eval()
        model.train()
        with pytest.raises(KernelFallbackError):
            model(_ids())


def test_every_conv_call_site_is_in_the_report(fake_providers: Any, tiny: Any) -> None:
    """transformers 5.25 calls causal_conv1d_fn / _update from the new module-level ``causal_conv1d_forward``
    (kernelizable itself) instead of from the layer's forward: the report must still list one conv site per GDN
    layer. Fails under 5.25 until the guard's call-site reader follows that function (guard / layer_guard)."""
    model = tiny.tiny_model("qwen3_5")
    report = _guard(model, packed=False, mode="training", strict=False)
    try:
        conv = sorted(e.layer for e in report.entries if e.kernel == "causal_conv1d_fn")
        assert conv == GDN_LAYERS, f"transformers {metadata.version('transformers')}: conv sites {conv}"
    finally:
        report.disarm()


def test_generate_inside_a_training_guard_runs_the_decode_references_without_refusing(
    fresh_transformers_models: None, tiny: Any
) -> None:
    """Evaluating by generation inside a training job: the decode-only kernels ("slow (decode-only)" in the
    table) are not armed in training mode, so generate() runs their torch references; the prefill kernels stay
    guarded (the control: the same guard without their allow items refuses the first forward)."""
    model = tiny.tiny_model("qwen3_5", use_cache=True)  # as Qwen3.5 checkpoints ship it: generate() decodes
    prefill = ["causal_conv1d_fn", "chunk_gated_delta_rule", "attention"]
    with _guard(model, packed=False, mode="training", allow=prefill) as report:
        decode = {e.kernel for e in report.entries if not e.fast and e.kernel not in prefill}
        assert decode == {"causal_conv1d_update", "fused_recurrent_gated_delta_rule"}
        out = model.generate(_ids(), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape == (1, 15) and out.past_key_values is not None  # the cache: decode kernels ran
        assert {e.kernel for e in fallback_events()} == {"causal_conv1d_fn", "chunk_gated_delta_rule"}
    with _guard(model, packed=False, mode="training", allow=["attention"], strict=False), \
            pytest.raises(KernelFallbackError, match="causal_conv1d_fn"):
        model.generate(_ids(), max_new_tokens=3, do_sample=False)
