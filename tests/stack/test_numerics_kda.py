"""``check --run`` for Kimi delta attention (kimi_linear, glm5_next, bailing_hybrid): fla's ``chunk_kda`` and
``fused_recurrent_kda`` against transformers' own torch references, on CPU with correct and broken stand-ins;
the real kernels at Kimi-Linear's geometry are a `gpu` test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernelguard.stack import numerics
from kernelguard.stack.numerics import GdnShape, run_numerics, shapes_for_model

pytest.importorskip("transformers.models.kimi_linear", reason="this transformers has no Kimi delta attention")

KDA = ["chunk_kda", "fused_recurrent_kda"]
# A grouped (GVA) shape is checked with as many key heads as value heads: KDA layers give q, k and v one count.
SHAPES = [
    GdnShape(num_k_heads=2, num_v_heads=4, key_dim=32, value_dim=32, batch=2, seq_len=96),
    GdnShape(num_k_heads=4, num_v_heads=4, key_dim=32, value_dim=32, seq_len=200, segments=(70, 100, 30)),
]
PADDED, VARLEN = "B2 T96 H4 K32 V32", "B1 T200 H4 K32 V32 varlen[70,100,30]"
# fp32 against 1e-3, as the GDN CPU cases (test_numerics.py says why): a correct stand-in is ~1e-7 off.
FP32 = {"dtype": torch.float32, "tolerance": 1e-3}


@pytest.fixture
def kda(fake_providers: Path) -> dict[str, Any]:
    import fla.ops.kda as fake_kda

    return {"chunk_kda": fake_kda.chunk_kda, "fused_recurrent_kda": fake_kda.fused_recurrent_kda}


def _run(providers: dict[str, Any], kernels: list[str] = KDA) -> numerics.NumericsReport:
    return run_numerics(kernels, providers=providers, device="cpu", shapes=SHAPES, **FP32)


def test_correct_kda_passes_every_tensor_against_kimis_reference(kda: dict[str, Any]) -> None:
    report = _run(kda)
    assert report.ok, report.render()
    cases = {(c.kernel, c.shape, c.tensor) for c in report.cases}
    for shape in (PADDED, VARLEN):
        for tensor in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            assert ("chunk_kda", shape, tensor) in cases
    assert {c.tensor for c in report.cases if c.kernel == "fused_recurrent_kda"} == {"o", "final_state"}
    assert any("reference: transformers.models.kimi_linear.modeling_kimi_linear" in n for n in report.notes)
    assert not any("GDN layer passes" in n for n in report.notes)  # the q/k head note is about GDN only


def test_a_per_head_decay_fails_where_kda_differs(kda: dict[str, Any]) -> None:
    """A kernel that treats KDA's per-channel decay as GDN's one decay per head (its mean over the channels)
    is wrong on the output and on dg in every layout."""
    good = kda["chunk_kda"]

    def per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 **kw: Any) -> Any:
        return good(q, k, v, g.mean(dim=-1, keepdim=True).expand_as(g), beta, **kw)

    report = _run({"chunk_kda": per_head}, kernels=["chunk_kda"])
    failed = {(c.shape, c.tensor) for c in report.failures}
    assert {(PADDED, "o"), (VARLEN, "o"), (PADDED, "dg"), (VARLEN, "dg")} <= failed, report.render()


def test_kda_ignoring_cu_seqlens_fails_only_the_packed_row(kda: dict[str, Any]) -> None:
    good = kda["chunk_kda"]

    def leaky(*args: Any, cu_seqlens: Any = None, **kw: Any) -> Any:
        return good(*args, **kw)  # state flows across packed examples

    report = _run({"chunk_kda": leaky}, kernels=["chunk_kda"])
    failed = {(c.shape, c.tensor) for c in report.failures}
    assert (VARLEN, "o") in failed and {shape for shape, _ in failed} == {VARLEN}, report.render()


def test_gdn_and_kda_kernels_together_take_each_reference_from_its_own_family(
    kda: dict[str, Any], fake_providers: Path
) -> None:
    import fla.ops.gated_delta_rule as gdr

    both = {**kda, "chunk_gated_delta_rule": gdr.chunk_gated_delta_rule}
    report = _run(both, kernels=["chunk_gated_delta_rule", "chunk_kda"])
    assert report.ok, report.render()
    note = next(n for n in report.notes if n.startswith("reference: "))
    assert "modeling_qwen3_5" in note and "modeling_kimi_linear" in note


@pytest.mark.parametrize(
    ("family", "heads", "dim"),
    [("kimi_linear", 32, 128), ("glm5_next", 64, 128), ("bailing_hybrid", None, None)],
)
def test_shapes_for_kda_configs_use_the_linear_attention_geometry(family: str, heads: Any, dim: Any) -> None:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")

    config = AutoConfig.for_model(family)
    text = config.get_text_config()
    heads = heads or text.linear_num_heads
    dim = dim or text.linear_head_dim
    shapes = shapes_for_model(config, generic=False)
    assert [(s.num_k_heads, s.num_v_heads, s.key_dim, s.value_dim, s.segments is None) for s in shapes] == [
        (heads, heads, dim, dim, True), (heads, heads, dim, dim, False)
    ]
    assert shapes[0].conv_kernel == text.linear_conv_kernel_dim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_chunk_kda_on_gpu_at_kimi_linear_shapes() -> None:
    """Real fla ``chunk_kda`` (forward and backward, padded and packed) and ``fused_recurrent_kda`` at
    Kimi-Linear's geometry in bf16 against the product's tolerance; the control, fla's kernel fed GDN's one
    decay per head, fails."""
    from fla.ops.kda import chunk_kda
    from transformers import KimiLinearConfig

    shapes = shapes_for_model(KimiLinearConfig(), generic=False)
    report = run_numerics(KDA, shapes=shapes)
    assert report.ok, report.render()

    def per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 **kw: Any) -> Any:
        return chunk_kda(q, k, v, g.mean(dim=-1, keepdim=True).expand_as(g).contiguous(), beta, **kw)

    control = run_numerics(["chunk_kda"], providers={"chunk_kda": per_head}, shapes=shapes[:1])
    assert {"o", "dg"} <= {c.tensor for c in control.failures}, control.render()
