"""`kernelguard train` packs a Mamba-2 hybrid (Nemotron-H: Mamba-2 + attention + MoE), whose causal LM hands the
batch's ``seq_idx`` on to every scan, with the Mamba-2 stand-in; the same run with a stand-in that ignores
``seq_idx`` is stopped at step 1 by the first-row probe, with its sentence and fix (no traceback), and refuses
Mamba2ForCausalLM by name before anything is written (its forward drops the keywords)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import train_helpers as h

pytestmark = pytest.mark.slow

MAMBA_STAND_IN = Path(__file__).resolve().parents[1] / "fake_providers_mamba"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import tiny_models

    found = h.write_train_assets(tmp_path_factory.mktemp("mamba"), rows=60)
    for family in ("nemotron_h", "mamba2", "falcon_h1", "zamba2"):
        folder = found["root"] / family
        folder.mkdir()
        config = tiny_models.tiny_config(family, vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
        config.to_json_file(str(folder / "config.json"))
        found[family] = folder
    return found


def _train(assets: dict[str, Path], family: str, out: Path, monkeypatch: pytest.MonkeyPatch, *, leak: bool = False):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PYTHONPATH", str(MAMBA_STAND_IN))
    if leak:
        monkeypatch.setenv("KERNELGUARD_FAKE_MAMBA_LEAK", "1")
    return h.run_train(["--model", str(assets[family]), "--tokenizer", str(assets["tok"]), "--data",
                        str(assets["data"]), "--output-dir", str(out), "--init", "random", "--max-steps", "2",
                        "--block-size", "128", "--param-dtype", "fp32", "--allow", "attention", "--no-progress",
                        "--no-export", "--no-plot"], nproc=0)


def test_a_packed_nemotron_h_trains_and_a_leaking_scan_stops_it_at_step_1(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = _train(assets, "nemotron_h", tmp_path / "ok", monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "mamba_split_conv1d_scan_combined  mamba_ssm 2.2.4+kernelguard.fake" in done.stderr
    steps = [json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s][-1] == 2
    leaked = _train(assets, "nemotron_h", tmp_path / "leak", monkeypatch, leak=True)
    assert leaked.returncode == 1 and "Traceback" not in leaked.stderr
    assert ("kernelguard train: stopped by the guard (exit 1).\nkernelguard: the first packed row, run example by "
            "example, differs from the packed run from model.layers.0") in leaked.stderr


@pytest.mark.parametrize("family", ["falcon_h1", "zamba2"])
def test_the_other_mamba2_hybrid_layouts_train_packed(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """Falcon-H1 (attention and Mamba-2 side by side in every layer; its model registers each mixer's
    ``mup_vector``, a buffer in no checkpoint that the random init must recompute) and Zamba2 (one attention block
    shared between Mamba-2 layers): both pack and train. Falcon-H1 stopped before step 1 when its mixer could not be
    rebuilt alone (tests/train/test_fresh_buffers.py)."""
    done = _train(assets, family, tmp_path / "ok", monkeypatch)
    assert done.returncode == 0, done.stderr
    assert "packed 60 examples" in done.stderr
    steps = [json.loads(line) for line in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s][-1] == 2


def test_mamba2_is_refused_by_name_before_anything_is_written(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.24's Mamba2ForCausalLM drops the batch's keywords: refused as unpackable. 5.25 passes them
    on, and its layers sit under `backbone`, which kernelguard train does not shard: refused for that, by name.
    Either way before anything is written, and never with a traceback (the attention-free model is built)."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    from kernelguard.resolution.transformers_calls import dropped_keywords

    refused = _train(assets, "mamba2", tmp_path / "out", monkeypatch)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    if dropped_keywords(modeling.__file__, "Mamba2ForCausalLM") is not None:
        assert ("mamba2 cannot be packed: `Mamba2ForCausalLM.forward` calls `self.backbone(...)` without its "
                "**kwargs, so a batch's packed-sequence keywords never reach its layers") in said
    else:
        assert "Mamba2ForCausalLM" in said and "model.layers and model.language_model.layers" in said
    assert not (tmp_path / "out").exists()
