"""Known-bad stacks, as data. Each row names its source and is matched by the pure resolver.

A row matches a candidate provider when every condition it sets holds. Conditions are version specifiers
(``packaging``) over facts the probe collects, the target archs, the mode, and the model's key head dim. The
resolver turns a match into a rejection unless the user allowed the row's ID (``--allow ID``); an allowed
match is still shown.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FLASH_QLA_28", "FLA_640", "FLA_1077", "FLA_1077_GRID_LIMIT", "KNOWN_ISSUES", "KnownIssue", "by_id"]


@dataclass(frozen=True, slots=True)
class KnownIssue:
    id: str
    title: str
    source: str
    effect: str  # what goes wrong, one sentence
    fix: str  # the general fix (`kernelguard issues`); a check on real facts may print a more exact one
    kernels: tuple[str, ...] = ()  # empty: any kernel served by `provider`
    provider: str | None = None  # import name ("fla") or None for "any"
    archs: tuple[str, ...] = ()  # target compute capabilities this applies to
    modes: tuple[str, ...] = ()
    triton: str | None = None  # version specifier on the installed Triton
    provider_version: str | None = None  # specifier on the provider's version
    key_head_dim_max: int | None = None  # applies only when the model's key head dim <= this
    key_head_dim_min: int | None = None
    requires_installed: tuple[str, ...] = ()  # distributions that must be present for the issue to exist
    unless_installed: tuple[str, ...] = ()  # a distribution whose presence avoids the issue
    # fla's GDN backward backends (kernelguard.resolution.fla_backend) the issue lives in: "triton", "tilelang", "flash_qla"
    fla_backends: tuple[str, ...] = ()
    kernels_version: str | None = None  # specifier on the installed `kernels` (Hub candidates)
    # (distribution, specifier) on another installed distribution the provider hands the op to (flash-qla)
    installed_version: tuple[str, str] | None = None
    # Rows the resolver detects from facts of their own kind rather than from the conditions above:
    # "undefined-symbol" (a compiled extension fails to load against this torch), "kernels-window",
    # "installed-set" (a combination of installed distributions, reported once for the whole environment),
    # "packed-segments" (kernelguard train counts each block's segments before step 1), "hub-no-backward"
    # (a Hub layer kernels swaps back at kernelize time: the guard reports the reference that then runs).
    detector: str | None = None
    # What we measured ourselves (where, on what, how far off), shown with every match so a user can judge an
    # --allow; the full runs are in bench/RESULTS.md.
    evidence: str = ""
    # Allowing this row also lifts fla's own RuntimeError for the stack (kernelguard's trainer and
    # `check --run` set fla's Triton-version flag in-process), so the accepted path actually runs.
    lifts_fla_refusal: bool = False
    # When set, a check's fix is kernelguard.resolution.install's command for this package built from the facts (torch's
    # own Triton pin decides between a Triton and a newer torch), then "; or " + ``accept``.
    fix_install: str | None = None
    accept: str = ""


FLA_640 = "https://github.com/fla-org/flash-linear-attention/issues/640"
FLA_1077 = "https://github.com/fla-org/flash-linear-attention/pull/1077"
FLASH_QLA_28 = "https://github.com/QwenLM/FlashQLA/pull/28"
FLA_1077_GRID_LIMIT = 65_535  # CUDA's cap on grid axis 1, where fla < 0.6.0 puts N * HV
# torch pins its Triton exactly, so `pip install triton` next to torch <= 2.12 breaks torch's own requirement.
_TRITON_FIX = (
    "Triton >= 3.7.1 through a torch that requires it (torch pins Triton exactly: 2.11 -> 3.6.0, 2.12 -> 3.7.0, "
    "2.13 -> 3.7.1; so pip install 'torch>=2.13'), or pip install tilelang z3-solver (fla then uses its TileLang "
    "backward); kernelguard check prints the command for the installed torch"
)

KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="fla-640-wrong-grads",
        title="fla gated-delta backward reported to give wrong dk/dg on Hopper with Triton 3.4-3.7.0",
        source=FLA_640,
        # Upstream bisected the miscompile (H20, Triton 3.5) to chunk_bwd_dqkwg's key-dim tile BK = 64. fla
        # uses BK = min(next_pow2(K), 128) on Hopper-sized shared memory, so the tile is 64 exactly when the
        # key head dim is 33-64. Kept as a rejection: we could not reproduce it, but one GPU and one Triton
        # are not proof of absence; an allow is the user's call, after `check --run` on their own stack.
        effect=(
            "the Triton chunk backward (chunk_bwd_dqkwg) is reported upstream to corrupt dk and dg when its "
            "key-dim tile is 64, i.e. key head dim <= 64; training would silently learn from wrong gradients"
        ),
        evidence=(
            "not reproduced on an H200 with Triton 3.6.0 + fla 0.6.0 (refusal lifted): at key head dim 64 "
            "(tile 64) every tensor stayed within 0.45% of the fp32 reference on kernelguard's inputs (2 shapes "
            "incl. varlen and GVA), and at key head dim 128 forcing the tile to 64 gave errors identical to the "
            "stock tile 128 to three digits"
        ),
        fix=_TRITON_FIX + (
            "; or run `kernelguard check --run --allow fla-640-wrong-grads` on this machine and, if every "
            "tensor passes, train with --allow fla-640-wrong-grads"
        ),
        fix_install="triton",
        accept=(
            "run `kernelguard check --run --allow fla-640-wrong-grads` on this machine and, if every tensor "
            "passes, train with --allow fla-640-wrong-grads"
        ),
        kernels=("chunk_gated_delta_rule", "chunk_kda"),
        provider="fla",
        archs=("9.0",),
        modes=("training",),
        triton=">=3.4,<3.7.1",
        key_head_dim_max=64,
        fla_backends=("triton",),
        lifts_fla_refusal=True,
    ),
    KnownIssue(
        id="fla-640-refusal",
        title="fla refuses the gated backward on Hopper with Triton 3.4-3.7.0",
        source=FLA_640,
        effect=(
            "fla raises RuntimeError at the first gated backward ('Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs "
            "produces incorrect results') for every shape, so training stops at step 1; at key head dim >= 128 "
            "its key-dim tile is 128, outside the reported bug, so allowing this lifts the refusal in "
            "kernelguard's guard and trainer"
        ),
        evidence=(
            "correct on an H200 with Triton 3.6.0 + fla 0.6.0 at key head dim 128: o, dq, dk, dv, dg, dbeta "
            "within 0.36-0.45% of the fp32 reference in bf16 (model shapes, varlen, GVA)"
        ),
        fix=_TRITON_FIX + (
            "; or accept with --allow fla-640-refusal (safe at key head dim >= 128; verify with kernelguard check --run)"
        ),
        fix_install="triton",
        accept="accept with --allow fla-640-refusal (safe at this key head dim; verify with kernelguard check --run)",
        kernels=("chunk_gated_delta_rule", "chunk_kda"),
        provider="fla",
        archs=("9.0",),
        modes=("training",),
        triton=">=3.4,<3.7.1",
        provider_version=">=0.6.0",
        key_head_dim_min=65,
        fla_backends=("triton",),
        lifts_fla_refusal=True,
    ),
    KnownIssue(
        id="flash-qla-wrong-grads",
        title="flash-qla < 0.1.3 computes wrong A_log / dt_bias gradients, and fla hands it the whole GDN op",
        source=(
            f"{FLASH_QLA_28} (wrong gate gradients for strong decay while the forward looks right; fixed in commit "
            "6e5d2ea, first released in flash-qla 0.1.3; 0.1.1 also wrote out of bounds, QwenLM/FlashQLA issue #23); "
            "fla-core 0.6.0's FlashQLABackend takes forward and backward whenever flash_qla imports, with no "
            "version check"
        ),
        effect=(
            "fla runs the gated-delta op on FlashQLA, whose backward gives wrong A_log and dt_bias gradients "
            "under strong decay while the loss looks normal; training would silently learn from them"
        ),
        fix="pip install 'flash-qla>=0.1.3'; or export FLA_FLASH_QLA=0 (fla then runs its own Triton/TileLang op)",
        kernels=("chunk_gated_delta_rule",),
        provider="fla",
        modes=("training",),
        fla_backends=("flash_qla",),
        installed_version=("flash-qla", "<0.1.3"),
    ),
    KnownIssue(
        id="tilelang-without-z3",
        title="tilelang installed without z3-solver breaks `import fla`",
        source="https://github.com/tile-ai/tilelang (libz3.so.4.15 is loaded at import)",
        effect="importing fla fails (OSError: libz3.so...: cannot open shared object file), so every fla kernel falls back",
        fix="pip install z3-solver  (or pip uninstall tilelang)",
        provider="fla",
        requires_installed=("tilelang",),
        unless_installed=("z3-solver",),
        detector="installed-set",
    ),
    KnownIssue(
        id="extension-built-for-other-torch",
        title="a compiled extension built against another torch (or CUDA / C++ ABI)",
        source="https://github.com/Dao-AILab/causal-conv1d/issues (undefined symbol at import, e.g. _ZN3c10...)",
        effect="the extension fails to load with 'undefined symbol', transformers swallows the ImportError "
        "and runs the torch reference path",
        fix=(
            "rebuild against the installed torch: pip install setuptools wheel ninja packaging && pip install "
            "--no-build-isolation --no-cache-dir --force-reinstall --no-deps PKG (kernelguard check prints it for PKG)"
        ),
        detector="undefined-symbol",
    ),
    KnownIssue(
        id="kernels-version",
        title="kernels package outside the version window transformers accepts",
        source=(
            "transformers/utils/import_utils.py KERNELS_MIN_VERSION / KERNELS_MAX_VERSION, is_kernels_available(); "
            "modeling_utils.py set_use_kernels (5.25: from_pretrained(use_kernels=None) means True unless "
            "USE_HUB_KERNELS is false)"
        ),
        effect=(
            "is_kernels_available() is False: transformers never uses Kernel Hub kernels, and a load with "
            "use_kernels=True raises ValueError: Kernels are not available - under transformers 5.25 that is every "
            "from_pretrained() that does not turn the Hub off"
        ),
        fix=(
            "pip install 'kernels>=MIN,<MAX' (the window of the installed transformers; 5.25: 'kernels>=0.19.1,<0.20', "
            "its own requirement); or load without the Hub (use_kernels=False, or USE_HUB_KERNELS=NO) and use the pip "
            "packages fla / causal-conv1d (kernelguard check --no-hub gives their commands)"
        ),
        detector="kernels-window",
    ),
    KnownIssue(
        id="kernels-before-0.14",
        title="kernels < 0.14 reads only the Hub's old \"model\"-type kernel repositories, removed on 2026-09-13",
        source=(
            "https://github.com/huggingface/kernels/issues/757 (model-type repos removed from 2026-09-13); "
            "kernel-type repos are read from kernels 0.14.0 on (https://github.com/huggingface/kernels/pull/435; "
            "0.13.0's loader has no repo_type='kernel')"
        ),
        effect="these releases find no Hub kernel at all, so every Hub candidate is missing and the pip package "
        "or the torch reference serves instead",
        fix="pip install 'kernels>=0.14' within the window of the installed transformers (kernelguard check prints it)",
        provider="hub",
        kernels_version="<0.14",
    ),
    KnownIssue(
        id="fla-1077-too-many-segments",
        title="fla < 0.6.0: a packed batch with more than 65,535 / HV sequences fails at launch",
        source=(
            f"{FLA_1077} (the GDN state kernels put N * HV on CUDA grid axis 1, capped at 65,535 blocks; fixed in "
            "fla-core 0.6.0, whose chunk_delta_h grid is (NV * N * HV,) where 0.5.2's is (NV, N * HV))"
        ),
        effect="a packed block with more than 65,535 // HV segments (2,047 at 32 value heads) stops the step with "
        "'RuntimeError: Triton Error [CUDA]: invalid argument'",
        fix="pip install 'fla-core>=0.6.0' 'flash-linear-attention>=0.6.0', or pack fewer, longer examples per "
        "block (--max-length smaller); kernelguard train checks every block before step 1",
        provider="fla",
        provider_version="<0.6.0",
        detector="packed-segments",
    ),
    KnownIssue(
        id="hub-layer-without-backward",
        title="a Hub layer without a backward, kernelized for training, falls back with an info-level log only",
        source=(
            "kernels/layer/layer.py _conditionally_replace_forward (kernels 0.17.2): Mode.TRAINING and "
            "has_backward=False -> logging.info('Layer does not support backward, using fallback')"
        ),
        effect="kernelize(mode=Mode.TRAINING) keeps the layer's own (reference) forward and says so only at INFO, "
        "which no default logging configuration prints",
        fix="kernelguard.guard(model) after kernelize reports and trips on the reference forward that runs; use "
        "a Hub kernel that declares has_backward, or the pip package",
        provider="hub",
        detector="hub-no-backward",
    ),
)


def by_id(issue_id: str) -> KnownIssue | None:
    return next((issue for issue in KNOWN_ISSUES if issue.id == issue_id), None)
