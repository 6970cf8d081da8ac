"""The export chats: `final/` and `kernelguard export` hold the chat template the run trained with (a shipped
training variant's inference original), generation_config.json and the special token ids, so the folder loads
with the Auto classes, applies its chat template and generates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.train import chat_templates
from kernelguard.train.output.inference_files import (
    fill_special_token_ids,
    generation_config,
    inference_template,
)

IM_END, PAD = h.SPECIALS.index("<|im_end|>"), h.SPECIALS.index("<|endoftext|>")


def _tokenizer(tmp_path: Path, *, chat_template: str | None, template: str | None = None) -> Any:
    from kernelguard.train.inputs.tokenizer import load_tokenizer

    folder = h.write_tokenizer(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(folder), chat_template=chat_template)


@pytest.mark.parametrize(
    ("tokenizer_template", "override", "expected"),
    [
        (None, "qwen3_5_nothink_training", "qwen3_5_nothink"),  # shipped variant -> its original
        (None, "qwen3_training", "qwen3"),  # two originals share it: the current one
        ("qwen3_v0", None, "qwen3_v0"),  # the tokenizer's own original is that variant's twin: kept
        (None, "qwen3_6", "qwen3_6"),  # a shipped original: as trained
    ],
)
def test_the_inference_template_is_the_one_trained_with_in_its_chat_form(
    tmp_path: Path, tokenizer_template: str | None, override: str | None, expected: str
) -> None:
    own = chat_templates.read(tokenizer_template) if tokenizer_template else None
    tok = _tokenizer(tmp_path, chat_template=override, template=own)
    assert inference_template(tok) == chat_templates.read(expected)


def test_a_template_file_is_shipped_as_is_and_no_template_stays_none(tmp_path: Path) -> None:
    file = tmp_path / "mine.jinja"
    file.write_text(h.CHAT_TEMPLATE)
    assert inference_template(_tokenizer(tmp_path / "a", chat_template=str(file))) == h.CHAT_TEMPLATE
    assert inference_template(_tokenizer(tmp_path / "b", chat_template=None)) is None


def test_special_ids_fill_only_what_the_config_leaves_unset(tmp_path: Path) -> None:
    import tiny_models

    tok = _tokenizer(tmp_path, chat_template="qwen3_training")
    config = tiny_models.tiny_config("qwen3_5", vocab_size=h.VOCAB_SIZE, eos_token_id=None, pad_token_id=None)
    config.bos_token_id = 7  # set by the model's authors: kept
    fill_special_token_ids(config, tok)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (IM_END, PAD, 7)
    generation = generation_config(config, tok)
    assert (generation.eos_token_id, generation.pad_token_id, generation.bos_token_id) == (IM_END, PAD, None)


def _chat(folder: Path) -> tuple[str, list[int]]:
    """Load ``folder`` the way a user would, apply its chat template, generate greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "abcab"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    return tok.decode(prompt["input_ids"][0]), out[0].tolist()


@pytest.mark.slow
def test_final_and_kernelguard_export_load_apply_the_template_and_generate(tmp_path: Path) -> None:
    tok = h.write_tokenizer(tmp_path / "tok")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["chat_template"]  # the template comes from --chat-template only
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    model = h.write_model_config(tmp_path / "model", eos_token_id=None, pad_token_id=None)
    data = h.write_jsonl(tmp_path / "data.jsonl", h.copy_task_rows(40))
    out = tmp_path / "out"
    args = ["--model", str(model), "--tokenizer", str(tok), "--data", str(data), "--output-dir", str(out),
            "--chat-template", "qwen3_5_nothink_training", "--max-length", "256", "--param-dtype", "fp32",
            "--max-steps", "1", "--no-progress", "--no-plot", "--packing", "none",
            "--allow", "attention", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    r = h.run_train(args, fakes=False, nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    final = out / "final"
    assert (final / "chat_template.jinja").read_text() == chat_templates.read("qwen3_5_nothink")
    saved = json.loads((final / "config.json").read_text())
    text = saved.get("text_config", saved)
    assert (text["eos_token_id"], text["pad_token_id"]) == (IM_END, PAD)
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == IM_END
    prompt, _ = _chat(final)
    assert prompt == "<|im_start|>user\nabcab<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

    again = tmp_path / "again"
    checkpoint = next((out / "checkpoints").iterdir())
    r = subprocess.run([sys.executable, "-m", "kernelguard", "export", str(checkpoint), "--output", str(again)],
                       capture_output=True, text=True, check=False, cwd=str(h.REPO), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("chat_template.jinja", "generation_config.json", "config.json"):
        assert (again / name).read_text() == (final / name).read_text(), name
    assert _chat(again) == _chat(final)
