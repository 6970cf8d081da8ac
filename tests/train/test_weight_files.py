"""Weights whose files lie (kernelguard.train.model.weight_files, kernelguard.train.model.weights.plan_weights): every
header, the index and every shard are compared with what the model builds before any memory is used; what
cannot be right is refused (one paragraph per problem class, naming tensor and file), what transformers would
report as UNEXPECTED is warned about."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import train_helpers as h
from safetensors.torch import load_file, save_file

from kernelguard.errors import CheckpointError
from kernelguard.train.model.weights import plan_weights


def _model(**overrides: Any) -> Any:
    import tiny_models

    return tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2, **overrides)


def _save(path: Path, shard: str = "5GB", **overrides: Any) -> Path:
    _model(**overrides).to(torch.bfloat16).save_pretrained(str(path), max_shard_size=shard)
    return path


def _meta(path: Path) -> Any:
    from kernelguard.train.model.parallel import build_meta_model, model_source

    config, _ = model_source(str(path))
    # A multimodal config builds the text model (AutoModelForCausalLM maps it to *ForCausalLM in a fresh
    # process). Built from its text config here, so an earlier test's purge of transformers.models.* (Auto
    # classes then hold another import of the module) cannot hand the text model the composite config.
    return build_meta_model(config.get_text_config(), attn_implementation="sdpa")


def _refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        plan_weights(_meta(path), path)
    assert "nothing was loaded" in info.value.message
    return info.value.message


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_header_dtype_that_does_not_fit_its_bytes_is_refused_naming_tensor_and_file(tmp_path: Path) -> None:
    src = _save(tmp_path / "src")
    header, data = _header(src / "model.safetensors")
    header["model.norm.weight"]["dtype"] = "F32"  # same bytes, twice the width: the header lies
    _write(src / "model.safetensors", header, data)
    message = _refusal(src)
    assert "headers whose dtype and shape do not fit the bytes they point at" in message
    assert "model.norm.weight (model.safetensors): F32 [64] is 256 bytes; the header gives it 128" in message


def test_bytes_of_another_dtype_under_a_right_sized_header_are_refused_by_their_values(tmp_path: Path) -> None:
    src = _save(tmp_path / "src")
    header, data = _header(src / "model.safetensors")
    begin, end = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    fp32 = (torch.randn((end - begin) // 4) * 0.08).numpy().tobytes()  # f32 bytes, read as BF16 pairs
    _write(src / "model.safetensors", header, data[:begin] + fp32 + data[end:])
    message = _refusal(src)
    assert "values that cannot be weights in their header's dtype" in message
    assert "model.layers.0.mlp.up_proj.weight (model.safetensors): BF16 values include" in message


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", shard="60KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    save_file({"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, str(src / "stray.safetensors"))
    message = _refusal(src)
    assert "in more than one file (which one is read is an accident of file order)" in message
    assert (f"model.norm.weight: in {index['model.norm.weight']}, stray.safetensors; the index names "
            f"{index['model.norm.weight']}") in message


def test_an_index_naming_a_file_that_lacks_the_tensor_is_refused(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", shard="60KB")
    path = src / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    real = index["weight_map"]["model.norm.weight"]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != real)
    index["weight_map"]["model.norm.weight"] = other
    path.write_text(json.dumps(index))
    message = _refusal(src)
    assert f"model.norm.weight: the index says {other}, the tensor is in {real}" in message


def test_a_truncated_shard_is_named(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", shard="60KB")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    message = _refusal(src)
    assert "1 file(s) of " in message and "shorter than their header says (truncated: a partial download or copy)" in message
    assert f"{shard.name}: " in message and "tensor(s) are cut off" in message


def test_unexpected_tensors_are_warned_about_ten_and_a_count_and_ignored_ones_are_not(tmp_path: Path) -> None:
    src = _save(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    extras = {f"model.layers.0.extra_{i:02d}.weight": torch.ones(4, dtype=torch.bfloat16) for i in range(12)}
    save_file({**tensors, **extras, "mtp.fc.weight": torch.ones(4, dtype=torch.bfloat16)},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    plan, note = plan_weights(_meta(src), src)
    assert note is None and plan is not None
    (warning,) = plan.warnings
    assert "12 tensor(s) of" in warning and "are not built by the model config (UNEXPECTED)" in warning
    assert "model.layers.0.extra_09.weight (model.safetensors)" in warning
    assert "extra_10" not in warning and warning.endswith("... and 2 more")
    assert "mtp.fc.weight" not in warning  # transformers ignores mtp.* silently: so do we (still carried)
    assert "mtp.fc.weight" in plan.carried and len(plan.carried) == 13


def test_a_tied_model_whose_file_has_a_different_head_is_refused_and_an_equal_head_is_fine(tmp_path: Path) -> None:
    src = _save(tmp_path / "src", tie_word_embeddings=True)
    tensors = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.clone()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    plan, _ = plan_weights(_meta(src), src)
    assert plan is not None and plan.tied and plan.warnings == ()
    save_file({**tensors, "lm_head.weight": embed + 1}, str(src / "model.safetensors"), metadata={"format": "pt"})
    message = _refusal(src)
    assert "contradict tie_word_embeddings: true" in message
    assert "lm_head.weight (model.safetensors) differs from model.embed_tokens.weight (model.safetensors)" in message


def test_a_multimodal_config_without_vision_weights_is_refused(tmp_path: Path) -> None:
    import tiny_models
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_models.tiny_config("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "patch_size": 4, "temporal_patch_size": 1}
    src = tmp_path / "src"
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)).to(
        torch.bfloat16).save_pretrained(str(src))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    message = _refusal(src)
    assert "that a multimodal config needs are absent: no vision tower" in message
    assert "model.visual.* (no file of" in message and "Qwen3_5ForConditionalGeneration" in message


def test_an_integer_dtype_for_a_weight_is_refused(tmp_path: Path) -> None:
    src = _save(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(64, dtype=torch.int16)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    message = _refusal(src)
    assert "model.norm.weight (model.safetensors): I16; the model trains it as floating point" in message


def test_overlapping_byte_ranges_and_a_key_named_twice_are_refused(tmp_path: Path) -> None:
    src = _save(tmp_path / "src")
    header, data = _header(src / "model.safetensors")
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    first, second = names[0], names[1]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    start = header[first]["data_offsets"][0]
    header[second]["data_offsets"] = [start, start + size]  # its bytes now overlap the first tensor's
    _write(src / "model.safetensors", header, data)
    assert "byte ranges that overlap or leave gaps (a hand-edited or damaged header)" in _refusal(src)
    header, data = _header(src / "model.safetensors")
    header[second]["data_offsets"] = [header[first]["data_offsets"][1], header[first]["data_offsets"][1] + size]
    text = json.dumps(header)
    twice = text[:-1] + f', "{first}": ' + json.dumps(header[first]) + "}"
    raw = twice.encode() + b" " * (-len(twice) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    message = _refusal(src)
    assert f"named twice in one header (JSON keeps the last silently):\n  {first} (model.safetensors)" in message
