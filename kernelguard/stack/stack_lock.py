"""``kernelguard.lock``: the stack a check verified, written at image build and enforced at job start.

Written from a passing check (``kernelguard lock``, ``kernelguard check --write-lock FILE``); verified by
``kernelguard check --lock``, ``kernelguard train --lock``, ``kernelguard.require(lock=...)``,
``KernelGuardCallback(lock=...)`` and ``KERNELGUARD_LOCK``: the same check is run here for the lock's model, mode
and target, the same lock is built from what it found, and every field that differs becomes one line -- what
the lock says, what is here, the command that restores it (``kernelguard.resolution.install``). Only what decides which
kernel runs and how is locked (schema in docs/lock.md): a package no kernel depends on never is.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError, LockMismatch
from kernelguard.resolution import (
    ALL_LATEST_VAR,
    CLI,
    ComputeCapability,
    allow_hint,
    fla_backend_command,
    pin_command,
)

from .compose import CheckOptions, CheckResult, run_check
from .lock_arguments import rebuild_command, refuse_contradictions
from .lock_file import ENV_LOCK, LOCK_SCHEMA, kernelguard_version, lock_option, lock_path, read_lock
from .lock_hub import hub_repo_differences, hub_repo_entries

__all__ = [
    "ENV_LOCK",
    "LOCK_SCHEMA",
    "Difference",
    "build_lock",
    "compare",
    "kernelguard_version",
    "lock_option",
    "lock_path",
    "read_lock",
    "verify_lock",
    "write_lock",
]


@dataclass(frozen=True, slots=True)
class Difference:
    what: str
    locked: str
    here: str
    fix: str

    def line(self) -> str:
        return f"{self.what}: lock says {self.locked}, here {self.here}; restore: {self.fix}"


# ------------------------------------------------------------------------------------------------ build ---
def _sha256(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _python(version: object) -> str | None:
    # The minor release decides which wheels (cp312) and extension modules load; a patch release does not.
    return ".".join(str(version).split(".")[:2]) if version else None


def _stack(result: CheckResult) -> dict[str, Any]:
    env = result.env
    stack: dict[str, Any] = {
        "python": _python(env.python.value),
        "torch": env.torch_version.value,
        "cuda": env.cuda_version.value,
        "cxx11_abi": env.cxx11_abi.value,
        "triton": env.triton_version,
        "transformers": result.resolution.requirements.transformers_version,
        "kernelguard": kernelguard_version(),
    }
    # fla hands its whole GDN op to any importable flash_qla (known issue flash-qla-wrong-grads): its release is part
    # of the stack whenever installed (a node that adds one, or another release, differs).
    if env.version_of("flash-qla") is not None:
        stack["flash-qla"] = env.version_of("flash-qla")
    # kernels decides whether transformers uses the Hub at all: locked only when the job does.
    if result.resolution.target.use_hub:
        stack["kernels"] = env.version_of("kernels")
        if (latest := getattr(getattr(result.facts, "hub_load", None), "all_latest", None)) is not None:
            stack[ALL_LATEST_VAR] = latest  # every Hub pin overridden: write_lock refuses, a node differs
    return stack


def _package_entry(result: CheckResult, module: str) -> dict[str, Any]:
    from kernelguard.resolution import PACKAGES

    facts = result.facts
    found = facts.packages.get(module) if facts is not None else None
    if found is None:
        return {}
    spec = PACKAGES.get(found.import_name)
    names = spec.distributions if spec is not None else (found.distribution,)
    versions = {d: result.env.version_of(d) for d in names if d}
    if not any(versions.values()) and found.distribution:
        versions = {found.distribution: found.version}
    return {
        "version": found.version,
        "distributions": {d: v for d, v in versions.items() if v is not None},
        "extensions": [
            {"file": Path(e.path).name, "sha256": _sha256(e.path), "sass": sorted(e.sass), "ptx": sorted(e.ptx)}
            for e in found.extensions
        ],
    }


def _kernel_entries(result: CheckResult) -> dict[str, Any]:
    res = result.resolution
    modules = {req.kernel: req.module for req in res.requirements.kernels}
    repos = {req.kernel: req.hub.repo_id for req in res.requirements.kernels if req.hub is not None}
    entries: dict[str, Any] = {}
    for verdict in res.verdicts:
        chosen = verdict.selected
        if chosen is None:  # what is installed still says why: its versions and builds
            module = modules.get(verdict.kernel)
            entries[verdict.kernel] = {"provider": None, "kind": None,
                                       **(_package_entry(result, module) if module else {})}
            continue
        entry: dict[str, Any] = {"provider": chosen.provider, "kind": chosen.kind}
        if chosen.kind == "package":
            module = modules.get(verdict.kernel) or chosen.provider.split(" ")[0]
            entry.update(_package_entry(result, module))
        elif chosen.kind == "hub" and result.facts is not None:
            probe = result.facts.hub.get(repos.get(verdict.kernel, ""))
            if probe is not None:
                entry.update({"repo": probe.repo_id, "revision": probe.revision, "variant": probe.chosen_variant})
        entries[verdict.kernel] = entry
    return entries


def _pins(result: CheckResult) -> list[dict[str, Any]]:
    """The fla autotune pins kernelguard applies on the lock's target (kernelguard.resolution.fla_autotune)."""
    from kernelguard.resolution import load_pins

    fla = result.env.version_of("fla-core")
    archs = {str(a.base) for a in result.resolution.target.archs}
    out = []
    for entry in load_pins().get("entries", []):
        if entry.get("capability") in archs and entry.get("triton") == result.env.triton_version and entry.get("fla") == fla:
            text = json.dumps(entry.get("kernels", {}), sort_keys=True)
            out.append({"capability": entry["capability"], "triton": entry["triton"], "fla": entry["fla"],
                        "sha256": hashlib.sha256(text.encode()).hexdigest()})
    return out


def build_lock(result: CheckResult) -> dict[str, Any]:
    """The lock of ``result``'s stack: only what decides which kernel runs and how."""
    res = result.resolution
    req = res.requirements
    backends = result.facts.fla_backends if result.facts is not None else {}
    return {
        "kernelguard_lock": LOCK_SCHEMA,
        "model": {"name": result.options.model, "family": req.family.name, "mode": req.mode, "packed": req.packed,
                  "hub": res.target.use_hub},
        "target_archs": [str(a) for a in res.target.archs],
        "verdict": "ok" if result.ok else "fail",
        "allow": sorted(res.target.allow.values()),
        "stack": _stack(result),
        "kernels": _kernel_entries(result),
        "fla_backend": {arch: {"forward": b.forward, "backward": b.backward} for arch, b in backends.items()},
        "fla_autotune_pins": _pins(result),
        **({"hub_repos": repos} if (repos := hub_repo_entries(result)) is not None else {}),
    }


def write_lock(result: CheckResult, path: str | os.PathLike[str]) -> Path:
    """Write ``result``'s lock to ``path`` whole or not at all (a temporary file renamed over it)."""
    target = Path(path)
    lock = build_lock(result)
    if ALL_LATEST_VAR in lock["stack"]:  # kernels would load the newest of every Hub kernel, not what it pins
        raise ConfigError(f"{ALL_LATEST_VAR}={lock['stack'][ALL_LATEST_VAR]} is set: kernels loads the newest version "
                          "of every Hub kernel whatever a lock pins, so this lock would pin Hub revisions the job does "
                          "not load.", fix=f"unset {ALL_LATEST_VAR} and write the lock again (or lock the pip packages: --no-hub)")
    text = json.dumps(lock, indent=2) + "\n"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# ---------------------------------------------------------------------------------------------- compare ---
def _show(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]" if value else "none"
    return str(value)


_NODE_MAY_ADD = ("flash-qla", ALL_LATEST_VAR)  # written only when present: one the lock lacks is a difference


def _stack_fix(name: str, locked: Any, stack: Mapping[str, Any]) -> str:
    if name == ALL_LATEST_VAR or locked is None:  # what the image did not have, the node must not have either
        return f"unset {name} (kernels then loads the Hub revisions the lock pins)" if name == ALL_LATEST_VAR \
            else f"pip uninstall -y {name}"
    if name == "python":
        return f"run the job with Python {locked}, the image's"
    if name in ("cuda", "cxx11_abi"):
        return pin_command("torch", stack.get("torch"))
    if name == "kernelguard":  # the release the lock was written with: its known issues decided
        return pin_command("kernelguard", locked)
    return pin_command(name, locked)


def _kernel_differences(kernel: str, locked: Mapping[str, Any], here: Mapping[str, Any]) -> list[Difference]:
    """The most precise differences first (a version, a build, a Hub revision); the provider only when none."""
    out = _identity_differences(kernel, locked, here)
    if not out and (locked.get("kind"), locked.get("provider")) != (here.get("kind"), here.get("provider")):
        out.append(Difference(f"{kernel} provider", _show(locked.get("provider")), _show(here.get("provider")),
                              _provider_fix(locked)))
    return out


def _identity_differences(kernel: str, locked: Mapping[str, Any], here: Mapping[str, Any]) -> list[Difference]:
    out = []
    had, has = locked.get("distributions", {}), here.get("distributions", {})
    for name in sorted(set(had) | set(has)):
        if had.get(name) != has.get(name):
            found = has.get(name) or "not installed"
            out.append(Difference(f"{kernel}: {name}", had.get(name) or "not installed", found,
                                  pin_command(name, had.get(name))))
    if not had and not has and locked.get("version") != here.get("version"):  # importable without a distribution
        out.append(Difference(f"{kernel}: version", _show(locked.get("version")), _show(here.get("version")),
                              "put the image's copy of this package back on sys.path"))
    if not out:  # same versions: the build itself must be the same
        out += _extension_differences(kernel, locked, here)
    for key in ("repo", "revision", "variant") if locked.get("kind") == "hub" else ():
        if locked.get(key) != here.get(key):
            out.append(Difference(f"{kernel}: Hub {key}", _show(locked.get(key)), _show(here.get(key)),
                                  _hub_fix(locked)))
    return out


def _extension_differences(kernel: str, locked: Mapping[str, Any], here: Mapping[str, Any]) -> list[Difference]:
    owner = next(iter(locked.get("distributions", {}).items()), (None, None))
    fix = pin_command(owner[0], owner[1]) if owner[0] else "reinstall the image's build"
    fix += " (the lock's build; a different build of the same version has other GPU code)"
    had = {e["file"]: e for e in locked.get("extensions", [])}
    has = {e["file"]: e for e in here.get("extensions", [])}
    out = []
    for name in sorted(set(had) | set(has)):
        a, b = had.get(name), has.get(name)
        if a is None or b is None:
            out.append(Difference(f"{kernel}: {name}", "present" if a else "absent", "present" if b else "absent", fix))
            continue
        if a.get("sha256") != b.get("sha256"):
            archs = "" if (a.get("sass"), a.get("ptx")) == (b.get("sass"), b.get("ptx")) else (
                f" ({_archs(a)} -> {_archs(b)})")
            out.append(Difference(f"{kernel}: {name} sha256", _short(a.get("sha256")),
                                  f"{_short(b.get('sha256'))}{archs}", fix))
    return out


def _archs(entry: Mapping[str, Any]) -> str:
    return ", ".join([*entry.get("sass", []), *entry.get("ptx", [])]) or "no GPU code"


def _short(digest: object) -> str:
    return f"sha256 {str(digest)[:12]}" if digest else "unreadable"


def _provider_fix(locked: Mapping[str, Any]) -> str:
    names = locked.get("distributions", {})
    if names:
        return " && ".join(pin_command(d, v) for d, v in names.items())
    if locked.get("kind") == "hub":
        return _hub_fix(locked)
    return "restore the image's packages (kernelguard check shows why this provider was not chosen)"


def _hub_fix(locked: Mapping[str, Any]) -> str:
    return (f"python -c \"from kernels import get_kernel; get_kernel('{locked.get('repo')}', "
            f"revision='{locked.get('revision')}')\" with HF_HUB_OFFLINE unset, then run offline again")


def compare(locked: Mapping[str, Any], here: Mapping[str, Any], *, syntax: str = CLI) -> list[Difference]:
    """Every difference between two locks, in a stable order: stack, allow items, kernels, fla, pins."""
    out: list[Difference] = []
    had_stack, has_stack = locked.get("stack", {}), here.get("stack", {})
    for name in [*had_stack, *(n for n in _NODE_MAY_ADD if n in has_stack and n not in had_stack)]:
        had, has = had_stack.get(name), has_stack.get(name)
        if name == "python":  # a lock written by hand (or by another tool) may carry a patch release: not locked
            had, has = _python(had), _python(has)
        if had != has:
            absent = "unset" if name == ALL_LATEST_VAR else "not installed"
            shown = [_show(v) if v is not None else absent for v in (had, has)]
            out.append(Difference(name, *shown, _stack_fix(name, had, had_stack)))
    if sorted(locked.get("allow", [])) != sorted(here.get("allow", [])):
        items = sorted(locked.get("allow", []))
        fix = f"pass exactly the lock's: {allow_hint(items, syntax)}" if items else "pass no allow items"
        out.append(Difference("allow items", _show(items), _show(sorted(here.get("allow", []))), fix))
    had_k, has_k = locked.get("kernels", {}), here.get("kernels", {})
    for kernel in had_k:
        out.extend(_kernel_differences(kernel, had_k[kernel], has_k.get(kernel, {})))
    for kernel in has_k:  # both ways: a kernel the check requires that the lock has no entry for vouches nothing
        if kernel not in had_k:
            out.append(Difference(kernel, "no entry for it", _entry_text(has_k[kernel]),
                                  "write the lock again where the image is built (kernelguard lock --output FILE): "
                                  "a lock without this kernel's entry cannot say which build of it the image verified"))
    from kernelguard.resolution import kernels_cache_dir

    out += [Difference(*found) for found in hub_repo_differences(
        locked.get("hub_repos"), here.get("hub_repos"), transformers=had_stack.get("transformers"),
        cache_dir=str(kernels_cache_dir()))]
    had_b, has_b = locked.get("fla_backend", {}), here.get("fla_backend", {})
    for arch in had_b:
        a, b = had_b[arch], has_b.get(arch, {})
        if a != b:
            where = f" on sm {arch}" if arch else ""
            out.append(Difference(f"fla GDN backward backend{where}", _show(a.get("backward")),
                                  _show(b.get("backward")), fla_backend_command(a.get("backward"), b.get("backward"))))
    if locked.get("fla_autotune_pins", []) != here.get("fla_autotune_pins", []):
        version = had_stack.get("kernelguard")
        out.append(Difference("fla autotune pins", _pins_text(locked), _pins_text(here),
                              f"install kernelguard {version}, the release the lock was written with (its pins file)"))
    return out


def _entry_text(entry: Mapping[str, Any]) -> str:
    versions = ", ".join(f"{d} {v}" for d, v in entry.get("distributions", {}).items())
    provider = entry.get("provider") or "no fast provider"
    return f"{provider} ({versions})" if versions else str(provider)


def _pins_text(lock: Mapping[str, Any]) -> str:
    pins = lock.get("fla_autotune_pins", [])
    return ", ".join(f"sm {p['capability']} Triton {p['triton']} fla {p['fla']} ({str(p['sha256'])[:12]})"
                     for p in pins) or "none"


# ----------------------------------------------------------------------------------------------- verify ---
def _gpu_differences(result: CheckResult, locked: Mapping[str, Any], model: str) -> list[Difference]:
    """On a GPU node: every visible GPU's arch must be one the lock was written for."""
    archs = [ComputeCapability.parse(a, source="the lock's target_archs") for a in locked.get("target_archs", [])]
    out = []
    for gpu in result.env.gpus:
        here = ComputeCapability.parse(gpu.capability, source="a visible GPU")
        if archs and here.base not in {a.base for a in archs}:
            out.append(Difference(
                f"GPU {gpu.index} ({gpu.name}) arch", ", ".join(map(str, archs)), str(here),
                f"run on a GPU the lock targets, or write a lock for this one where the image is built: "
                f"kernelguard lock --model {model} --arch {here.base}"))
    return out


def verify_lock(
    path: str | os.PathLike[str], *, allow: Any = None, syntax: str = CLI, option: str = "--lock",
    given: Mapping[str, Any] | None = None,
) -> CheckResult:
    """Check this node against the lock at ``path``. ``allow`` None: the lock's own allow items; otherwise the
    caller's, which must equal the lock's. ``given``: the model, mode, arch, packed and hub the caller passed
    explicitly (None: not passed); one that contradicts the lock is a usage error (:func:`refuse_contradictions`).
    Raises :class:`LockMismatch` with one line per difference; returns the check (its verdict may still fail: the
    caller reports that as for any check)."""
    locked = read_lock(path, option=option)
    refuse_contradictions(locked, given or {}, syntax=syntax, option=option)
    model = locked.get("model", {})
    name = str(model.get("name") or model.get("family") or "qwen3_5")
    if not Path(name).exists() and ("/" in name or name.endswith(".json")):
        name = str(model.get("family"))  # the image's config file is not on this node: its family still is
    options = CheckOptions(
        model=name, mode=str(model.get("mode", "training")), archs=tuple(locked.get("target_archs", [])),
        allow=tuple(locked.get("allow", [])) if allow is None else allow, packed=model.get("packed"),
        hub=bool(model.get("hub", False)), hub_repos="hub_repos" in locked,
    )
    result = run_check(options)
    differences = _gpu_differences(result, locked, name) + compare(locked, build_lock(result), syntax=syntax)
    if differences:
        archs = locked.get("target_archs", [])
        target = f"on sm {', '.join(archs)}" if archs else "with no target arch (written without --arch or a GPU)"
        raise LockMismatch(
            f"this node's stack differs from {path} (written for {model.get('family')} {model.get('mode')} "
            f"{target}): {len(differences)} difference(s), so the kernels the image verified are not the ones this "
            "job would run.",
            differences=tuple(d.line() for d in differences), lock=str(path),
            fix=f"run each restore above; or rebuild the image and its lock: {rebuild_command(locked, path)}",
        )
    return result


