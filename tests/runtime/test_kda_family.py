"""A Kimi-delta-attention family (kimi_linear: chunk_kda, MLA attention, MoE) through the guard, with the fake
fla's KDA stand-in: its kernels are judged like GDN's, a padded batch runs, and a packed row is refused because
transformers' own layer hands chunk_kda the batch's ``cu_seq_lens_q`` under that name (fla reads
``cu_seqlens``). The control: the same collator's row through a GDN family passes and matches each example alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.runtime.model_guard import guard

pytest.importorskip("transformers.models.kimi_linear", reason="this transformers has no Kimi delta attention")

FEATURES = [{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}]
LEAK = ("recurrent and conv state would carry from each example into the next. The results are wrong, not only "
        "slow, and nothing else raises.")


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _flattened() -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    features = [{**f, "labels": list(f["input_ids"])} for f in FEATURES]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)


def test_kda_layers_are_judged_and_a_padded_batch_runs(fake_providers: Any, tiny: Any) -> None:
    model = tiny.tiny_model("kimi_linear")
    report = guard(model, allow=["attention"])
    text = report.render()
    assert "chunk_kda" in text and "causal_conv1d_fn" in text
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([FEATURES[0]["input_ids"]])).logits
    assert logits.shape == (1, 5, 256)


def test_a_packed_row_is_refused_because_the_layer_drops_the_boundary(fake_providers: Any, tiny: Any) -> None:
    model = tiny.tiny_model("kimi_linear")
    guard(model, packed=True, allow=["attention"])
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(**_flattened())
    error = info.value
    assert error.message == (
        "kernelguard: model.layers.0.self_attn (and 2 more KDA layers) got a packed row of 3 examples (by its "
        "cu_seq_lens_q) but its KDA kernels get no `cu_seqlens` (transformers' layer does not pass "
        f"`cu_seqlens` to `chunk_kda`): {LEAK}")
    assert error.fix == ("padded batches (padding_free=False, no DataCollatorWithFlattening): the model's own layer "
                         "drops the boundary, which no collator can mend; or accept it explicitly with "
                         "allow=['packed-without-boundaries']")


def test_the_control_a_gdn_family_takes_the_same_row_and_keeps_examples_apart(fake_providers: Any, tiny: Any) -> None:
    model = tiny.tiny_model("qwen3_5", num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    guard(model, packed=True, allow=["attention"])
    with torch.no_grad():
        packed = model(**_flattened()).logits
        alone = model(input_ids=torch.tensor([FEATURES[1]["input_ids"]])).logits
    torch.testing.assert_close(packed[0, 5:8], alone[0], rtol=1e-4, atol=1e-5)
