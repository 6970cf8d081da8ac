"""Non-persistent buffers after the meta-device build and ``to_empty``: each is recomputed to the value a normal
build holds, or the run stops. Falcon-H1's model registers each mixer's ``mup_vector`` itself, from outside the
mixer (whose constructor also needs a ``layer_idx``): rebuilding the mixer alone cannot make it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kernelguard.errors import CheckpointError
from kernelguard.train.model.fresh_buffers import restore_buffers


def _transient(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{b}" if name else b: getattr(m, b) for name, m in model.named_modules()
            for b in m._non_persistent_buffers_set if isinstance(getattr(m, b, None), torch.Tensor)}


def _garbage_then_restored(model_cls: type, config: Any, wrap: bool = False) -> nn.Module:
    with torch.device("meta"):
        model = model_cls(config)
    if wrap:  # activation checkpointing renames every layer's path, as kernelguard train applies it
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    model.to_empty(device="cpu")
    for value in _transient(model).values():
        value.fill_(float("nan"))  # what uninitialised memory may hold
    restore_buffers(model, config)
    return model


@pytest.mark.parametrize(("family", "wrap"), [("falcon_h1", False), ("falcon_h1", True), ("qwen3_5", True)])
def test_every_non_persistent_buffer_is_recomputed_to_a_normal_builds_value(tiny: Any, family: str,
                                                                           wrap: bool) -> None:
    config = tiny.tiny_config(family)
    model_cls = type(tiny.tiny_model(family))
    expected = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in _transient(model_cls(config)).items()}
    got = {k.replace("._checkpoint_wrapped_module", ""): v
           for k, v in _transient(_garbage_then_restored(model_cls, config, wrap)).items()}
    assert got.keys() == expected.keys()
    if family == "falcon_h1":
        assert "model.layers.0.mamba.mup_vector" in got  # the buffer only the model's constructor makes
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


class _Owner(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.inner = nn.Linear(2, 2)


def test_a_buffer_nothing_rebuilds_stops_the_run_instead_of_training_on_garbage() -> None:
    with torch.device("meta"):
        model = _Owner(config=None)
    model.inner.register_buffer("scale", torch.ones(2), persistent=False)  # set from outside, by nobody's class
    model.to_empty(device="cpu")
    with pytest.raises(CheckpointError) as info:
        restore_buffers(model, None)
    assert info.value.message.startswith("cannot recompute the non-persistent buffer inner.scale (Linear): neither "
                                         "its module nor any module above it rebuilds it from its config")
