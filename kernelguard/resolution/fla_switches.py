"""fla 0.6.0's environment switches, and what each does to the calls transformers makes.

Read in fla-core 0.6.0's source (``fla/backends.py``, ``fla/ops/*/backends/``, ``fla/modules/*/backends/``,
``fla/utils.py``). Backends a switch turns on replace fla's Triton kernels inside the op; kernelguard's numerics
(``check --run``) then measure whichever one runs. The GDN op's own choice (FlashQLA / TileLang / Triton) is
:mod:`kernelguard.resolution.fla_backend`'s; this module says what the other switches do, and why FlashKDA is
never on transformers' path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["FLASH_KDA_NOTE", "FLA_SWITCHES", "switch_notes"]

# variable -> what it changes for a transformers model (fla's default in brackets where it matters)
FLA_SWITCHES: dict[str, str] = {
    "FLA_GLUON": "turns on fla's Gluon backends (off by default) for every op that registers one: Triton's "
                 "experimental Gluon kernels replace the Triton ones where their verifiers accept the call",
    "FLA_CONV_GLUON": "fla's own causal_conv1d on Gluon kernels; transformers calls the causal-conv1d package's "
                      "causal_conv1d_fn, not fla's, so this changes nothing on its path",
    "FLA_CE_GLUON": "fla's fused cross-entropy on Gluon kernels; transformers' loss is torch's unless the trainer "
                    "swaps in fla's",
    "FLA_FLASH_KDA": "FlashKDA (a CUTLASS forward for chunk_kda, on by default, grad-free calls only)",
    "FLA_FLASH_QLA": "FlashQLA for the whole gated-delta op (on by default when flash_qla imports)",
    "FLA_TILELANG": "TileLang kernels inside fla's Triton op (on by default on Hopper with Triton >= 3.4 when "
                    "tilelang and nvcc are there)",
    "FLA_DISABLE_BACKEND_DISPATCH": "bypasses every backend (=1): fla's Triton kernels throughout",
    "FLA_USE_FAST_OPS": "=1 swaps exp/log in fla's Triton kernels for the GPU's fast approximations (less exact)",
    "FLA_TRIL_PRECISION": "tf32 / tf32x3 let fla's autotuner pick TF32 for its triangular solves (default ieee)",
    "FLA_USE_TMA": "=1 lets fla's Triton kernels use tensor-descriptor (TMA) loads where the GPU has them",
    "FLA_CACHE_RESULTS": "whether Triton keeps fla's autotune choices on disk (default 1; 0: every new process "
                         "searches again)",
}

FLASH_KDA_NOTE = (
    "chunk_kda: FlashKDA (fla 0.6.0's CUTLASS forward, FLA_FLASH_KDA) is not on transformers' path: its "
    "verifier wants use_gate_in_kernel=True (A_log and dt_bias passed in), and transformers' layers compute the "
    "gate themselves and do not pass it (fla's default is False); chunk_kda runs fla's Triton kernels, forward "
    "and backward"
)


def switch_notes(environ: Mapping[str, str], kernels: Iterable[str]) -> list[str]:
    """One note per fla switch set in ``environ`` (what it changes here), and FlashKDA's when fla serves
    ``chunk_kda``. ``kernels``: the kernels fla serves in this check."""
    served = set(kernels)
    notes = [f"{name}={environ[name]} is set: {effect}" for name, effect in FLA_SWITCHES.items() if name in environ]
    if "chunk_kda" in served:
        notes.append(FLASH_KDA_NOTE)
    return notes
