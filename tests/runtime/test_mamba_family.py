"""The Mamba families through the guard, with the Mamba-2 stand-in (tests/fake_providers_mamba): a packed row
keeps its examples apart only where the batch's ``seq_idx`` reaches every scan.

* Nemotron-H (Mamba-2 + attention + MoE) passes its keywords on: a packed row runs and equals each example alone;
  with a stand-in that ignores ``seq_idx`` the first-row probe refuses it (the control).
* transformers 5.24's Mamba2ForCausalLM calls its backbone without its ``**kwargs``: the row's boundaries never
  reach a layer and the backbone's own check sees one long sequence. The guard refused nothing and the examples
  mixed; now the check at the model's entry refuses it (5.25 passes them on: there the row runs, kept apart),
  and the backbone called directly with the same row is fine.
* A Mamba-1 scan takes no boundary at all: a packed row through one is refused whatever the batch carries.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.runtime.model_guard import guard

LENGTHS = (11, 6)  # a row of two examples; with chunk 8 the first spans two chunks
LEAK = ("recurrent and conv state would carry from each example into the next. The results are wrong, not only "
        "slow, and nothing else raises.")


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _row() -> tuple[torch.Tensor, dict[str, Any]]:
    """One packed row of LENGTHS with every boundary signal DataCollatorWithFlattening writes."""
    import tiny_models

    return tiny_models.packed_row(LENGTHS)


def _alone(model: Any, ids: torch.Tensor) -> torch.Tensor:
    parts, start = [], 0
    for n in LENGTHS:
        parts.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(parts, dim=1)


# The Mamba-2 hybrids whose causal LM hands the batch's keywords on to every layer: each packs.
PACKABLE = ("nemotron_h", "bamba", "falcon_h1", "zamba2")


@pytest.mark.parametrize("family", PACKABLE)
def test_a_packed_mamba2_hybrid_row_runs_and_equals_each_example_alone(
    fake_mamba: Any, tiny: Any, family: str
) -> None:
    model = tiny.tiny_model(family).train()
    report = guard(model, packed=True, allow=["attention"])
    assert {e.kernel for e in report.entries if e.status == "selected"} >= {
        "mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined"}
    ids, boundaries = _row()
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = _alone(model, ids)
    assert (packed - alone).abs().max().item() < 1e-4  # fp32: ~1e-6 here; a leak is O(1)


@pytest.mark.parametrize("family", PACKABLE)
def test_a_stand_in_that_ignores_seq_idx_is_refused_by_the_first_row_probe(
    fake_mamba: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    model = tiny.tiny_model(family).train()
    from mamba_ssm.ops.triton import ssd_combined

    monkeypatch.setattr(ssd_combined, "LEAK", True)
    guard(model, packed=True, allow=["attention"])
    ids, boundaries = _row()
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(input_ids=ids, use_cache=False, **boundaries)
    assert info.value.message.startswith("kernelguard: the first packed row, run example by example, differs from "
                                         "the packed run from model.layers.0")


def _mamba2_drops() -> str | None:
    """How the installed transformers' Mamba2ForCausalLM drops the batch's keywords (5.24), None where it passes
    them on (5.25)."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    from kernelguard.resolution.transformers_calls import dropped_keywords

    return dropped_keywords(modeling.__file__, "Mamba2ForCausalLM")


def test_mamba2_for_causal_lm_given_a_packed_row_is_refused_where_its_forward_drops_the_boundaries(
    fake_mamba: Any, tiny: Any
) -> None:
    model = tiny.tiny_model("mamba2").train()
    ids, boundaries = _row()
    with torch.no_grad():  # unguarded first: what the refusal prevents (or, where passed on, what it allows)
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = _alone(model, ids)
    assert (packed - alone)[:, :LENGTHS[0]].abs().max().item() < 1e-4  # the first example, which nothing precedes
    second = (packed - alone)[:, LENGTHS[0]:].abs().max().item()
    guard(model, packed=True)
    dropped = _mamba2_drops()
    if dropped is None:  # this transformers hands seq_idx on: the row is kept apart and the guard lets it run
        assert second < 1e-4
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, **boundaries)
        return
    assert second > 1e-2  # the second example saw the first: the examples mixed, and nothing raised
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(input_ids=ids, use_cache=False, **boundaries)
    assert info.value.message == (
        "kernelguard: backbone.layers.0.mixer (and 1 more Mamba-2 layer) got a packed row of 2 examples (by its "
        f"cu_seq_lens_q) but its conv and Mamba-2 scan get no `seq_idx` (the model's own forward drops it: {dropped}): {LEAK}")
    assert info.value.fix == (
        "padded batches (padding_free=False, no DataCollatorWithFlattening): the model's own forward drops the "
        "boundary before its layers, which no collator can mend; or accept it explicitly with "
        "allow=['packed-without-boundaries']")


def test_the_controls_of_mamba2_a_padded_batch_and_the_backbone_given_the_row(fake_mamba: Any, tiny: Any) -> None:
    model = tiny.tiny_model("mamba2").train()
    guard(model, packed=True)
    ids, boundaries = _row()
    with torch.no_grad():
        model(input_ids=ids[:, :LENGTHS[0]], use_cache=False)  # one example per row: nothing to keep apart
        # the same row handed to the backbone itself: its seq_idx reaches every scan and the examples stay apart
        hidden = model.backbone(input_ids=ids, **{k: boundaries[k] for k in ("seq_idx", "cu_seq_lens_q")})[0]
        first = model.backbone(input_ids=ids[:, :LENGTHS[0]])[0]
        second = model.backbone(input_ids=ids[:, LENGTHS[0]:])[0]
    assert (hidden - torch.cat([first, second], dim=1)).abs().max().item() < 1e-4


def test_a_packed_jamba_row_mixes_its_examples_and_the_guard_refuses_it_by_its_mamba1_scan(
    fake_mamba: Any, tiny: Any
) -> None:
    """Jamba's Mamba-1 layers run mamba-ssm's selective_scan_fn (the stand-in: its reference, which matched
    transformers' torch path to 2e-7 on a padded batch), which takes no boundary: a packed row is one sequence."""
    model = tiny.tiny_model("jamba").train()
    ids, boundaries = _row()
    with torch.no_grad():  # unguarded: what the refusal prevents
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = _alone(model, ids)
    # Jamba's small init carries little state: rounding here is ~2e-7, the leak ~3e-3
    assert (packed - alone)[:, :LENGTHS[0]].abs().max().item() < 1e-5
    assert (packed - alone)[:, LENGTHS[0]:].abs().max().item() > 1e-4  # the second example saw the first
    report = guard(model, packed=True, allow=["attention"])
    assert {e.kernel for e in report.entries if e.status == "selected"} >= {"selective_scan_fn", "causal_conv1d_fn"}
    with torch.no_grad():
        model(input_ids=ids[:, :LENGTHS[0]], use_cache=False)  # the control: one example per row runs
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(input_ids=ids, use_cache=False, **boundaries)
    message = info.value.message
    assert message.startswith("kernelguard: model.layers.0.mamba (and 2 more Mamba layers) got a packed row of 2 "
                              "examples (by its cu_seq_lens_q) but ")
    # the scan takes no boundary, and the decoder layer calls the mixer without the batch's keywords besides
    assert "`selective_scan_fn` takes no boundary at all: its scan runs on from one packed example into the next" \
        in message
    assert message.endswith(LEAK)


def test_a_scan_that_takes_no_boundary_refuses_a_packed_row_whatever_it_carries() -> None:
    """mamba-ssm's Mamba-1 selective scan has no boundary parameter (jamba, zamba): made-up facts of one such
    layer, a row carrying every signal."""
    from kernelguard.resolution import AllowPolicy
    from kernelguard.runtime.boundary_check import BoundaryCheck
    from kernelguard.runtime.boundary_facts import GdnBoundaries

    why = "`selective_scan_fn` takes no boundary at all: its scan runs on from one packed example into the next"
    facts = GdnBoundaries(("model.layers.0.mamba",), {"selective_scan_fn": ("selective_scan_fn", why)})
    check = BoundaryCheck(torch.nn.Module(), facts, AllowPolicy())
    ids, boundaries = _row()
    with pytest.raises(PackedWithoutBoundariesError) as info:
        check.check_call((), {"input_ids": ids, **boundaries})
    assert info.value.message == (
        "kernelguard: model.layers.0.mamba got a packed row of 2 examples (by its cu_seq_lens_q) but "
        f"{why}: {LEAK}")
    assert info.value.fix.startswith("padded batches (padding_free=False, no DataCollatorWithFlattening): "
                                     "`selective_scan_fn` takes no boundary, which no collator can mend")
    check.check_call((), {"input_ids": ids[:, :LENGTHS[0]]})  # the control: one example, nothing to refuse


def test_granite_moe_hybrid_builds_its_mask_without_the_position_ids_so_sdpa_is_blind_to_a_packed_row(
    fake_mamba: Any
) -> None:
    """transformers' GraniteMoeHybridModel calls create_causal_mask without the position ids, so sdpa never sees a
    packed row's restarts: measured here, the row's second example differs from itself alone while every kernel
    gets its seq_idx. The guard passed it until the first-row probe ran; now the attention check refuses it
    (``allow=["attention"]`` accepts a slow attention, never a blind one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernelguard.resolution.transformers_calls import mask_sees_positions

    config = AutoConfig.for_model(
        "granitemoehybrid", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=16, mamba_chunk_size=8, mamba_expand=2, layer_types=["mamba", "mamba", "mamba", "attention"],
        num_local_experts=0, use_cache=False, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    import transformers.models.granitemoehybrid.modeling_granitemoehybrid as modeling

    if mask_sees_positions(modeling.__file__) is not False:
        pytest.skip("this transformers' GraniteMoeHybridModel hands its mask code the position ids")
    ids, boundaries = _row()
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = _alone(model, ids)
    assert (packed - alone)[:, LENGTHS[0]:].abs().max().item() > 1e-2  # what the refusal prevents
    guard(model, packed=True, allow=["attention"], first_row_probe=False)  # the static check alone
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(input_ids=ids, use_cache=False, **boundaries)
    assert ("but cannot see where they begin: sdpa finds a packed row's boundaries only in the position_ids given "
            "to transformers' mask code, and this model builds its causal mask without them.") in info.value.message
    assert info.value.fix.startswith("a varlen attention (attn_implementation='flash_attention_2', or "
                                     "'kernelguard_varlen'), or padded batches")


def test_the_entry_check_applies_to_a_causal_lm_that_drops_the_keywords_never_to_a_base_model(
    fake_mamba: Any, tiny: Any
) -> None:
    """A base model's forward hands its embedding the input ids without **kwargs and its layers the keywords:
    it is no wrapper that drops them (a packed row given to `model.model(...)` must not be refused for it)."""
    from kernelguard.resolution import AllowPolicy
    from kernelguard.runtime.boundary_facts import entry_facts, gdn_boundaries

    for family in ("qwen3_5", "nemotron_h", "mamba2"):
        model = tiny.tiny_model(family)
        facts = gdn_boundaries(model.named_modules(), AllowPolicy())
        base = getattr(model, model.base_model_prefix)
        assert entry_facts(base, facts) is None, family
        if family != "mamba2":
            assert entry_facts(model, facts) is None, family  # their causal LM passes them on
    assert (entry_facts(model, facts) is None) is (_mamba2_drops() is None)
