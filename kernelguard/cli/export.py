"""``kernelguard export CHECKPOINT_DIR ...``: the command line of
:func:`kernelguard.train.output.export.export_checkpoint` (2 a bad input or a refused export, 1 another
kernelguard error, 130 Ctrl-C: :func:`kernelguard.errors.exit_code_for`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernelguard.errors import (
    EXIT_OK,
    INTERRUPTED_LINES,
    KernelGuardError,
    end_startup_interrupts,
    exit_code_for,
    startup_interrupts,
)

from .common import command_parser, non_empty_path

__all__ = ["HELP", "main", "parser"]

HELP = "a Hugging Face folder from a kernelguard train checkpoint (kernelguard export --help)"
_INTERRUPTED = INTERRUPTED_LINES["export"]["SIGINT"]


def _path(text: str) -> Path:
    return Path(non_empty_path(text))


_path.__name__ = "path"  # argparse names the type in its "invalid ... value" message


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    from kernelguard.train import DEFAULT_MAX_SHARD_SIZE

    return _parser(DEFAULT_MAX_SHARD_SIZE)


def _parser(default_shard_size: str) -> argparse.ArgumentParser:
    parser = command_parser(
        "export",
        description="Write a Hugging Face model folder (sharded safetensors, index, config, tokenizer, chat "
        "template) from a kernelguard train checkpoint, e.g. of a run stopped before its end.",
    )
    parser.add_argument("checkpoint", type=_path, metavar="CHECKPOINT_DIR", help="OUTPUT/checkpoints/step_N")
    parser.add_argument("--output", type=_path, metavar="DIR", help="where to write it [default: OUTPUT/final]")
    parser.add_argument("--max-shard-size", default=default_shard_size, metavar="SIZE",
                        help="largest safetensors file: 5GB (default), 500MB, or bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    parser.add_argument("--accept-changed-tokenizer", action="store_true",
                        help="export with the run's tokenizer / chat template files as they are now, though they "
                        "changed since it trained (checkpoints without their own copy only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``kernelguard export CHECKPOINT_DIR [--output DIR] [--max-shard-size SIZE] [--overwrite]
    [--accept-changed-tokenizer]``."""
    from kernelguard.stack import wrap_message

    argv = list(sys.argv[2:] if argv is None else argv)
    with startup_interrupts(_INTERRUPTED):
        from kernelguard.train import DEFAULT_MAX_SHARD_SIZE, not_a_checkpoint

        args = _parser(DEFAULT_MAX_SHARD_SIZE).parse_args(argv)
        # A step that is not there is refused before torch loads (seconds), with a step that is.
        if (refusal := not_a_checkpoint(args.checkpoint.expanduser())) is not None:
            print(wrap_message(f"kernelguard export: error: {_with_command(refusal, argv)}"), file=sys.stderr)
            return exit_code_for(refusal)
        from kernelguard.train import FINAL, check_destination

        checkpoint = args.checkpoint.expanduser()
        try:  # an output that is taken is refused before torch loads too
            check_destination(args.output.expanduser() if args.output else checkpoint.parent.parent / FINAL,
                              overwrite=args.overwrite, checkpoint=checkpoint)
        except KernelGuardError as e:
            print(wrap_message(f"kernelguard export: error: {e}"), file=sys.stderr)
            return exit_code_for(e)
        _say(f"loading torch and transformers to export {args.checkpoint}")
        from kernelguard.train import export_checkpoint  # imports torch

        end_startup_interrupts()  # the export takes locks and writes next: Ctrl-C unwinds through their clean-up
    try:
        final = export_checkpoint(args.checkpoint, output=args.output, max_shard_size=args.max_shard_size,
                                  overwrite=args.overwrite, accept_changed_tokenizer=args.accept_changed_tokenizer,
                                  say=_say)
    except KernelGuardError as e:
        print(wrap_message(f"kernelguard export: error: {e}"), file=sys.stderr, flush=True)
        return exit_code_for(e)
    except KeyboardInterrupt as e:
        print(_INTERRUPTED, file=sys.stderr, flush=True)
        return exit_code_for(e)
    print(f"kernelguard export: wrote {final}", file=sys.stderr, flush=True)
    return EXIT_OK


def _say(line: str) -> None:
    print(f"kernelguard export: {line}", file=sys.stderr, flush=True)


def _with_command(error: KernelGuardError, argv: list[str]) -> KernelGuardError:
    """The refusal with, as its fix, this command line with the checkpoint it names in place of the one given."""
    from kernelguard.resolution import with_corrected_command
    from kernelguard.train import FINAL

    old, new = error.details.get("replace", (None, None))
    if old is None:
        return error
    details = dict(error.details)
    given_output = any(a == "--output" or a.startswith("--output=") for a in argv) or "--overwrite" in argv
    default = Path(new).parent.parent / FINAL
    if not given_output and default.exists():  # the default output is taken: a fix that pastes needs its own
        details["add"] = ("--output", str(default.with_name(f"final-{Path(new).name}")))
    return with_corrected_command(error, "export", argv, details=details)
