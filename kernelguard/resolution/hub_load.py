"""Whether a job's ``from_pretrained`` loads Kernel Hub kernels, and what that load does when it cannot.

transformers 5.25 turned the Hub on by default: ``from_pretrained(use_kernels=None)`` means ``use_kernels=True``
unless the environment variable ``USE_HUB_KERNELS`` is false, and a load with ``use_kernels=True`` raises
``ValueError: Kernels are not available...`` when ``kernels`` is missing or outside the version window the
installed transformers accepts (``KERNELS_MIN_VERSION`` / ``KERNELS_MAX_VERSION``; the same raise as 5.17-5.24
with an explicit ``use_kernels=True``). Older releases default to ``use_kernels=False``.

Facts are read from transformers' source without importing it (``check`` runs where torch may be missing);
:func:`resolve_use_hub` is the one decision every caller makes from them: ``kernelguard check`` (``--hub`` /
``--no-hub`` / neither), ``kernelguard train`` (always ``use_kernels=False``: it checks and guards the pip
packages) and the Trainer callback (what the loaded model did).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .decisions import REJECTED, Decision
from .facts import Facts, HubLoad
from .versions import base_version, hub_ref, version_in

if TYPE_CHECKING:
    from .catalog import HubRepo

__all__ = [
    "ALL_LATEST_VAR",
    "ENV_VAR",
    "LOAD",
    "hub_notes",
    "import_decision",
    "kernels_hub_status",
    "kernels_outside_window",
    "load_decision",
    "load_error_sentence",
    "no_variant_fix",
    "probe_hub_load",
    "resolve_use_hub",
    "transformers_package_devices",
]

ENV_VAR = "USE_HUB_KERNELS"
# kernels 0.19: on (1/ON/YES/TRUE), every Hub kernel loads its newest numbered version, overriding the version
# transformers' mapping asks for and any lockfile pin, with only a warning (kernels' _use_latest_kernels)
ALL_LATEST_VAR = "UNSTABLE_KERNELS_ALL_LATEST"
# 5.25's from_pretrained: `use_kernels = kwargs.pop("use_kernels", None)` then `elif use_kernels is None:`
# `use_kernels = True`; 5.17-5.24 pop it with the default False.
_DEFAULT_NONE = re.compile(r"""use_kernels\s*=\s*kwargs\.pop\(\s*["']use_kernels["']\s*,\s*None\s*\)""")
_NONE_MEANS_TRUE = re.compile(r"use_kernels\s+is\s+None\s*:\s*\n\s*use_kernels\s*=\s*True")


def probe_hub_load(root: Path, transformers_version: str, window: tuple[str, str] | None,
                   kernels_version: str | None, environ: dict[str, str] | None = None) -> HubLoad:
    """Read ``root/modeling_utils.py`` (transformers' package folder) and ``USE_HUB_KERNELS``."""
    try:
        text = (root / "modeling_utils.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    default_on = bool(_DEFAULT_NONE.search(text) and _NONE_MEANS_TRUE.search(text))
    env = os.environ if environ is None else environ
    latest = env.get(ALL_LATEST_VAR)
    return HubLoad(transformers_version, default_on, env.get(ENV_VAR), window, kernels_version,
                   kernels_core=_requires_kernels(), all_latest=latest if (latest or "").upper() in _ON else None)


_ON = {"1", "ON", "YES", "TRUE"}  # kernels' own reading of UNSTABLE_KERNELS_ALL_LATEST


def hub_notes(load: HubLoad | None, *, use_hub: bool, source: str) -> list[str]:
    """What the check says about the Hub load as a whole (``source``: why the job uses the Hub)."""
    return [n for n in (_hub_default_note(load, use_hub=use_hub, source=source),
                        _all_latest_note(load, use_hub=use_hub)) if n]


def _all_latest_note(load: HubLoad | None, *, use_hub: bool) -> str | None:
    """The check's note when UNSTABLE_KERNELS_ALL_LATEST makes kernels load the newest version of every Hub
    kernel (the variants above were judged on those)."""
    if load is None or not use_hub or load.all_latest is None:
        return None
    return (f"{ALL_LATEST_VAR}={load.all_latest}: kernels loads the newest cached numbered version of every Hub "
            "kernel, whatever version transformers asks for or a lock pins (judged here on those versions); "
            f"unset {ALL_LATEST_VAR} to load the versions transformers asks for")


def _requires_kernels() -> bool:
    """The installed transformers lists kernels among its own requirements (5.25+), not only in an extra."""
    from importlib import metadata

    try:
        requires = metadata.requires("transformers") or []
    except metadata.PackageNotFoundError:
        return False
    return any(re.match(r"kernels\b", line) and "extra" not in line for line in requires)


def resolve_use_hub(asked: bool | None, load: HubLoad) -> tuple[bool, str]:
    """(does the job's load use Hub kernels, where that came from), for ``asked``: True (``--hub``: the job
    passes use_kernels=True), False (``--no-hub``: use_kernels=False), None (the job passes nothing)."""
    if asked is False:
        return False, "--no-hub: the job loads with use_kernels=False"
    if load.env_off:
        # transformers 5.25 turns even an explicit use_kernels=True off under a false USE_HUB_KERNELS (a warning).
        if load.default_on:
            return False, f"{ENV_VAR}={load.env_value}: transformers {load.transformers_version} loads without them"
        if asked is None:
            return False, f"transformers {load.transformers_version} loads with use_kernels=False by default"
    if asked:
        return True, "--hub: the job loads with use_kernels=True"
    if load.default_on:
        return True, (f"transformers {load.transformers_version}'s default: from_pretrained(use_kernels=None) "
                      f"means use_kernels=True unless {ENV_VAR} is false")
    return False, f"transformers {load.transformers_version} loads with use_kernels=False by default"


def load_error_sentence(load: HubLoad) -> str | None:
    """What ``from_pretrained`` raises when the load uses Hub kernels and ``kernels`` cannot serve, else None."""
    if load.kernels_usable:
        return None
    found = "kernels is not installed" if load.kernels_version is None else f"kernels {load.kernels_version} is installed"
    window = (f" Please install a compatible version ({load.window[0]} <= version < {load.window[1]})"
              if load.window else "")
    return (f"{found}, so the model load raises before any kernel runs: from_pretrained(use_kernels=True) "
            f"raises `ValueError: Kernels are not available.{window}`")


def transformers_package_devices(package: str) -> tuple[str, ...] | None:
    """The devices transformers sends a pip package's inputs to (``hub_kernels._PACKAGE_SUPPORTED_DEVICES``,
    5.25+: inputs on any other device take the torch path, or raise when packed); None where this transformers
    has no such table (every device) or has not been imported."""
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if not isinstance(table, dict) or package not in table:
        return None
    return tuple(str(d) for d in table[package])


def _hub_default_note(load: HubLoad | None, *, use_hub: bool, source: str) -> str | None:
    """The check's note when Kernel Hub kernels come first because transformers loads them by default."""
    if load is None or not use_hub or not load.default_on:
        return None
    return (f"Kernel Hub kernels are the first provider of every kernel: {source}; USE_HUB_KERNELS=NO or "
            "use_kernels=False loads without them (check that with --no-hub)")


LOAD = "model load"  # the Decision.kernel of the load itself: not a kernel, but it decides before any kernel runs


def load_decision(load: HubLoad | None, *, use_hub: bool, hub_source: str, fix: str) -> Decision | None:
    """The load's own verdict when it uses Hub kernels and ``kernels`` cannot serve: rejected, because
    from_pretrained raises (``fix``: kernelguard.resolution.install's kernels command); None when the load is fine."""
    if load is None or not use_hub:
        return None
    why = f" The job loads with Hub kernels: {hub_source}." if hub_source else ""
    # before 5.25 the window's raise needs an explicit use_kernels=True: said per Hub candidate
    sentence = load_error_sentence(load) if load.default_on else None
    if sentence is not None:
        return Decision(LOAD, "from_pretrained(use_kernels=True)", "hub", REJECTED, f"{sentence}.{why}", fix)
    if load.offline_missing:
        return _offline_decision(load, why)
    if load.unreachable is None:
        return None
    return Decision(
        LOAD, "from_pretrained(use_kernels=True)", "hub", REJECTED,
        "the load asks the Hub whether each kernel's publisher is trusted before it loads it, and the Hub cannot be "
        f"reached from here ({load.unreachable}): from_pretrained raises `ValueError: Kernel repository ... could "
        f"not verify publisher trust status`, a network failure, not a trust problem.{why}",
        "HF_HUB_OFFLINE=1 with the kernels in the local cache (downloaded where the Hub is reachable; `kernelguard "
        "check` with HF_HUB_OFFLINE=1 says whether they are there), or USE_HUB_KERNELS=NO (use_kernels=False) with "
        "the pip kernels. trust_remote_code=True only skips the trust request; the load's next Hub request (the "
        "kernel's versions) fails the same way")


def _offline_decision(load: HubLoad, why: str) -> Decision:
    first = load.offline_missing[0].split(" ")[0]
    return Decision(
        LOAD, "from_pretrained(use_kernels=True)", "hub", REJECTED,
        "the load fetches the Hub kernels every layer of this model names, for inference (it loads in eval mode) "
        "and again for training, and HF_HUB_OFFLINE=1 allows only the local cache, which lacks "
        f"{', '.join(load.offline_missing)}: from_pretrained raises `ValueError: Version ... of '{first}' is not "
        f"available in the local cache and Hugging Face Hub is in offline mode`.{why}",
        f"{load.offline_download}   (run where the Hub is reachable; or USE_HUB_KERNELS=NO with the pip kernels)")


def import_decision(error: str | None, version: str | None) -> Decision | None:
    """The load's verdict when ``import transformers`` itself fails (``error``): nothing after it runs."""
    if error is None:
        return None
    pin = f"=={version}" if version else ""
    return Decision(LOAD, "import transformers", "package", REJECTED,
                    f"importing transformers {version or ''} fails, so every job stops at its first line: "
                    f"{error}", f"pip install --force-reinstall 'transformers{pin}'")


def kernels_hub_status() -> str | None:
    """A sentence when transformers has Hub kernels switched off because of the kernels version, else None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from transformers.utils import import_utils
    except ImportError:
        return None
    low, high = getattr(import_utils, "KERNELS_MIN_VERSION", None), getattr(import_utils, "KERNELS_MAX_VERSION", None)
    try:
        installed = version("kernels")
    except PackageNotFoundError:
        return "Kernel Hub off: `kernels` is not installed"
    if getattr(import_utils, "is_kernels_available", lambda: True)():
        return None
    return f"Kernel Hub off: kernels {installed} is outside transformers' accepted range" + \
        (f" [{low}, {high})" if low and high else "")


def kernels_outside_window(facts: Facts) -> str | None:
    """The one place the kernels version window is judged (transformers reads it from import_utils)."""
    window, version = facts.kernels_window, facts.env.version_of("kernels")
    if not window or not version or version_in(base_version(version), f">={window[0]},<{window[1]}"):
        return None
    return (f"kernels {version} is outside [{window[0]}, {window[1]}), the range this transformers accepts, so "
            "is_kernels_available() is False and from_pretrained(use_kernels=True) raises ValueError: Kernels are "
            "not available")  # 5.17 through 5.25 alike; said only when the job loads with use_kernels=True


def no_variant_fix(hub: HubRepo, probe: Any) -> str:
    """The fix of a Hub candidate no build variant of which loads: nothing in the offline cache (providers.hub's
    "not available offline"): its download; else builds for other systems only: the pip kernels."""
    repo, ref = hub.repo_id, hub_ref(hub.version, hub.revision)
    if probe.source == "not available offline" and probe.location:
        return (f"hf download {repo} --repo-type kernel --revision {ref} --cache-dir {probe.location}   "
                f"(run where the Hub is reachable; or set LOCAL_KERNELS={repo}=PATH)")
    return f"USE_HUB_KERNELS=NO with the pip kernels  (or set LOCAL_KERNELS={repo}=PATH to a build for this system)"
