"""Packed rows without example boundaries (kernelguard.runtime.boundaries): refused at the forward, per call, compiled too.

The fake fla and causal-conv1d honour ``cu_seqlens`` / ``seq_idx``, so a row that carries them runs each example
on its own, and one that does not is exactly the silent leak the check refuses.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kernelguard.errors import ConfigError, PackedWithoutBoundariesError
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.runtime.model_guard import guard, inspect
from kernelguard.runtime.registry import REGISTRY
from kernelguard.runtime.segments import examples_per_row

FIRST = "model.layers.0.linear_attn"
LEAK = "recurrent and conv state would carry from each example into the next. The results are wrong, not only slow, and nothing else raises."
FIX = ("DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True), or padding_free=False; "
       "or accept it explicitly with allow=['packed-without-boundaries']")
BOTH = ("its gated-delta kernels get no `cu_seqlens` (the batch has no `cu_seq_lens_q`) and its conv gets no "
        "`seq_idx` (the batch has no `seq_idx`)")
CONV = "its conv gets no `seq_idx` (the batch has no `seq_idx`)"
FEATURES = [{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}]


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _model(tiny: Any, **overrides: Any) -> Any:
    return tiny.tiny_model("qwen3_5", **overrides)


def _guarded(tiny: Any, allow: tuple[str, ...] = ("attention",), **overrides: Any) -> Any:
    model = _model(tiny, **overrides)
    return model, guard(model, packed=True, allow=list(allow))


def _flatten(**flags: Any) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    features = [{**f, "labels": list(f["input_ids"])} for f in FEATURES]
    return DataCollatorWithFlattening(**flags)(features)


def _message(examples: int, source: str, gets: str, more: str = " (and 2 more GDN layers)") -> str:
    return f"kernelguard: {FIRST}{more} got a packed row of {examples} examples (by its {source}) but {gets}: {LEAK}"


def _refused(model: Any, batch: dict[str, Any]) -> PackedWithoutBoundariesError:
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(**batch)
    return info.value


# ------------------------------------------------------------------------------------------ the four cases ---
def test_flattening_collator_with_its_defaults_is_refused(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny)
    error = _refused(model, _flatten())
    assert error.message == _message(3, "position_ids", BOTH)
    assert error.fix == FIX
    assert (error.layer, error.examples, error.missing) == (FIRST, 3, ("cu_seqlens", "seq_idx"))


def test_flattening_collator_with_both_flags_passes_and_keeps_examples_apart(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny, num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    batch = _flatten(return_flash_attn_kwargs=True, return_seq_idx=True)
    with torch.no_grad():
        packed = model(**batch).logits
        alone = model(input_ids=torch.tensor([FEATURES[1]["input_ids"]])).logits
    torch.testing.assert_close(packed[0, 5:8], alone[0], rtol=1e-4, atol=1e-5)  # the second example, unleaked


def test_flash_kwargs_without_seq_idx_is_refused_for_the_conv(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny)
    error = _refused(model, _flatten(return_flash_attn_kwargs=True))
    assert error.message == _message(3, "cu_seq_lens_q", CONV)
    assert error.missing == ("seq_idx",)


def test_trl_padding_free_without_seq_idx_is_refused(fake_providers: Any, tiny: Any) -> None:
    """TRL's padding-free collator before it sent ``seq_idx`` (the fact in DESIGN.md): boundaries for the
    gated-delta kernels and attention, none for the conv."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(FEATURES)
    del batch["seq_idx"]
    model, _ = _guarded(tiny)
    assert _refused(model, batch).message == _message(3, "cu_seq_lens_q", CONV)


def test_trl_padding_free_position_ids_only_is_refused(fake_providers: Any, tiny: Any) -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    full = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(FEATURES)
    batch = {k: full[k] for k in ("input_ids", "labels", "position_ids")}
    model, _ = _guarded(tiny)
    assert _refused(model, batch).message == _message(3, "position_ids", BOTH)


def test_padded_batch_passes(fake_providers: Any, tiny: Any) -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0)(FEATURES)
    assert batch["input_ids"].shape == (3, 5) and "attention_mask" in batch
    model = _model(tiny)
    guard(model, packed=False)
    with torch.no_grad():
        model(**batch)
        # a padded batch with the position ids transformers' generate() builds (padding at 1): still one per row
        positions = (batch["attention_mask"].cumsum(-1) - 1).masked_fill(batch["attention_mask"] == 0, 1)
        model(**batch, position_ids=positions)


def test_single_sequence_row_passes(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), position_ids=torch.arange(4)[None])
        model(input_ids=torch.tensor([[3, 4, 5, 6]]))  # no position ids at all
        model(torch.tensor([[3, 4, 5, 6]]), None, torch.arange(4)[None])  # positional position_ids


def test_positional_position_ids_are_read(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny)
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError):
        model(torch.tensor([[3, 4, 5, 6]]), None, torch.tensor([[0, 1, 0, 1]]))


# ------------------------------------------------------------------------------------------- the allow item ---
def test_only_the_explicit_allow_item_accepts_and_it_is_logged_once(
    fake_providers: Any, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kernelguard")
    model, _ = _guarded(tiny, allow=("*",))
    _refused(model, _flatten())  # `*` accepts slow paths, not wrong results
    REGISTRY.reset()
    model, _ = _guarded(tiny, allow=("attention", "packed-without-boundaries"))
    with torch.no_grad():
        model(**_flatten())
        model(**_flatten())
    logged = [r.getMessage() for r in caplog.records if "packed-without-boundaries" in r.getMessage()]
    assert logged == [f"kernelguard: allowed (packed-without-boundaries): {_message(3, 'position_ids', BOTH)}"]


def test_the_allow_item_parses_round_trips_and_a_typo_is_refused() -> None:
    policy = AllowPolicy.parse(["packed-without-boundaries"])
    assert policy.allows_packed_without_boundaries() and policy.values() == ["packed-without-boundaries"]
    assert not AllowPolicy.parse(["*"]).allows_packed_without_boundaries()
    assert AllowPolicy().merge(policy).allows_packed_without_boundaries()
    with pytest.raises(ConfigError, match="packed-without-boundaries"):  # listed among the valid items
        AllowPolicy.parse(["packed-without-boundary"], kernel_names=())


def test_a_torch_reference_drops_the_boundaries_the_batch_carries(fresh_transformers_models: Any, tiny: Any) -> None:
    model = _model(tiny)
    guard(model, packed=False, allow=["chunk_gated_delta_rule", "causal_conv1d_fn"])
    error = _refused(model, _flatten(return_flash_attn_kwargs=True, return_seq_idx=True))
    assert error.message == _message(3, "cu_seq_lens_q", (
        "its gated-delta kernels get no `cu_seqlens` (`chunk_gated_delta_rule` runs its torch reference, which "
        "ignores `cu_seqlens`) and its conv gets no `seq_idx` (`causal_conv1d_fn` runs its torch reference, which "
        "ignores `seq_idx`)"))


# ----------------------------------------------------------------------------------------------- lifecycle ---
def test_inspect_arms_nothing_and_disarm_removes_the_hook(fake_providers: Any, tiny: Any) -> None:
    model = _model(tiny)
    inspect(model, packed=True, allow=["attention"])
    assert not model.model._forward_pre_hooks and not REGISTRY.boundary_watches
    with guard(model, packed=True, allow=["attention"]) as report:  # armed on the decoder stack, not the head
        assert report.boundaries.armed and report.boundaries.stacks == ["model"]
        assert len(model.model._forward_pre_hooks) == 1 and not model._forward_pre_hooks
    assert not model.model._forward_pre_hooks and not REGISTRY.boundary_watches
    with torch.no_grad():
        model(**_flatten())  # disarmed: the leak is the user's again


def test_registry_reset_disarms(fake_providers: Any, tiny: Any) -> None:
    model, report = _guarded(tiny)
    REGISTRY.reset()
    assert not report.boundaries.armed and not model.model._forward_pre_hooks


def test_examples_per_row() -> None:
    assert examples_per_row(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [3]
    assert examples_per_row(torch.tensor([[0, 1, 2], [0, 1, 2]])) == [1, 1]
    assert examples_per_row(torch.tensor([[5, 6, 7, 8]])) == [1]  # a continuation is one example
    assert examples_per_row(torch.tensor([[[0, 1, 0, 1]]] * 4)) == [2]  # multimodal rope planes
    assert examples_per_row(torch.tensor([[0]])) == [1]


# ---------------------------------------------------------------------------------------------- compiled ---
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default"])
def test_compiled_model_is_checked_on_every_call(fake_providers: Any, tiny: Any, fullgraph: bool) -> None:
    torch._dynamo.reset()
    model, _ = _guarded(tiny, num_hidden_layers=1, layer_types=["linear_attention"])
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    single, packed = torch.arange(6)[None], torch.tensor([[0, 1, 2, 0, 1, 2]])
    try:
        with torch.no_grad():
            model(ids, position_ids=single)  # eager first: the fake fla resolves its reference once, eagerly
            compiled = torch.compile(model, fullgraph=fullgraph, backend="eager")
            compiled(ids, position_ids=single)
            with pytest.raises(PackedWithoutBoundariesError) as info:
                compiled(ids, position_ids=packed)  # same graph as the single row: the values decide
            compiled(ids, position_ids=single)
    finally:
        torch._dynamo.reset()
    assert info.value.message == _message(2, "position_ids", BOTH, more="")


def test_train_controls_without_boundaries_need_the_allow_item_and_the_warning_says_so() -> None:
    from kernelguard.errors import ConfigError
    from kernelguard.train.settings.packing_modes import LEAKY_WARNING, check_control_allowed

    for control in ("leaky", "naive"):
        with pytest.raises(ConfigError) as info:
            check_control_allowed(control, allowed=AllowPolicy.parse(["attention"]).allows_packed_without_boundaries())
        assert info.value.fix == "train with --packing packed; to run the control, add --allow packed-without-boundaries"
        check_control_allowed(control, allowed=AllowPolicy.parse(["packed-without-boundaries"])
                              .allows_packed_without_boundaries())
    check_control_allowed("packed", allowed=False)
    assert not AllowPolicy.parse(["*"]).allows_packed_without_boundaries()  # a wrong result, not a slow path
    assert LEAKY_WARNING.endswith(
        "It needs --allow packed-without-boundaries, which the guard otherwise requires for such rows")


def test_a_layer_that_does_not_pass_the_boundary_is_named(fake_providers: Any, tiny: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An older modeling file whose GDN call has no ``cu_seqlens=``: the batch carries it, the kernel never
    gets it (read from the modeling source, as ``check --hub`` reads it)."""
    from kernelguard.resolution import transformers_calls as calls

    real = calls.call_shape

    def without_cu_seqlens(source: str, call_site: str) -> Any:
        shape = real(source, call_site)
        if shape is None or "cu_seqlens" not in shape.keywords:
            return shape
        return calls.CallShape(shape.function, shape.positional,
                                tuple(k for k in shape.keywords if k != "cu_seqlens"), (), False)

    monkeypatch.setattr(calls, "call_shape", without_cu_seqlens)
    model, _ = _guarded(tiny)
    error = _refused(model, _flatten(return_flash_attn_kwargs=True, return_seq_idx=True))
    assert error.message == _message(3, "cu_seq_lens_q", (
        "its gated-delta kernels get no `cu_seqlens` (transformers' layer does not pass `cu_seqlens` to "
        "`chunk_gated_delta_rule`)"))


# ------------------------------------------------------------------ the invariant, wherever it is consumed ---
STARTS = (0, 5, 8)  # FEATURES: 5, 3 and 4 tokens


def _bounded() -> dict[str, Any]:
    return _flatten(return_flash_attn_kwargs=True, return_seq_idx=True)


def _disagree(told: str) -> str:
    return (f"kernelguard: {FIRST} (and 2 more GDN layers) got a packed row whose boundary signals disagree: "
            f"{told}: each layer would split the row where its own signal says (the gated-delta kernels by "
            "cu_seq_lens_q, the conv by seq_idx, attention by cu_seq_lens_q or position_ids), so examples run "
            f"into each other. {LEAK.split('. ', 1)[1]}")


def test_an_all_ones_attention_mask_is_not_a_padding_mask(fake_providers: Any, tiny: Any) -> None:
    """A hand-made collator keeping the tokenizer's all-ones mask with restarting position ids: the GDN layers
    get no boundaries (refused as before a mask hid the row), and with every GDN boundary given, attention
    still cannot see them behind the mask."""
    model, _ = _guarded(tiny)
    positions_only = {k: v for k, v in _flatten().items() if k != "labels"}
    masked = {**positions_only, "attention_mask": torch.ones_like(positions_only["input_ids"])}
    assert _refused(model, masked).message == _message(3, "position_ids", BOTH)
    error = _refused(model, {**_bounded(), "attention_mask": torch.ones_like(masked["input_ids"])})
    assert error.message == (
        "kernelguard: model.layers.3.self_attn got a packed row of 3 examples (by its cu_seq_lens_q) but cannot see "
        "where they begin: sdpa builds its mask from the attention_mask given, which has no boundaries (all ones). "
        "Attention would reach across examples. The results are wrong, not only slow, and nothing else raises.")
    assert error.fix.startswith("drop the attention_mask from packed batches (an all-ones mask hides the "
                                "boundaries), or a varlen attention")
    assert (error.missing, error.details["kind"]) == (("attention",), "attention")


def test_boundary_signals_that_contradict_each_other_are_refused(fake_providers: Any, tiny: Any) -> None:
    model, _ = _guarded(tiny)
    zeros = {**_bounded(), "seq_idx": torch.zeros(1, 12, dtype=torch.int32)}
    error = _refused(model, zeros)
    assert error.message == _disagree("position_ids 3 examples (starting at 0, 5, 8), cu_seq_lens_q 3 examples "
                                      "(starting at 0, 5, 8), seq_idx 1 example (starting at 0)")
    assert error.details["signals"] == {"position_ids": [0, 5, 8], "cu_seq_lens_q": [0, 5, 8], "seq_idx": [0]}
    two = torch.tensor([0, 5, 12], dtype=torch.int32)  # cu_seq_lens and seq_idx: 2 examples; positions: 3
    fewer = {**_bounded(), "cu_seq_lens_q": two, "cu_seq_lens_k": two, "max_length_q": 7, "max_length_k": 7,
             "seq_idx": torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)}
    assert _refused(model, fewer).message == _disagree(
        "position_ids 3 examples (starting at 0, 5, 8), cu_seq_lens_q 2 examples (starting at 0, 5), seq_idx 2 "
        "examples (starting at 0, 5)")
    short = {**_bounded(), "cu_seq_lens_q": torch.tensor([0, 5, 8, 10], dtype=torch.int32)}
    short["cu_seq_lens_k"] = short["cu_seq_lens_q"]
    assert "cu_seq_lens_q ends at 10, but the row has 12 tokens" in _refused(model, short).message


def test_a_wrapper_and_the_base_model_are_checked_where_the_batch_reaches_the_layers(
    fake_providers: Any, tiny: Any
) -> None:
    """The check sits on the decoder stack: a wrapper whose forward(batch) calls the model, guarded as the wrapper,
    and `model.model(...)` for hidden states (a chunked-loss trainer) are refused like the model itself."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: dict[str, Any]) -> Any:
            return self.inner(**batch)

    leaky = {k: v for k, v in _flatten().items() if k != "labels"}
    wrapper = Wrapper(_model(tiny))
    report = guard(wrapper, packed=True, allow=["attention"])
    assert report.boundaries.stacks == ["inner.model"]
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        wrapper(leaky)
    assert info.value.message == _message(3, "position_ids", BOTH).replace(FIRST, "inner." + FIRST)
    model, _ = _guarded(tiny)
    assert _refused(model.model, leaky).message == _message(3, "position_ids", BOTH)


def test_sdpa_without_position_ids_cannot_see_the_rows_boundaries_even_when_attention_is_allowed(
    fake_providers: Any, tiny: Any
) -> None:
    """cu_seq_lens + seq_idx keep the GDN layers exact, but sdpa finds a packed row only in its position ids:
    `attention` accepts a slow attention, never a blind one."""
    model, _ = _guarded(tiny, allow=("attention",))
    error = _refused(model, {k: v for k, v in _bounded().items() if k != "position_ids"})
    assert "sdpa finds a packed row's boundaries only in its position_ids, and the batch has none" in error.message
    assert error.fix.startswith("pass position_ids that restart at 0 for each example, or a varlen attention")
    with torch.no_grad():
        model(**_bounded(), use_cache=False)
    cached = _refused(model, {**_bounded(), "use_cache": True})
    assert "this call builds one (use_cache=True, by the keyword or the model's config)" in cached.message


def test_trl_padding_free_with_pad_to_multiple_of_passes_and_keeps_examples_apart(fake_providers: Any, tiny: Any) -> None:
    """TRL >= 1.16's padding-free batch: position ids padded with zeros (each pad its own segment), cu_seq_lens and
    seq_idx written from them: every signal agrees, and each example's outputs are its outputs alone."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=16)(FEATURES)
    assert batch["input_ids"].shape == (1, 16) and batch["cu_seq_lens_q"].tolist() == [0, 5, 8, 12, 13, 14, 15, 16]
    model, _ = _guarded(tiny, num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for (a, b), feature in zip(zip(STARTS, (5, 8, 12)), FEATURES):
            alone = model(input_ids=torch.tensor([feature["input_ids"]])).logits
            torch.testing.assert_close(packed[0, a:b], alone[0], rtol=1e-4, atol=1e-5)


def test_the_allow_item_accepts_a_contradiction_once_logged(
    fake_providers: Any, tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model, _ = _guarded(tiny, allow=("attention", "packed-without-boundaries"))
    with caplog.at_level(logging.WARNING, logger="kernelguard"), torch.no_grad():
        for _ in range(2):
            model(**{**_bounded(), "seq_idx": torch.zeros(1, 12, dtype=torch.int32)})
    lines = [r.getMessage() for r in caplog.records if "allowed (packed-without-boundaries)" in r.getMessage()]
    assert len(lines) == 1 and "seq_idx 1 example" in lines[0]


# ------------------------------------------------------------------------------------- the first-row probe ---
def _ignoring_cu_seqlens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake fla's chunk kernel still takes `cu_seqlens` (every static check passes) but no longer honours it:
    the GDN state runs on from each example into the next, a way of going wrong nobody listed."""
    import fla.ops.gated_delta_rule as fake

    varlen = fake._varlen
    monkeypatch.setattr(fake, "_varlen", lambda *a, **k: varlen(*a, **{**k, "cu_seqlens": None}))


def test_the_first_row_probe_finds_a_leak_no_static_check_sees(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ignoring_cu_seqlens(monkeypatch)
    model, report = _guarded(tiny)
    error = _refused(model, _bounded())
    assert error.details["kind"] == "probe" and error.layer == "model.layers.1"
    assert error.message.startswith(
        "kernelguard: the first packed row, run example by example, differs from the packed run from "
        "model.layers.1 (linear attention) on: the example at tokens ")
    assert error.fix.startswith(
        "check that each layer's kernels (GDN, KDA, Mamba-2 scan, conv) honour cu_seqlens / seq_idx")
    assert "The layers do not keep the row's examples apart, whatever its boundary keywords say" in error.message
    reference, worst, tolerance = error.details["layers"][1][1:]
    # measured 3.8e-5 against a 1e-6 tolerance (the fp32 floor), where a correct row's layers differ by at most
    # 2.4e-7: 3x the tolerance is 12.8x under the one and 12.6x over the other
    assert worst > 3 * tolerance and tolerance >= 20 * reference
    with torch.no_grad():
        model(**_bounded())  # once per stack: the next rows pass (the static checks stay armed)


def test_the_probe_is_what_refuses_it_and_can_be_turned_off(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative controls: with the comparison disabled, or first_row_probe=False, the same leaking row passes
    silently; the measurement still shows the leak."""
    _ignoring_cu_seqlens(monkeypatch)
    model, report = _guarded(tiny)
    (probe,) = report.boundaries.probes
    probe.compare = False
    with torch.no_grad():
        model(**_bounded())
    assert any(d.differs for d in probe.measured)
    REGISTRY.reset()
    model = _model(tiny)
    report = guard(model, packed=True, allow=["attention"], first_row_probe=False)
    assert report.boundaries.probes == []
    with torch.no_grad():
        model(**_bounded())
    with pytest.raises(ConfigError, match="first_row_probe must be True or False"):
        guard(model, packed=True, allow=["attention"], first_row_probe="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("collator", ["flattening", "trl"])
def test_the_probe_passes_correct_rows_exact_to_fp32(fake_providers: Any, tiny: Any, collator: str) -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = _bounded() if collator == "flattening" else {
        k: v for k, v in DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=16)(
            FEATURES).items() if k != "labels"}
    model, report = _guarded(tiny)
    with torch.no_grad():
        model(**batch)
    (probe,) = report.boundaries.probes
    assert len(probe.measured) == 4 and max(d.worst for d in probe.measured) < 1e-5  # measured ~2e-7
    assert [d.example for d in probe.measured][0] in ((5, 8), (8, 12))


# ---------------------------------------------------------------------------- correct batches, not refused ---
def _alone(model: Any, index: int) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([FEATURES[index]["input_ids"]]), use_cache=False).logits[0]


def test_cu_seq_lens_padded_to_a_static_shape_with_trailing_repeats_passes_exactly(
    fake_providers: Any, tiny: Any
) -> None:
    """[0, 5, 8, 12, 12, 12]: a collator's static-shape cu_seq_lens (the repeats describe no tokens) is the same
    row; it was refused as "an empty or decreasing segment". An empty segment between two examples still is."""
    model, _ = _guarded(tiny)
    padded = torch.tensor([0, 5, 8, 12, 12, 12], dtype=torch.int32)
    with torch.no_grad():
        logits = model(**{**_bounded(), "cu_seq_lens_q": padded, "cu_seq_lens_k": padded}, use_cache=False).logits
    torch.testing.assert_close(logits[0, 5:8], _alone(model, 1), rtol=1e-4, atol=1e-5)
    inner = torch.tensor([0, 5, 5, 8, 12], dtype=torch.int32)
    error = _refused(model, {**_bounded(), "cu_seq_lens_q": inner, "cu_seq_lens_k": inner})
    assert "cu_seq_lens_q has an empty or decreasing segment" in error.message


def _block_mask(starts: list[int], length: int, *, additive: bool = False) -> torch.Tensor:
    segment = torch.zeros(length, dtype=torch.long)
    segment[starts[1:]] = 1
    segment = segment.cumsum(0)
    index = torch.arange(length)
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    if additive:
        return torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed[None, None]


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_a_hand_built_4d_block_diagonal_mask_is_read_for_its_blocks(
    fake_providers: Any, tiny: Any, additive: bool
) -> None:
    """sdpa given the row's own causal block-diagonal 4-D mask sees every boundary: accepted and exact (it was
    refused as "the attention_mask given, which has no boundaries"); a 4-D mask whose blocks are another row's
    is a contradiction, refused, and so is a plain causal 4-D mask (one block) over a row of three."""
    model, _ = _guarded(tiny)
    with torch.no_grad():
        logits = model(**_bounded(), attention_mask=_block_mask([0, 5, 8], 12, additive=additive),
                       use_cache=False).logits
    torch.testing.assert_close(logits[0, 5:8], _alone(model, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[0, 8:12], _alone(model, 2), rtol=1e-4, atol=1e-5)
    other = _refused(model, {**_bounded(), "attention_mask": _block_mask([0, 6, 8], 12, additive=additive)})
    assert "attention_mask 3 examples (starting at 0, 6, 8)" in other.message
    one = _refused(model, {**_bounded(), "attention_mask": _block_mask([0], 12, additive=additive)})
    assert "attention_mask 1 example (starting at 0)" in one.message  # plain causal: one example, not three


def test_a_cache_the_config_asks_for_is_read_like_the_keyword(fake_providers: Any, tiny: Any) -> None:
    """Qwen3.5 checkpoints ship use_cache=True: a training call that omits the keyword builds a cache, and sdpa
    then gets no packed mask (it passed: the check read the keyword only). Passing use_cache=False is exact."""
    model, _ = _guarded(tiny, use_cache=True)
    with torch.no_grad():
        logits = model(**_bounded(), use_cache=False).logits
    torch.testing.assert_close(logits[0, 5:8], _alone(model, 1), rtol=1e-4, atol=1e-5)
    omitted = _refused(model, _bounded())
    assert "this call builds one (use_cache=True, by the keyword or the model's config)" in omitted.message
    assert omitted.fix.startswith("pass use_cache=False when training on packed rows")


def test_guard_twice_keeps_one_watch_and_a_correct_row_passes(fake_providers: Any, tiny: Any) -> None:
    """guard(model) called again (a notebook cell re-run): the new watch replaces the old one on the same stack,
    and no check runs inside a probe's own forwards (it raised IndexError from the probe)."""
    model = _model(tiny)
    first = guard(model, packed=True, allow=["attention"])
    second = guard(model, packed=True, allow=["attention"])
    assert not first.boundaries.armed and second.boundaries.armed
    with torch.no_grad():
        model(**_flatten(return_flash_attn_kwargs=True, return_seq_idx=True))
    measured = second.boundaries.probes[0].measured
    assert measured and not any(d.differs for d in measured)


@pytest.mark.parametrize("shape", ["list", "stacked"])
def test_cu_seq_lens_that_the_kernels_cannot_take_are_refused_naming_the_keyword(
    fake_providers: Any, tiny: Any, shape: str
) -> None:
    model, _ = _guarded(tiny)
    batch = _flatten(return_flash_attn_kwargs=True, return_seq_idx=True)
    cu = batch["cu_seq_lens_q"]
    bad = cu.tolist() if shape == "list" else cu[None]  # what default_data_collator makes of a per-row list
    with torch.no_grad(), pytest.raises(ConfigError) as info:
        model(**{**batch, "cu_seq_lens_q": bad, "cu_seq_lens_k": bad})
    found = "a Python list" if shape == "list" else f"a 2-D int32 tensor of shape [1, {cu.numel()}]"
    assert info.value.message == (
        f"cu_seq_lens_q is {found}; the GDN kernels and the varlen attention take one 1-D integer tensor of the "
        "examples' start offsets in the packed row, ending with its length (e.g. [0, 10, 16, 24]). A [1, N] tensor "
        "is what default_data_collator makes of a per-row list; DataCollatorWithFlattening("
        "return_flash_attn_kwargs=True) builds the 1-D one."
    )
    assert info.value.fix == ("batch['cu_seq_lens_q'] = torch.tensor(batch['cu_seq_lens_q'], dtype=torch.int32)"
                              if shape == "list" else "batch['cu_seq_lens_q'] = batch['cu_seq_lens_q'][0]")


@pytest.mark.parametrize("layout", ["pads after", "pads between"])
def test_a_packed_row_with_masked_pads_is_checked_not_waved_through(fake_providers: Any, tiny: Any, layout: str) -> None:
    """A zero in the mask made the whole batch 'padded' and switched every check off, though the unmasked
    tokens hold several examples (TRL's bfd rows with padding_free=False keep their position ids; pads between
    examples): the row leaks and is refused like any packed row without boundaries. Left- and right-padded
    batches (one example per row among the unmasked tokens) still pass."""
    model, _ = _guarded(tiny)
    first, second, pads = list(range(8)), list(range(7)), [0] * 5
    positions = first + second + pads if layout == "pads after" else first + pads + second
    mask = [1] * 15 + [0] * 5 if layout == "pads after" else [1] * 8 + [0] * 5 + [1] * 7
    batch = {"input_ids": torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(0)),
             "position_ids": torch.tensor([positions]), "attention_mask": torch.tensor([mask])}
    error = _refused(model, batch)
    assert error.message == _message(2, "position_ids", BOTH)
    ids = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(1))
    left = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 10, [0] * 4 + [1] * 6]),
            "position_ids": torch.tensor([list(range(10)), [1] * 4 + list(range(6))])}
    right = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 10, [1] * 6 + [0] * 4]),
             "position_ids": torch.tensor([list(range(10)), list(range(6)) + [1] * 4])}
    padded = _model(tiny)
    guard(padded, packed=False, allow=["attention"])
    with torch.no_grad():
        padded(**left)
        padded(**right)


def test_generate_on_right_padded_rows_is_not_a_packed_row(fake_providers: Any, tiny: Any) -> None:
    """transformers' own generate tests (greedy, sample, beam: `*_generate_dict_output(s)`) decode from rows padded
    on the right: the token generated after the pads takes position 1 again (`[0, 1, <pads>, 1]`). Its unmasked
    positions repeat but never begin again at 0, so it holds one example; it was refused as "a packed row of 2
    examples" (12 of those suites' tests under the plugin). The control beside it: the same row whose token after
    the pads begins again at 0 is a second example, and refused."""
    model, _ = _guarded(tiny)
    ids = torch.randint(3, 250, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0, 1]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=torch.tensor([[0] * 7 + [1], [0, 1] + [0] * 5 + [1]]))
    error = _refused(model, {"input_ids": ids, "attention_mask": mask,
                             "position_ids": torch.tensor([[0] * 8, [0, 1] + [0] * 6])})
    assert error.message == _message(2, "position_ids", BOTH)


def test_a_leaking_attention_layer_is_named_as_one_with_the_attention_fix(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sdpa that no longer sees the packed row (transformers' packed-sequence detection gone: what a cache or a
    mask does to it): the GDN layers keep the examples apart, the attention layer is the first to differ, and the
    refusal says so, with the attention's causes, not the GDN kernels'."""
    import transformers.masking_utils as masking

    model, _ = _guarded(tiny)
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: None)
    error = _refused(model, _bounded())
    assert error.layer == "model.layers.3" and error.message.startswith(
        "kernelguard: the first packed row, run example by example, differs from the packed run from "
        "model.layers.3 (full attention) on: ")
    assert error.fix.startswith("its attention reaches across the row's examples: sdpa and eager keep them apart "
                                "only from the position ids, with no cache (use_cache=False")


def test_the_probe_runs_on_a_stack_called_with_positional_input_ids(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked-loss trainers call the decoder stack as `model.model(input_ids, **rest)`: the probe skipped such a
    call, so a leak no static check sees passed; the positional input ids are now read as the keyword."""
    _ignoring_cu_seqlens(monkeypatch)
    model, _ = _guarded(tiny)
    batch = _bounded()
    ids = batch.pop("input_ids")
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model.model(ids, **batch)
    assert info.value.details["kind"] == "probe" and info.value.layer == "model.layers.1"


@pytest.mark.parametrize("fault", ["stale cu_seq_lens", "seq_idx all zeros", "none"])
def test_signals_are_watched_between_the_reads_and_the_first_bad_call_is_named(
    fake_providers: Any, tiny: Any, fault: str
) -> None:
    """The host reads the signals on the first calls and every RECHECK_EVERY-th; a collator that goes wrong
    later (call 9: a stale cu_seq_lens, an all-zero seq_idx) passed until the next read, then unseen. The device
    now compares them at every call, without a host read, and the next read refuses naming the call."""
    from kernelguard.runtime.boundary_check import FIRST_CALLS, RECHECK_EVERY

    model, _ = _guarded(tiny, num_hidden_layers=1, layer_types=["linear_attention"])  # 64 calls: the smallest
    good = _bounded()
    bad = dict(good)
    if fault == "stale cu_seq_lens":
        cu = good["cu_seq_lens_q"].clone()
        cu[1] += 1  # the previous batch's split: one token off, same length
        bad.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    elif fault == "seq_idx all zeros":
        bad["seq_idx"] = torch.zeros_like(good["seq_idx"])
    with torch.no_grad():
        for _ in range(FIRST_CALLS):
            model(**good)
        model(**bad)  # call 9: between reads, nothing raises here
        for _ in range(RECHECK_EVERY - FIRST_CALLS - 2):
            model(**good)
        if fault == "none":
            model(**good)  # the read at call RECHECK_EVERY finds nothing
            return
        with pytest.raises(PackedWithoutBoundariesError) as info:
            model(**good)  # call RECHECK_EVERY: the read
    assert info.value.details["kind"] == "disagree"
    assert f"boundary signals disagreed at its call {FIRST_CALLS + 1} (compared on the device at every call, read back at call {RECHECK_EVERY}" in info.value.message


def test_generate_with_a_static_cache_on_left_padded_rows_passes(fake_providers: Any, tiny: Any) -> None:
    """generate() with a static cache hands a hybrid model its masks as a dict by layer type ({"full_attention":
    4-D, "linear_attention": 2-D}) and left-padded rows' positions as [0, 0, 0, 0, 1, 2, 3]: a padded batch, read
    from the dict's 2-D mask (issue 51: refused as "a packed row of 4 examples" when the dict was not read). The
    same dict around an all-ones mask on a row whose positions restart is still a packed row, and refused."""
    model = tiny.tiny_model("qwen3_5", use_cache=True)
    guard(model, mode="inference", allow=["attention"])
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                         cache_implementation="static", pad_token_id=0)
    assert out.shape == (2, 10)
    packed = _flatten()
    ones = torch.ones_like(packed["input_ids"])
    with pytest.raises(PackedWithoutBoundariesError, match="got a packed row of 3 examples"):
        model.model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
                    attention_mask={"linear_attention": ones, "full_attention": None})


def test_a_shared_prefix_tree_mask_is_not_read_as_a_packed_row(fake_providers: Any, tiny: Any) -> None:
    """transformers' custom 4-D mask test: three continuations of one prefix in one row, each attending to the
    prefix and itself, positions [0, 1, 2, 3, 3, 3] (issue 51: refused as "a packed row of 3 examples" with a
    boundary fix that does not fit it). Under a mask that is not block-diagonal, only positions that begin again
    at 0 start an example: the same mask over two real examples is still a packed row."""
    model = _model(tiny)
    guard(model, mode="inference", allow=["attention"])
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                         [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)[None, None]
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=tree, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]]), use_cache=False)
        with pytest.raises(PackedWithoutBoundariesError, match="got a packed row of 2 examples"):
            model(input_ids=ids, attention_mask=tree, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1]]), use_cache=False)


@pytest.mark.parametrize(
    ("readers", "family", "words", "splits"),
    [
        ({"cu_seqlens": ("chunk_gated_delta_rule",), "seq_idx": ("causal_conv1d_fn",)}, "GDN",
         {"cu_seqlens": "its gated-delta kernels get", "seq_idx": "its conv gets"},
         "the gated-delta kernels by cu_seq_lens_q, the conv by seq_idx"),
        ({"seq_idx": ("mamba_split_conv1d_scan_combined",)}, "Mamba-2",
         {"seq_idx": "its conv and Mamba-2 scan get"}, "the conv and Mamba-2 scan by seq_idx"),
        ({"cu_seqlens": ("chunk_kda", "fused_recurrent_kda")}, "KDA",
         {"cu_seqlens": "its KDA kernels get"}, "the KDA kernels by cu_seq_lens_q"),
        ({"seq_idx": ("causal_conv1d_fn",)}, "conv", {"seq_idx": "its conv gets"}, "the conv by seq_idx"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_layers_and_the_parts_that_read_each_boundary(
    readers: dict[str, tuple[str, ...]], family: str, words: dict[str, str], splits: str
) -> None:
    """The words a refusal and the packed-row explanation use, from the kernels the layers call: GDN's two
    signals, Mamba-2's fused conv and scan on one, KDA's kernels, a conv family alone."""
    from kernelguard.runtime.boundary_facts import GdnBoundaries

    facts = GdnBoundaries(("model.layers.0.mixer",), {}, readers=readers)
    assert facts.family == family
    assert {param: facts.reader_words(param) for param in readers} == words
    assert facts.splits() == splits
