"""A model kernelize()d onto Hub kernels is not a fallback, in kernels' per-layer layout (0.18 on).

From kernels 0.18 each GDN layer holds its own copy of every kernel ``Func`` (``layer._kernel_funcs``);
kernelize() changes the copies, never the module-level Func the modeling file calls. Here kernelize() runs for
real on CPU, with a mapping to local "Hub" layers whose forward is the torch reference itself (so the numbers
must not change), and the guard must see the copies: the control is the same model not kernelized.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernelguard.errors import KernelFallbackError
from kernelguard.resolution import transformers_compat as compat
from kernelguard.runtime.model_guard import arm_tripwires, guard
from kernelguard.runtime.registry import REGISTRY

kernels = pytest.importorskip("kernels", reason="the Hub tests need the hub extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.kernelguard(False)  # the control enters the torch references on purpose

GDN_LAYER = "model.layers.0.linear_attn"
KERNELS = ("causal_conv1d_fn", "chunk_gated_delta_rule")


@pytest.fixture(autouse=True)
def _no_leftover_tripwires() -> Iterator[None]:
    yield
    leftover = REGISTRY.armed_sites()
    REGISTRY.reset()
    assert not leftover, f"test left tripwires armed: {leftover}"


def _model(tiny: Any) -> Any:
    model = tiny.tiny_model("qwen3_5", num_hidden_layers=1, layer_types=["linear_attention"]).train()
    if not isinstance(getattr(model.model.layers[0].linear_attn, "_kernel_funcs", None), dict):
        pytest.skip("this kernels / transformers pair has no per-layer kernel copies (kernels < 0.18)")
    return model


class _Repo:
    """A kernel repository kernels can load offline: ``load()`` returns the layer class."""

    def __init__(self, cls: type) -> None:
        self.cls, self.repo_id, self.revision = cls, f"local/{cls.__name__}", "r1"

    def load(self) -> type:
        return self.cls


def _hub_layers(module: Any) -> dict[str, type]:
    """Layers with the call signature transformers' Func declares, running the torch reference."""
    conv = compat.unpack_closure(module.causal_conv1d_fn).torch_function
    chunk = compat.unpack_closure(module.torch_chunk_gated_delta_rule).torch_function

    class Conv(torch.nn.Module):
        def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):  # type: ignore[no-untyped-def]
            return conv(hidden_states, weight, bias, activation, **kwargs)

    class Chunk(torch.nn.Module):
        def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None,  # type: ignore[no-untyped-def]
                    output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
            return chunk(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, **kwargs)

    return {"causal_conv1d_fn": Conv, "chunk_gated_delta_rule": Chunk}


def _kernelize(model: Any) -> None:
    module = sys.modules[type(model).__module__]
    mode = kernels.Mode.TRAINING
    mapping = {name: {"cpu": {mode: _Repo(cls)}} for name, cls in _hub_layers(module).items()}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device="cpu")


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))


def test_a_kernelized_model_passes_the_guard_and_its_sites_name_the_hub_layers(
    fresh_transformers_models: None, tiny: Any
) -> None:
    model = _model(tiny)
    expected = model(_ids()).logits.detach()
    _kernelize(model)
    with guard(model, packed=False) as report:
        logits = model(_ids()).logits.detach()
    sites = {(s.kernel, s.kind, s.implementation) for s in report.entries if s.layer == GDN_LAYER}
    assert {("causal_conv1d_fn", "hub", "local/Conv@r1"), ("chunk_gated_delta_rule", "hub", "local/Chunk@r1")} <= sites
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)  # the "Hub" layers are the references


def test_the_same_model_not_kernelized_is_refused(fresh_transformers_models: None, tiny: Any) -> None:
    model = _model(tiny)
    with pytest.raises(KernelFallbackError) as info:
        guard(model, packed=False)
    assert all(f"{kernel} -> torch reference in {GDN_LAYER}" in str(info.value) for kernel in KERNELS)


@pytest.mark.parametrize("kernelized", [True, False], ids=["kernelized", "control"])
def test_kernelized_after_arming_the_calls_are_served_not_refused(
    fresh_transformers_models: None, tiny: Any, kernelized: bool
) -> None:
    """Armed first (the module-level names hold tripwires), kernelized after: the tripwire finds the copy
    the layer dispatches to."""
    model = _model(tiny)
    with arm_tripwires(on_fallback="raise"):
        if kernelized:
            _kernelize(model)
            model(_ids())
        else:
            with pytest.raises(KernelFallbackError, match="causal_conv1d_fn"):
                model(_ids())


def test_the_hub_kernel_of_a_func_comes_from_kernels_public_inspection() -> None:
    """kernels 0.18+: ``get_kernelized_layers`` reports the repository kernelize() recorded on the Func; the
    control: a Func with nothing recorded and nothing cached is ``@unknown``."""
    kernels = pytest.importorskip("kernels")
    if not hasattr(kernels, "get_kernelized_layers"):
        pytest.skip(f"kernels {kernels.__version__} has no get_kernelized_layers")
    from types import MethodType

    from kernelguard.resolution.kernels_funcs import hub_kernel_of

    class HubChunk(torch.nn.Module):
        def forward(self, *args: object, **kwargs: object) -> str:
            return "hub"

    func = torch.nn.Module()
    func.forward = MethodType(HubChunk.forward, func)
    assert hub_kernel_of(func).endswith("HubChunk.forward@unknown")
    func.__dict__["_kernel_repo"] = kernels.LayerRepository(
        repo_id="kernels-community/fla", layer_name="chunk_gated_delta_rule", version=3)
    assert hub_kernel_of(func) == "kernels-community/fla@v3"
