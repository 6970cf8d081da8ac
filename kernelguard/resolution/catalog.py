"""The kernel table: what a model family needs and which providers can serve it. Data only, no probing.

The one hand-written table, ``PACKAGES``, maps the import names transformers tries to how kernelguard inspects
and installs them. Families (``Family``: which kernels a modeling file wraps, where transformers imports each
from, its Hub repo) are discovered from the installed transformers' source by :mod:`kernelguard.resolution.discovery`;
:func:`requirements` turns a family, mode and layout into what a job needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelguard.errors import ConfigError

from .geometry import field, key_head_dim, layer_types, text_config

__all__ = [
    "MODES",
    "PACKAGES",
    "PACKED_REFERENCE",
    "VARLEN_ATTENTION",
    "Family",
    "HubRepo",
    "KernelRequirement",
    "ModelSpec",
    "PackageSpec",
    "Requirements",
    "has_linear_layers",
    "is_decode_only",
    "requirements",
]

MODES = ("training", "inference")

# Kernels that only serve one-token decode steps; a training job never calls them.
_DECODE_ONLY = re.compile(r"^(fused_recurrent_\w+|\w+_update)$")

VARLEN_ATTENTION = "varlen_attention"


@dataclass(frozen=True, slots=True)
class PackageSpec:
    """How one provider package is found, checked and installed."""

    import_name: str
    distributions: tuple[str, ...]  # pip names that ship the import name, most specific first
    availability_function: str | None  # transformers' is_*_available() that holds its minimum version
    # (how to install it is kernelguard.resolution.install's, built from the facts: no command string lives here)
    compiled: bool  # ships CUDA extensions (.so) whose archs and torch ABI must match
    default_devices: tuple[str, ...] = ("cuda",)


PACKAGES: dict[str, PackageSpec] = {
    spec.import_name: spec
    for spec in (
        PackageSpec(
            "fla",
            ("fla-core", "flash-linear-attention"),
            "is_flash_linear_attention_available",
            compiled=False,
            default_devices=("cuda", "xpu"),
        ),
        PackageSpec(
            "causal_conv1d",
            ("causal-conv1d",),
            "is_causal_conv1d_available",
            compiled=True,
        ),
        PackageSpec(
            "mamba_ssm",
            ("mamba-ssm",),
            "is_mamba_2_ssm_available",
            compiled=True,
        ),
        PackageSpec(
            "flash_attn",
            ("flash-attn",),
            "is_flash_attn_2_available",
            compiled=True,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class HubRepo:
    repo_id: str
    layer_name: str
    version: int | None
    revision: str | None
    # False where the mapping's repository says check_arch=False (kernels 0.19): a build whose declared CUDA
    # archs miss the GPU is loaded anyway instead of refused
    check_arch: bool = True


@dataclass(frozen=True, slots=True)
class KernelRequirement:
    """One kernel a family calls, and the providers in the order transformers tries them."""

    kernel: str  # "chunk_gated_delta_rule"
    call_site: str  # the decorated function in the modeling file, e.g. "torch_chunk_gated_delta_rule"
    package: str | None  # import name transformers tries ("fla"); None for attention
    module: str | None  # exact module path transformers imports ("fla.ops.gated_delta_rule")
    hub: HubRepo | None

    @property
    def package_spec(self) -> PackageSpec | None:
        return PACKAGES.get(self.package) if self.package else None


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # directory name under transformers/models, e.g. "qwen3_5"
    model_types: tuple[str, ...]
    kernels: tuple[KernelRequirement, ...]
    has_attention: bool
    gated_delta: bool
    default_key_head_dim: int | None
    source: str


@dataclass(frozen=True, slots=True)
class Requirements:
    """What a job of this family and mode needs."""

    family: Family
    mode: str
    packed: bool
    kernels: tuple[KernelRequirement, ...]
    needs_varlen_attention: bool
    key_head_dim: int | None
    key_head_dim_source: str
    transformers_version: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What ``--model`` named: a family, plus head dims when a real config was given."""

    family: Family
    config: dict | None
    origin: str


def requirements(spec: ModelSpec, mode: str, *, packed: bool, transformers_version: str) -> Requirements:
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}.")
    kernels = tuple(
        k for k in spec.family.kernels if mode == "inference" or not is_decode_only(k.kernel)
    )
    if spec.config and not has_linear_layers(spec.config):
        kernels = ()  # every layer is full attention: the model never calls a gated-delta kernel
    key_dim = key_head_dim(spec.config) if spec.config else None
    if key_dim is not None:
        name = "linear_key_head_dim" if field(text_config(spec.config), "linear_key_head_dim") else "linear_head_dim"
        key_source = f"{name} in {spec.origin}"
    else:
        key_dim = spec.family.default_key_head_dim
        key_source = f"default of {spec.family.name}'s config class" if key_dim else "unknown"
    return Requirements(
        family=spec.family,
        mode=mode,
        packed=packed,
        kernels=kernels,
        needs_varlen_attention=packed and mode == "training" and spec.family.has_attention,
        key_head_dim=key_dim,
        key_head_dim_source=key_source,
        transformers_version=transformers_version,
    )


def has_linear_layers(config: dict) -> bool:
    """Whether a config's layers include gated-delta (linear attention) ones. Only an explicit layer_types
    list can say no: without one, the config class's own default pattern (which has them) applies."""
    if not config.get("layer_types"):
        return True
    return any("linear" in t for t in layer_types(config))


def is_decode_only(kernel: str) -> bool:
    """Kernels that only serve one-token decode steps; a training job never calls them."""
    return bool(_DECODE_ONLY.match(kernel))


# A packed row's examples are kept apart only by cu_seqlens / seq_idx, which transformers' torch references ignore.
PACKED_REFERENCE = (
    "the torch reference cannot keep packed examples apart (it ignores cu_seqlens / seq_idx: transformers >= 5.20 "
    "raises ValueError at the first packed step, older releases silently mix the examples' state), so an allow "
    "cannot make it acceptable for packed training"
)
