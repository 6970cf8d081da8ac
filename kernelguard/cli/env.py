"""``kernelguard env``: a paste-ready bug-report block."""

from __future__ import annotations

import argparse

from kernelguard.errors import EXIT_OK

from .common import command_parser, print_out, run_command

__all__ = ["HELP", "main", "parser"]

HELP = "a paste-ready bug-report block: the stack, fla's backend, each kernel's provider"


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    return _parser()


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("env", description=HELP)
    parser.add_argument("--model", help="family, config.json or model folder whose providers to list [default: qwen3_5]")
    parser.add_argument("--arch", action="extend", nargs="+", metavar="CC",
                        help="target compute capabilities (several, or repeat the flag; default: visible GPUs)")
    parser.add_argument("--json", action="store_true", help="machine-readable (the same facts)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return run_command(lambda: _env(args))


def _env(args: argparse.Namespace) -> int:
    from .env_report import collect, render_env

    report = collect(model=args.model or "qwen3_5", archs=tuple(args.arch or ()))
    if args.json:
        import json

        print_out(json.dumps(report, indent=2))
    else:
        print_out(render_env(report))
    return EXIT_OK
