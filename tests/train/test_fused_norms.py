"""`kernelguard train --fused-norms` (kernelguard.train.model.fused_norms): which modules Liger's fused RMSNorm and
SiLU-gate kernels may replace, decided by what each computes; and the refusal when liger_kernel is missing.
The kernels themselves need CUDA (bench/gpu/levers_widths_export.sh measures them)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kernelguard.errors import ConfigError
from kernelguard.train.model import fused_norms


def _types(model: nn.Module) -> dict[str, Any]:
    decided: dict[str, Any] = {}
    for module in model.modules():
        name = type(module).__name__
        if name not in decided and fused_norms._is_norm_candidate(module):
            decided[name] = fused_norms.norm_kind(module)
        elif name not in decided and fused_norms._is_mlp_candidate(module):
            decided[name] = fused_norms.mlp_matches(module)
    return decided


def test_qwen3_5_norms_are_offset_one_in_fp32_and_the_gated_norm_is_left() -> None:
    import tiny_models

    from kernelguard.train.model.parallel import build_meta_model

    model = build_meta_model(tiny_models.tiny_config("qwen3_5"), attn_implementation="sdpa")  # on meta, as built
    assert _types(model) == {"Qwen3_5RMSNorm": (1.0, "gemma"), "Qwen3_5RMSNormGated": None, "Qwen3_5MLP": True}


def test_a_llama_style_norm_and_a_non_silu_mlp() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class GeluMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))

    assert fused_norms.norm_kind(LlamaRMSNorm(8)) == (0.0, "llama")  # w * normed.to(dtype)
    assert fused_norms.norm_kind(nn.LayerNorm(8)) is None  # a bias: not a candidate
    assert fused_norms.mlp_matches(GeluMLP()) is False


def test_fuse_norms_replaces_only_what_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiny_models

    from kernelguard.train.model.parallel import build_meta_model

    calls: list[str] = []
    ops = types.ModuleType("liger_kernel.ops")
    norm = types.SimpleNamespace(LigerRMSNormFunction=types.SimpleNamespace(
        apply=lambda x, w, eps, offset, casting, in_place: calls.append(f"norm {offset} {casting}") or x))
    swiglu = types.SimpleNamespace(LigerSiLUMulFunction=types.SimpleNamespace(
        apply=lambda a, b: calls.append("silu-mul") or a * b))
    for name, module in {"liger_kernel": types.ModuleType("liger_kernel"), "liger_kernel.ops": ops,
                         "liger_kernel.ops.rms_norm": norm, "liger_kernel.ops.swiglu": swiglu}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fused_norms, "liger_missing", lambda: None)
    model = build_meta_model(tiny_models.tiny_config("qwen3_5"), attn_implementation="sdpa")
    done = fused_norms.fuse_norms(model)
    by_class: dict[str, list[bool]] = {}
    for module in model.modules():  # replaced: the instance has its own forward
        by_class.setdefault(type(module).__name__, []).append("forward" in vars(module))
    norms, mlps = by_class["Qwen3_5RMSNorm"], by_class["Qwen3_5MLP"]
    assert all(norms) and all(mlps) and not any(by_class["Qwen3_5RMSNormGated"])
    assert len(norms) == 2 * len(model.model.layers) + 1 + 2  # 2 per layer, the final one, q/k of attention
    assert done.norms == {"Qwen3_5RMSNorm": len(norms)} and done.mlps == {"Qwen3_5MLP": len(mlps)}
    assert done.left == {"Qwen3_5RMSNormGated": "not an RMSNorm Liger computes bit for bit"}
    assert done.describe().startswith(f"fused norms (Liger): RMSNorm {len(norms)} x Qwen3_5RMSNorm; ")
    model.model.norm(torch.ones(2, 4, device="meta"))
    assert calls == ["norm 1.0 gemma"]


def test_without_liger_the_flag_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from kernelguard.train.settings.config import TrainConfig
    from kernelguard.train.startup.preflight import check_flags

    if fused_norms.liger_missing() is None:
        pytest.skip("liger_kernel is installed here")
    cfg = TrainConfig.from_flags(model="m", data="d", output_dir=tmp_path / "out", fused_norms=True)
    with pytest.raises(ConfigError) as info:
        check_flags(cfg)
    assert info.value.message == "--fused-norms uses Liger-Kernel's fused kernels, and liger_kernel is not installed."
    assert info.value.fix == fused_norms.LIGER_FIX
    assert not (tmp_path / "out").exists()
