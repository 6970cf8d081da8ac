"""The ``kernelguard`` command table and dispatcher: one module per subcommand, each with ``HELP`` and
``main(argv) -> int``; handlers only parse arguments and call the library.

A new subcommand is a module of this room with those two names, added to :data:`COMMANDS`. Exit codes come from
the one table in :mod:`kernelguard.errors`: 0 every required kernel is served well; 1 a requirement fails; 2 usage
or configuration error; 3 `kernelguard train` refused to start (a slow fallback would run).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kernelguard import __version__
from kernelguard.errors import exit_codes_help
from kernelguard.stack import help_formatter

from . import check, env, export, issues, lock, tokenizer, train
from .common import Parser

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "check": check, "lock": lock, "env": env, "issues": issues, "train": train, "export": export,
    "tokenizer": tokenizer,
}


def _parser() -> Parser:
    parser = Parser(
        prog="kernelguard",
        formatter_class=help_formatter(),
        description="Stop hybrid (gated-delta-net) model fine-tuning from silently running slow fallback kernels.",
        epilog=exit_codes_help("kernelguard"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, module in COMMANDS.items():  # listed for --help; each command parses its own arguments
        sub.add_parser(name, help=module.HELP, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    program = argv is None  # the console script (or `python -m kernelguard`), not a caller in-process
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return train.main(argv[1:], program=program)
    if argv and argv[0] in COMMANDS:
        return int(COMMANDS[argv[0]].main(argv[1:]))
    _parser().parse_args(argv)  # --help, --version, or a usage error naming the commands: each exits
    return 2  # pragma: no cover - parse_args exits for every argv that names no command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
