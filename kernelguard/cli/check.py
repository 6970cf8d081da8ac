"""``kernelguard check``: which provider serves each kernel, and why every other candidate was rejected."""

from __future__ import annotations

import argparse
import sys

from kernelguard.errors import EXIT_FAIL, EXIT_OK, end_startup_interrupts, exit_codes_help

from .common import command_parser, non_empty_path, print_out, run_command

__all__ = ["HELP", "add_check_arguments", "check_options", "main", "parser"]

HELP = "which provider serves each kernel, and why the others were rejected"


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    return _parser()


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "check",
        description="Resolve which provider serves each kernel a model family needs, and why every other "
        "candidate was rejected. Works without a GPU (pass --arch). Defaults come from [tool.kernelguard] in "
        "the nearest pyproject.toml.",
        epilog=exit_codes_help("check"),
    )
    add_check_arguments(parser)
    parser.add_argument("--run", action="store_true", help="on a GPU: run each fast kernel fwd+bwd vs the torch reference")
    parser.add_argument("--json", action="store_true", help="machine-readable output (its schema: docs/json-schema.md)")
    parser.add_argument("--lock", metavar="FILE", type=non_empty_path,
                        help="refuse when this node's stack differs from FILE (written by kernelguard lock); the "
                        "model, mode, target and allow items are the lock's")
    parser.add_argument("--write-lock", metavar="FILE", type=non_empty_path,
                        help="when the check passes, write its lock to FILE")
    return parser


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``check`` and ``lock`` share: what to check, for which target."""
    parser.add_argument("--model", help="family (qwen3_5), config.json, or local model folder [default: qwen3_5]")
    parser.add_argument("--mode", choices=("training", "inference"), help="[default: training]")
    # A list flag reads the same in every command (kernelguard train's too): `--allow A B` and `--allow A --allow B`.
    parser.add_argument("--arch", action="extend", nargs="+", metavar="CC",
                        help="target compute capabilities (9.0 = H100/H200; several, or repeat the flag); default: "
                        "visible GPUs")
    parser.add_argument("--allow", action="extend", nargs="+", metavar="ID",
                        help="accept known issues, kernels' fallbacks, or 'attention' (several, or repeat the flag)")
    packed = parser.add_mutually_exclusive_group()
    packed.add_argument("--packed", dest="packed", action="store_true", default=None,
                        help="packed 1D sequences (default for training): needs a varlen attention")
    packed.add_argument("--no-packed", dest="packed", action="store_false")
    hub = parser.add_mutually_exclusive_group()
    hub.add_argument("--hub", dest="hub", action="store_true", default=None,
                     help="the job loads with use_kernels=True: also resolve Kernel Hub kernels [default: what "
                     "the installed transformers does: 5.25+ loads them unless USE_HUB_KERNELS=NO]")
    hub.add_argument("--no-hub", dest="hub", action="store_false",
                     help="the job loads with use_kernels=False (or USE_HUB_KERNELS=NO): pip packages only")


def check_options(args: argparse.Namespace) -> object:
    """The :class:`kernelguard.stack.compose.CheckOptions` of the flags, the rest from ``[tool.kernelguard]``."""
    from kernelguard.stack import CheckOptions, load_pyproject_defaults

    defaults = load_pyproject_defaults()
    return CheckOptions(
        model=args.model if args.model is not None else defaults.get("model", "qwen3_5"),
        mode=args.mode if args.mode is not None else defaults.get("mode", "training"),
        archs=tuple(args.arch or defaults.get("arch", ())),
        allow=tuple(args.allow or ()) + tuple(defaults.get("allow", ())),
        packed=args.packed if args.packed is not None else defaults.get("packed"),
        hub=args.hub if args.hub is not None else defaults.get("hub"),
        run=getattr(args, "run", False),
        hub_repos=bool(getattr(args, "write_lock", None)),
        arch_source="--arch" if args.arch else "arch in [tool.kernelguard] of pyproject.toml",
    )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.run:  # before the probe imports fla: an unpinned autotune search is paid once per machine
        from kernelguard.resolution import keep_search_results

        keep_search_results()
    return run_command(lambda: _check(args), command=("check", argv))


def _check(args: argparse.Namespace) -> int:
    from kernelguard.stack import render, run_check, to_json

    if args.lock:
        from kernelguard.stack import verify_lock

        # A flag repeating the lock's own value is accepted; one that contradicts it is refused (stack_lock).
        given = {"model": args.model, "mode": args.mode, "arch": args.arch, "packed": args.packed, "hub": args.hub}
        result = verify_lock(args.lock, allow=tuple(args.allow) if args.allow else None, given=given)
    else:
        result = run_check(check_options(args))  # type: ignore[arg-type]
    print_out(to_json(result) if args.json else render(result))
    if result.ok and args.write_lock:
        from kernelguard.stack import write_lock

        end_startup_interrupts()  # a file is written next: Ctrl-C unwinds through its clean-up
        print(f"kernelguard: lock written to {write_lock(result, args.write_lock)}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAIL
