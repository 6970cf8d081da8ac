"""Which Kernel Hub build variant would ``kernels`` pick for a target environment, offline and without a GPU.

Everything that decides (variant-name parsing, compatibility checks, preference order, the
``LOCAL_KERNELS`` syntax, cached version refs, metadata checks) is delegated to the ``kernels`` package
itself; this module only finds the repository's files on disk and turns kernels' decisions into verdicts.

Seam used for made-up targets: kernels' public resolvers (``resolve_variants``, ``get_kernel_variants``)
only read the live system, but they are thin wrappers around
``_resolve_variant_for_system`` in kernels' variants module, which takes every system fact as an argument
(backend object, cpu, os, torch version, cxx11 ABI, tvm-ffi version, from 0.17 the macOS version, from 0.19
the Python version, free-threading and MLX). :mod:`kernelguard.resolution.providers.kernels_target` builds those from a
target, with a ``Backend`` made by kernels' own ``parse_backend``/``CUDA``. ``get_kernel_variants``
is not used: it lists the repository tree over the network.

Releases differ in their private helpers; :mod:`kernelguard.resolution.providers.kernels_release` finds them by feature
detection, and a missing one becomes a note here, never an import error.

``kernels`` is an optional extra (``pip install 'kernelguard-gdn[hub]'``) imported lazily (torch is not imported
by it) and any failure of it degrades into a probe with a ``note``; ``probe_hub_kernel`` never raises.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..facts import HubKernelProbe, HubTarget, VariantVerdict
from ..versions import hub_ref
from .kernels_release import KernelsRelease, import_kernels
from .kernels_target import resolver_arguments

__all__ = [
    "SOURCE_LOCAL_FOLDER",
    "SOURCE_LOCAL_KERNELS",
    "SOURCE_NOT_AVAILABLE",
    "SOURCE_OFFLINE_CACHE",
    "TRUSTED_ORGS",
    "HubKernelProbe",
    "HubTarget",
    "VariantVerdict",
    "kernels_cache_dir",
    "local_kernels_repos",
    "probe_hub_kernel",
]

# kernels 0.17.2 has no hard-coded allow-list: ``kernels.hf_hub._check_trust_remote_code`` asks the Hub
# (``get_organization_overview(org).trustedKernelPublisher``) and skips the check entirely in offline
# mode and for LOCAL_KERNELS paths. transformers 5.23 treats "repos outside `kernels-community`" as
# untrusted (transformers/integrations/hub_kernels.py: ``ALLOW_ALL_KERNELS`` comment, ``allow_all_kernels``
# docstring; modeling_utils.py), and passes ``trust_remote_code=True`` explicitly for every other org it
# maps (Atlas-Inference, biohub). Offline we cannot ask the Hub, so we use transformers' static view.
TRUSTED_ORGS: tuple[str, ...] = ("kernels-community",)

SOURCE_LOCAL_KERNELS = "LOCAL_KERNELS"
SOURCE_LOCAL_FOLDER = "local folder"
SOURCE_OFFLINE_CACHE = "offline cache"
SOURCE_NOT_AVAILABLE = "not available offline"


@dataclass(slots=True)
class _Location:
    source: str
    path: Path | None
    revision: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Resolution:
    chosen: str | None
    verdicts: list[VariantVerdict]
    variant_path: Path | None
    notes: list[str] = field(default_factory=list)


def probe_hub_kernel(
    repo_id: str,
    *,
    target: HubTarget | None = None,
    local_path: str | None = None,
    allow_untrusted: bool = False,
    revision: str | None = None,
    version: int | None = None,
    check_arch: bool = True,
) -> HubKernelProbe:
    """Say which build variant of ``repo_id`` kernels would load for ``target`` (None: this system).

    Lookup order: ``local_path``, then ``LOCAL_KERNELS``, then the Hugging Face cache (local files only).
    ``revision``/``version`` pick the cached snapshot like ``get_kernel(revision=/version=)``; without
    either, the newest cached ``vN`` ref, else ``main``. ``check_arch``: as the mapping's repository passes it
    to kernels (False: a build whose declared archs miss the GPU is loaded anyway).
    """
    trusted = _is_trusted(repo_id, allow_untrusted)
    try:
        kernels = import_kernels()
    except Exception as exc:  # noqa: BLE001 - a broken install fails with anything, not just ImportError
        return _empty_probe(repo_id, trusted, f"kernels could not be imported: {exc!r}.")
    try:
        return _probe(kernels, repo_id, target, local_path, trusted, revision, version, check_arch)
    except Exception as exc:  # noqa: BLE001 - kernels internals drift between releases; report, never raise
        return _empty_probe(repo_id, trusted, f"kernels failed while resolving {repo_id}: {exc!r}.")


def local_kernels_repos() -> frozenset[str]:
    """The repositories ``LOCAL_KERNELS`` serves from a folder, read with the installed kernels' own parser
    (the one ``get_kernel`` uses); empty when it is unset, kernels is missing or rejects it (nothing served)."""
    raw = os.environ.get("LOCAL_KERNELS")
    if raw is None:
        return frozenset()
    try:
        kernels = import_kernels()
        return frozenset(kernels.parse_local_kernels(raw)) if kernels.parse_local_kernels else frozenset()
    except Exception:  # noqa: BLE001 - no kernels, or a value it rejects: no repository is served locally
        return frozenset()


def _probe(
    kernels: KernelsRelease,
    repo_id: str,
    target: HubTarget | None,
    local_path: str | None,
    trusted: bool,
    revision: str | None,
    version: int | None,
    check_arch: bool = True,
) -> HubKernelProbe:
    located = _locate(kernels, repo_id, local_path, revision, version)
    location = str(located.path) if located.path is not None else None
    if not trusted:
        # kernelguard refuses before looking at variants, as kernels does online (trust before download).
        note = _join([_untrusted_message(repo_id), *located.notes])
        return HubKernelProbe(repo_id, located.source, location, located.revision, None, (), False, note)
    if located.source == SOURCE_NOT_AVAILABLE or located.path is None:
        return HubKernelProbe(
            repo_id, located.source, location, located.revision, None, (), True, _join(located.notes)
        )
    resolution = _resolve_location(kernels, located, target)
    notes = located.notes + resolution.notes
    if resolution.chosen is not None and resolution.variant_path is not None:
        notes += _chosen_variant_notes(kernels, resolution.variant_path, target, check_arch)
    return HubKernelProbe(
        repo_id=repo_id,
        source=located.source,
        location=location,
        revision=located.revision,
        chosen_variant=resolution.chosen,
        variants=tuple(resolution.verdicts),
        trusted=True,
        note=_join(notes),
    )


# --- trust ---------------------------------------------------------------------------------------------


def _is_trusted(repo_id: str, allow_untrusted: bool) -> bool:
    org = repo_id.split("/", 1)[0] if "/" in repo_id else ""
    return allow_untrusted or org in TRUSTED_ORGS


def _untrusted_message(repo_id: str) -> str:
    return (
        f"Repository {repo_id} is outside the trusted organisations ({', '.join(TRUSTED_ORGS)}); "
        f"pass --allow untrusted-hub-repo to accept it."
    )


def _empty_probe(repo_id: str, trusted: bool, note: str) -> HubKernelProbe:
    notes = [note] if trusted else [_untrusted_message(repo_id), note]
    return HubKernelProbe(repo_id, SOURCE_NOT_AVAILABLE, None, None, None, (), trusted, " ".join(notes))


# --- where the files are ------------------------------------------------------------------------------


def _locate(
    kernels: KernelsRelease, repo_id: str, local_path: str | None, revision: str | None, version: int | None
) -> _Location:
    if local_path is not None:
        path = Path(local_path)
        notes = [] if path.is_dir() else [f"The local folder {path} does not exist."]
        return _Location(SOURCE_LOCAL_FOLDER, path, notes=notes)
    from_env = _from_local_kernels(kernels, repo_id)
    if from_env.path is not None:
        return from_env
    from_cache = _from_offline_cache(kernels, repo_id, revision, version)
    from_cache.notes[:0] = from_env.notes
    return from_cache


def _from_local_kernels(kernels: KernelsRelease, repo_id: str) -> _Location:
    raw = os.environ.get("LOCAL_KERNELS")
    if raw is None:  # kernels only skips the override when the variable is unset, not when it is empty
        return _Location(SOURCE_LOCAL_KERNELS, None)
    if kernels.parse_local_kernels is None:
        note = f"kernels {kernels.version} has no LOCAL_KERNELS parser kernelguard knows, so LOCAL_KERNELS is ignored."
        return _Location(SOURCE_LOCAL_KERNELS, None, notes=[note])
    try:
        # kernels' own parser, so the syntax (repo=path:repo=path) and its errors match get_kernel's.
        overrides: dict[str, Path] = kernels.parse_local_kernels(raw)
    except ValueError as exc:
        return _Location(SOURCE_LOCAL_KERNELS, None, notes=[f"kernels rejects LOCAL_KERNELS: {exc}"])
    path = overrides.get(repo_id)
    if path is None:
        return _Location(SOURCE_LOCAL_KERNELS, None)
    notes = [] if path.is_dir() else [f"LOCAL_KERNELS maps {repo_id} to {path}, which does not exist."]
    return _Location(SOURCE_LOCAL_KERNELS, path, notes=notes)


def kernels_cache_dir() -> Path:
    """The folder kernels reads its Hub cache from."""
    return _cache_dir()


def _cache_dir() -> Path:
    # Same variable kernels reads (kernels.hf_hub._get_cache_dir), falling back to the HF hub cache.
    from huggingface_hub import constants

    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)


def _cache_revision(kernels: KernelsRelease, repo_id: str, revision: str | None, version: int | None) -> str:
    if kernels.versions is None:
        if version is not None:
            raise ValueError(f"kernels {kernels.version} cannot read cached version refs (no kernels._versions)")
        return revision or "main"
    if revision is not None or version is not None:
        return _select_cached_ref(kernels.versions, repo_id, revision, version)
    cached = kernels.versions._get_available_versions_from_cache(repo_id)
    return str(cached[max(cached)].target_commit) if cached else "main"


def _select_cached_ref(versions: ModuleType, repo_id: str, revision: str | None, version: int | None) -> str:
    # kernels' own revision/version selection (same errors as get_kernel), reading refs/vN from the cache only;
    # each release names it differently, so the first one this release has is used.
    resolve = getattr(versions, "resolve_revision_or_version", None)  # 0.18+: returns the commit (an Oid)
    if resolve is None:
        resolve = getattr(versions, "select_revision_or_version", None)  # 0.16, 0.17: returns the ref
    if resolve is not None and "local_files_only" in inspect.signature(resolve).parameters:
        return str(resolve(repo_id, revision=revision, version=version, local_files_only=True))
    # kernels 0.16's selection lists refs on the Hub unless HF_HUB_OFFLINE is set: read the cache as it
    # does offline (same helper, same errors), so the probe never touches the network.
    if revision is not None and version is not None:
        raise ValueError("Only one of `revision` or `version` must be specified.")
    if revision is not None:
        return revision
    cached = versions._get_available_versions_from_cache(repo_id)
    if version not in cached:
        available = ", ".join(str(v) for v in sorted(cached)) or "none"
        raise ValueError(f"Version {version} not found in the local cache, available versions: {available}")
    return str(cached[version].target_commit)


def _from_offline_cache(
    kernels: KernelsRelease, repo_id: str, revision: str | None, version: int | None
) -> _Location:
    from huggingface_hub import snapshot_download

    cache_dir = _cache_dir()
    try:
        ref = _cache_revision(kernels, repo_id, revision, version)
        # Same call as kernels.resolver.resolve_hub_cache_kernel; local_files_only never touches the network.
        snapshot = Path(
            snapshot_download(
                repo_id, repo_type="kernel", revision=ref, cache_dir=str(cache_dir), local_files_only=True
            )
        )
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError, kernels' ValueError for a missing vN
        ref = hub_ref(version, revision)  # kernels' vN refs are branches
        return _Location(SOURCE_NOT_AVAILABLE, cache_dir, notes=[_not_found_message(repo_id, cache_dir, exc, ref)])
    return _Location(SOURCE_OFFLINE_CACHE, snapshot / "build", revision=snapshot.name)


def _not_found_message(repo_id: str, cache_dir: Path, exc: Exception, ref: str) -> str:
    # The revision the load asks for, into the cache folder kernels reads: the download writes the snapshot and,
    # for a vN branch, the ref that kernels resolves the version through offline.
    return (
        f"No local copy of {repo_id} was found: LOCAL_KERNELS has no entry for it and the offline cache "
        f"{cache_dir} has no usable snapshot ({_first_sentence(exc)}). While online, run "
        f"`hf download {repo_id} --repo-type kernel --revision {ref} --cache-dir {cache_dir}` (or "
        f"`kernels download <project>` for a locked project), or set LOCAL_KERNELS={repo_id}=<path>."
    )


# --- which variant --------------------------------------------------------------------------------------


def _resolve_location(kernels: KernelsRelease, located: _Location, target: HubTarget | None) -> _Resolution:
    assert located.path is not None
    if located.source == SOURCE_OFFLINE_CACHE:
        return _resolve_base(kernels, located.path, target)
    # kernels.resolver.resolve_local_kernel tries the folder itself, then its build/, first match wins.
    bases = [b for b in (located.path, located.path / "build") if b.is_dir()]
    resolutions = [_resolve_base(kernels, base, target) for base in bases]
    for resolution in resolutions:
        if resolution.chosen is not None:
            return resolution
    if (located.path / "metadata.json").is_file():
        return _folder_is_variant(located.path)
    if not resolutions:
        return _Resolution(None, [], None)
    # Nothing fits: report the base with the most variants (the build/ folder on ties, the Hub layout).
    return max(reversed(resolutions), key=lambda r: len(r.verdicts))


def _folder_is_variant(path: Path) -> _Resolution:
    # kernels' fallback when a LOCAL_KERNELS/local path points straight at one variant folder.
    reason = (
        "The folder itself holds metadata.json, so kernels loads it as the variant without checking "
        "its name against the target."
    )
    return _Resolution(path.name, [VariantVerdict(path.name, True, reason)], path)


def _resolve_base(kernels: KernelsRelease, base: Path, target: HubTarget | None) -> _Resolution:
    if not base.is_dir():
        return _Resolution(None, [], None, notes=[f"{base} does not exist, so there are no build variants."])
    parsed, unparsable = _parse_variant_dirs(kernels, base)
    trace, notes = _decide(kernels, parsed, target)
    verdicts, chosen = _verdicts_from_trace(kernels, trace)
    considered = {v.variant for v in verdicts}
    for variant in parsed:  # kernels drops arch variants from its trace on free-threaded Python < 3.15
        if variant.variant_str not in considered:
            reason = "kernels left this variant out of its decision (arch kernels need a GIL-enabled Python)."
            verdicts.append(VariantVerdict(variant.variant_str, False, reason))
    verdicts += unparsable
    return _Resolution(chosen, verdicts, base / chosen if chosen is not None else None, notes)


def _parse_variant_dirs(kernels: KernelsRelease, base: Path) -> tuple[list[Any], list[VariantVerdict]]:
    # Folder listing as in kernels.variants.get_variants_local, but keeping the parse errors it swallows.
    parsed: list[Any] = []
    unparsable: list[VariantVerdict] = []
    for entry in sorted(base.iterdir()):
        if not entry.is_dir() or entry.name.startswith((".", "_")):  # __pycache__, .git: never variants
            continue
        try:
            parsed.append(kernels.variants.parse_variant(entry.name))
        except ValueError as exc:
            reason = _rejected(f"this folder name is not a build variant it can read ({exc})")
            unparsable.append(VariantVerdict(entry.name, False, reason))
    return parsed, unparsable


def _decide(kernels: KernelsRelease, parsed: list[Any], target: HubTarget | None) -> tuple[list[Any], list[str]]:
    if target is None:
        _, trace = kernels.variants.resolve_variants(parsed)  # the live system, exactly as get_kernel does
        return list(trace), []
    resolve = getattr(kernels.variants, "_resolve_variant_for_system", None)
    if resolve is None:
        raise LookupError(
            f"kernels {kernels.version} has no {kernels.variants.__name__}._resolve_variant_for_system, so only "
            "this machine (no --arch or other made-up target) can be resolved"
        )
    arguments, notes = resolver_arguments(kernels, target, set(inspect.signature(resolve).parameters))
    _, trace = resolve(variants=parsed, **arguments)
    return list(trace), notes


def _verdicts_from_trace(kernels: KernelsRelease, trace: list[Any]) -> tuple[list[VariantVerdict], str | None]:
    # The trace is already in kernels' preference order: the first accepted decision is what it loads.
    accepted = [d.variant.variant_str for d in trace if isinstance(d, kernels.variants.VariantAccepted)]
    chosen = accepted[0] if accepted else None
    verdicts = []
    for decision in trace:
        name = decision.variant.variant_str
        if isinstance(decision, kernels.variants.VariantAccepted):
            reason = (
                "Compatible with the target, and kernels prefers it over every other compatible variant."
                if name == chosen
                else f"Compatible with the target, but kernels prefers {chosen}."
            )
            verdicts.append(VariantVerdict(name, True, reason))
        else:
            reason = _rejected(decision.reason or "no reason given")
            verdicts.append(VariantVerdict(name, False, reason))
    return verdicts, chosen


# --- checks kernels runs on the chosen variant at load time --------------------------------------------


def _chosen_variant_notes(kernels: KernelsRelease, variant_path: Path, target: HubTarget | None,
                          check_arch: bool = True) -> list[str]:
    metadata_path = variant_path / "metadata.json"
    if not metadata_path.is_file():
        return [f"Variant {variant_path.name} has no metadata.json, so kernels would fail to load it."]
    try:
        metadata = kernels.metadata_type.read_from_file(metadata_path)
    except ValueError as exc:
        return [f"kernels cannot read {metadata_path}, so it would fail to load the variant: {exc}"]
    notes = []
    if kernels.minver_problem is not None:  # metadata "kernels-minver" vs the installed kernels
        problem = kernels.minver_problem(metadata, variant_path)
        if problem:
            notes.append(problem)
    capability = target.gpu_capability if target is not None else None
    if capability is not None:
        notes += _arch_notes(kernels, metadata, variant_path.name, capability, check_arch)
    return notes


def _arch_notes(kernels: KernelsRelease, metadata: Any, variant: str, capability: tuple[int, int],
                check_arch: bool = True) -> list[str]:
    # Mirrors kernels.archs._check_arch_incompatibility, which reads the live device; we feed the target's.
    archs = list(metadata.backend.archs or [])
    backend_type = metadata.backend.backend_type
    if not archs or backend_type != getattr(type(backend_type), "CUDA", None):
        return []
    wanted = f"{capability[0]}.{capability[1]}"
    if kernels.supports_capability is None:
        unchecked = (
            f"kernels {kernels.version} has no CUDA arch check kernelguard can reuse, so variant {variant}'s "
            f"declared archs ({', '.join(archs)}) were not checked against compute capability {wanted}."
        )
        return [unchecked]
    if kernels.supports_capability(archs, capability):
        return []
    declared = (f"Variant {variant} declares CUDA archs {', '.join(archs)}, which do not cover compute capability "
                f"{wanted}")
    if not check_arch:  # the mapping turned kernels' refusal off: it loads, and runs only if the archs undersold it
        return [f"{declared}; transformers' kernel mapping passes check_arch=False, so kernels loads it anyway and "
                "it may fail or crash the process at run time on this GPU."]
    return [f"{declared}; kernels would refuse to load it unless check_arch=False."]


def _rejected(kernels_reason: str) -> str:
    # kernels' reasons are lower-case fragments ("backend (cu128) does not match selected backend (cpu)");
    # keep them verbatim so users can grep kernels' sources/issues for them, and make a sentence around.
    reason = kernels_reason.strip().rstrip(".")
    return f"Rejected by kernels: {reason}."


def _first_sentence(exc: Exception) -> str:
    # huggingface_hub's offline error goes on to suggest local_files_only=False, which is not our advice.
    return f"{type(exc).__name__}: {str(exc).split('. ')[0].rstrip('.')}"


def _join(notes: list[str]) -> str | None:
    return " ".join(notes) if notes else None
