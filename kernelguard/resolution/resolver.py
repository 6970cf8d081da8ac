"""Pure resolution: facts + requirements -> decisions with reasons. No probing, no torch import.

Every candidate provider of every required kernel gets one ``Decision``: accepted or rejected, with a full
sentence that says what was expected and what was found, and the command that fixes it. The first accepted
candidate, in the order transformers tries them, serves the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .capability import ComputeCapability
from .catalog import PACKED_REFERENCE, VARLEN_ATTENTION, KernelRequirement, Requirements
from .decisions import ACCEPTED, FALLBACK, REJECTED, SELECTED, SKIPPED, Decision
from .facts import Facts, PackageFacts
from .family_support import PACKED_ROWS, packed_rows_decision
from .hub_load import hub_notes, import_decision, kernels_outside_window, load_decision, no_variant_fix
from .install import cuda_torch_command, install_command, upgrade_command
from .issue_match import handed_issues, issue_matches, issue_sentence
from .known_issues import KNOWN_ISSUES, KnownIssue
from .target import Target
from .versions import base_version as _base_version
from .versions import torch_minor as _torch_minor
from .versions import version_in as _version_in

__all__ = ["KernelVerdict", "Resolution", "Target", "resolve"]


@dataclass(frozen=True, slots=True)
class KernelVerdict:
    kernel: str
    candidates: tuple[Decision, ...]
    ok: bool  # a fast provider serves it, or its fallback was explicitly allowed

    @property
    def selected(self) -> Decision | None:
        return next((d for d in self.candidates if d.status == SELECTED), None)


@dataclass(frozen=True, slots=True)
class Resolution:
    requirements: Requirements
    target: Target
    verdicts: tuple[KernelVerdict, ...]
    notes: tuple[str, ...]  # things the user must know that are not one kernel's decision
    unchecked: tuple[str, ...]  # what could not be checked here, and how to check it
    load_error: Decision | None = None  # from_pretrained itself raises (kernelguard.resolution.hub_load.load_decision)

    @property
    def ok(self) -> bool:
        return self.load_error is None and all(v.ok for v in self.verdicts)


# --------------------------------------------------------------------------------------------- helpers


# --------------------------------------------------------------------------------------------- candidates


def _hub_decision(req: KernelRequirement, facts: Facts, target: Target, requirements: Requirements) -> Decision | None:
    if req.hub is None:
        return None
    label = f"hub {req.hub.repo_id}"
    if req.hub.revision:
        label += f"@{req.hub.revision[:12]}"
    elif req.hub.version is not None:
        label += f" (version {req.hub.version})"

    def rejected(reason: str, fix: str | None = None, status: str = REJECTED) -> Decision:
        return Decision(req.kernel, label, "hub", status, reason, fix)

    if not target.use_hub:
        why = f" ({target.hub_source})" if target.hub_source else ""
        return rejected(
            f"not requested{why}: transformers only swaps in Kernel Hub kernels when the model is loaded with "
            "use_kernels=True (pass --hub to check them).",
            status=SKIPPED,
        )
    if facts.env.version_of("kernels") is None:
        return rejected("the kernels package is not installed, so from_pretrained(use_kernels=True) raises "
                        "ValueError: Kernels are not available.", _install_fix("kernels", facts, Target()))
    for issue in KNOWN_ISSUES:  # before the window: "loads nothing at all" says more than "outside the window"
        if issue.provider == "hub" and issue.kernels_version and issue.detector is None \
                and _version_in(_base_version(facts.env.version_of("kernels")), issue.kernels_version) \
                and not target.allow.allows_issue(issue.id):
            return Decision(req.kernel, label, "hub", REJECTED, issue_sentence(issue, allowed=False),
                            _install_fix("kernels", facts, Target()), (issue.id,))
    outside = kernels_outside_window(facts)
    if outside:
        return rejected(f"{outside}.", _install_fix("kernels", facts, Target()))
    probe = facts.hub.get(req.hub.repo_id)
    if probe is None:
        return rejected("the Hub repository was not probed.")
    if not probe.trusted and not target.allow.allows_untrusted_hub():
        return rejected(
            f"repository {req.hub.repo_id} is outside the trusted organisations.",
            "pass --allow untrusted-hub-repo to accept it",
        )
    if probe.chosen_variant is None:
        rejections = "; ".join(f"{v.variant}: {v.reason.rstrip('.')}" for v in probe.variants if not v.accepted)
        where = f"{probe.source}" + (f" at {probe.location}" if probe.location else "")
        detail = f" Variants: {rejections}." if rejections else ""
        note = f" {probe.note}" if probe.note else ""
        return rejected(f"no build variant matches this system ({where}).{detail}{note}", no_variant_fix(req.hub, probe))
    layer = facts.hub_layers.get(req.kernel)
    if layer is not None and layer.problem is not None:
        note = f" ({layer.note})" if layer.note else ""
        return rejected(
            f"build variant {probe.chosen_variant} from {probe.source}, loaded for transformers' call "
            f"{layer.call}: {layer.problem.rstrip('.')}{note}.",
            layer.fix or f"use a revision of {req.hub.repo_id} whose `{req.hub.layer_name}` layer the installed "
            "kernels accepts and that takes this call, or load without use_kernels=True and install the package",
        )
    judged = f"; {layer.judged_by} accepts its `{layer.layer_name}` layer" if layer is not None and layer.judged_by \
        else ""
    note = f" ({layer.note})" if layer is not None and layer.note else ""
    handed, sentences = handed_issues(req.kernel, layer.hands_to if layer else (), facts, target, requirements)
    blocking = [i for i in handed if not target.allow.allows_issue(i.id)]
    return Decision(
        req.kernel, label, "hub", REJECTED if blocking else ACCEPTED,
        f"build variant {probe.chosen_variant} from {probe.source}{judged}{note}{sentences}.",
        blocking[0].fix if blocking else None, tuple(i.id for i in handed),
    )


def _package_decision(
    req: KernelRequirement, facts: Facts, target: Target, requirements: Requirements, unchecked: list[str]
) -> Decision | None:
    spec = req.package_spec
    if spec is None or req.module is None:
        return None
    label = f"{spec.import_name} ({req.module}.{req.kernel})"
    found = facts.packages.get(req.module)

    install = _install_fix(spec.import_name, facts, target)

    def rejected(reason: str, fix: str | None = install, issues: tuple[str, ...] = ()) -> Decision:
        return Decision(req.kernel, label, "package", REJECTED, reason, fix, issues)

    if found is None or (found.version is None and found.import_error is not None):
        return rejected(f"{' / '.join(spec.distributions)} is not installed (import {req.module!r} failed).")
    minimum = facts.transformers_min_versions.get(spec.import_name)
    if minimum and not _version_in(_base_version(found.version), f">={minimum}"):
        return rejected(
            f"{found.distribution} {found.version} is older than {minimum}, the minimum transformers requires.",
            upgrade_command(str(found.distribution), minimum),
        )
    broken = _broken_import(req, found, facts, target)
    if broken is not None:
        return rejected(*broken)
    if target.archs and "cuda" not in found.devices:
        return rejected(
            f"it runs on {', '.join(found.devices)} ({found.devices_source}), the target is a CUDA GPU.", None
        )
    arch_problems = _arch_problems(found, target, unchecked, label)
    if arch_problems:
        return rejected(arch_problems)
    matched: list[str] = []
    for issue in KNOWN_ISSUES:
        hit, unknown = issue_matches(issue, req.kernel, spec.import_name, found.version, facts, target, requirements)
        if unknown:
            unchecked.append(f"{req.kernel}: {unknown}")
        if not hit:
            continue
        matched.append(issue.id)
        if not target.allow.allows_issue(issue.id):
            return rejected(issue_sentence(issue, allowed=False), _issue_fix(issue, facts, target), tuple(matched))
    reason = f"{found.distribution or spec.import_name} {found.version or '(no version)'} imports {req.module}.{req.kernel}"
    if spec.compiled and found.extensions:
        reason += f"; extensions load and contain {_describe_targets(found)}"
    reason += "."
    for issue_id in matched:
        issue = next(i for i in KNOWN_ISSUES if i.id == issue_id)
        reason += f" Note: {issue_sentence(issue, allowed=True)}."
    return Decision(req.kernel, label, "package", ACCEPTED, reason, None, tuple(matched))


_DEATHS = ("crashes on import", "hangs on import", "exits the interpreter on import")


def _broken_import(
    req: KernelRequirement, found: PackageFacts, facts: Facts, target: Target
) -> tuple[str, str | None, tuple[str, ...]] | None:
    """(reason, fix, known issues) when the package is installed but its import or an extension fails."""
    broken = [e for e in found.extensions if e.load_error]
    if not (found.import_error or broken):
        return None
    error = found.import_error or broken[0].load_error or ""
    reinstall = _install_fix(found.import_name, facts, target, reinstall=True)
    if error.startswith(_DEATHS):
        reason = (f"importing {req.module} kills the Python process: {error}. transformers imports it the same "
                  "way when the modeling module loads, so the job would die there.")
        return reason, reinstall, ()
    if "undefined symbol" in error:
        torch_now = _torch_minor(facts.env.torch_version.value)
        built = f"built for torch {found.built_for_torch}" if found.built_for_torch else "built for another torch"
        reason = (f"its compiled extension does not load against the installed torch "
                  f"{facts.env.torch_version.value} ({error}): {built}, found torch {torch_now}.")
        return reason, reinstall, ("extension-built-for-other-torch",)
    return (f"importing {req.module}.{req.kernel} fails exactly as transformers would see it: {error}.",
            _install_fix(found.import_name, facts, target), ())


def _install_fix(package: str, facts: Facts, target: Target, *, reinstall: bool = False) -> str:
    """The exact install command for this torch / CUDA / ABI / archs (kernelguard.resolution.install), with its caveats."""
    env = facts.env
    abi = env.cxx11_abi.value
    advice = install_command(
        package, torch_version=env.torch_version.value, cuda_version=env.cuda_version.value, archs=target.archs,
        cxx11_abi=abi if isinstance(abi, bool) else None, python_version=str(env.python.value or "3.11"),
        machine=str(env.machine.value or "x86_64"), kernels_window=facts.kernels_window, reinstall=reinstall,
        kernels_core=facts.hub_load is not None and facts.hub_load.kernels_core,
    )
    return advice.fix_line()


def _issue_fix(issue: KnownIssue, facts: Facts, target: Target) -> str:
    """A known issue's fix for these facts: the install built for this torch, then the allow way out."""
    if issue.fix_install is None:
        return issue.fix
    return f"{_install_fix(issue.fix_install, facts, target)}; or {issue.accept}"


def _describe_targets(found: PackageFacts) -> str:
    sass = sorted({s for e in found.extensions for s in e.sass})
    ptx = sorted({p for e in found.extensions for p in e.ptx})
    parts = [", ".join(sass) + " SASS" if sass else "no SASS", ", ".join(ptx) + " PTX" if ptx else "no PTX"]
    return " and ".join(parts)


def _arch_problems(found: PackageFacts, target: Target, unchecked: list[str], label: str) -> str | None:
    if not found.extensions:
        return None
    if not target.archs:
        unchecked.append(f"{label}: GPU archs compiled into its extensions were read ({_describe_targets(found)}) "
                         "but not compared with a target (pass --arch, e.g. --arch 9.0)")
        return None
    for extension in found.extensions:
        if extension.arch_error:
            if "no embedded CUDA code" in extension.arch_error:
                continue  # a host-only helper library inside the wheel
            unchecked.append(f"{label}: could not read the GPU code of {extension.path}: {extension.arch_error}")
            continue
        for arch in target.archs:
            ok, sentence = _as_targets(extension).runs_on(arch)
            if not ok:
                return f"{extension.path.rsplit('/', 1)[-1]} cannot run on compute capability {arch}: {sentence}"
    return None


def _as_targets(extension: Any) -> Any:
    from .providers.fatbin import CudaTargets

    return CudaTargets(
        path=extension.path,
        sass=extension.sass,
        ptx=extension.ptx,
        method=extension.arch_method or "elf-fatbin",
        error=extension.arch_error,
    )


def _reference_decision(kernel: str, target: Target, call_site: str, requirements: Requirements) -> Decision:
    packed_training = requirements.packed and requirements.mode == "training"
    asked = target.allow.allows_fallback(kernel)
    reason = (
        f"{call_site} is transformers' pure-PyTorch reference: correct but slow in training (launch-bound; GPU "
        "utilisation still reads high; measured on one H200: kernelguard train's fast path ran 6.8x this path's "
        "tokens/s on a 1.16 B Qwen3.5-shaped proxy, bench/RESULTS.md 1.5)"
    )
    if asked and packed_training:
        return Decision(kernel, "torch reference", "reference", FALLBACK, f"{reason}; {PACKED_REFERENCE}.",
                        "install a fast provider above, or check unpacked training with --no-packed")
    reason += "; explicitly allowed by --allow." if asked else "; used only when every provider above is rejected."
    return Decision(kernel, "torch reference", "reference", FALLBACK, reason)


def _finish(kernel: str, candidates: list[Decision], allowed_fallback: bool) -> KernelVerdict:
    promoted: list[Decision] = []
    chosen = False
    for decision in candidates:
        if decision.status == ACCEPTED and not chosen or decision.status == FALLBACK and not chosen and allowed_fallback:
            decision = Decision(**{**_fields(decision), "status": SELECTED})
            chosen = True
        promoted.append(decision)
    return KernelVerdict(kernel, tuple(promoted), ok=chosen)


def _fields(decision: Decision) -> dict[str, Any]:
    return {name: getattr(decision, name) for name in Decision.__slots__}


def _resolve_kernel(req: KernelRequirement, facts: Facts, target: Target, requirements: Requirements,
                    unchecked: list[str]) -> KernelVerdict:
    candidates = [
        d
        for d in (_hub_decision(req, facts, target, requirements), _package_decision(req, facts, target, requirements, unchecked))
        if d is not None
    ]
    candidates.append(_reference_decision(req.kernel, target, req.call_site, requirements))
    packed_training = requirements.packed and requirements.mode == "training"
    return _finish(req.kernel, candidates, allowed_fallback=target.allow.allows_fallback(req.kernel)
                   and not packed_training)


def _resolve_attention(facts: Facts, target: Target, unchecked: list[str]) -> KernelVerdict:
    """Packed training needs an attention that takes cu_seqlens instead of an O(T^2) block mask."""
    candidates: list[Decision] = []
    flash = facts.packages.get("flash_attn")
    install = _install_fix("flash_attn", facts, target)
    if flash is None or flash.version is None:
        candidates.append(Decision(VARLEN_ATTENTION, "flash_attn (flash_attn_varlen_func)", "package", REJECTED,
                                   "flash-attn is not installed.", install))
    elif flash.import_error:
        candidates.append(Decision(VARLEN_ATTENTION, "flash_attn (flash_attn_varlen_func)", "package", REJECTED,
                                   f"importing flash_attn fails: {flash.import_error}.", install))
    else:
        problem = _arch_problems(flash, target, unchecked, "flash_attn")
        candidates.append(Decision(VARLEN_ATTENTION, "flash_attn (flash_attn_varlen_func)", "package",
                                   REJECTED if problem else ACCEPTED,
                                   problem or f"flash-attn {flash.version} imports flash_attn_varlen_func.",
                                   install if problem else None))
    varlen = "torch.nn.attention.varlen.varlen_attn (attn_implementation='kernelguard_varlen')"
    if facts.env.torch_error:
        candidates.append(Decision(VARLEN_ATTENTION, varlen, "torch", REJECTED,
                                   f"torch cannot be imported ({facts.env.torch_error}).", "reinstall torch"))
    elif facts.env.torch_version.value and facts.env.cuda_version.value is None \
            and facts.env.cuda_version.source.startswith("torch"):
        candidates.append(Decision(VARLEN_ATTENTION, varlen, "torch", REJECTED,
                                   f"torch {facts.env.torch_version.value} is a build without CUDA; varlen_attn "
                                   "runs only on CUDA GPUs.", cuda_torch_command(facts.env.torch_version.value)))
    elif not facts.torch_varlen_attention:
        candidates.append(Decision(VARLEN_ATTENTION, varlen, "torch", REJECTED,
                                   f"torch {facts.env.torch_version.value} has no torch.nn.attention.varlen.varlen_attn.",
                                   upgrade_command("torch", "2.10")))
    elif target.archs and any(a.base < ComputeCapability(8, 0) for a in target.archs):
        candidates.append(Decision(VARLEN_ATTENTION, varlen, "torch", REJECTED,
                                   "varlen_attn needs compute capability >= 8.0 (flash backend); target is "
                                   f"{', '.join(map(str, target.archs))}.", None))
    else:
        candidates.append(Decision(VARLEN_ATTENTION, varlen, "torch", ACCEPTED,
                                   "built into the installed torch; kernelguard.runtime.attention registers it with "
                                   "transformers' AttentionInterface (kernelguard train does this).", None))
    allowed = target.allow.allows_attention()
    candidates.append(Decision(
        VARLEN_ATTENTION, "sdpa / eager with a block mask", "reference", FALLBACK,
        "builds an O(T^2) block mask from packed position_ids for every full-attention layer"
        + ("; explicitly allowed by --allow attention." if allowed
           else "; used only when nothing above serves (accept it with --allow attention)."),
    ))
    return _finish(VARLEN_ATTENTION, candidates, allowed_fallback=allowed)


def _global_notes(facts: Facts, target: Target, load_error: Decision | None) -> list[str]:
    outside = kernels_outside_window(facts) if target.use_hub and load_error is None else None
    notes = [f"known issue kernels-version: {outside}; fix: {_install_fix('kernels', facts, Target())}"] if outside else []
    notes += hub_notes(facts.hub_load, use_hub=target.use_hub, source=target.hub_source)
    if facts.env.torch_error:
        notes.append(f"torch could not be imported: {facts.env.torch_error}")
    for issue in KNOWN_ISSUES:
        installed = all(facts.env.version_of(d) for d in issue.requires_installed)
        avoided = any(facts.env.version_of(d) for d in issue.unless_installed)
        if issue.detector == "installed-set" and installed and not avoided:
            notes.append(f"known issue {issue.id} ({issue.source}): {issue.effect}; fix: {issue.fix}")
    return notes


def resolve(facts: Facts, requirements: Requirements, target: Target) -> Resolution:
    """Decide, for every kernel ``requirements`` needs, which provider serves it — or that none does."""
    unchecked: list[str] = []
    verdicts = [_resolve_kernel(req, facts, target, requirements, unchecked) for req in requirements.kernels]
    if requirements.needs_varlen_attention:
        verdicts.append(_resolve_attention(facts, target, unchecked))
    leak = packed_rows_decision(requirements, allowed=target.allow.allows_packed_without_boundaries())
    if leak is not None:
        verdicts.append(_finish(PACKED_ROWS, [leak], allowed_fallback=target.allow.allows_packed_without_boundaries()))
    if not target.archs:
        unchecked.insert(0, "no GPU visible and no --arch given: GPU-arch checks and arch-specific known issues "
                            "were skipped (pass --arch 9.0 for an H100/H200 target)")
    load_error = import_decision(facts.env.transformers_error, facts.env.version_of("transformers")) or load_decision(
        facts.hub_load, use_hub=target.use_hub, hub_source=target.hub_source,
        fix=_install_fix("kernels", facts, Target()))  # 5.25+: the load itself raises
    return Resolution(requirements, target, tuple(verdicts), tuple(_global_notes(facts, target, load_error)),
                      tuple(dict.fromkeys(unchecked)), load_error)

