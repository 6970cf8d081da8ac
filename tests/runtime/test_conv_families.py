"""Families whose only fast kernel is a short convolution (causal_conv1d_fn), through the guard with a packed row.

* LFM2: its layers hand the conv the batch's ``seq_idx``: the row runs and equals each example alone.
* Inkling: its decoder layer and attention call their short convolutions without ``**kwargs``, so the conv's
  ``kwargs.get("seq_idx")`` is always None and a packed row's examples mix. Only the first-row probe caught it; the
  static check now reads the call from the modeling file and refuses the row at its first call, by the cause.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.runtime.model_guard import guard

LENGTHS = (11, 6)


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _row() -> tuple[torch.Tensor, dict[str, Any]]:
    """One packed row of LENGTHS with every boundary signal DataCollatorWithFlattening writes."""
    import tiny_models

    return tiny_models.packed_row(LENGTHS)


def _packed_minus_alone(model: Any) -> torch.Tensor:
    ids, boundaries = _row()
    with torch.no_grad():
        packed = model(input_ids=ids, use_cache=False, **boundaries).logits
        alone = torch.cat([model(input_ids=ids[:, :LENGTHS[0]], use_cache=False).logits,
                           model(input_ids=ids[:, LENGTHS[0]:], use_cache=False).logits], dim=1)
    return (packed - alone).abs()


def test_a_packed_lfm2_row_runs_and_equals_each_example_alone(fake_providers: Any, tiny: Any) -> None:
    model = tiny.tiny_model("lfm2").train()
    report = guard(model, packed=True, allow=["attention"])
    assert "causal_conv1d_fn" in {e.kernel for e in report.entries if e.status == "selected"}
    assert _packed_minus_alone(model).max().item() < 1e-4  # fp32: ~1e-7 here


def test_a_packed_inkling_row_is_refused_at_its_first_call_by_the_layer_that_drops_seq_idx(
    fake_providers: Any, tiny: Any
) -> None:
    model = tiny.tiny_model("inkling").train()
    diff = _packed_minus_alone(model)  # unguarded: what the refusal prevents
    assert diff[:, :LENGTHS[0]].max().item() < 1e-5 < 1e-4 < diff[:, LENGTHS[0]:].max().item()
    guard(model, packed=True, allow=["attention"], first_row_probe=False)  # the static check alone
    ids, boundaries = _row()
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(input_ids=ids, use_cache=False, **boundaries)
    assert info.value.message.startswith(
        "kernelguard: model.layers.0.self_attn.k_sconv (and 15 more conv layers) got a packed row of 2 examples (by "
        "its cu_seq_lens_q) but its conv gets no `seq_idx` (transformers' layer does not pass `seq_idx` to "
        "`causal_conv1d_fn`: `InklingAttention.forward` calls `self.k_sconv(...)` without its **kwargs)")
    assert info.value.fix.startswith("padded batches (padding_free=False, no DataCollatorWithFlattening): the "
                                     "model's own layer drops the boundary, which no collator can mend")
