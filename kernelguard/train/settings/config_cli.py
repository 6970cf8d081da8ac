"""`kernelguard train`'s command line, derived from the schema in kernelguard.train.settings.config: one flag per field
(``--learning-rate`` for ``learning_rate``), its help text, default, type and choices taken from the field and
from kernelguard.train.settings.config_rules; plus the torchrun launcher's options (LaunchOptions) and ``--config``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError, exit_codes_help
from kernelguard.stack import fit_lines, fit_usage, terminal_width

from ..common.run_folder import CONFIG_FILE
from .config import SECTIONS, TrainConfig, setting
from .config_file import file_defaults, load_config_file
from .config_rules import (
    AUTO_SWITCHES,
    blocks_per_forward_value,
    checkpointing_value,
    choices_of,
    field_kinds,
)

__all__ = [
    "DEPRECATED_FLAGS",
    "LAUNCH_FIELDS",
    "NPROC_NAMES",
    "PROG",
    "Command",
    "LaunchOptions",
    "build_parser",
    "parse_args",
    "parse_command",
]

PROG = "kernelguard train"
# Old flag -> its HF-style name. The old names still parse (hidden from --help, with a warning) for one release.
DEPRECATED_FLAGS = {
    "--output": "--output-dir",
    "--lr": "--learning-rate",
    "--epochs": "--num-train-epochs",
    "--grad-accum": "--gradient-accumulation-steps",
    "--grad-clip": "--max-grad-norm",
    "--save-every": "--save-steps",
}
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")  # torchrun's named --nproc-per-node values
# --help groups, in order: title -> the sections whose flags it lists.
_GROUPS = (
    ("model and data", ("model", "data", "evaluation", "packing")),
    ("optimisation", ("training", "optimizer")),
    ("model runtime", ("runtime",)),
    ("checkpoints, output and tracking", ("checkpoint", "metrics")),
)
_LAUNCH_GROUP = "launcher (runs torch.distributed.run; leave out under torchrun)"


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """torchrun's options, for `kernelguard train --nproc-per-node N ...` (kernelguard.train.launch)."""

    nproc_per_node: str = setting(help="processes per node (an int, or gpu/cpu/auto)", metavar="N")
    nnodes: str = setting("1", "nodes, or MIN:MAX (default: 1)", metavar="N")
    node_rank: int = setting(0, "this node's rank (default: 0)", metavar="R")
    rdzv_backend: str | None = setting(None, "rendezvous backend, e.g. c10d", metavar="NAME")
    rdzv_endpoint: str | None = setting(None, "rendezvous endpoint", metavar="HOST:PORT")
    rdzv_id: str | None = setting(None, "rendezvous job id", metavar="ID")
    master_addr: str | None = setting(None, "static rendezvous host", metavar="HOST")
    master_port: int | None = setting(None, "static rendezvous port", metavar="PORT")

    def __post_init__(self) -> None:
        n = self.nproc_per_node
        if not (n.isdigit() and int(n) > 0) and n not in NPROC_NAMES:
            raise ConfigError(
                f"--nproc-per-node is {n!r}; expected a positive integer or one of {', '.join(NPROC_NAMES)}.",
                fix="--nproc-per-node 8 (one process per GPU)",
            )
        nodes = self.nnodes.split(":")
        if not (
            len(nodes) <= 2
            and all(x.isdigit() and int(x) > 0 for x in nodes)
            and int(nodes[0]) <= int(nodes[-1])
        ):
            raise ConfigError(
                f"--nnodes is {self.nnodes!r}; expected a positive integer N or MIN:MAX with MIN <= MAX.",
                fix="--nnodes 2 (or --nnodes 1:4 for an elastic job)",
            )
        if self.node_rank < 0 or (len(nodes) == 1 and self.node_rank >= int(nodes[0])):
            raise ConfigError(
                f"--node-rank is {self.node_rank}; expected 0 to {int(nodes[-1]) - 1} for --nnodes {self.nnodes}.",
                fix="--node-rank 0 on the first node, 1 on the second, ...",
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(
                f"--master-port is {self.master_port}; expected 1 to 65535.", fix="--master-port 29500"
            )


LAUNCH_FIELDS = tuple(f.name for f in fields(LaunchOptions))


@dataclass(frozen=True, slots=True)
class Command:
    """One parsed `kernelguard train` command line: the run, how to launch it, and what to warn about."""

    config: TrainConfig
    launch: LaunchOptions | None = None
    warnings: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------ argparse pieces ---
class _ArgumentParser(argparse.ArgumentParser):
    deprecated_used: list[str]

    def error(self, message: str) -> None:  # type: ignore[override]
        # With one nearest name, the caller (train.__main__) puts the whole command line, corrected, as the fix.
        from kernelguard.resolution import usage_suggestion

        said, replace, flag = usage_suggestion(message, self._option_string_actions)
        details = {"replace": replace, "flag": flag} if replace else {}
        raise ConfigError(said, fix=f"{self.prog} --help", details=details)


class _CheckpointingSwitch(argparse.BooleanOptionalAction):
    """``--activation-checkpointing [auto|on|off]`` (alone: on) and its ``--no-`` twins (off). A
    BooleanOptionalAction, so a --config file sets it like any switch: true, false, or null (auto)."""

    VALUES = "auto|on|off"

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"  # after BooleanOptionalAction's own nargs=0, so the positive names take a value
        self.metavar = self.VALUES

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value (got {values!r}); it means off")
            setattr(namespace, self.dest, False)
            return
        flag = "--" + self.dest.replace("_", "-")
        value = True if values is None else checkpointing_value(values, source=option_string or flag, flag=flag)
        setattr(namespace, self.dest, value)

    def from_file(self, value: Any, *, where: str) -> bool | None:
        """A --config file's value: true, false, null (auto) or the strings auto/on/off."""
        flag = "--" + self.dest.replace("_", "-")
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return checkpointing_value(value, source=where, flag=flag)
        raise ConfigError(
            f"{where} is {value!r} ({type(value).__name__}); expected auto, on, off, true or false.",
            fix=f"{self.dest}: auto",
        )


class _BlocksPerForward(argparse.Action):
    """``--blocks-per-forward auto|N``; a --config file gives null, auto or a number."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, blocks_per_forward_value(values, source=option_string or "--blocks-per-forward"))

    def from_file(self, value: Any, *, where: str) -> int | None:
        return blocks_per_forward_value(value, source=where)


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help line states its default (booleans only when the flag has a --no- twin)."""

    def __init__(self, prog: str, width: int | None = None) -> None:
        super().__init__(prog, max_help_position=34, width=terminal_width(width))

    def _format_usage(self, *args: Any) -> str:
        return fit_usage(super()._format_usage(*args), self._width)

    def format_help(self) -> str:
        return fit_lines(super().format_help(), self._width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        # Never split a flag name (--num-train-epochs) at one of its hyphens across two lines.
        text = " ".join(text.split())
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _CheckpointingSwitch):  # the --no- names take no value
            names = sorted(action.option_strings, key=lambda o: o.startswith("--no-"))  # positives first
            return f"{names[0]} [{_CheckpointingSwitch.VALUES}], " + ", ".join(names[1:])
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        plain_switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        default = action.default
        if "%(default)" in text or plain_switch or default in (None, argparse.SUPPRESS) or default == []:
            return text
        return f"{text} (default: %(default)s)"


class _DeprecatedStore(argparse._StoreAction):
    """A renamed flag's old name: stores like the new one and records a warning for the caller to print."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        parser.deprecated_used.append(
            f"{option_string} is deprecated and will be removed in the next release; use {self.replacement}"
        )


# ---------------------------------------------------------------------------------- schema -> argparse ---
def _path_argument(text: str) -> Path | str:
    """A path flag's value; an empty one stays "" (Path("") is the current folder) for its not-empty rule."""
    return Path(text) if text.strip() else text


def _flag_kwargs(f: Any, base: Any, *, launcher: bool) -> dict[str, Any]:
    """argparse keywords for one field: action, type, nargs, default, choices, metavar, help."""
    meta = f.metadata
    default = None if launcher or f.default is MISSING else f.default
    kw: dict[str, Any] = {"dest": f.name, "help": meta["help"].replace("%", "%%"), "default": default}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if f.name in AUTO_SWITCHES:
        kw["action"] = _CheckpointingSwitch
    elif f.name == "blocks_per_forward":
        kw["action"] = _BlocksPerForward
    elif base is bool:
        negatable = meta.get("negatable") or default is True
        kw["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
    elif base == tuple[str, ...]:
        kw.update(action="append" if meta.get("append") else "extend", default=[])
        if not meta.get("append"):
            kw["nargs"] = "+"
    elif base == tuple[float, float]:
        kw.update(nargs=2, type=float)
    elif base in (int, float):
        kw["type"] = base
    elif base is Path:
        kw["type"] = _path_argument
    if choices_of(f.name):
        kw["choices"] = choices_of(f.name)
    return kw


def _add_field(group: Any, f: Any, base: Any, *, launcher: bool = False) -> None:
    flag = "--" + f.name.replace("_", "-")
    kw = _flag_kwargs(f, base, launcher=launcher)
    action = group.add_argument(flag, *f.metadata.get("aliases", ()), **kw)
    for old, new in DEPRECATED_FLAGS.items():  # a hidden twin under the flag's old name
        if new == flag:
            twin = {k: v for k, v in kw.items() if k in ("type", "metavar", "choices")}
            group.add_argument(
                old,
                dest=action.dest,
                action=_DeprecatedStore,
                replacement=new,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                **twin,
            )
    if f.metadata.get("negated"):
        name, text = f.metadata["negated"]
        group.add_argument(name, dest=f.name, action="store_false", help=text)
    if f.name == "adam_betas":  # Hugging Face's one-beta flags refine --adam-betas
        group.add_argument(
            "--adam-beta1", type=float, metavar="B1", help="AdamW beta1 alone (Hugging Face's name)"
        )
        group.add_argument(
            "--adam-beta2", type=float, metavar="B2", help="AdamW beta2 alone (Hugging Face's name)"
        )


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The `kernelguard train` parser: every TrainConfig field and LaunchOptions field as a flag."""
    p = _ArgumentParser(
        prog=prog,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a prefix of one flag must never silently mean another
        description="Packed FSDP2 supervised fine-tuning that starts only once kernelguard's guard passes. "
        "Flags follow Hugging Face's names; --flag_name spellings work too. Every flag can also be set in a "
        "--config file (key = the flag name with underscores); flags on the command line win.",
        epilog=exit_codes_help("train", capital=True) + ". With --nproc-per-node, the same codes come back from "
        "the ranks. Plain `torchrun` exits 1 whenever a rank fails, whatever the rank's code. Renamed flags (old names work for one release): "
        + ", ".join(f"{old} -> {new}" for old, new in DEPRECATED_FLAGS.items())
        + ".",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML (.yaml/.yml), TOML (.toml) or JSON (.json) file of flag values, e.g. OUTPUT/"
        + CONFIG_FILE,
    )
    for title, sections in _GROUPS:
        group = p.add_argument_group(title)
        for name in sections:
            kinds = field_kinds(SECTIONS[name])
            for f in fields(SECTIONS[name]):
                _add_field(group, f, kinds[f.name][0])
    group = p.add_argument_group(_LAUNCH_GROUP)
    kinds = field_kinds(LaunchOptions)
    for f in fields(LaunchOptions):
        _add_field(group, f, kinds[f.name][0], launcher=True)
    return p


# ------------------------------------------------------------------------------------------------ parse ---
def _normalize_flag_spelling(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--output_dir x` -> `--output-dir x`, as Hugging Face's parser accepts both spellings."""
    known = set(parser._option_string_actions)
    out = []
    for tok in argv:
        name, sep, rest = tok.partition("=")
        dashed = name.replace("_", "-")
        out.append(dashed + sep + rest if tok.startswith("--") and "_" in name and dashed in known else tok)
    return out


def _required_missing(ns: dict[str, Any], config_file: Path | None, argv: list[str]) -> None:
    """The first required setting not given, refused with the user's own command completed: a run folder named
    after the model where kernelguard can name one, a placeholder only for what it cannot guess."""
    from kernelguard.resolution import corrected_command

    for cls in SECTIONS.values():
        for f in fields(cls):
            if "required" in f.metadata and ns.get(f.name) is None:
                flag = "--" + f.name.replace("_", "-")
                value = f.metadata["required"]
                if f.name == "output_dir" and ns.get("model"):
                    value = f"runs/{Path(str(ns['model'])).name.removesuffix('.json') or 'run'}"
                where = f" (or set {f.name} in {config_file})" if config_file else ""
                raise ConfigError(f"{flag} is required.",
                                  fix=f"{corrected_command('train', argv, {'add': (flag, value)})}{where}")


def parse_command(argv: list[str] | None) -> Command:
    """The command line (plus its --config file) -> the validated run, launcher options and warnings."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    argv = _normalize_flag_spelling(argv, parser)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    given = pre.parse_known_args(argv)[0].config
    if given is not None and not given.strip():  # Path("") would be the current folder
        raise ConfigError(
            "--config is empty; it must name a file (an unset shell variable gives an empty argument).",
            fix="pass --config FILE (a .yaml, .toml or .json file of flag values), or leave --config out",
        )
    config_file = Path(given) if given is not None else None
    from_file = file_defaults(parser, load_config_file(config_file), config_file) if config_file else {}
    lists = {
        a.dest for a in parser._actions if isinstance(a, (argparse._AppendAction, argparse._ExtendAction))
    }
    parser.set_defaults(**{k: v for k, v in from_file.items() if k not in lists})
    parser.deprecated_used = []  # type: ignore[attr-defined]
    ns = vars(parser.parse_args(argv))
    typed = _given_on_command_line(argv) if from_file else set()
    overridden = [
        f"--{dest.replace('_', '-')} {_shown(ns[dest])} on the command line overrides {dest}: {_shown(from_file[dest])} "
        f"from {config_file}"
        for dest in from_file
        if dest in typed and ns.get(dest) not in (None, [], from_file[dest])
    ]
    for dest in lists & from_file.keys():  # a list given on the command line replaces the file's
        ns[dest] = ns[dest] or from_file[dest]
    _required_missing(ns, config_file, argv)
    b1, b2 = ns.pop("adam_beta1"), ns.pop("adam_beta2")
    ns["adam_betas"] = (ns["adam_betas"][0] if b1 is None else b1, ns["adam_betas"][1] if b2 is None else b2)
    names = {f.name for cls in SECTIONS.values() for f in fields(cls)}
    cfg = TrainConfig.from_flags(**{k: v for k, v in ns.items() if k in names})
    warnings = [*parser.deprecated_used, *overridden]  # type: ignore[attr-defined]
    return Command(cfg, _launch_options(ns), tuple(warnings))


def _shown(value: Any) -> str:
    return repr(str(value)) if isinstance(value, Path) else repr(value)


def _given_on_command_line(argv: list[str]) -> set[str]:
    """The settings the command line itself gives (argparse converts a file's string default with the flag's
    type, so comparing values cannot tell a typed flag from the file's own value)."""
    unset = object()
    parser = build_parser()
    parser.deprecated_used = []  # type: ignore[attr-defined]
    lists = (argparse._AppendAction, argparse._ExtendAction)  # these add to their default: None starts a list
    parser.set_defaults(**{a.dest: None if isinstance(a, lists) else unset for a in parser._actions
                           if a.dest != "help"})  # fmt: skip
    return {dest for dest, value in vars(parser.parse_args(argv)).items() if value is not unset and value is not None}


def _launch_options(ns: dict[str, Any]) -> LaunchOptions | None:
    given = {k: ns[k] for k in LAUNCH_FIELDS if ns.get(k) is not None}
    if not given:
        return None
    if "nproc_per_node" not in given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"{flags} given without --nproc-per-node.", fix="add --nproc-per-node N")
    values: dict[str, Any] = {k: str(v) if k in ("nproc_per_node", "nnodes") else v for k, v in given.items()}
    return LaunchOptions(**values)


def parse_args(argv: list[str] | None) -> TrainConfig:
    """The validated TrainConfig of a command line (launcher options and warnings dropped)."""
    return parse_command(argv).config
