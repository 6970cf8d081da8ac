"""One flag, one grammar (issue 43): a flag that several subcommands share parses the same way in each, so a
command line written for one (`kernelguard train --allow A B`) works for the others (`check`, `lock`)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kernelguard.cli import COMMANDS


def _parsers() -> dict[str, argparse.ArgumentParser]:
    return {name: module.parser() for name, module in COMMANDS.items()}


def _grammar(action: argparse.Action) -> tuple[str, Any]:
    """How a flag reads its values: a switch (no value), one value, or a list (several per flag, repeatable)."""
    if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
        return ("list", action.nargs)
    if action.nargs == 0:
        return ("switch", 0)
    return ("value", action.nargs)


def _shared_flags() -> dict[str, dict[str, tuple[str, Any]]]:
    flags: dict[str, dict[str, tuple[str, Any]]] = {}
    for name, parser in _parsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                flags.setdefault(option, {})[name] = _grammar(action)
    return {flag: by_command for flag, by_command in flags.items() if len(by_command) > 1}


def test_every_command_has_a_parser_and_the_walk_finds_the_shared_flags() -> None:
    assert set(_parsers()) == {"check", "lock", "env", "issues", "train", "export", "tokenizer"}
    shared = _shared_flags()
    assert set(shared["--allow"]) == {"train", "check", "lock"}
    assert set(shared["--arch"]) == {"check", "lock", "env"}
    assert {"--model", "--lock", "--json", "--max-shard-size", "--overwrite", "--output"} <= set(shared)


def test_a_flag_shared_by_several_commands_reads_the_same_way_in_each() -> None:
    different = {flag: by_command for flag, by_command in _shared_flags().items()
                 if len(set(by_command.values())) > 1}
    assert different == {}
    assert set(_shared_flags()["--allow"].values()) == {("list", "+")}


@pytest.mark.parametrize("command", ["train", "check", "lock"])
def test_allow_takes_several_values_and_repeats_in_every_command(command: str) -> None:
    parser = COMMANDS[command].parser()
    both = ["--allow", "causal_conv1d_fn", "chunk_gated_delta_rule", "--allow", "attention"]
    args, rest = parser.parse_known_args(both)
    assert args.allow == ["causal_conv1d_fn", "chunk_gated_delta_rule", "attention"] and rest == []


@pytest.mark.parametrize("command", ["check", "lock", "env"])
def test_arch_takes_several_values_and_repeats(command: str) -> None:
    args = COMMANDS[command].parser().parse_args(["--arch", "8.0", "9.0", "--arch", "10.0"])
    assert args.arch == ["8.0", "9.0", "10.0"]


def test_check_accepts_trains_form_of_allow_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43: `check ... --allow causal_conv1d_fn chunk_gated_delta_rule` exited 2, "unrecognized arguments"."""
    from kernelguard.cli import main

    code = main(["check", "--arch", "9.0", "--allow", "causal_conv1d_fn", "chunk_gated_delta_rule"])
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and code in (0, 1)
