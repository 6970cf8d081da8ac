"""Model folders whose safetensors lie, one mistake each (bench/cpu/bad_inputs_sweep.py's round-4 cases): a tiny
qwen3_5 saved by save_pretrained, then edited the way a broken download, a bad conversion or a hand edit does."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
import train_helpers as h
from safetensors.torch import load_file, save_file


def _model(**overrides: Any) -> Any:
    import tiny_models

    return tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2, **overrides)


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict[str, Any] | str, data: bytes) -> None:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def folders(root: Path) -> dict[str, str]:
    """name -> folder; each a copy of one good save with one mistake."""
    good, sharded, tied = root / "good", root / "sharded", root / "tied"
    _model().to(torch.bfloat16).save_pretrained(str(good))
    _model().to(torch.bfloat16).save_pretrained(str(sharded), max_shard_size="60KB")
    _model(tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(str(tied))
    out: dict[str, str] = {}

    def copy(name: str, source: Path = good) -> Path:
        shutil.copytree(source, root / name)
        out[name] = str(root / name)
        return root / name

    single = "model.safetensors"
    header, data = _header(good / single)
    norm = header["model.norm.weight"]
    _write(copy("dtype_bytes") / single, {**header, "model.norm.weight": {**norm, "dtype": "F32"}}, data)
    begin, end = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    fp32 = (torch.randn((end - begin) // 4) * 0.08).numpy().tobytes()
    _write(copy("f32_as_bf16") / single, header, data[:begin] + fp32 + data[end:])
    save_file({"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)},
              str(copy("two_files", sharded) / "stray.safetensors"))
    index_path = copy("index_lies", sharded) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    real = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = next(f for f in sorted(set(index["weight_map"].values())) if f != real)
    index_path.write_text(json.dumps(index))
    tensors = load_file(str(good / single))
    save_file({**tensors, "model.layers.0.extra.weight": torch.ones(4, dtype=torch.bfloat16)},
              str(copy("unexpected") / single), metadata={"format": "pt"})
    tied_tensors = load_file(str(tied / single))
    save_file({**tied_tensors, "lm_head.weight": tied_tensors["model.embed_tokens.weight"] + 1},
              str(copy("tied_head", tied) / single), metadata={"format": "pt"})
    no_vision = copy("no_vision")
    config = json.loads((no_vision / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "patch_size": 4, "temporal_patch_size": 1}
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    multimodal = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                  "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": vision,
                  "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    (no_vision / "config.json").write_text(json.dumps(multimodal))
    save_file({"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v
               for k, v in tensors.items()}, str(no_vision / single), metadata={"format": "pt"})
    shard = sorted(copy("truncated", sharded).glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    raw = json.dumps(header)
    _write(copy("key_twice") / single, raw[:-1] + f', "{first}": ' + json.dumps(header[first]) + "}", data)
    second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[1]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    start = header[first]["data_offsets"][0]
    _write(copy("overlap") / single, {**header, second: {**header[second], "data_offsets": [start, start + size]}},
           data)
    save_file({"base_model.model.lora_A.weight": torch.ones(4, 4)}, str(copy("stray_adapter") / "adapter_model.safetensors"))
    return out
