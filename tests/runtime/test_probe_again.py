"""The first-row probe measures the path the step takes, and measures again when that path changes.

A probe that runs once, without autograd, vouches for a path the training step may not take: a kernel or a
wrapper that goes another way when autograd is on, a layer wrapped after the first row, a row it could not
measure. Each test here fails on a probe that runs once under ``torch.no_grad()``. CPU, fp32, the fake fla /
causal-conv1d (they honour ``cu_seqlens`` / ``seq_idx`` exactly as the real kernels do).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.runtime.model_guard import guard

BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _row(*lengths: int) -> dict[str, Any]:
    from transformers import DataCollatorWithFlattening

    start = 3
    features = []
    for n in lengths:
        features.append({"input_ids": list(range(start, start + n))})
        start += n
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    return {k: v for k, v in batch.items() if k != "labels"}


def _guarded(tiny: Any) -> tuple[Any, Any]:
    model = tiny.tiny_model("qwen3_5")
    report = guard(model, packed=True, allow=["attention"])
    (probe,) = report.boundaries.probes
    return model, probe


def _leaking_when(monkeypatch: pytest.MonkeyPatch, leaks: Any) -> None:
    """The fake fla's chunk kernel takes `cu_seqlens` (every static check passes) and ignores it whenever
    ``leaks()``: the GDN state runs on from each example into the next."""
    import fla.ops.gated_delta_rule as fake

    varlen = fake._varlen
    monkeypatch.setattr(fake, "_varlen", lambda *a, **k: varlen(*a, **{**k, "cu_seqlens": None} if leaks() else k))


def test_a_leak_on_the_autograd_path_alone_is_refused_where_the_step_takes_it(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _leaking_when(monkeypatch, torch.is_grad_enabled)
    model, probe = _guarded(tiny)
    with torch.no_grad():
        model(**_row(5, 3, 4))  # the no-grad path keeps the examples apart: measured, passes
    assert probe.runs == 1 and not any(d.differs for d in probe.measured)
    with pytest.raises(PackedWithoutBoundariesError) as info:
        model(**_row(5, 3, 4))  # the step's path, autograd on: measured again, and it leaks
    assert probe.runs == 2 and info.value.details["kind"] == "probe"
    assert info.value.layer == "model.layers.1"  # as for a kernel that always leaks (test_boundaries.py)


def test_a_layer_wrapped_after_the_first_row_is_measured_again(fake_providers: Any, tiny: Any) -> None:
    model, probe = _guarded(tiny)
    with torch.no_grad():
        model(**_row(5, 3, 4))
    assert probe.runs == 1
    layer = model.model.layers[1]
    forward = layer.forward
    layer.forward = lambda *a, **k: forward(*a, **{n: v for n, v in k.items() if n not in BOUNDARIES})
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError) as info:
        model(**_row(5, 3, 4))  # every static check reads the stack's keywords, which are all there
    assert probe.runs == 2 and info.value.layer == "model.layers.1"


def test_a_row_the_probe_cannot_measure_does_not_spend_it(
    fake_providers: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _leaking_when(monkeypatch, lambda: True)
    model, probe = _guarded(tiny)
    with torch.no_grad():
        model(**_row(6, 1, 1))  # one example of two tokens or more: nothing to compare it with
    assert probe.runs == 0
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError):
        model(**_row(5, 3, 4))


def test_a_correct_model_is_measured_once_per_path_however_often_it_is_called(fake_providers: Any, tiny: Any) -> None:
    """The negative control of the three above, and the probe's cost: rows of one length class, train and eval,
    autograd on and off, 16 calls: four paths, four measurements, no refusal."""
    model, probe = _guarded(tiny)
    for call in range(16):
        model.train(call % 4 < 2)
        with torch.set_grad_enabled(call % 2 == 0):
            model(**_row(5, 3, 4))
    assert probe.runs == 4 and not any(d.differs for d in probe.measured)
