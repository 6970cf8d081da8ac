"""Fact dataclasses: what the probes found, as plain values. The bottom layer; no probing here.

``env.probe()`` fills :class:`Environment`, ``providers.installed`` fills :class:`PackageFacts`,
``providers.hub`` fills :class:`HubKernelProbe`; the pure resolver reads only these types (:class:`Facts`)
plus what the job targets (``resolver.Target``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .capability import ComputeCapability
from .versions import base_version, version_in

__all__ = [
    "Environment",
    "ExtensionFacts",
    "Fact",
    "Facts",
    "FlaBackend",
    "Gpu",
    "HubKernelProbe",
    "HubLayerCheck",
    "HubLoad",
    "HubTarget",
    "PackageFacts",
    "VariantVerdict",
]


@dataclass(frozen=True, slots=True)
class Fact:
    """A value and the source it was read from (a function, a file, a flag)."""

    value: Any
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    capability: ComputeCapability
    source: str


@dataclass(frozen=True, slots=True)
class Environment:
    """Everything kernel selection depends on. Made-up Environments drive the resolver's tests."""

    python: Fact
    platform: Fact
    machine: Fact
    glibc: Fact
    torch_version: Fact
    torch_error: str | None
    cuda_version: Fact  # torch's CUDA runtime, None for CPU/ROCm builds
    hip_version: Fact
    cxx11_abi: Fact
    gpus: tuple[Gpu, ...]
    driver: Fact
    packages: dict[str, Fact] = field(default_factory=dict)  # distribution -> version (None when absent)
    # ``import transformers`` failing while its files are there (a broken dependency): every job fails there
    transformers_error: str | None = None

    def version_of(self, distribution: str) -> str | None:
        fact = self.packages.get(distribution)
        return None if fact is None else fact.value

    @property
    def triton_version(self) -> str | None:
        return self.version_of("triton") or self.version_of("pytorch-triton")

    def to_dict(self) -> dict[str, Any]:
        simple = {
            name: getattr(self, name).to_dict()
            for name in (
                "python",
                "platform",
                "machine",
                "glibc",
                "torch_version",
                "cuda_version",
                "hip_version",
                "cxx11_abi",
                "driver",
            )
        }
        return {
            **simple,
            "torch_error": self.torch_error,
            "transformers_error": self.transformers_error,
            "gpus": [
                {"index": g.index, "name": g.name, "capability": str(g.capability), "source": g.source}
                for g in self.gpus
            ],
            "packages": {name: fact.to_dict() for name, fact in sorted(self.packages.items())},
        }


@dataclass(frozen=True, slots=True)
class ExtensionFacts:
    """One compiled extension (.so) shipped by the package."""

    path: str
    module: str
    load_error: str | None
    sass: frozenset[str] = frozenset()
    ptx: frozenset[str] = frozenset()
    arch_error: str | None = None  # why the embedded GPU code could not be read
    arch_method: str | None = None


@dataclass(frozen=True, slots=True)
class PackageFacts:
    import_name: str
    distribution: str | None
    version: str | None
    module: str  # the module path transformers imports, e.g. "fla.ops.gated_delta_rule"
    attribute: str  # the function it takes from it
    import_error: str | None  # None: the import and attribute lookup succeeded
    devices: tuple[str, ...]
    devices_source: str
    built_for_torch: str | None = None  # when the wheel's name or URL says which torch it was built for
    extensions: tuple[ExtensionFacts, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class HubTarget:
    """The facts kernels' variant resolver consumes, for an environment that need not be this one.

    ``torch_version``: "2.13" (a full "2.13.0+cu128" is cut to major.minor as kernels does); None means
    torch is absent. ``cuda_version``: "12.8" for a CUDA torch build, None otherwise. ``backend``: a kernels
    backend token for other accelerators ("rocm64", "xpu20251", "metal", "neuron", "tpu", "cann81");
    give either it or ``cuda_version``. ``cxx11_abi`` only matters on Linux (kernels ignores it elsewhere).
    ``gpu_capability`` is not used for choosing (kernels does not either) but is checked against the
    chosen variant's declared CUDA archs, as kernels' ``ArchValidator`` does at load time.

    ``python_version`` ("3.12"), ``free_threaded`` and ``has_mlx`` describe the interpreter the job runs under
    (kernels 0.19 rejects a variant built for a newer Python or, on free-threaded Python, for abi3, and an MLX
    variant without MLX); None means the Python running kernelguard, since kernels' own defaults (a GIL-enabled
    Python 3.15 with MLX) describe no real interpreter.
    """

    torch_version: str | None
    cuda_version: str | None = None
    backend: str | None = None
    cxx11_abi: bool | None = True
    cpu: str = "x86_64"
    os: str = "linux"
    gpu_capability: tuple[int, int] | None = None
    tvm_ffi_version: str | None = None
    macos_version: str | None = None
    python_version: str | None = None
    free_threaded: bool | None = None
    has_mlx: bool | None = None


@dataclass(frozen=True, slots=True)
class VariantVerdict:
    variant: str
    accepted: bool
    reason: str


@dataclass(frozen=True, slots=True)
class HubKernelProbe:
    repo_id: str
    source: str
    location: str | None
    revision: str | None
    chosen_variant: str | None
    variants: tuple[VariantVerdict, ...]
    trusted: bool
    note: str | None


@dataclass(frozen=True, slots=True)
class FlaBackend:
    """Which of fla's own backends runs the gated-delta op on one target arch (``kernelguard.resolution.fla_backend``).

    ``forward``: "flash_qla" or "triton"; ``backward``: "flash_qla", "tilelang" (fla's Triton op with its
    TileLang ``chunk_bwd_dqkwg``), "triton", or None for inference. ``reasons``: one sentence per backend
    fla considered and why it was taken or passed over; ``source``: whose logic decided (fla's registry or
    kernelguard's reading of fla's rules for a target arch this machine does not have)."""

    arch: str | None  # the target compute capability, None when no target is known
    forward: str
    backward: str | None
    reasons: tuple[str, ...]
    source: str

    @property
    def label(self) -> str:
        if self.backward in (None, self.forward):
            return self.forward
        return f"{self.forward} (backward: {self.backward})"

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, "forward": self.forward, "backward": self.backward, "label": self.label,
                "reasons": list(self.reasons), "source": self.source}


@dataclass(frozen=True, slots=True)
class HubLayerCheck:
    """Whether the installed kernels accepts the mapped layer of the variant a Hub mapping resolves to (for the
    check's mode), and whether its ``forward`` takes the call transformers makes. ``problem`` is None when both
    hold; ``judged_by`` says who decided ("kernels 0.17.2", or kernelguard's reading of the source when kernels
    could not be asked here, ``note`` saying why)."""

    kernel: str  # the mapped op, e.g. "chunk_gated_delta_rule"
    repo_id: str
    layer_name: str
    variant: str
    call: str  # the call transformers makes, e.g. "chunk_gated_delta_rule(3 positional, g=, beta=, ...)"
    problem: str | None  # which check failed, in a sentence
    file: str | None = None  # where the layer's forward was read
    judged_by: str | None = None
    note: str | None = None
    fix: str | None = None  # the command that removes ``problem``, when one does (a missing Python dependency)
    # the installed backends the variant's code hands its op to when they import (as fla's own dispatcher does
    # with flash_qla): a known issue of that backend is then on the Hub path too
    hands_to: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FetchedHubRepo:
    """One repository a Hub-kernel load fetches: the ref kernels asks for and the commit the local cache holds for
    it (None: not cached, or served by LOCAL_KERNELS)."""

    repo_id: str
    ref: str
    commit: str | None


_TRUE = ("1", "ON", "YES", "TRUE")  # transformers' ENV_VARS_TRUE_VALUES: anything else is false


@dataclass(frozen=True, slots=True)
class HubLoad:
    """What a plain ``from_pretrained`` does with Kernel Hub kernels here (read by kernelguard.resolution.hub_load)."""

    transformers_version: str
    default_on: bool  # from_pretrained(use_kernels=None) means True (transformers 5.25+)
    env_value: str | None  # USE_HUB_KERNELS as set in this environment (None: unset)
    window: tuple[str, str] | None  # [min, max) of kernels this transformers accepts
    kernels_version: str | None  # the installed kernels (None: not installed)
    kernels_core: bool = False  # transformers requires kernels itself (5.25+), not through an extra
    all_latest: str | None = None  # UNSTABLE_KERNELS_ALL_LATEST as set, when kernels reads it as on
    unreachable: str | None = None  # why the Hub cannot be reached, where the load would ask it (hub_reach)
    # HF_HUB_OFFLINE: the repositories the load fetches (both modes) that the local cache lacks, as "repo (ref)",
    # and the one command that downloads every one the load fetches
    offline_missing: tuple[str, ...] = ()
    offline_download: str | None = None
    fetched: tuple[FetchedHubRepo, ...] | None = None  # every repository the load fetches; None: not asked

    @property
    def env_off(self) -> bool:
        return self.env_value is not None and self.env_value.upper() not in _TRUE

    @property
    def kernels_usable(self) -> bool:
        """transformers' is_kernels_available(): installed and inside the window."""
        if self.kernels_version is None:
            return False
        if self.window is None:
            return True
        return version_in(base_version(self.kernels_version), f">={self.window[0]},<{self.window[1]}")


@dataclass(frozen=True, slots=True)
class Facts:
    """Everything the resolver decides from, collected once by ``check``."""

    env: Environment
    packages: Mapping[str, PackageFacts] = field(default_factory=dict)  # by module path
    hub: Mapping[str, HubKernelProbe] = field(default_factory=dict)  # by repo_id
    hub_layers: Mapping[str, HubLayerCheck] = field(default_factory=dict)  # by kernel, for resolved variants
    kernels_window: tuple[str, str] | None = None  # [min, max) of kernels this transformers uses
    transformers_min_versions: Mapping[str, str | None] = field(default_factory=dict)
    torch_varlen_attention: bool = False
    # fla's GDN backend per target arch ("" when no arch is targeted); empty when fla was not probed.
    fla_backends: Mapping[str, FlaBackend] = field(default_factory=dict)
    hub_load: HubLoad | None = None  # what a plain from_pretrained does with Kernel Hub kernels
