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
from kernelguard.runtime.registry import REGISTRY

LENGTHS = (11, 6)  # a row of two examples; with chunk 8 the first spans two chunks
LEAK = ("recurrent and conv state would carry from each example into the next. The results are wrong, not only "
        "slow, and nothing else raises.")


@pytest.fixture(autouse=True)
def _clean() -> Any:
    yield
    REGISTRY.reset()


def _row() -> tuple[torch.Tensor, dict[str, Any]]:
    """One packed row of LENGTHS with every boundary signal DataCollatorWithFlattening writes."""
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (1, sum(LENGTHS)))
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    return ids, {
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "seq_idx": torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(LENGTHS)])[None],
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS),
    }


def _alone(model: Any, ids: torch.Tensor) -> torch.Tensor:
    parts, start = [], 0
    for n in LENGTHS:
        parts.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(parts, dim=1)


def test_a_packed_nemotron_h_row_runs_and_equals_each_example_alone(fake_mamba: Any, tiny: Any) -> None:
    model = tiny.tiny_model("nemotron_h").train()
    report = guard(model, packed=True, allow=["attention"])
    assert {e.kernel for e in report.entries if e.status == "selected"} >= {
        "mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined"}
    ids, boundaries = _row()
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = _alone(model, ids)
    assert (packed - alone).abs().max().item() < 1e-4  # fp32: ~1e-6 here; a leak is O(1)


def test_a_stand_in_that_ignores_seq_idx_is_refused_by_the_first_row_probe(
    fake_mamba: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny.tiny_model("nemotron_h").train()
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
        "kernelguard: backbone.layers.0.mixer (and 1 more GDN layer) got a packed row of 2 examples (by its "
        f"cu_seq_lens_q) but its conv gets no `seq_idx` (the model's own forward drops it: {dropped}): {LEAK}")
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
