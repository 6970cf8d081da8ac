"""Small pieces of `kernelguard train`: config validation, LR schedule, FLOP accounting, checkpoint folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import ConfigError
from kernelguard.train import checkpoint as ckpt
from kernelguard.train.config import TrainConfig, parse_args
from kernelguard.train.step import lr_lambda
from kernelguard.train.metrics import forward_flops_per_token, peak_flops, step_flops


def test_config_validation_names_the_fix(tmp_path: Path) -> None:
    base: dict[str, Any] = {"model": "m", "data": "d", "output": tmp_path / "o"}
    cfg = TrainConfig(**base)
    assert cfg.tokenizer == "m" and cfg.block_size == 8192 and cfg.overlong == "truncate"
    for bad, text in [
        ({"block_size": 0}, "block_size"),
        ({"grad_accum": -1}, "grad_accum"),
        ({"param_dtype": "int8"}, "param_dtype"),
        ({"overlong": "wrap"}, "overlong"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"lr": 0.0}, "lr"),
    ]:
        with pytest.raises(ConfigError, match=text) as info:
            TrainConfig(**base, **bad)
        assert info.value.fix
    with pytest.raises(TypeError):
        TrainConfig("m", "d", tmp_path)  # type: ignore[misc]  # keyword-only


def test_parse_args_allow_is_repeatable(tmp_path: Path) -> None:
    cfg = parse_args(
        [
            "--model",
            "m",
            "--data",
            "d",
            "--output",
            str(tmp_path),
            "--allow",
            "attention",
            "--allow",
            "chunk_gated_delta_rule",
            "causal_conv1d_fn",
            "--param-dtype",
            "fp32",
        ]
    )
    assert cfg.allow == ("attention", "chunk_gated_delta_rule", "causal_conv1d_fn")
    assert cfg.param_dtype == "fp32"


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    f = lr_lambda(2, 10, 0.1)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)


def test_step_flops_matches_the_documented_formula(tiny: Any) -> None:
    import torch

    config = tiny.tiny_config("qwen3_5")
    model = tiny.tiny_model("qwen3_5")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # GDN per token and layer: conv 2*(2*32 + 64)*4 = 1024; 4 value heads * (4*16*16 + 2*64*(16+16)) = 20480.
    gdn = 3 * (1024 + 20480)
    assert forward_flops_per_token(config) == 2 * linear + gdn
    # Full attention (1 layer, 4 heads, head dim 16), causal: 2*2*L^2*4*16/2 per example.
    lens = [100, 28]
    attn = sum(2 * 2 * n * n * 4 * 16 / 2 for n in lens)
    assert step_flops(config, lens) == pytest.approx(3 * (128 * (2 * linear + gdn) + attn))
    assert peak_flops("cpu") == 0.0


def test_moe_counts_only_active_experts(tiny: Any) -> None:
    dense = tiny.tiny_config("qwen3_5_moe", num_experts=4)
    more = tiny.tiny_config("qwen3_5_moe", num_experts=64)
    # 60 more experts add only router weights (hidden 64 x 60 per layer, 4 layers), not expert matmuls.
    assert forward_flops_per_token(more) - forward_flops_per_token(dense) == pytest.approx(2 * 4 * 64 * 60)


def test_incomplete_checkpoints_are_ignored_and_removed(tmp_path: Path) -> None:
    root = ckpt.checkpoint_root(tmp_path)
    for name, marker in [("step_2", True), ("step_4", True), ("step_6", False), ("step_8.tmp", True)]:
        (root / name).mkdir(parents=True)
        if marker:
            (root / name / ckpt.MARKER).write_text("done")
    (tmp_path / "final.tmp").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_4"
    removed = {p.name for p in ckpt.remove_incomplete(tmp_path)}
    assert removed == {"step_6", "step_8.tmp", "final.tmp"}
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None


def test_accepted_fla_640_rows_lift_the_refusal_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from kernelguard.train.loop import lift_accepted_fla_refusal

    # An fla laid out like 0.6.0: the flag imported by value into the consumer module.
    names = ("fla", "fla.ops", "fla.ops.common", "fla.ops.common.chunk_o", "fla.utils")
    mods = {n: types.ModuleType(n) for n in names}
    mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 = False
    mods["fla.utils"].TRITON_ABOVE_3_7_1 = False
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)

    assert lift_accepted_fla_refusal({"kernels-version"}) == []
    assert mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 is False
    assert sorted(lift_accepted_fla_refusal({"fla-640-wrong-grads"})) == ["fla.ops.common.chunk_o", "fla.utils"]
    assert mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 is True


def test_lifting_with_an_fla_that_has_no_refusal_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from kernelguard.train.loop import lift_accepted_fla_refusal

    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))  # a package without fla.ops.common
    for name in [n for n in sys.modules if n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    assert lift_accepted_fla_refusal({"fla-640-refusal"}) == []
