"""``kernelguard issues``: the known-bad stacks kernelguard checks, and the other ``--allow`` items."""

from __future__ import annotations

import argparse

from kernelguard.errors import EXIT_OK

from .common import command_parser, print_out, run_command

__all__ = ["HELP", "main", "parser"]

HELP = "list the known-bad stacks kernelguard checks"


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    return _parser()


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("issues", description=HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable: one object per known issue")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return run_command(lambda: _issues(args.json))


def _issues(as_json: bool = False) -> int:
    from kernelguard.resolution import KNOWN_ISSUES, POLICY_ITEMS
    from kernelguard.stack import fix_lines, terminal_width, wrap_text

    if as_json:
        import json

        from kernelguard.resolution import split_fix

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
        print_out(json.dumps(data, indent=2))
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
    print_out("\n".join(lines))
    return EXIT_OK
