"""``kernelguard export CHECKPOINT_DIR ...``: the command line of :func:`kernelguard.train.output.export.export_checkpoint`,
with kernelguard's exit codes (2 a bad input or a refused export, 1 another kernelguard error, 130 Ctrl-C)."""

from __future__ import annotations

import sys
from pathlib import Path

from kernelguard.errors import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    ConfigError,
    KernelGuardError,
)
from kernelguard.interrupts import end_startup_interrupts

from ..train.settings.config_rules import DEFAULT_MAX_SHARD_SIZE
from ..train.output.export import export_checkpoint

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``kernelguard export CHECKPOINT_DIR [--output DIR] [--max-shard-size SIZE] [--overwrite]
    [--accept-changed-tokenizer]``; EXIT_USAGE on a bad input or a refused export, 130 on Ctrl-C."""
    import argparse

    from kernelguard.report import help_formatter, wrap_message

    parser = argparse.ArgumentParser(
        prog="kernelguard export",
        formatter_class=help_formatter(),
        description="Write a Hugging Face model folder (sharded safetensors, index, config, tokenizer, chat "
        "template) from a kernelguard train checkpoint, e.g. of a run stopped before its end.",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR", help="OUTPUT/checkpoints/step_N")
    parser.add_argument("--output", type=Path, metavar="DIR", help="where to write it [default: OUTPUT/final]")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                        help="largest safetensors file: 5GB (default), 500MB, or bytes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    parser.add_argument("--accept-changed-tokenizer", action="store_true",
                        help="export with the run's tokenizer / chat template files as they are now, though they "
                        "changed since it trained (checkpoints without their own copy only)")
    args = parser.parse_args(argv)
    end_startup_interrupts()  # the export takes locks and writes next: Ctrl-C unwinds through their clean-up
    try:
        final = export_checkpoint(args.checkpoint, output=args.output, max_shard_size=args.max_shard_size,
                                  overwrite=args.overwrite, accept_changed_tokenizer=args.accept_changed_tokenizer)
    except ConfigError as e:
        print(wrap_message(f"kernelguard export: error: {e}"), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KernelGuardError as e:
        print(wrap_message(f"kernelguard export: error: {e}"), file=sys.stderr, flush=True)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("kernelguard export: interrupted; nothing was written.", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(f"kernelguard export: wrote {final}", file=sys.stderr, flush=True)
    return EXIT_OK
