"""`kernelguard train` under transformers 5.25, whose from_pretrained loads Kernel Hub kernels by default.

kernelguard train checks and guards the pip packages, so it loads with ``use_kernels=False`` whatever the
transformers default (5.25 would otherwise raise ``ValueError: Kernels are not available`` here, where kernels
0.17.2 is outside its window). On CPU, 5.25 hands a pip package only inputs on the devices it lists for it
(causal_conv1d: cuda): the stand-ins add cpu there, and without them the guard refuses before step 1 instead of
transformers' raw "can't keep packed sequences apart" traceback. Runs under any transformers (CI: 5.24 and 5.25).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import train_helpers as h

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return h.write_train_assets(tmp_path_factory.mktemp("train525"), rows=60)


@pytest.fixture(scope="module")
def weights(assets: dict[str, Path]) -> Path:
    """A saved model folder with .bin weights: rank 0 loads those with transformers' from_pretrained (a
    safetensors folder is read shard by shard instead, without from_pretrained)."""
    import tiny_models
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_models.tiny_config("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    folder = assets["root"] / "weights"
    folder.mkdir()
    config.save_pretrained(str(folder))  # 5.25's save_pretrained writes safetensors only: the .bin by hand
    torch.save(AutoModelForCausalLM.from_config(config).state_dict(), folder / "pytorch_model.bin")
    return folder


def _args(assets: dict[str, Path], model: Path, output: Path) -> list[str]:
    return ["--model", str(model), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(output), "--block-size", "256", "--param-dtype", "fp32", "--max-steps", "2",
            "--no-progress", "--allow", "attention"]


@pytest.mark.parametrize("source", ["config", "weights"])
def test_train_reaches_a_finished_step_with_the_stand_ins(
    assets: dict[str, Path], weights: Path, tmp_path: Path, source: str
) -> None:
    model = assets["model"] if source == "config" else weights
    r = h.run_train(_args(assets, model, tmp_path / "out"), nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernelguard train: done: 2 steps" in r.stderr
    assert "Traceback" not in r.stderr and "Kernels are not available" not in r.stderr
    assert ("weights: " in r.stderr) and (source == "config") == ("initialised" in r.stderr)
    for kernel in ("causal_conv1d_fn", "chunk_gated_delta_rule"):  # each conv and GDN site served by a stand-in
        assert any(line.split()[:2] == ["fast", kernel] for line in r.stderr.splitlines()), r.stderr[-3000:]


def test_without_the_stand_ins_the_guard_refuses_before_transformers_raises(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    r = h.run_train(_args(assets, assets["model"], tmp_path / "out"), fakes=False, nproc=0)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "can't keep packed sequences apart" not in r.stderr
    assert "causal_conv1d_fn" in r.stderr and "fix:" in r.stderr
