"""Which of fla's own backends runs the gated-delta op: fla's dispatch asked, without running a kernel.

fla 0.5.2+ routes ``chunk_gated_delta_rule`` through its backend dispatch (``fla.ops.backends`` in 0.5.2,
``fla.backends`` in 0.6.0; the rules below were read in fla-core 0.6.0's source:
``fla/backends.py``, ``fla/ops/gated_delta_rule/backends/flash_qla.py``,
``fla/ops/common/backends/tilelang/__init__.py``):

* operation ``gated_delta_rule``: ``FlashQLABackend`` (backend type ``flash_qla``, priority 3) takes the whole
  op, forward and backward, when ``flash_qla`` is importable, ``FLA_FLASH_QLA`` is not ``0`` (on by default),
  the GPU is SM90 / SM100 / SM103 (SM120: forward only, so never when an input needs grad), q/k/v are bf16 or
  fp16, and the key and value head dims are both 128. Otherwise fla's own Triton op runs.
* operation ``common``: inside the Triton op, ``CommonTileLangBackend`` (type ``tilelang``) replaces the gated
  ``chunk_bwd_dqkwg`` -- the backward kernel of fla #640 -- when ``tilelang`` is importable and a usable nvcc is
  found (``fla.utils.has_usable_nvcc``), and ``FLA_TILELANG`` is not ``0``; unset, it is on exactly on Hopper
  with Triton >= 3.4. Its verifier wants the value heads to be a multiple of the key heads.
* ``FLA_DISABLE_BACKEND_DISPATCH=1`` bypasses every backend: Triton throughout. ``FLA_<TYPE>`` other than ``0``
  forces a backend type on (fla's ``BaseBackend.is_enabled``).

fla logs its choice at INFO on ``fla.backends`` only at the first call. Here, when fla is already imported (a
check imports ``fla.ops.gated_delta_rule`` the way transformers does), each backend's availability and switch are
fla's own answers (``is_available()`` / ``is_enabled()`` of the registered backends), and on a GPU of the target
arch its verifiers are called with meta tensors of the model's shapes. For a target this machine does not have
(a docker build), the verifier conditions above are applied to the target arch: ``source`` says which.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .capability import ComputeCapability
from .facts import Facts, FlaBackend

__all__ = ["FLA_VARIABLES", "Candidate", "GdnShape", "backward_for", "decide", "probe"]

FLASH_QLA = "flash_qla"
TILELANG = "tilelang"
TRITON = "triton"
# The switches fla reads (BaseBackend.is_enabled, fla.backends._DISPATCH_DISABLED).
FLA_VARIABLES = ("FLA_FLASH_QLA", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH")


@dataclass(frozen=True, slots=True)
class GdnShape:
    """What fla's verifiers look at: head dims and head counts of one GDN layer."""

    key_dim: int | None
    value_dim: int | None
    num_k_heads: int | None = None
    num_v_heads: int | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One registered fla backend: importable (and, for TileLang, an nvcc found) and switched on."""

    available: bool
    enabled: bool | None  # None: its switch is unset, so the default for the target arch decides
    why_unavailable: str = ""


def _switch(name: str) -> bool | None:
    """fla's reading of a backend switch: unset -> None, "0" -> off, anything else -> on."""
    value = os.environ.get(name)
    return None if value is None else value != "0"


def decide(
    arch: ComputeCapability | None,
    *,
    training: bool,
    shape: GdnShape,
    triton_version: str | None,
    flash_qla: Candidate,
    tilelang: Candidate,
    dispatch_disabled: bool,
    source: str,
) -> FlaBackend:
    """fla 0.6.0's choice for the GDN op on ``arch`` (pure: every fact is an argument)."""
    label = str(arch) if arch is not None else None
    if dispatch_disabled:
        return FlaBackend(label, TRITON, TRITON if training else None,
                          ("FLA_DISABLE_BACKEND_DISPATCH=1: fla bypasses every backend",), source)
    reasons: list[str] = []
    qla_problem = _flash_qla_problem(arch, training, shape, flash_qla)
    if qla_problem is None:
        reasons.append("flash_qla: taken (flash_qla importable, FLA_FLASH_QLA not 0, K=V=128 on SM90/SM100)")
        return FlaBackend(label, FLASH_QLA, FLASH_QLA if training else None, tuple(reasons), source)
    reasons.append(f"flash_qla: passed over ({qla_problem})")
    if not training:
        return FlaBackend(label, TRITON, None, tuple(reasons), source)
    tile_problem = _tilelang_problem(arch, shape, triton_version, tilelang)
    if tile_problem is None:
        reasons.append("tilelang: runs chunk_bwd_dqkwg (the backward of fla #640)")
        return FlaBackend(label, TRITON, TILELANG, tuple(reasons), source)
    reasons.append(f"tilelang: passed over ({tile_problem})")
    return FlaBackend(label, TRITON, TRITON, tuple(reasons), source)


def _flash_qla_problem(arch: ComputeCapability | None, training: bool, shape: GdnShape, qla: Candidate) -> str | None:
    if not qla.available:
        return qla.why_unavailable or "flash_qla is not importable"
    if qla.enabled is False:
        return "FLA_FLASH_QLA=0"
    if arch is None:
        return "no target arch to check its SM90/SM100/SM120 rule against"
    if not (arch.major in (9, 10) or (arch.major, arch.minor) == (12, 0)):
        return f"FlashQLA requires NVIDIA SM90, SM100/SM103 or SM120, target is {arch}"
    if (arch.major, arch.minor) == (12, 0) and training:
        return "FlashQLA on SM120 implements the forward pass only, but training needs the backward"
    if shape.key_dim != 128 or shape.value_dim != 128:
        return f"FlashQLA requires K=128 and V=128, the model has K={shape.key_dim}, V={shape.value_dim}"
    return None


def _tilelang_problem(
    arch: ComputeCapability | None, shape: GdnShape, triton_version: str | None, tile: Candidate
) -> str | None:
    if not tile.available:
        return tile.why_unavailable or "tilelang is not importable"
    if tile.enabled is False:
        return "FLA_TILELANG=0"
    if tile.enabled is None:  # fla's default: on only where Triton >= 3.4 miscompiles the Triton backward
        hopper = arch is not None and arch.major == 9
        if not (hopper and _at_least(triton_version, "3.4.0")):
            return f"off by default except on Hopper with Triton >= 3.4 (target {arch or 'unknown'}, Triton {triton_version})"
    if shape.num_k_heads and shape.num_v_heads and shape.num_v_heads % shape.num_k_heads:
        return f"needs num_v_heads ({shape.num_v_heads}) divisible by num_k_heads ({shape.num_k_heads})"
    return None


def _at_least(version: str | None, minimum: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(version) >= Version(minimum)
    except InvalidVersion:
        return False


def backward_for(facts: Facts, archs: Iterable[str], targets: Iterable[ComputeCapability], *, training: bool) -> str | None:
    """fla's GDN backward backend on the first target among ``archs`` (any target when empty), as probed; for
    made-up facts without a probe, fla's default on them: TileLang when it is installed, else Triton."""
    wanted = {ComputeCapability.parse(a, source="a known issue's archs") for a in archs}
    targets = list(targets)
    for arch in targets:
        probed = facts.fla_backends.get(str(arch))
        if probed is not None and (not wanted or arch.base in wanted):
            return probed.backward
    if not targets and "" in facts.fla_backends:
        return facts.fla_backends[""].backward
    if not training:
        return None
    return TILELANG if facts.env.version_of("tilelang") else TRITON


# ------------------------------------------------------------------------------------------------- probe ---
def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _usable_nvcc() -> bool:
    """fla.utils.has_usable_nvcc's search (CUDA_HOME / CUDA_PATH, PATH, the nvidia-cuda-nvcc wheel, /usr/local/cuda)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists() or shutil.which("nvcc"):
        return True
    try:
        if any(f.name == "nvcc" for f in metadata.files("nvidia-cuda-nvcc") or []):
            return True
    except metadata.PackageNotFoundError:
        pass
    return Path("/usr/local/cuda/bin/nvcc").exists()


def _dispatch_module() -> Any | None:
    """fla's dispatch module once fla is imported: ``fla.backends`` (0.6.0), ``fla.ops.backends`` (0.5.2)."""
    return sys.modules.get("fla.backends") or sys.modules.get("fla.ops.backends")


def _registered(operation: str, backend_type: str) -> Any | None:
    """fla's registered backend object of ``backend_type`` for ``operation`` (only if fla is already imported)."""
    module = _dispatch_module()
    registries = getattr(module, "_operation_registries", None)  # fla 0.6.0
    cls = getattr(module, "BackendRegistry", None)
    if registries is None and cls is not None:  # fla 0.5.2 registers lazily, at first call
        try:
            cls.ensure_initialized(operation)
        except Exception:  # noqa: BLE001, S110 - its registration failing is what the rules below then say
            pass
        registries = getattr(cls, "_registries", None)
    registry = registries.get(operation) if isinstance(registries, dict) else None
    backends = getattr(registry, "_backends", None)
    return backends.get(backend_type) if isinstance(backends, dict) else None


def _candidate(operation: str, backend_type: str, switch: str, *, needs_nvcc: bool) -> tuple[Candidate, bool]:
    """(candidate, read from fla's registry)."""
    backend = _registered(operation, backend_type)
    if backend is not None:
        try:
            available = bool(backend.is_available())
            # fla's own default_enable was computed for the live GPU; a target arch's default is decide()'s.
            enabled = bool(backend.is_enabled()) if os.environ.get(switch) is not None else None
            why = "" if available else f"fla's {type(backend).__name__}.is_available() is False" + (
                f": {backend_type} is not importable" if not _find(backend_type)
                else ": no usable nvcc" if needs_nvcc and not _usable_nvcc() else "")
            return Candidate(available, enabled, why), True
        except Exception:  # noqa: BLE001, S110 - a changed fla internals: read the facts ourselves below
            pass
    package = backend_type
    if not _find(package):
        return Candidate(False, _switch(switch), f"{package} is not importable"), False
    if needs_nvcc and not _usable_nvcc():
        return Candidate(False, _switch(switch), "tilelang is installed but no usable nvcc was found"), False
    return Candidate(True, _switch(switch)), False


def _verify_on_this_gpu(shape: GdnShape, training: bool) -> tuple[bool, str | None] | None:
    """FlashQLA's own verifier on meta tensors of the model's shape, on this GPU (None: cannot ask)."""
    backend = _registered("gated_delta_rule", FLASH_QLA)
    if backend is None or not (shape.key_dim and shape.value_dim):
        return None
    try:
        import torch

        heads, v_heads = shape.num_k_heads or 1, shape.num_v_heads or shape.num_k_heads or 1

        def meta(*size: int) -> Any:
            return torch.empty(size, device="meta", dtype=torch.bfloat16, requires_grad=training)

        q, k = meta(1, 64, heads, shape.key_dim), meta(1, 64, heads, shape.key_dim)
        v, g, beta = meta(1, 64, v_heads, shape.value_dim), meta(1, 64, v_heads), meta(1, 64, v_heads)
        with torch.set_grad_enabled(training):
            accepted, reason = backend.verify("chunk_gated_delta_rule", q, k, v, g, beta)
        return bool(accepted), reason
    except Exception:  # noqa: BLE001 - fla's verifier changed shape: the rule-based decision stands
        return None


def _without_dispatch() -> bool:
    """An imported fla without backend dispatch (releases before 0.5.2): nothing to dispatch to."""
    if "fla" not in sys.modules or _dispatch_module() is not None:
        return False
    return not any(_find(name) for name in ("fla.backends", "fla.ops.backends"))


def _live_arch() -> ComputeCapability | None:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return ComputeCapability.from_tuple(torch.cuda.get_device_capability(0))
    except Exception:  # noqa: BLE001, S110 - no usable GPU
        pass
    return None


def probe(
    archs: Iterable[ComputeCapability], *, training: bool, shape: GdnShape, triton_version: str | None
) -> dict[str, FlaBackend]:
    """fla's GDN backend for each target arch ("" when none is targeted); {} when fla is not installed."""
    targets: list[ComputeCapability | None] = [*archs] or [None]
    if not _find("fla"):
        return {}
    if _without_dispatch():
        version = getattr(sys.modules.get("fla"), "__version__", "?")
        return {str(a) if a else "": FlaBackend(str(a) if a else None, TRITON, TRITON if training else None,
                                               (f"fla {version} has no backend dispatch: its own Triton kernels run",),
                                               "fla's modules (no backend dispatch before fla 0.5.2)")
                for a in targets}
    qla, qla_from_fla = _candidate("gated_delta_rule", FLASH_QLA, "FLA_FLASH_QLA", needs_nvcc=False)
    tile, tile_from_fla = _candidate("common", TILELANG, "FLA_TILELANG", needs_nvcc=True)
    module = _dispatch_module()
    disabled = bool(getattr(module, "_DISPATCH_DISABLED", os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"))
    live = _live_arch()
    out: dict[str, FlaBackend] = {}
    for arch in targets:
        asked = "fla's registered backends" if qla_from_fla or tile_from_fla else "fla's dispatch rules"
        source = f"{asked}; verifier conditions applied to target {arch}" if arch else asked
        backend = decide(arch, training=training, shape=shape, triton_version=triton_version, flash_qla=qla,
                         tilelang=tile, dispatch_disabled=disabled, source=source)
        if arch is not None and live is not None and live.base == arch.base and qla.available and not disabled:
            verdict = _verify_on_this_gpu(shape, training)
            if verdict is not None:
                source = "fla's dispatch on this GPU (FlashQLABackend's verifier on meta tensors of the model's shapes)"
                backend = _with_flash_qla_verdict(backend, verdict, qla, source, training, arch, shape,
                                                  triton_version, tile)
        out[str(arch) if arch else ""] = backend
    return out


def _with_flash_qla_verdict(
    backend: FlaBackend, verdict: tuple[bool, str | None], qla: Candidate, source: str, training: bool,
    arch: ComputeCapability, shape: GdnShape, triton_version: str | None, tile: Candidate,
) -> FlaBackend:
    accepted, reason = verdict
    if qla.enabled is False:
        accepted, reason = False, "FLA_FLASH_QLA=0"
    if accepted:
        return FlaBackend(str(arch), FLASH_QLA, FLASH_QLA if training else None,
                          ("flash_qla: taken (fla's verifier accepted this model's shapes on this GPU)",), source)
    rest = decide(arch, training=training, shape=shape, triton_version=triton_version,
                  flash_qla=Candidate(False, False, f"fla's verifier: {reason}"), tilelang=tile,
                  dispatch_disabled=False, source=source)
    return rest
