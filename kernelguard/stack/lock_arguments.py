"""A stack lock's own arguments (model, mode, packing, archs, Hub use, allow items): the command that writes the
same lock again, and the refusal of explicit arguments that contradict it (repeating the lock's value is not)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import CLI, PYTHON, ComputeCapability

__all__: list[str] = [
    "rebuild_command",
    "refuse_contradictions",
]


def rebuild_command(locked: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """The ``kernelguard lock`` command that writes ``locked`` again for the same model, mode, packing, Hub use,
    target archs and allow items (a bare ``--output`` would check the defaults instead, and fail or differ)."""
    model = locked.get("model", {})
    args = ["kernelguard", "lock", "--model", str(model.get("name") or model.get("family") or "qwen3_5"),
            "--mode", str(model.get("mode") or "training")]
    args += [] if model.get("packed") is None else ["--packed" if model["packed"] else "--no-packed"]
    args += ["--hub"] if model.get("hub") else []
    args += [part for flag, key in (("--arch", "target_archs"), ("--allow", "allow"))
             for value in (sorted if key == "allow" else list)(locked.get(key, [])) for part in (flag, str(value))]
    return shlex.join([*args, "--output", str(path)])


def _locked_value(locked: Mapping[str, Any], name: str) -> Any:
    model = locked.get("model", {})
    if name == "arch":
        return sorted(str(ComputeCapability.parse(a, source="the lock's target_archs"))
                      for a in locked.get("target_archs", []))
    return model.get(name) if name != "model" else model.get("name")


def _normalised(name: str, value: Any) -> Any:
    if name == "arch":
        values = [value] if isinstance(value, (str, int, float)) else list(value)
        return sorted(str(ComputeCapability.parse(str(a), source="arch")) for a in values)
    return bool(value) if name in ("packed", "hub") else str(value)


def _spelled(name: str, value: Any, syntax: str) -> str:
    if syntax == PYTHON:
        return f"{name}={value!r}"
    if name in ("packed", "hub"):
        return f"--{name}" if value else f"--no-{name}"
    values = [value] if name != "arch" or isinstance(value, (str, int, float)) else list(value)
    return " ".join(f"--{name} {v}" for v in values)


def refuse_contradictions(locked: Mapping[str, Any], given: Mapping[str, Any], *, syntax: str = CLI,
                          option: str = "--lock") -> None:
    """A usage error naming each explicit argument (model, mode, arch, packed, hub; None: not given) whose value
    is not the lock's: the lock decides what is checked, and repeating exactly its value is no contradiction."""
    clashes = []
    for name in ("model", "mode", "arch", "packed", "hub"):
        value = given.get(name)
        if value is None:
            continue
        locked_value = _locked_value(locked, name)
        if _normalised(name, value) != (locked_value if name == "arch" else _normalised(name, locked_value)):
            shown = (", ".join(locked_value) or "none") if name == "arch" else locked_value
            clashes.append((_spelled(name, value, syntax), f"the lock's {name} is {shown}"))
    if not clashes:
        return
    named = "; ".join(f"{arg} contradicts it ({why})" for arg, why in clashes)
    args = " ".join(_spelled(n, given[n], CLI) for n in ("model", "mode", "arch", "packed", "hub")
                    if given.get(n) is not None)
    raise ConfigError(
        f"{option} checks the model, mode, target and Hub use the lock was written for: {named}.",
        fix=f"drop {', '.join(arg for arg, _ in clashes)}, or write a new lock with them: kernelguard lock {args} "
            "--output FILE")
