"""Pinned Triton autotune choices for fla's kernels, so a first ``check --run`` compiles one config per kernel.

fla decorates its Triton kernels with ``triton.autotune`` (or fla's ``fla_cache_autotune`` subclass). The first
call of each kernel with a new autotune key (head counts, head dims, chunk size, varlen flag, dtypes — never the
sequence length) compiles and times *every* candidate config: that is the 4-6 minutes of a cold
``kernelguard check --run`` on an H200 (bench/RESULTS.md). Triton's ``Autotuner.run`` looks its in-memory
``cache[key]`` up first and benchmarks only on a miss, so filling that cache with the choices a previous
autotuning run made on the same GPU architecture, Triton and fla versions skips the search: one compile per
kernel instead of one per candidate. Anything not pinned (another geometry, another stack) autotunes as before.

The pins are data (``fla_autotune_pins.json``, recorded on the GPU by ``bench/check_timing.py --record``); a pin
is used only for an exact key match on the exact (compute capability, Triton, fla) stack it was recorded on.
fla's own ``FLA_CACHE_MODE``/``FLA_CONFIG_DIR`` mechanism covers only its ``fla_cache_autotune`` kernels (not the
plain ``triton.autotune`` ones, e.g. ``chunk_scaled_dot_kkt``), so it is not used here.

A key no pin covers (a model geometry nobody recorded) is searched once per process. ``keep_search_results``
turns on Triton's own disk cache of search results (``TRITON_CACHE_AUTOTUNING``, read when each autotuner is
created, i.e. when fla is imported), so the search costs minutes once per machine and cache folder, not at every
start: kernelguard's commands call it before any provider import; a value the user set is left alone.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PINS_FILE",
    "SEARCH_CACHE_VARIABLE",
    "Stack",
    "apply",
    "config_from_dict",
    "config_to_dict",
    "current_stack",
    "entry_for",
    "fla_autotuners",
    "keep_search_results",
    "load_pins",
    "merge_entry",
    "pin_for_this_gpu",
    "record",
    "search_note",
    "searched_after_pinning",
]

PINS_FILE = Path(__file__).with_name("fla_autotune_pins.json")
SEARCH_CACHE_VARIABLE = "TRITON_CACHE_AUTOTUNING"
_CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass(frozen=True, slots=True)
class Stack:
    """What a pinned config is valid for: configs depend on shared memory per SM (the arch) and on the code."""

    capability: str  # "9.0"
    triton: str
    fla: str

    def to_dict(self) -> dict[str, str]:
        return {"capability": self.capability, "triton": self.triton, "fla": self.fla}


def current_stack(device: int = 0) -> Stack | None:
    """This process's stack, or None without CUDA, Triton or fla."""
    import importlib.metadata as md

    import torch

    if not torch.cuda.is_available():
        return None
    try:
        triton_version = md.version("triton")
        fla_version = md.version("fla-core")
    except md.PackageNotFoundError:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return Stack(f"{major}.{minor}", triton_version, fla_version)


def keep_search_results(environ: MutableMapping[str, str] | None = None) -> bool:
    """Have Triton keep each autotune search's result in its cache folder, unless the switch is already set.

    Call before fla is imported (Triton reads the switch when an autotuner is created). Returns whether the
    environment was changed; child processes (a launcher's ranks) inherit the switch."""
    env = os.environ if environ is None else environ
    if SEARCH_CACHE_VARIABLE in env:
        return False  # the user's choice, 0 included
    env[SEARCH_CACHE_VARIABLE] = "1"
    return True


def _autotuner_class() -> type | None:
    module = sys.modules.get("triton.runtime.autotuner")
    return getattr(module, "Autotuner", None) if module is not None else None


def fla_autotuners() -> Iterator[tuple[str, Any]]:
    """(qualified name, Autotuner) for every autotuned kernel in the loaded fla modules.

    ``triton.heuristics`` may wrap an autotuner: follow ``.fn`` a few levels."""
    cls = _autotuner_class()
    if cls is None:
        return
    seen: set[int] = set()
    for mod_name, module in sorted(sys.modules.items()):
        if module is None or not (mod_name == "fla" or mod_name.startswith("fla.")):
            continue
        for attr, obj in sorted(vars(module).items()):
            for _ in range(4):
                if isinstance(obj, cls):
                    if id(obj) not in seen:
                        seen.add(id(obj))
                        yield f"{mod_name}.{attr}", obj
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break


def config_to_dict(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"kwargs": dict(config.kwargs)}
    for name in _CONFIG_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            out[name] = value
    return out


def config_from_dict(data: Mapping[str, Any]) -> Any:
    import triton

    accepted = inspect.signature(triton.Config).parameters
    extra = {k: data[k] for k in _CONFIG_FIELDS if k in data and k in accepted}
    return triton.Config(dict(data["kwargs"]), **extra)


def _jsonable_key(key: tuple[Any, ...]) -> list[Any] | None:
    out = []
    for value in key:
        if value is None or isinstance(value, (bool, int, float, str)):
            out.append(value)
        else:
            return None  # an exotic key part: cannot be pinned faithfully
    return out


def record(stack: Stack) -> dict[str, Any]:
    """The autotune choices made so far in this process, as one pins entry for ``stack``."""
    kernels: dict[str, list[dict[str, Any]]] = {}
    for name, tuner in fla_autotuners():
        if len(getattr(tuner, "configs", ())) <= 1:
            continue  # nothing is searched for a single-config kernel
        rows = []
        for key, config in getattr(tuner, "cache", {}).items():
            jkey = _jsonable_key(tuple(key))
            if jkey is not None:
                rows.append({"key": jkey, "config": config_to_dict(config)})
        if rows:
            kernels[name] = rows
    return {**stack.to_dict(), "kernels": kernels}


def merge_entry(pins: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """``pins`` with ``entry`` added (an entry for the same stack has its kernels/keys updated)."""
    entries = [dict(e) for e in pins.get("entries", [])]
    stack = {k: entry[k] for k in ("capability", "triton", "fla")}
    for e in entries:
        if {k: e.get(k) for k in stack} == stack:
            kernels = {n: {json.dumps(r["key"]): r for r in rows} for n, rows in e["kernels"].items()}
            for n, rows in entry["kernels"].items():
                kernels.setdefault(n, {}).update({json.dumps(r["key"]): r for r in rows})
            e["kernels"] = {n: list(rows.values()) for n, rows in sorted(kernels.items())}
            break
    else:
        entries.append(dict(entry))
    return {"entries": entries}


def load_pins(path: Path = PINS_FILE) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"entries": []}
    return data if isinstance(data, dict) and isinstance(data.get("entries"), list) else {"entries": []}


def entry_for(stack: Stack, pins: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for e in pins.get("entries", []):
        if (e.get("capability"), e.get("triton"), e.get("fla")) == (
            stack.capability,
            stack.triton,
            stack.fla,
        ):
            return e
    return None


def _load_pinned_modules(names: Iterator[str] | list[str]) -> None:
    """Import the fla modules whose kernels the pins name (``fla.ops.kda.chunk_intra.kernel`` -> its module), in
    a process that already imported fla: a kernel module transformers imports only at its first call (the GDN
    chunk path, l2norm, KDA's) would otherwise be searched then, with its pin unused."""
    import importlib

    if "fla" not in sys.modules:
        return  # fla is not this process's provider: never drag it in
    for module in dict.fromkeys(name.rsplit(".", 1)[0] for name in names):
        if module.startswith("fla.") and module not in sys.modules:
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - another fla layout: its kernels stay unpinned, as before
                continue


def apply(entry: Mapping[str, Any]) -> int:
    """Fill the loaded fla autotuners' caches from ``entry``; returns how many keys were pinned.

    A key the autotuner already holds (tuned or pinned earlier in this process) is left alone."""
    wanted = entry.get("kernels", {})
    _load_pinned_modules(list(wanted))
    pinned = 0
    for name, tuner in fla_autotuners():
        for row in wanted.get(name, ()):
            key = tuple(row["key"])
            if key not in tuner.cache:
                tuner.cache[key] = config_from_dict(row["config"])
                pinned += 1
    return pinned


def searched_after_pinning(entry: Mapping[str, Any] | None) -> list[str]:
    """Autotuned kernels whose key ``entry`` did not pin: each one cost a full search of its configs.

    Read after a run, so a slow cold ``check --run`` names the kernels and keys that missed their pins instead
    of leaving the user to guess between autotuning and compilation."""
    pinned = {
        name: {tuple(row["key"]) for row in rows} for name, rows in ((entry or {}).get("kernels") or {}).items()
    }
    missed = []
    for name, tuner in fla_autotuners():
        if len(getattr(tuner, "configs", ())) <= 1:
            continue
        for key in getattr(tuner, "cache", {}):
            if tuple(key) not in pinned.get(name, set()):
                missed.append(f"{name.rsplit('.', 1)[-1]}{list(key)}")
    return missed


def search_note(path: Path = PINS_FILE) -> str | None:
    """One sentence naming the autotune searches a run made despite the pins, or None when there were none."""
    stack = current_stack()
    if stack is None:
        return None
    missed = searched_after_pinning(entry_for(stack, load_pins(path)))
    if not missed:
        return None
    return (
        f"fla autotuned {len(missed)} kernel shape(s) with no pin for sm {stack.capability}, Triton {stack.triton}, "
        f"fla {stack.fla} (each searched all its configs): {'; '.join(missed)}"
    )


def pin_for_this_gpu(path: Path = PINS_FILE) -> str:
    """Apply the pins recorded for this stack, if any; returns one sentence for the report."""
    stack = current_stack()
    if stack is None:
        return "fla autotune pins: not applicable (no CUDA, Triton or fla-core)"
    entry = entry_for(stack, load_pins(path))
    if entry is None:
        return (
            f"fla autotune pins: none recorded for sm {stack.capability}, Triton {stack.triton}, fla "
            f"{stack.fla}; fla autotunes each new shape (minutes on a machine's first run)"
        )
    count = apply(entry)
    return (
        f"fla autotune pins: {count} kernel configs pinned from {path.name} (recorded on sm {stack.capability}, "
        f"Triton {stack.triton}, fla {stack.fla}); shapes without a pin autotune as usual"
    )
