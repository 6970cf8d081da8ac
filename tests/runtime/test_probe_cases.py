"""The first-row probe sees every packed case issue 39 listed, by construction: measured directly on each batch
(``FirstRowProbe.measure``, which no static check stands in front of), every one differs from its examples run
alone at some layer, and the correct layouts do not. CPU, fp32, the fake fla / causal-conv1d."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.runtime import equivalence
from kernelguard.runtime.segments import read_segments

LENGTHS = (7, 9, 6)


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _row(*, cu: bool = True, seq: bool = True, positions: bool = True, mask: bool = False,
         seq_zero: bool = False, cu_values: tuple[int, ...] | None = None) -> dict[str, Any]:
    total = sum(LENGTHS)
    out: dict[str, Any] = {"input_ids": torch.randint(3, 256, (1, total), generator=torch.Generator().manual_seed(1))}
    if positions:
        out["position_ids"] = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    starts = torch.tensor(cu_values or (0, *torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32)
    if cu:
        longest = int(starts.diff().max())
        out.update(cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=longest, max_length_k=longest)
    if seq:
        seq_idx = torch.repeat_interleave(torch.arange(len(starts) - 1, dtype=torch.int32), starts.diff())[None]
        out["seq_idx"] = torch.zeros_like(seq_idx) if seq_zero else seq_idx
    if mask:
        out["attention_mask"] = torch.ones(1, total, dtype=torch.long)
    return out


def _measure(model: Any, batch: dict[str, Any]) -> list[equivalence.LayerDifference]:
    probe = equivalence.FirstRowProbe(model.model, "model", quiet=lambda on: None)
    # the examples the probe runs are the true ones (by LENGTHS), whatever the batch's own signals claim
    seg = read_segments(_row()["position_ids"], _row(), None)
    return probe.measure({**batch, "use_cache": False}, equivalence._chosen(seg))


CASES = {
    "all-ones mask, restarting positions": _row(cu=False, seq=False, mask=True),
    "cu_seq_lens right, seq_idx all zeros": _row(seq_zero=True),
    "cu_seq_lens and seq_idx say 2 examples, positions 3": _row(cu_values=(0, 7, 22)),
    "cu_seq_lens + seq_idx, no position ids (sdpa)": _row(positions=False),
    "position ids only (a wrapper's or model.model's batch)": _row(cu=False, seq=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_probe_sees_each_listed_case(fake_providers: Any, tiny: Any, case: str) -> None:
    measured = _measure(tiny.tiny_model("qwen3_5"), CASES[case])
    first = next(d for d in measured if d.differs)
    assert first.worst > 10 * first.tolerance, [(d.layer, d.worst, d.tolerance) for d in measured]


def test_the_probe_passes_the_correct_row_measured_the_same_way(fake_providers: Any, tiny: Any) -> None:
    measured = _measure(tiny.tiny_model("qwen3_5"), _row())
    assert measured and not any(d.differs for d in measured)
