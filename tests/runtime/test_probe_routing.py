"""kernelguard.runtime.probe_routing through the first-row probe: a mixture-of-experts router that breaks a near tie one way
in the packed row and the other way alone is replayed, not refused (issue 51: a correct bf16 Qwen3.5-MoE row was
refused), while a leak, or a choice whose logits moved, is still seen. CPU, the fake fla / causal-conv1d.

The tie is made exactly where rounding would make it: in the packed run, the router of one layer picks, for one
token of a later example, the expert ranked just below its last choice (its logits untouched), as a bf16 rounding
of a longer row's matmul does when two experts' scores are within rounding of each other."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.runtime import equivalence
from kernelguard.runtime.segments import read_segments

LENGTHS = (7, 9, 6)
TOKEN = 10  # in the second example (tokens 7-15)
LAYER = 1


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _row(*, boundaries: bool = True) -> dict[str, Any]:
    total = sum(LENGTHS)
    ids = torch.randint(3, 256, (1, total), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}
    if boundaries:
        cu = torch.tensor((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32), cu.diff())[None]
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                   seq_idx=seq_idx)
    return out


def _moe(tiny: Any, dtype: torch.dtype) -> Any:
    model = tiny.tiny_model("qwen3_5_moe").to(dtype)
    for p in model.model.layers[LAYER].mlp.experts.parameters():  # experts far apart: a changed choice shows
        p.data.mul_(8)
    return model


def _tie_in_the_packed_run(model: Any, *, move_logits: float = 0.0) -> None:
    """The router of LAYER, in the packed run (the whole row), gives TOKEN the expert ranked k+1 instead of its
    k-th; ``move_logits`` also scales that token's logits (what a leak does to the router's input)."""
    router = model.model.layers[LAYER].mlp.gate
    forward = router.forward

    def tied(hidden: torch.Tensor) -> Any:
        logits, scores, chosen = forward(hidden)
        if hidden.reshape(-1, hidden.shape[-1]).shape[0] != sum(LENGTHS):
            return logits, scores, chosen  # an example alone: its own choice
        ranked = logits[TOKEN].float().argsort(descending=True)
        chosen = chosen.clone()
        chosen[TOKEN, -1] = ranked[chosen.shape[-1]]
        if move_logits:
            logits = logits.clone()
            logits[TOKEN] = logits[TOKEN] * (1 + move_logits)
        return logits, scores, chosen

    router.forward = tied


def _measure(model: Any, batch: dict[str, Any]) -> list[equivalence.LayerDifference]:
    probe = equivalence.FirstRowProbe(model.model, "model", quiet=lambda on: None)
    seg = read_segments(_row()["position_ids"], _row(), None)
    return probe.measure({**batch, "use_cache": False}, equivalence._chosen(seg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_routing_tie_broken_the_other_way_alone_is_replayed_not_refused(
    fake_providers: Any, tiny: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _moe(tiny, dtype)
    _tie_in_the_packed_run(model)
    measured = _measure(model, _row())
    assert not any(d.differs for d in measured), [(d.layer, d.worst, d.tolerance) for d in measured]
    assert [d.rerouted for d in measured] == [0, 1, 0, 0]  # the one token, at the layer whose router tied
    # The control: without the replay, the same correct row is refused at that layer (the false refusal).
    monkeypatch.setattr(equivalence, "replay_hooks", lambda *args, **kwargs: [])
    measured = _measure(model, _row())
    first = next(d for d in measured if d.differs)
    assert first.layer == f"model.layers.{LAYER}" and first.example == (7, 16), (first.layer, first.worst)


def test_a_choice_whose_logits_moved_is_not_replayed(fake_providers: Any, tiny: Any) -> None:
    model = _moe(tiny, torch.float32)
    _tie_in_the_packed_run(model, move_logits=0.01)  # far above fp32's rounding
    measured = _measure(model, _row())
    first = next(d for d in measured if d.differs)
    assert first.layer == f"model.layers.{LAYER}" and first.rerouted == 0


def test_a_leak_in_a_moe_stack_is_still_seen(fake_providers: Any, tiny: Any) -> None:
    """Boundaries withheld: the GDN layers leak from the first layer on; the routers see the leak in their logits
    and nothing is replayed as a tie."""
    model = _moe(tiny, torch.bfloat16)
    measured = _measure(model, _row(boundaries=False))
    first = next(d for d in measured if d.differs)
    assert first.layer == "model.layers.0"
    assert all(d.rerouted == 0 for d in measured) and sum(d.differs for d in measured) == len(measured)
