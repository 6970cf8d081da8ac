"""Tripwires under torch.compile: traced by dynamo (fullgraph and default mode), verdict taken at trace time.

The backend is ``eager`` for most tests: dynamo's tracing, where the tripwire runs and the reference is chosen,
is the same for every backend, and inductor's code generation only adds time. One test compiles with the
default backend. The model is the smallest Qwen3.5 text model: one GDN layer.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

from kernelguard.errors import KernelFallbackError
from kernelguard.runtime.model_guard import arm_tripwires, clear_fallback_events, fallback_events, guard
from kernelguard.runtime.registry import REGISTRY

pytestmark = pytest.mark.kernelguard(False)  # these tests enter fallbacks on purpose

LAYER = "model.layers.0.linear_attn"
GDN_KERNELS = {"causal_conv1d_fn", "chunk_gated_delta_rule"}
MODES = pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])


def _reset_dynamo() -> None:
    """dynamo forgets its graphs, and the modules it resolved for guards: the fixtures re-import transformers'
    modeling modules, and ``torch._dynamo.reset`` keeps both dynamo's import cache and the aliases it left in
    the globals of the frames it compiled (``__import_<module>``), so guards would read the old module."""
    torch._dynamo.reset()
    import_module = getattr(torch._dynamo.symbolic_convert, "_import_module", None)
    getattr(import_module, "cache_clear", lambda: None)()
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for name in [n for n, v in names.items() if n.startswith("__import_") and isinstance(v, ModuleType)]:
            del names[name]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    _reset_dynamo()
    clear_fallback_events()
    yield
    leftover = REGISTRY.armed_sites()
    REGISTRY.reset()
    _reset_dynamo()
    assert not leftover, f"test left tripwires armed: {leftover}"


def _model(tiny: Any) -> Any:
    return tiny.tiny_model("qwen3_5", num_hidden_layers=1, layer_types=["linear_attention"])


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))


def _compiled(model: Any, fullgraph: bool, backend: str = "eager") -> Any:
    return torch.compile(model, fullgraph=fullgraph, backend=backend)


@MODES
def test_refused_fallback_raises_the_usual_error_from_the_compiled_region(
    fresh_transformers_models: None, tiny: Any, fullgraph: bool
) -> None:
    model = _model(tiny)
    with arm_tripwires(on_fallback="raise"), pytest.raises(KernelFallbackError) as info:
        _compiled(model, fullgraph)(_ids())
    error = info.value
    assert error.layer == LAYER and error.kernel == "causal_conv1d_fn"  # the first kernel the GDN layer calls
    assert error.message.startswith(f"{LAYER} entered the torch reference path of `causal_conv1d_fn`")
    assert "allow=['causal_conv1d_fn']" in str(error)
    assert next((e.kernel, e.allowed) for e in fallback_events()) == ("causal_conv1d_fn", False)


def test_refused_fallback_of_a_guarded_model_under_fullgraph_names_the_layer(
    fresh_transformers_models: None, tiny: Any
) -> None:
    model = _model(tiny)
    with guard(model, strict=False), pytest.raises(KernelFallbackError, match=f"^{LAYER} entered"):
        _compiled(model, True)(_ids())


@MODES
def test_allowed_fallback_compiles_runs_and_is_recorded_and_logged_once(
    fresh_transformers_models: None, tiny: Any, fullgraph: bool, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model(tiny)
    caplog.set_level(logging.WARNING, logger="kernelguard")
    with torch.no_grad():
        expected = model(_ids()).logits
        with arm_tripwires(allow=sorted(GDN_KERNELS), on_fallback="raise"):
            compiled = _compiled(model, fullgraph)
            first, second = compiled(_ids()).logits, compiled(_ids()).logits
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    events = fallback_events()
    assert {(e.layer, e.kernel, e.allowed) for e in events} == {(LAYER, k, True) for k in GDN_KERNELS}
    logged = [r.getMessage() for r in caplog.records if "allowed fallback" in r.getMessage()]
    assert sorted(k for k in GDN_KERNELS for m in logged if f"`{k}`" in m) == sorted(GDN_KERNELS)


def test_record_mode_records_a_refused_fallback_at_trace_time_and_runs(
    fresh_transformers_models: None, tiny: Any
) -> None:
    model = _model(tiny)
    with torch.no_grad(), arm_tripwires(on_fallback="record"):
        _compiled(model, True)(_ids())
    assert {(e.layer, e.kernel, e.allowed) for e in fallback_events()} == {(LAYER, k, False) for k in GDN_KERNELS}


def test_a_graph_traced_under_one_arming_is_traced_again_under_the_next(
    fresh_transformers_models: None, tiny: Any
) -> None:
    """The pytest plugin re-arms for every test: a compiled model shared by two tests reports in both."""
    model = _model(tiny)
    compiled = _compiled(model, True)
    with torch.no_grad():
        with arm_tripwires(on_fallback="record"):
            compiled(_ids())
        clear_fallback_events()
        compiled(_ids())  # disarmed: nothing is recorded
        assert fallback_events() == []
        with arm_tripwires(on_fallback="record"):
            compiled(_ids())
    assert {e.kernel for e in fallback_events()} == GDN_KERNELS


@MODES
def test_fast_fake_providers_compile_with_no_fallback(fake_providers: Any, tiny: Any, fullgraph: bool) -> None:
    model = _model(tiny)
    with torch.no_grad(), guard(model) as report:
        assert report.ok
        expected = model(_ids()).logits  # eager first: the fake fla resolves its torch reference once, eagerly
        got = _compiled(model, fullgraph)(_ids()).logits
    torch.testing.assert_close(got, expected)
    assert fallback_events() == []


@pytest.mark.slow
def test_allowed_fallback_with_the_default_backend(fresh_transformers_models: None, tiny: Any) -> None:
    model = _model(tiny)
    with torch.no_grad():
        expected = model(_ids()).logits
        with arm_tripwires(allow=sorted(GDN_KERNELS)):
            got = _compiled(model, True, backend="inductor")(_ids()).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert {(e.kernel, e.allowed) for e in fallback_events()} == {(k, True) for k in GDN_KERNELS}
