"""``kernelguard`` command line. Handlers only parse arguments and call the library.

Exit codes (the table in kernelguard.errors): 0 every required kernel is served well; 1 a requirement fails;
2 usage or configuration error; 3 `kernelguard train` refused to start (a slow fallback would run).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, ConfigError, KernelGuardError
from ..interrupts import end_startup_interrupts, startup_interrupts
from ..report import help_formatter, wrap_message

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's default exit code is already 2; keep it, with our one-line hint.
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kernelguard",
        formatter_class=help_formatter(),
        description="Stop hybrid (gated-delta-net) model fine-tuning from silently running slow fallback kernels.",
        epilog="exit codes: 0 every required kernel is served well; 1 a requirement fails; 2 usage or configuration "
        "error; 3 kernelguard train refused to start (the guard found a slow fallback)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    wrapped = {"formatter_class": help_formatter()}

    check = sub.add_parser(
        "check",
        **wrapped,
        help="which provider serves each kernel, and why the others were rejected",
        description="Resolve which provider serves each kernel a model family needs, and why every other "
        "candidate was rejected. Works without a GPU (pass --arch). Defaults come from [tool.kernelguard] in "
        "the nearest pyproject.toml.",
        epilog="exit codes: 0 every required kernel is served; 1 a requirement fails; 2 usage or configuration error",
    )
    _add_check_arguments(check)
    check.add_argument("--run", action="store_true", help="on a GPU: run each fast kernel fwd+bwd vs the torch reference")
    check.add_argument("--json", action="store_true", help="machine-readable output (its schema: docs/json-schema.md)")
    check.add_argument("--lock", metavar="FILE",
                       help="refuse when this node's stack differs from FILE (written by kernelguard lock); the "
                       "model, mode, target and allow items are the lock's")
    check.add_argument("--write-lock", metavar="FILE", help="when the check passes, write its lock to FILE")

    lock = sub.add_parser(
        "lock",
        **wrapped,
        help="check, then write kernelguard.lock: the verified stack, enforced at job start with --lock",
        description="Run the check and, when it passes, write the lock of the stack it verified (schema in "
        "docs/lock.md). Jobs enforce it with `kernelguard check --lock`, `kernelguard train --lock`, "
        "kernelguard.require(lock=...) or KERNELGUARD_LOCK.",
        epilog="exit codes: 0 written; 1 the check fails (nothing written); 2 usage or configuration error",
    )
    _add_check_arguments(lock)
    lock.add_argument("--output", "-o", default="kernelguard.lock", metavar="FILE", help="[default: kernelguard.lock]")

    env = sub.add_parser("env", **wrapped, help="a paste-ready bug-report block: the stack, fla's backend, each kernel's provider")
    env.add_argument("--model", help="family, config.json or model folder whose providers to list [default: qwen3_5]")
    env.add_argument("--arch", action="append", metavar="CC", help="target compute capability (default: visible GPUs)")
    env.add_argument("--json", action="store_true", help="machine-readable (the same facts)")

    issues = sub.add_parser("issues", **wrapped, help="list the known-bad stacks kernelguard checks")
    issues.add_argument("--json", action="store_true", help="machine-readable: one object per known issue")

    # Listed for --help only: main() hands everything after "train" to kernelguard.train untouched.
    sub.add_parser("train", help="packed FSDP2 fine-tuning that starts only once the guard passes "
                   "(kernelguard train --help)", add_help=False)
    sub.add_parser("export", help="a Hugging Face folder from a kernelguard train checkpoint "
                   "(kernelguard export --help)", add_help=False)
    return parser


def _add_check_arguments(check: argparse.ArgumentParser) -> None:
    check.add_argument("--model", help="family (qwen3_5), config.json, or local model folder [default: qwen3_5]")
    check.add_argument("--mode", choices=("training", "inference"), help="[default: training]")
    check.add_argument("--arch", action="append", metavar="CC",
                       help="target compute capability, repeatable (9.0 = H100/H200); default: visible GPUs")
    check.add_argument("--allow", action="append", metavar="ID",
                       help="accept one known issue, a kernel's fallback, or 'attention' (repeatable)")
    packed = check.add_mutually_exclusive_group()
    packed.add_argument("--packed", dest="packed", action="store_true", default=None,
                        help="packed 1D sequences (default for training): needs a varlen attention")
    packed.add_argument("--no-packed", dest="packed", action="store_false")
    check.add_argument("--hub", action="store_true", default=None,
                       help="the job loads with use_kernels=True: also resolve Kernel Hub kernels")


def _check_options(args: argparse.Namespace) -> object:
    from ..check import CheckOptions, load_pyproject_defaults

    defaults = load_pyproject_defaults()
    return CheckOptions(
        model=args.model if args.model is not None else defaults.get("model", "qwen3_5"),
        mode=args.mode if args.mode is not None else defaults.get("mode", "training"),
        archs=tuple(args.arch or defaults.get("arch", ())),
        allow=tuple(args.allow or ()) + tuple(defaults.get("allow", ())),
        packed=args.packed if args.packed is not None else defaults.get("packed"),
        hub=bool(args.hub if args.hub is not None else defaults.get("hub", False)),
        run=getattr(args, "run", False),
        arch_source="--arch" if args.arch else "arch in [tool.kernelguard] of pyproject.toml",
    )


def _check(args: argparse.Namespace) -> int:
    from ..check import run_check
    from ..report import render, to_json

    if args.lock:
        from ..stack_lock import verify_lock

        given = [flag for flag, value in (("--model", args.model), ("--mode", args.mode), ("--arch", args.arch),
                                          ("--packed/--no-packed", args.packed), ("--hub", args.hub)) if value is not None]
        if given:
            raise ConfigError(f"--lock checks the model, mode, target and Hub use the lock was written for; "
                              f"{', '.join(given)} cannot change them.",
                              fix=f"drop {', '.join(given)}, or write a new lock with them: kernelguard lock {' '.join(given)} ...")
        result = verify_lock(args.lock, allow=tuple(args.allow) if args.allow else None)
    else:
        result = run_check(_check_options(args))  # type: ignore[arg-type]
    _print(to_json(result) if args.json else render(result))
    if result.ok and args.write_lock:
        from ..stack_lock import write_lock

        end_startup_interrupts()  # a file is written next: Ctrl-C unwinds through its clean-up
        print(f"kernelguard: lock written to {write_lock(result, args.write_lock)}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAIL


def _lock(args: argparse.Namespace) -> int:
    from ..check import run_check
    from ..report import render
    from ..stack_lock import write_lock

    result = run_check(_check_options(args))  # type: ignore[arg-type]
    if not result.ok:  # a lock of a stack that fails its own check would only pin the failure
        _print(render(result))
        print(f"kernelguard lock: the check fails, so {args.output} was not written.", file=sys.stderr)
        return EXIT_FAIL
    end_startup_interrupts()  # a file is written next: Ctrl-C unwinds through its clean-up
    path = write_lock(result, args.output)
    _print(f"kernelguard lock: wrote {path} ({len(result.resolution.verdicts)} kernels, target "
           f"{', '.join(f'sm {a}' for a in result.resolution.target.archs) or 'unknown'}); "
           f"enforce it at job start with `kernelguard check --lock {path}` or KERNELGUARD_LOCK={path}")
    return EXIT_OK


def _env(args: argparse.Namespace) -> int:
    from ..env_report import collect, render_env

    report = collect(model=args.model or "qwen3_5", archs=tuple(args.arch or ()))
    if args.json:
        import json

        _print(json.dumps(report, indent=2))
    else:
        _print(render_env(report))
    return EXIT_OK


def _print(text: str) -> None:
    """Print, tolerating a closed pipe (`kernelguard check | head`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _issues(as_json: bool = False) -> int:
    from ..known_issues import KNOWN_ISSUES
    from ..policy import POLICY_ITEMS
    from ..report import fix_lines, terminal_width, wrap_text

    if as_json:
        import json

        from ..decisions import split_fix

        fields = ("id", "title", "effect", "evidence", "source", "kernels", "provider", "archs", "modes", "triton",
                  "provider_version", "kernels_version", "fla_backends", "detector")
        # Version 2: "fix" is one shell command or null, its prose in "fix_note" (as in check --json).
        data = {
            "schema_version": 2,
            "known_issues": [
                {**{name: getattr(issue, name) for name in fields},
                 **dict(zip(("fix", "fix_note"), split_fix(issue.fix)))}
                for issue in KNOWN_ISSUES
            ],
            "allow_items": dict(POLICY_ITEMS),
        }
        _print(json.dumps(data, indent=2))
        return EXIT_OK
    width = terminal_width()
    lines: list[str] = []
    for issue in KNOWN_ISSUES:
        lines.append(issue.id)
        lines.extend(wrap_text(text, 2, width, hanging=2) for text in (
            issue.title, f"effect: {issue.effect}", *([f"measured: {issue.evidence}"] if issue.evidence else [])))
        lines.extend(fix_lines(issue.fix, width=width, indent=2))
        lines.extend([wrap_text(f"source: {issue.source}", 2, width, hanging=2), ""])
    lines.append("other --allow values:")
    lines.extend(wrap_text(f"{name}: {meaning}", 2, width, hanging=2) for name, meaning in POLICY_ITEMS.items())
    lines.append(wrap_text("<kernel name> (e.g. chunk_gated_delta_rule): accept that kernel's torch reference path",
                       2, width, hanging=2))
    _print("\n".join(lines))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    program = argv is None  # the console script (or `python -m kernelguard`), not a caller in-process
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        try:  # Ctrl-C while the trainer's modules import: its own one line, as from inside it
            from ..train.__main__ import exit_program
            from ..train.__main__ import main as train_main
        except KeyboardInterrupt:  # leave at once: the teardown after a half-done import can fail again
            print("kernelguard train: interrupted before training started; nothing was written.", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_INTERRUPTED)
        code = train_main(argv[1:])
        return exit_program(code) if program else code
    if argv[:1] == ["export"]:
        with startup_interrupts("kernelguard export: interrupted; nothing was written."):
            from .export import main as export_main  # imports torch

            return export_main(argv[1:])  # which ends the start-up before it writes anything
    args = _parser().parse_args(argv)
    with startup_interrupts(_INTERRUPTED):
        try:
            if args.command == "check":
                return _check(args)
            if args.command == "lock":
                return _lock(args)
            if args.command == "env":
                return _env(args)
            return _issues(args.json)
        except ConfigError as exc:
            print(wrap_message(f"kernelguard: error: {exc}"), file=sys.stderr)
            return EXIT_USAGE
        except KernelGuardError as exc:
            print(wrap_message(f"kernelguard: {exc}"), file=sys.stderr)
            return EXIT_FAIL
        except KeyboardInterrupt:  # Ctrl-C once a file is being written: one line and the shell's code
            print(_INTERRUPTED, file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED


_INTERRUPTED = "kernelguard: interrupted."


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
