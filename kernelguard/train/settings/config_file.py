"""`--config FILE` for `kernelguard train`: a YAML, TOML or JSON mapping of flag names to values, checked
against the argparse parser it feeds (same names, same types, same choices), so a file and a command line are
validated alike. Keys are a flag's name with underscores (``learning_rate``, also any alias or old name such as
``block_size``, ``lr``: kernelguard.train.settings.config.RENAMED); negated switches are written positively (``export: false``, not ``no_export: true``); ``null`` leaves an optional
flag unset. Errors name the file, the key, the value and what was expected.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError

from .config import RENAMED

__all__ = ["file_defaults", "load_config_file"]


def load_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML/TOML/JSON file; ConfigError (naming the file) for anything else."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise ConfigError(
            f"--config {path}: unknown file type {suffix or '(none)'!r}; expected .yaml, .yml, .toml or .json.",
            fix="rename the file with the extension of its format",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({e}).", fix="pass a readable file") from None
    try:
        data = _parse_config_text(text, suffix)
    except Exception as e:  # noqa: BLE001  # each parser has its own error class; all mean "malformed file"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--config {path}: not valid {suffix[1:].upper()}: {first}", fix="fix the file"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: the top level is a {type(data).__name__}; expected a mapping of flag names to values.",
            fix="write one `name: value` per line (YAML) or `name = value` (TOML)",
        )
    return data


def _parse_config_text(text: str, suffix: str) -> Any:
    if suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text, object_pairs_hook=_unique_pairs)
    import yaml  # a dependency of transformers, so present wherever training is

    return yaml.load(text, Loader=_unique_keys_loader())


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice (only one of the values could be used)")
        out[key] = value
    return out


def _unique_keys_loader() -> Any:
    """PyYAML's SafeLoader, refusing a mapping that repeats a key (it keeps the last one silently; TOML
    already refuses). A merge key (``<<: *defaults``) is YAML's own way to take keys from another mapping, and
    a key written beside it overrides the merged one (the YAML merge spec): neither is a repeat. Only the
    mapping's own keys are compared, before PyYAML flattens the merge into them."""
    import yaml

    merge_tag = "tag:yaml.org,2002:merge"

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == merge_tag:
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice (lines {seen[key]} and "
                        f"{key_node.start_mark.line + 1}; only one of the values could be used)",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _file_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config-file key -> the flag it sets: the dest and every flag name with underscores, except negated ones
    (`--no-export`, `--all-tokens-loss`: write `export: false` / `assistant_only_loss: false`)."""
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        keys.setdefault(action.dest, action)
        if isinstance(action, argparse._StoreFalseAction):
            continue
        for opt in action.option_strings:
            name = opt.lstrip("-").replace("-", "_")
            if not name.startswith("no_"):
                keys.setdefault(name, action)
    return keys


def file_defaults(parser: argparse.ArgumentParser, data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A config file's mapping -> {flag dest: value}, each value checked as its flag would check it."""
    keys = _file_keys(parser)
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        action = keys.get(key) or keys.get(RENAMED.get(key, ""))
        if action is None:
            close = difflib.get_close_matches(key, list(keys), n=1)
            raise ConfigError(
                f"--config {path}: unknown key {raw_key!r}"
                + (f" (did you mean {close[0]!r}?)." if close else "."),
                fix=f"keys are the flags of `{parser.prog} --help` with underscores, e.g. learning_rate",
            )
        if action.dest in seen:
            raise ConfigError(
                f"--config {path}: {seen[action.dest]!r} and {raw_key!r} set the same option.",
                fix="keep one of them",
            )
        seen[action.dest] = str(raw_key)
        out[action.dest] = _file_value(action, str(raw_key), value, path)
    return out


def _file_value(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    """The value a config-file entry gives the flag's dest, type-checked like the command line would."""

    def wrong(expected: str) -> ConfigError:
        return ConfigError(
            f"--config {path}: {key} is {value!r} ({type(value).__name__}); expected {expected}.",
            fix=f"set {key} to {expected} in {path.name}",
        )

    if value is None and action.default is None:  # null/~ for an optional flag: left unset
        return None
    from_file = getattr(action, "from_file", None)  # a flag with its own file spelling (auto/on/off)
    if from_file is not None:
        return from_file(value, where=f"--config {path}: {key}")
    if isinstance(
        action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
    ):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise wrong("a string or a list of strings")
        return list(items)
    if isinstance(action.nargs, int):
        if not isinstance(value, list) or len(value) != action.nargs:
            raise wrong(f"a list of {action.nargs} {_type_name(action.type)}s")
        return tuple(_scalar(action, x, wrong) for x in value)
    return _scalar(action, value, wrong)


def _yaml_float(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _type_name(kind: Any) -> str:
    return {int: "integer", float: "number"}.get(kind, "string")


# Settings that name local paths: a leading ~ is the home folder, as on a command line.
_PATHS = frozenset({"model", "tokenizer", "data", "eval_data", "chat_template", "output_dir", "profile_trace"})
# Launcher settings that are strings only because they also take words (gpu, auto, MIN:MAX, a job name).
_COUNTS_AS_TEXT = frozenset({"nproc_per_node", "nnodes", "rdzv_id"})


def _scalar(action: argparse.Action, value: Any, wrong: Any) -> Any:
    kind = action.type
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise wrong("an integer")
    if kind is float:
        value = _yaml_float(value)  # PyYAML reads 3e-4 (no dot) as a string: accept what float() reads
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        value = float(value)
    if kind not in (int, float):
        if action.dest in _COUNTS_AS_TEXT and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # nproc_per_node: 8 is the command line's "8" (YAML and TOML read an int)
        if not isinstance(value, str):
            raise wrong("a string")
        if action.dest in _PATHS and (value == "~" or value.startswith("~/")):
            value = str(Path(value).expanduser())  # a shell would have expanded it on a command line
        value = Path(value) if kind is Path else value
    if action.choices is not None and value not in action.choices:
        raise wrong("one of " + ", ".join(map(str, action.choices)))
    return value
