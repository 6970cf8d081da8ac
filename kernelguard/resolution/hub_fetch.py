"""Every Kernel Hub repository a ``from_pretrained(use_kernels=True)`` load fetches for one model, in both modes.

transformers kernelizes the model it loads (in eval mode: kernels' inference mapping) and again for training
(the training mapping). For every module whose class names a Hub layer (``kernel_layer_name``, set by
``use_kernel_forward_from_hub``) and every kernel function attached to a layer (``_kernel_funcs``), kernels
fetches the repository transformers' own table gives for the device and mode. Here the model is built on the
meta device (no memory, no weights) and its names are looked up in that table the way kernels selects: a mode
entry serves a mode it contains, ``FALLBACK`` any. Offline, each one must be in the local cache before the load.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .versions import hub_ref

__all__ = ["FetchedRepo", "download_command", "load_repos", "load_repos_isolated"]

# Building the model imports its modeling module, which imports the kernel packages transformers decorates with
# (a broken compiled one can kill the process): so a check asks a child process.
_CHILD = """
import json, sys
sys.path[:] = json.loads(sys.argv[1])
from dataclasses import asdict
from transformers import AutoConfig
from kernelguard.resolution.hub_fetch import load_repos
raw = json.loads(sys.argv[2])
print(json.dumps([asdict(r) for r in load_repos(AutoConfig.for_model(raw.pop("model_type"), **raw))]))
"""

MODES = ("INFERENCE", "TRAINING")


@dataclass(frozen=True, slots=True)
class FetchedRepo:
    """One repository and revision the load fetches, with the layer names and modes that ask for it."""

    repo_id: str
    version: int | None
    revision: str | None
    layers: tuple[str, ...]
    modes: tuple[str, ...]

    @property
    def ref(self) -> str:
        """The Hub ref kernels downloads: the version's ``vN`` branch, else the pinned revision."""
        return hub_ref(self.version, self.revision)


def load_repos(config: Any, *, device: str = "cuda") -> list[FetchedRepo]:
    """The repositories a Hub-kernel load of ``config``'s model fetches on ``device``, in inference and training
    mode. Raises ImportError without transformers' kernel table (a transformers without Hub kernels)."""
    from transformers.integrations import hub_kernels

    table = getattr(hub_kernels, "_KERNEL_MAPPING", None)
    getter = getattr(hub_kernels, "get_kernel_mapping_transformers", None)
    if callable(getter):
        table = getter()
    if not isinstance(table, Mapping):
        raise ImportError("transformers has no Kernel Hub mapping (transformers.integrations.hub_kernels)")
    found: dict[tuple[str, int | None, str | None], tuple[list[str], list[str]]] = {}
    for name in _layer_names(config):
        for mode in MODES:
            repo = _repository(table.get(name), device, mode)
            if repo is None:
                continue
            key = (str(getattr(repo, "_repo_id", "")), getattr(repo, "_version", None), getattr(repo, "_revision", None))
            layers, modes = found.setdefault(key, ([], []))
            layers.append(name) if name not in layers else None
            modes.append(mode.lower()) if mode.lower() not in modes else None
    return [FetchedRepo(r, v, rev, tuple(ls), tuple(ms)) for (r, v, rev), (ls, ms) in sorted(found.items(), key=str)]


def load_repos_isolated(config: Mapping[str, Any], *, timeout: float = 120.0) -> list[FetchedRepo] | None:
    """:func:`load_repos` of a config.json's values (``model_type`` and the rest), in a child process; None when
    the child fails (the model cannot be built, an import crashes): the per-kernel probes still say what they can."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(sys.path), json.dumps(dict(config))],
                              capture_output=True, text=True, timeout=timeout, check=False)
        rows = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if not isinstance(rows, list):
        return None
    return [FetchedRepo(r["repo_id"], r["version"], r["revision"], tuple(r["layers"]), tuple(r["modes"])) for r in rows]


def download_command(repos: Iterable[FetchedRepo], cache_dir: str) -> str:
    """One shell line that puts every repository where kernels reads its cache."""
    return " && ".join(f"hf download {r.repo_id} --repo-type kernel --revision {shlex.quote(r.ref)} "
                       f"--cache-dir {shlex.quote(cache_dir)}" for r in repos)


def _layer_names(config: Any) -> list[str]:
    """The Hub layer names of every module of ``config``'s model, built on the meta device."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    names: list[str] = []
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # a config with no causal-LM class: the base model has the same layers
            model = AutoModel.from_config(config)
    for module in model.modules():
        for name in (getattr(type(module), "kernel_layer_name", None),
                     *(getattr(f, "kernel_layer_name", key) for key, f in getattr(module, "_kernel_funcs", {}).items())):
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def _repository(devices: Any, device: str, mode: str) -> Any:
    """The repository kernels selects for ``device`` (the plain device entry, not a capability-specific one)
    and ``mode``; None when the table has none."""
    if not isinstance(devices, Mapping):
        return None
    entry = next((repo for key, repo in devices.items() if str(getattr(key, "type", key)) == device
                  and getattr(key, "properties", None) is None), None)
    if entry is None or not isinstance(entry, Mapping):
        return entry
    from kernels import Mode

    wanted = getattr(Mode, mode)
    for key, repo in entry.items():  # a mode entry serves the modes it contains (INFERENCE | TORCH_COMPILE too)
        if wanted in key:
            return repo
    return next((repo for key, repo in entry.items() if key == Mode.FALLBACK), None)
