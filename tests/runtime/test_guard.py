"""Runtime guard on tiny CPU models: reports, strict refusal, tripwires, reversibility, versions, devices."""

from __future__ import annotations

import json
import logging
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MethodType
from typing import Any

import pytest
import torch
from check_helpers import COMMANDS

from kernelguard.errors import ConfigError, KernelFallbackError, UnsupportedTransformersError
from kernelguard.resolution import transformers_compat as compat
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.runtime import registry
from kernelguard.runtime.import_hook import IMPORT_WATCHER
from kernelguard.runtime.layer_guard import classify_closure
from kernelguard.runtime.model_guard import (
    CallSite,
    GuardReport,
    arm_tripwires,
    clear_fallback_events,
    fallback_events,
)
from kernelguard.runtime.model_guard import guard as _guard
from kernelguard.runtime.registry import REGISTRY

# These tests enter fallbacks on purpose; the pytest plugin must not fail them.
pytestmark = pytest.mark.kernelguard(False)

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
GDN_LAYERS = ("model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn")
MODELING = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
}
FALLBACK_GLOBALS = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")  # armed in training mode
DECODE_GLOBALS = ("torch_recurrent_gated_delta_rule", "causal_conv1d_update")  # armed in inference mode only


@pytest.fixture(autouse=True)
def _no_leftover_tripwires() -> Iterator[None]:
    clear_fallback_events()
    yield
    leftover = REGISTRY.armed_sites()
    REGISTRY.reset()
    assert not leftover, f"test left tripwires armed: {leftover}"
    assert IMPORT_WATCHER not in sys.meta_path


def guard(model: Any, **kwargs: Any) -> GuardReport:
    """kernelguard.guard for padded batches unless a test says ``packed=``: most tests here are about one call
    site's classification, not about packing (the default, packed for training, has tests of its own)."""
    return _guard(model, **{"packed": False, **kwargs})


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))


def _by_kernel(report: GuardReport, kernel: str) -> list[CallSite]:
    return [e for e in report.entries if e.kernel == kernel]


# ------------------------------------------------------------------------------------ without fakes ---
@pytest.mark.parametrize("family", FAMILIES)
def test_strict_guard_refuses_naming_every_gdn_layer(
    fresh_transformers_models: None, tiny: Any, family: str
) -> None:
    model = tiny.tiny_model(family)
    with pytest.raises(KernelFallbackError) as info:
        guard(model)
    err = info.value
    for layer in GDN_LAYERS:
        assert layer in err.message
    assert err.layer == "model.layers.0.linear_attn"
    assert "No module named 'fla'" in err.message
    # The same commands `kernelguard check` prints (build tools and pins included), not a bare package name.
    assert COMMANDS["fla"] in (err.fix or "")
    assert COMMANDS["causal_conv1d"] in (err.fix or "")
    assert not REGISTRY.armed_sites(), "a refused strict guard must not arm anything"


@pytest.mark.parametrize("family", FAMILIES)
def test_report_marks_every_gdn_layer_as_torch_reference(
    fresh_transformers_models: None, tiny: Any, family: str
) -> None:
    model = tiny.tiny_model(family)
    with guard(model, strict=False) as report:
        chunk = _by_kernel(report, "chunk_gated_delta_rule")
        assert [e.layer for e in chunk] == list(GDN_LAYERS)
        assert all(e.kind == "reference" and not e.fast and not e.allowed for e in chunk)
        assert all("ModuleNotFoundError: No module named 'fla'" in e.reason for e in chunk)
        (attn,) = _by_kernel(report, "attention")
        assert attn.layer == "model.layers.3.self_attn" and attn.implementation == "sdpa" and attn.fast
        assert not report.ok
        assert "model.layers.2.linear_attn" in report.render()
        json.dumps(report.to_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_nonstrict_first_forward_raises_naming_layer(
    fresh_transformers_models: None, tiny: Any, family: str
) -> None:
    model = tiny.tiny_model(family)
    with guard(model, strict=False), pytest.raises(KernelFallbackError) as info:
        model(_ids())
    assert info.value.layer == "model.layers.0.linear_attn"
    assert "model.layers.0.linear_attn entered the torch reference path" in str(info.value)
    assert info.value.kernel in ("causal_conv1d_fn", "chunk_gated_delta_rule")
    assert "pip install" in (info.value.fix or "")


def test_swallowed_fallback_is_still_recorded(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with guard(model, strict=False):
        try:
            model(_ids())
        except KernelFallbackError:
            pass
    (event,) = fallback_events()
    assert event.layer == "model.layers.0.linear_attn" and not event.allowed
    assert event.to_error().layer == event.layer


def test_silenced_transformers_logging_changes_nothing(
    fresh_transformers_models: None, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = tiny.tiny_model("qwen3_5")
        with pytest.raises(KernelFallbackError):
            guard(model)
        with guard(model, strict=False), pytest.raises(KernelFallbackError):
            model(_ids())
    finally:
        hf_logging.set_verbosity(before)


def test_allow_accepts_logs_once_and_reports(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny.tiny_model("qwen3_5")
    caplog.set_level(logging.WARNING, logger="kernelguard")
    with guard(model, allow=["chunk_gated_delta_rule", "causal_conv1d_fn"]) as report:
        assert report.ok
        assert all(e.allowed for e in _by_kernel(report, "chunk_gated_delta_rule"))
        assert "ALLOWED-SLOW" in report.render()
        model(_ids())
        model(_ids())
    assert {e.kernel for e in fallback_events()} == {"chunk_gated_delta_rule", "causal_conv1d_fn"}
    assert all(e.allowed for e in fallback_events())
    lines = [r.getMessage() for r in caplog.records if "allowed" in r.getMessage()]
    assert len([m for m in lines if "chunk_gated_delta_rule" in m and "entered" in m]) == 1


def test_allowed_gdn_reference_is_still_refused_for_packed_training(fresh_transformers_models: None, tiny: Any) -> None:
    # The torch references ignore cu_seqlens/seq_idx: a packed row would crash (transformers >= 5.20) or mix.
    model = tiny.tiny_model("qwen3_5")
    allow = ["chunk_gated_delta_rule", "causal_conv1d_fn", "attention"]
    with pytest.raises(KernelFallbackError) as info:
        guard(model, packed=True, allow=allow)
    assert "the torch reference cannot keep packed examples apart" in str(info.value)
    with guard(model, packed=False, allow=allow) as report:  # the same allow list is fine unpacked
        assert report.ok
    with guard(model, mode="inference", packed=True, strict=False, allow=allow) as report:
        assert all(e.allowed for e in _by_kernel(report, "chunk_gated_delta_rule"))  # packed matters in training


def test_decode_only_kernels_required_in_inference_mode(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    allow = ["chunk_gated_delta_rule", "causal_conv1d_fn"]
    with guard(model, allow=allow) as report:  # training: recurrent/update are decode-only
        assert not any(e.required for e in _by_kernel(report, "fused_recurrent_gated_delta_rule"))
    with pytest.raises(KernelFallbackError, match="fused_recurrent_gated_delta_rule"):
        guard(model, mode="inference", allow=allow)


def test_bad_arguments_are_config_errors(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with pytest.raises(ConfigError):
        guard(model, mode="train")
    with pytest.raises(ConfigError):
        guard(model, attention="loud")


# ------------------------------------------------------------------------------- reversibility ---
def test_disarm_restores_identity_and_arming_is_idempotent(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    module = sys.modules[MODELING["qwen3_5"]]
    originals = {name: getattr(module, name) for name in FALLBACK_GLOBALS}
    decode = {n: getattr(module, n) for n in DECODE_GLOBALS}
    first = guard(model, strict=False)  # training mode: the decode-only kernels are reported, not armed
    assert all(getattr(module, n) is decode[n] for n in DECODE_GLOBALS)
    wrappers = {name: getattr(module, name) for name in FALLBACK_GLOBALS}
    second = guard(model, strict=False)
    for name in FALLBACK_GLOBALS:
        assert getattr(module, name) is wrappers[name], "re-arming must not wrap twice"
        assert getattr(module, name) is not originals[name]
        assert getattr(module, name).__kernelguard_tripwire__.original is originals[name]
    assert _by_kernel(second, "chunk_gated_delta_rule")[0].kind == "reference"
    first.disarm()
    assert all(getattr(module, n) is wrappers[n] for n in FALLBACK_GLOBALS), "still held by the second arming"
    second.disarm()
    second.disarm()
    assert all(getattr(module, n) is originals[n] for n in FALLBACK_GLOBALS)


def test_disarm_leaves_a_foreign_replacement_alone(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    module = sys.modules[MODELING["qwen3_5"]]
    name = "torch_chunk_gated_delta_rule"
    original = getattr(module, name)

    def theirs(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    report = guard(model, strict=False)
    setattr(module, name, theirs)
    report.disarm()
    assert getattr(module, name) is theirs
    setattr(module, name, original)


def test_arm_tripwires_is_model_independent_and_covers_later_imports(
    fresh_transformers_models: None, tiny: Any
) -> None:
    tripwires = arm_tripwires()
    try:
        assert not any(m.__name__ == MODELING["qwen3_5"] for m in compat.iter_modeling_modules())
        model = tiny.tiny_model("qwen3_5")  # imported after arming: the import hook arms it
        with pytest.raises(KernelFallbackError) as info:
            model(_ids())
        assert info.value.layer == "model.layers.0.linear_attn"  # from the root module, without guard(model)
    finally:
        tripwires.disarm()
    module = sys.modules[MODELING["qwen3_5"]]
    assert not hasattr(vars(module)["torch_chunk_gated_delta_rule"], "__kernelguard_tripwire__")


def test_errors_pickle_round_trip(fresh_transformers_models: None, tiny: Any) -> None:
    with pytest.raises(KernelFallbackError) as info:
        guard(tiny.tiny_model("qwen3_5"))
    err = info.value
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is KernelFallbackError
    assert (clone.layer, clone.kernel, clone.reason, clone.fix, str(clone)) == (
        err.layer, err.kernel, err.reason, err.fix, str(err))
    refused = compat.unsupported("4.0.0", "because")
    assert str(pickle.loads(pickle.dumps(refused))) == str(refused)


# ------------------------------------------------------------------------------------- with fakes ---
@pytest.mark.parametrize("family", FAMILIES)
def test_with_fake_providers_reports_fast_and_forward_passes(
    fake_providers: Any, tiny: Any, family: str
) -> None:
    model = tiny.tiny_model(family)
    with guard(model) as report:
        assert report.ok
        chunk = _by_kernel(report, "chunk_gated_delta_rule")
        assert [e.layer for e in chunk] == list(GDN_LAYERS)
        assert all(e.fast and e.kind == "package" for e in chunk)
        assert chunk[0].implementation.startswith("fla.ops.gated_delta_rule.chunk_gated_delta_rule 0.6.0")
        conv = _by_kernel(report, "causal_conv1d_fn")
        assert all(e.fast and e.implementation.startswith("causal_conv1d.causal_conv1d_fn") for e in conv)
        assert report.tripwires.sites == []  # nothing falls back, nothing is wrapped
        model(_ids())
    assert fallback_events() == []


def test_installed_provider_that_cannot_run_on_the_device_is_not_fast(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny.tiny_model("qwen3_5")
    monkeypatch.delattr(sys.modules["fla"], "__kernelguard_devices__")  # like the real fla
    with pytest.raises(KernelFallbackError, match="does not run on device cpu"):
        guard(model)
    with guard(model, strict=False) as report:
        chunk = _by_kernel(report, "chunk_gated_delta_rule")
        assert all(not e.fast and e.kind == "package" for e in chunk)
        assert all(e.fast for e in _by_kernel(report, "causal_conv1d_fn"))


def test_packed_sdpa_attention_is_a_reported_slow_path(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny.tiny_model("qwen3_5")
    with pytest.raises(KernelFallbackError, match=r"O\(T\^2\)"):
        guard(model, packed=True)
    with guard(model, packed=True, attention="warn") as report:
        (attn,) = _by_kernel(report, "attention")
        assert not attn.fast and report.ok and "slow (warn)" in report.render()
    with guard(model, packed=True, allow=["attention"]) as report:
        assert _by_kernel(report, "attention")[0].allowed
    model.config._attn_implementation = "flash_attention_2"
    with guard(model, packed=True) as report:
        assert _by_kernel(report, "attention")[0].fast
    from transformers import AttentionInterface

    # Another test may have registered it in this process (the mapping is global): start unregistered.
    monkeypatch.delitem(AttentionInterface._global_mapping, "kernelguard_varlen", raising=False)
    model.config._attn_implementation = "kernelguard_varlen"
    with pytest.raises(KernelFallbackError, match="not registered"):
        guard(model, packed=True)

    monkeypatch.setitem(AttentionInterface._global_mapping, "kernelguard_varlen", lambda *a, **k: None)
    with guard(model, packed=True) as report:
        (attn,) = _by_kernel(report, "attention")
        assert attn.fast and attn.implementation == "kernelguard_varlen"


# -------------------------------------------------------------------------------------- versions ---
def test_old_transformers_version_is_refused(
    fresh_transformers_models: None, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    model = tiny.tiny_model("qwen3_5")
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(UnsupportedTransformersError, match="unsupported transformers version 4.57.1"):
        guard(model)
    with pytest.raises(UnsupportedTransformersError):
        arm_tripwires()


def test_release_without_the_decorator_is_refused(
    fresh_transformers_models: None, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations import hub_kernels

    model = tiny.tiny_model("qwen3_5")
    monkeypatch.delattr(hub_kernels, compat.DECORATOR_NAME)
    # Every supported transformers (>= 5.17) selects kernels through the decorator: without it kernelguard
    # cannot tell what a layer runs, and refuses rather than guess.
    refused = f"unsupported transformers version .*has no `{compat.DECORATOR_NAME}`"
    with pytest.raises(UnsupportedTransformersError, match=refused):
        guard(model)


def test_decorator_with_unknown_closure_layout_is_refused(
    fresh_transformers_models: None, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations import hub_kernels

    model = tiny.tiny_model("qwen3_5")
    monkeypatch.setattr(hub_kernels, compat.DECORATOR_NAME, lambda name, package: (lambda fn: fn))
    registry.reset()  # the decorator probe is memoised per transformers version
    try:
        with pytest.raises(UnsupportedTransformersError, match="no longer returns a closure"):
            guard(model)
    finally:
        registry.reset()


# ------------------------------------------------------------------------------------ Kernel Hub ---
def test_kernelized_func_module_is_reported_as_hub_kernel(
    fresh_transformers_models: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels_layer = pytest.importorskip("kernels.layer.layer")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrapped = modeling_qwen3_5.torch_chunk_gated_delta_rule
    func = kernels_layer._create_func_module(wrapped)()
    func.kernel_layer_name = "chunk_gated_delta_rule"
    closure = compat.unpack_closure(func)
    assert closure is not None and closure.is_torch_reference and closure.func_module is func
    assert compat.hub_kernel(closure) is None

    class HubChunk(torch.nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return "hub"

    class Repo:
        repo_id, revision = "kernels-community/gated-delta", "v1"

    monkeypatch.setitem(kernels_layer._CACHED_LAYER, Repo(), HubChunk)
    func.forward = MethodType(HubChunk.forward, func)
    site = classify_closure("model.layers.0.linear_attn", closure, "cuda", required=True, policy=AllowPolicy())
    assert (site.kind, site.implementation, site.fast) == ("hub", "kernels-community/gated-delta@v1", True)
    assert (site.decision.layer, site.decision.status) == ("model.layers.0.linear_attn", "selected")


def test_package_attribute_guard_is_callable(fresh_transformers_models: None, tiny: Any) -> None:
    import kernelguard

    model = tiny.tiny_model("qwen3_5")
    with kernelguard.guard(model, strict=False) as report:  # the module or the function: both work
        assert isinstance(report, GuardReport)


def test_packed_call_trips_before_transformers_value_error(fresh_transformers_models: None, tiny: Any) -> None:
    """transformers >= ~5.20 raises ValueError when cu_seqlens/seq_idx reach the torch path; ours comes first."""
    model = tiny.tiny_model("qwen3_5")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = {
        "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None],
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7,
        "seq_idx": torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32),
    }
    with guard(model, strict=False, packed=True, attention="ignore"), pytest.raises(KernelFallbackError) as info:
        model(_ids(), use_cache=False, **packed)
    assert info.value.layer == "model.layers.0.linear_attn"


@pytest.mark.parametrize(
    ("family", "kernel"),
    [
        ("qwen4_exp", "chunk_gated_delta_rule"),
        ("olmo_hybrid", "chunk_gated_delta_rule"),
        ("kimi_linear", "chunk_kda"),
        ("mamba2", "causal_conv1d_fn"),
    ],
)
def test_other_families_are_discovered_without_a_class_list(
    fresh_transformers_models: None, family: str, kernel: str
) -> None:
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    layers = [
        cls for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, torch.nn.Module) and cls.__module__ == module.__name__
        and any(s.closure.kernel == kernel for s in compat.layer_global_sites(cls.__new__(cls)))
    ]
    assert layers, f"no layer of {family} found calling {kernel}"


def test_olmo_hybrid_model_is_guarded(fresh_transformers_models: None) -> None:
    from transformers.models.olmo_hybrid import configuration_olmo_hybrid, modeling_olmo_hybrid

    config = configuration_olmo_hybrid.OlmoHybridConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    model = modeling_olmo_hybrid.OlmoHybridForCausalLM(config)
    with pytest.raises(KernelFallbackError, match=r"model\.layers\.0\.linear_attn"):
        guard(model)


def test_model_without_kernel_layers_reports_attention_only(fresh_transformers_models: None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with guard(LlamaForCausalLM(config)) as report:  # the attention check still applies: not an error
        assert report.ok and {e.kernel for e in report.entries} == {"attention"}
        assert report.notes == [
            ("no gated-delta call sites found: no layer calls a transformers kernel with a torch fallback; "
             "only attention was checked")
        ]
        assert "note: no gated-delta call sites found" in report.render()


# ------------------------------------------------------------------- one vocabulary (issue 9) ---
UNDEFINED_SYMBOL = "/site-packages/causal_conv1d_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"


@pytest.fixture
def conv_built_for_other_torch(fresh_transformers_models: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal_conv1d whose extension fails to load like one built against another torch."""
    package = tmp_path / "causal_conv1d"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ImportError({UNDEFINED_SYMBOL!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_known_issue_id_allows_the_sites_it_explains_and_nothing_else(
    conv_built_for_other_torch: None, tiny: Any
) -> None:
    model = tiny.tiny_model("qwen3_5")
    with pytest.raises(KernelFallbackError) as info:
        guard(model, allow=["extension-built-for-other-torch"])
    assert "chunk_gated_delta_rule" in info.value.message and "causal_conv1d_fn" not in info.value.message
    with guard(model, allow=["extension-built-for-other-torch", "chunk_gated_delta_rule"]) as report:
        (conv, *_) = _by_kernel(report, "causal_conv1d_fn")
        assert conv.allowed and conv.issues == ("extension-built-for-other-torch",)
        assert f"ImportError: {UNDEFINED_SYMBOL}" in conv.reason
        (chunk, *_) = _by_kernel(report, "chunk_gated_delta_rule")
        assert chunk.allowed and chunk.issues == ()
        model(_ids())  # both accepted: the tripwires let the forward through
    assert {(e.kernel, e.allowed) for e in fallback_events()} == {
        ("causal_conv1d_fn", True), ("chunk_gated_delta_rule", True)}


def test_allow_items_are_parsed_once_and_unknown_ones_are_config_errors(
    fresh_transformers_models: None, tiny: Any
) -> None:
    model = tiny.tiny_model("qwen3_5")
    for bad in (["No module named 'fla'"], ["chunk_gated_delta_rul"], [3]):
        with pytest.raises(ConfigError, match=r"^allow= of kernelguard.guard\(\): .* is not a known issue ID"):
            guard(model, allow=bad)  # reason text is no longer matched by substring
    assert not REGISTRY.armed_sites()


def test_call_sites_are_decisions_with_layer_and_kind_reference(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with guard(model, strict=False, allow=["causal_conv1d_fn"]) as report:
        chunk = _by_kernel(report, "chunk_gated_delta_rule")[0]
        conv = _by_kernel(report, "causal_conv1d_fn")[0]
    assert (chunk.decision.layer, chunk.decision.kind, chunk.decision.status) == (
        "model.layers.0.linear_attn", "reference", "fallback")
    assert (conv.decision.kind, conv.decision.status) == ("reference", "allowed")
    assert chunk.decision.provider == "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"
    row = chunk.to_dict()
    assert (row["layer"], row["kind"], row["status"], row["fast"], row["required"]) == (
        "model.layers.0.linear_attn", "reference", "fallback", False, True)


def test_clear_fallback_events_also_resets_log_once(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny.tiny_model("qwen3_5")
    caplog.set_level(logging.WARNING, logger="kernelguard")
    allow = ["chunk_gated_delta_rule", "causal_conv1d_fn"]
    for _ in range(2):
        with guard(model, allow=allow):
            model(_ids())
        clear_fallback_events()
    entered = [r for r in caplog.records if "allowed fallback" in r.getMessage() and "chunk_gated" in r.getMessage()]
    assert len(entered) == 2, "logged once per clear, not once per process"


def test_registry_reset_restores_every_original(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    module = sys.modules[MODELING["qwen3_5"]]
    originals = {name: vars(module)[name] for name in FALLBACK_GLOBALS}
    guard(model, strict=False)
    arm_tripwires()
    assert REGISTRY.armed_sites() and IMPORT_WATCHER in sys.meta_path
    REGISTRY.reset()
    assert all(vars(module)[n] is originals[n] for n in FALLBACK_GLOBALS)
    assert not REGISTRY.armed_sites() and IMPORT_WATCHER not in sys.meta_path and not fallback_events()


def test_record_mode_counts_entries_and_names_layers_without_guard(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    with arm_tripwires(on_fallback="record"):
        model(_ids())
        model(_ids())  # no exception: the entries are recorded and counted
    events = fallback_events()
    assert sorted({e.layer for e in events}) == list(GDN_LAYERS)
    assert {e.kernel for e in events} == {"chunk_gated_delta_rule", "causal_conv1d_fn"}
    assert len(events) == 6 and all(e.count == 2 and not e.allowed for e in events)


def test_scan_cache_rescans_only_new_or_replaced_modules(fresh_transformers_models: None, tiny: Any) -> None:
    REGISTRY.reset()
    tiny.tiny_model("qwen3_5")
    arm_tripwires().disarm()
    scans = REGISTRY.scan.scans
    for _ in range(3):
        arm_tripwires().disarm()
    assert REGISTRY.scan.scans == scans, "re-arming reads the cache"
    module = sys.modules[MODELING["qwen3_5"]]
    original = vars(module)["causal_conv1d_fn"]
    module.causal_conv1d_fn = lambda *a, **k: None  # a test double bound after the scan: not ours to wrap
    try:
        with arm_tripwires() as tripwires:
            assert f"{MODELING['qwen3_5']}.causal_conv1d_fn" not in tripwires.sites
        assert REGISTRY.scan.scans == scans + 1, "only the changed module is scanned again"
    finally:
        module.causal_conv1d_fn = original


def test_known_issue_ids_from_import_errors() -> None:
    assert compat.known_issue_ids(f"ImportError: {UNDEFINED_SYMBOL}") == ("extension-built-for-other-torch",)
    assert compat.known_issue_ids("OSError: libz3.so.4.15: cannot open shared object file") == ("tilelang-without-z3",)
    refusal = "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"
    assert compat.known_issue_ids(refusal) == ("fla-640-refusal",)
    assert compat.known_issue_ids("ModuleNotFoundError: No module named 'fla'") == ()


def test_hub_wrapper_is_the_one_closure_reader(fresh_transformers_models: None) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    name = modeling_qwen3_5.torch_chunk_gated_delta_rule  # a function, or a kernels Func module in-window
    wrapped = compat.hub_wrapper(name)
    assert wrapped is not None and (wrapped is name or not isinstance(name, type(wrapped)))
    cells = compat.closure_cells(wrapped)
    assert cells["func_name"] == "chunk_gated_delta_rule" and cells["implementation"] is cells["torch_function"]
    assert compat.hub_wrapper(object()) is None


# -------------------------------------------------------------- guard(x) validation (issue 10) ---
@pytest.mark.parametrize(("value", "shown"), [("abc", "str 'abc'"), (object(), "object <object object at"),
                                              (None, "NoneType None")])
def test_guard_of_a_non_module_is_a_config_error(value: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        guard(value)
    assert info.value.message.startswith(
        "kernelguard.guard(model): expected a torch.nn.Module (a transformers model such as Qwen3_5ForCausalLM), "
        f"got {shown}")
    assert "kernelguard.guard(model)" in (info.value.fix or "")


def test_module_without_kernel_sites_is_refused_when_strict_and_reported_otherwise() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"^kernelguard.guard\(Sequential\): no gated-delta call sites found and no "
                                          "attention layer"):
        guard(plain)
    with guard(plain, strict=False) as report:
        assert report.entries == [] and report.ok
        assert report.notes == [
            ("no gated-delta call sites found: no layer calls a transformers kernel with a torch fallback; "
             "nothing was checked")
        ]
        assert "OK (no gated-delta call sites found)" in report.render().splitlines()[0]
        assert report.to_dict()["kernel_call_sites"] == 0


def test_a_scan_made_while_armed_is_reused_after_disarm(fresh_transformers_models: None, tiny: Any) -> None:
    REGISTRY.reset()
    model = tiny.tiny_model("qwen3_5")
    with guard(model, strict=False):
        arm_tripwires().disarm()  # the first scan sees the guard's wrappers
    scans = REGISTRY.scan.scans
    arm_tripwires().disarm()
    assert REGISTRY.scan.scans == scans, "the scan recorded what the wrappers wrap, so it is still valid"


def test_allowed_slow_paths_are_logged_by_rank_0_only(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny.tiny_model("qwen3_5")
    caplog.set_level(logging.WARNING, logger="kernelguard")
    monkeypatch.setenv("RANK", "1")
    with guard(model, allow=["chunk_gated_delta_rule", "causal_conv1d_fn"]):
        pass
    assert not [r for r in caplog.records if "allowed slow path" in r.getMessage()]
    clear_fallback_events()  # resets the log-once set too
    monkeypatch.setenv("RANK", "0")
    with guard(model, allow=["chunk_gated_delta_rule", "causal_conv1d_fn"]):
        pass
    assert [r for r in caplog.records if "allowed slow path" in r.getMessage()]


# Memoised pure functions of files shipped inside kernelguard: no process fact, nothing for reset() to forget.
_PURE_MEMOS = {"kernelguard.train.chat_templates.read", "kernelguard.train.chat_templates._known_fingerprints",
               "kernelguard.runtime.tripwires._compiled_error_type",  # a class built from torch's own: no process fact
               "kernelguard.train.settings.config_rules.field_kinds"}  # a dataclass's field types: code, not process state


def _kernelguard_memos() -> dict[str, Any]:
    """Every functools cache on a loaded kernelguard module, by qualified name."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name == "kernelguard" or name.startswith("kernelguard."):
            for attr, value in list(vars(module).items()):
                if callable(getattr(value, "cache_info", None)) and getattr(value, "__module__", None) == name:
                    found[f"{name}.{attr}"] = value
    return found


def test_reset_returns_every_piece_of_process_state_to_its_initial_value(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from kernelguard.resolution import discovery, transformers_calls
    from kernelguard.runtime import attention

    model = tiny.tiny_model("qwen3_5")
    module = sys.modules[MODELING["qwen3_5"]]
    originals = {name: vars(module)[name] for name in FALLBACK_GLOBALS}
    discovery.gated_delta_families()
    discovery.kernels_version_window()
    attention.set_varlen_impl(attention.reference_varlen_attn)
    report = guard(model, strict=False, allow=["*"])
    tripwires = arm_tripwires(allow=["*"], on_fallback="record")
    model(_ids())
    transformers_calls.reference_parameters(module.__file__, "torch_chunk_gated_delta_rule")  # check --hub's memo
    layer = model.model.layers[0].linear_attn
    memos = {name: fn for name, fn in _kernelguard_memos().items() if name not in _PURE_MEMOS}
    # Everything below must be populated first, or the test would prove nothing.
    assert REGISTRY.armed_sites() and IMPORT_WATCHER in sys.meta_path and fallback_events()
    assert REGISTRY.logged_once and registry.layer_path(layer) == "model.layers.0.linear_attn"
    assert not REGISTRY.scan.empty and attention.varlen_impl() is attention.reference_varlen_attn
    assert {"kernelguard.resolution.discovery._families", "kernelguard.resolution.transformers_compat._probe_decorator",
            "kernelguard.resolution.transformers_compat._forward_names"} <= set(memos)
    assert all(fn.cache_info().currsize for fn in memos.values()), {n: f.cache_info() for n, f in memos.items()}

    registry.reset()

    assert all(vars(module)[n] is originals[n] for n in FALLBACK_GLOBALS), "originals are back in place"
    assert not report.tripwires.armed and not tripwires.armed
    assert registry.armed_sites() == [] and IMPORT_WATCHER not in sys.meta_path
    assert (REGISTRY.patches, REGISTRY.retired, REGISTRY.watchers) == ({}, {}, [])
    assert fallback_events() == [] and REGISTRY.logged_once == set()
    assert registry.layer_path(layer) is None and len(REGISTRY.layer_paths) == 0
    assert REGISTRY.scan.empty
    assert attention.varlen_impl() is None
    assert {n: f.cache_info().currsize for n, f in memos.items()} == dict.fromkeys(memos, 0)


# --------------------------------------------------------------------------- defaults, inspect, output ---
def test_packed_defaults_to_training_as_in_check_and_require(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5")
    allow = ["chunk_gated_delta_rule", "causal_conv1d_fn", "attention"]
    with pytest.raises(KernelFallbackError) as info:  # packed: no allow makes a GDN torch reference right
        _guard(model, allow=allow)
    assert "or train on padded batches (packed=False)" in (info.value.fix or "")
    assert "allow=" not in (info.value.fix or "")
    with _guard(model, packed=False, allow=allow) as report:
        assert report.ok and report.packed is False
    with _guard(model, mode="inference", strict=False, allow=allow) as report:
        assert report.packed is False  # packing is a training question


def test_inspect_reports_without_arming_or_raising(fresh_transformers_models: None, tiny: Any) -> None:
    import kernelguard

    model = tiny.tiny_model("qwen3_5")
    report = kernelguard.inspect(model)
    assert not report.ok and not report.tripwires.armed and not REGISTRY.armed_sites()
    assert "SLOW PATHS" in report.render()
    model(_ids())  # nothing armed: the reference path runs, nothing raises, nothing is recorded
    assert fallback_events() == []


def test_report_is_one_line_per_kernel_and_fits_the_width(fresh_transformers_models: None, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5", num_hidden_layers=16)
    report = _guard(model, packed=True, strict=False)
    with report:
        text = report.render(width=100)
        lines = text.splitlines()
        assert len(lines) < 30, text  # not 4 rows per GDN layer
        for kernel in ("causal_conv1d_fn", "chunk_gated_delta_rule"):
            assert re.search(rf"^  FALLBACK +{kernel} +torch reference +12 layers$", text, re.MULTILINE), text
        assert re.search(r"^  FALLBACK +attention +sdpa +4 layers$", text, re.MULTILINE), text
        assert all(len(line) <= 100 for line in lines if "pip install" not in line), text
        assert "why: chunk_gated_delta_rule -> torch reference in 12 layers (model.layers.0.linear_attn" in text
        assert "fix: or accept explicitly: kernelguard.guard(model, allow=['attention'])" in text
        assert "fix: or train on padded batches (packed=False)" in text
        assert "--allow" not in text
        cli = report.render(width=100, syntax="cli")
        assert "fix: or accept explicitly: --allow attention" in cli
        verbose = report.render(verbose=True)
        assert "model.layers.13.linear_attn" in verbose and len(verbose.splitlines()) > 16 * 4


def test_refusal_message_fits_the_terminal(fresh_transformers_models: None, tiny: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(KernelFallbackError) as info:
        _guard(tiny.tiny_model("qwen3_5", num_hidden_layers=16), packed=False)
    lines = str(info.value).splitlines()
    assert all(len(line) <= 80 for line in lines if "pip install" not in line), str(info.value)
    joined = " ".join(" ".join(lines).split())
    assert "12 layers (model.layers.0.linear_attn, model.layers.1.linear_attn ... model.layers.14" in joined


def test_an_allowed_fallback_is_logged_once_not_also_by_transformers(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers.integrations import hub_kernels

    if "is falling back to its reference PyTorch implementation" not in Path(hub_kernels.__file__).read_text():
        pytest.skip("this transformers logs no fallback warning of its own")
    hub_kernels.logger.warning_once.cache_clear()  # logged once per process: let this test see it
    caplog.set_level(logging.WARNING)
    model = tiny.tiny_model("qwen3_5")
    with _guard(model, packed=False, allow=["chunk_gated_delta_rule"], strict=False):
        with pytest.raises(KernelFallbackError):
            model(_ids())  # causal_conv1d_fn is not allowed: raised before transformers' wrapper runs
        with _guard(model, packed=False, allow=["chunk_gated_delta_rule", "causal_conv1d_fn"]):
            model(_ids())
    messages = [r.getMessage() for r in caplog.records]
    ours = [m for m in messages if m.startswith("kernelguard: allowed fallback") and "chunk_gated_delta_rule" in m]
    theirs = [m for m in messages if m.startswith("`chunk_gated_delta_rule` is falling back")]
    assert len(ours) == 1 and theirs == [], messages


def test_the_guards_log_lines_fit_100_columns(
    fresh_transformers_models: None, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With the torch references allowed (no fla, no causal-conv1d: a laptop), the allowed-slow-path lines and the
    first call's allowed-fallback lines ran to 200-380 columns; they are wrapped, nothing of them dropped."""
    import torch

    model = tiny.tiny_model("qwen3_5")
    caplog.set_level(logging.WARNING, logger="kernelguard")
    with guard(model, packed=False, allow=["attention", "chunk_gated_delta_rule", "causal_conv1d_fn"]):
        with torch.no_grad():
            model(input_ids=torch.randint(3, 200, (1, 12)), use_cache=False)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "allowed slow path `chunk_gated_delta_rule`" in text and "allowed fallback: " in text
    assert "torch_chunk_gated_delta_rule" in text  # a module path is never broken
    assert max(len(line) for line in text.splitlines()) <= 100, text
