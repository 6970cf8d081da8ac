"""The pure resolver on made-up systems: facts in, decisions (status, reason, fix, known issues) out.

Base case: an H200 node (sm 9.0), torch 2.13 + CUDA 12.8, Triton 3.7.1, fla 0.6.0, causal-conv1d with sm_90
SASS, kernels inside transformers' window, qwen3_5 packed training (key head dim 128). Every test changes
one thing with ``dataclasses.replace`` and states the exact decision that follows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from check_helpers import (
    BASE,
    CHUNK,
    EXT_SO,
    H200,
    INSTALL,
    TRAIN,
    UNDEFINED_SYMBOL,
    find,
    make_env,
    make_ext,
    make_pkg,
    qwen,
)

from kernelguard.errors import ConfigError
from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.catalog import HubRepo, ModelSpec
from kernelguard.resolution.providers.hub import HubKernelProbe, VariantVerdict
from kernelguard.resolution.resolver import (
    ACCEPTED,
    FALLBACK,
    REJECTED,
    SELECTED,
    SKIPPED,
    Decision,
    Facts,
    KernelVerdict,
    Resolution,
    Target,
    resolve,
)

FLA_640 = "https://github.com/fla-org/flash-linear-attention/issues/640"
CONV = "causal_conv1d_fn"
ATTN = "varlen_attention"
VARLEN = "torch.nn.attention.varlen.varlen_attn (attn_implementation='kernelguard_varlen')"
SDPA = "sdpa / eager with a block mask"
# The Hub repo version comes from the installed transformers' own mapping (2 in 5.23, 1 in 5.17).
_FLA_HUB = next(k.hub for k in discovery.resolve_model("qwen3_5").family.kernels if k.kernel == "chunk_gated_delta_rule")
FLA_HUB_LABEL = f"hub kernels-community/fla (version {_FLA_HUB.version})"


def with_package(facts: Facts, module: str, found: Any) -> Facts:
    return replace(facts, packages={**facts.packages, module: found})


def with_fla(facts: Facts, version: str = "0.6.0", **kwargs: Any) -> Facts:
    return with_package(facts, "fla.ops.gated_delta_rule", make_pkg("fla", version, **kwargs))


def with_conv(facts: Facts, **kwargs: Any) -> Facts:
    kwargs.setdefault("extensions", (make_ext(("sm_90",)),))
    return with_package(facts, "causal_conv1d", make_pkg("causal_conv1d", "1.6.0", **kwargs))


def allow(target: Target, *ids: str) -> Target:
    return replace(target, allow=frozenset(ids))


# --------------------------------------------------------------------------------------------- requirements


def test_requirements_of_qwen3_5_per_mode_and_key_dim_source() -> None:
    train, infer = qwen(), qwen("inference")
    assert [k.kernel for k in train.kernels] == [CONV, CHUNK]
    assert (train.packed, train.needs_varlen_attention, train.key_head_dim) == (True, True, 128)
    assert train.key_head_dim_source == "default of qwen3_5's config class"
    assert [k.kernel for k in infer.kernels] == [
        "causal_conv1d_update",
        CONV,
        CHUNK,
        "fused_recurrent_gated_delta_rule",
    ]
    assert (infer.packed, infer.needs_varlen_attention) == (False, False)
    small = qwen(key_dim=64)
    assert (small.key_head_dim, small.key_head_dim_source) == (64, "linear_key_head_dim in config.json")
    assert not qwen(packed=False).needs_varlen_attention


def test_base_hopper_stack_is_served_by_the_fast_providers() -> None:
    res = resolve(BASE, TRAIN, H200)
    assert res.ok and res.notes == () and res.unchecked == ()
    assert [(v.kernel, v.selected and v.selected.provider) for v in res.verdicts] == [
        (CONV, "causal_conv1d (causal_conv1d.causal_conv1d_fn)"),
        (CHUNK, "fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)"),
        (ATTN, VARLEN),
    ]
    chunk = find(res, CHUNK)
    assert [(d.kind, d.status) for d in chunk.candidates] == [
        ("hub", SKIPPED),
        ("package", SELECTED),
        ("reference", FALLBACK),
    ]
    assert (
        find(res, CHUNK, "package").reason
        == "fla-core 0.6.0 imports fla.ops.gated_delta_rule.chunk_gated_delta_rule."
    )
    assert find(res, CONV, "package").reason == (
        "causal-conv1d 1.6.0 imports causal_conv1d.causal_conv1d_fn; extensions load and contain sm_90 SASS and no PTX."
    )
    assert "pass --hub to check them" in find(res, CHUNK, "hub").reason


# --------------------------------------------------------------------------------------------- fla #640

# (id, triton, key dim, mode, archs, fla version, extra distributions, allow, status, issues)
FLA_640_ROWS = [
    (
        "hopper-triton3.6-kd64",
        "3.6.0",
        64,
        "training",
        ("9.0",),
        "0.6.0",
        {},
        (),
        REJECTED,
        ("fla-640-wrong-grads",),
    ),
    (
        "hopper-triton3.4.0-kd64",
        "3.4.0",
        64,
        "training",
        ("9.0",),
        "0.5.0",
        {},
        (),
        REJECTED,
        ("fla-640-wrong-grads",),
    ),
    (
        "hopper-triton3.7.0-kd64",
        "3.7.0",
        64,
        "training",
        ("9.0",),
        "0.6.0",
        {},
        (),
        REJECTED,
        ("fla-640-wrong-grads",),
    ),
    (
        "hopper-triton3.6-kd128-fla0.6",
        "3.6.0",
        128,
        "training",
        ("9.0",),
        "0.6.0",
        {},
        (),
        REJECTED,
        ("fla-640-refusal",),
    ),
    (
        "kd128-refusal-allowed",
        "3.6.0",
        128,
        "training",
        ("9.0",),
        "0.6.0",
        {},
        ("fla-640-refusal",),
        SELECTED,
        ("fla-640-refusal",),
    ),
    ("kd128-fla0.5-no-refusal", "3.6.0", 128, "training", ("9.0",), "0.5.0", {}, (), SELECTED, ()),
    (
        "kd64-wrong-grads-allowed",
        "3.6.0",
        64,
        "training",
        ("9.0",),
        "0.6.0",
        {},
        ("fla-640-wrong-grads",),
        SELECTED,
        ("fla-640-wrong-grads",),
    ),
    ("triton3.7.1", "3.7.1", 64, "training", ("9.0",), "0.6.0", {}, (), SELECTED, ()),
    ("triton3.3", "3.3.0", 64, "training", ("9.0",), "0.6.0", {}, (), SELECTED, ()),
    ("arch8.0", "3.6.0", 64, "training", ("8.0",), "0.6.0", {}, (), SELECTED, ()),
    ("arch10.0", "3.6.0", 128, "training", ("10.0",), "0.6.0", {}, (), SELECTED, ()),
    (
        "arch8.0+9.0",
        "3.6.0",
        64,
        "training",
        ("8.0", "9.0"),
        "0.6.0",
        {},
        (),
        REJECTED,
        ("fla-640-wrong-grads",),
    ),
    ("inference", "3.6.0", 64, "inference", ("9.0",), "0.6.0", {}, (), SELECTED, ()),
    (
        "tilelang-installed",
        "3.6.0",
        64,
        "training",
        ("9.0",),
        "0.6.0",
        {"tilelang": "0.1.6", "z3-solver": "4.15.0"},
        (),
        SELECTED,
        (),
    ),
    (
        "nightly-pytorch-triton",
        None,
        128,
        "training",
        ("9.0",),
        "0.6.0",
        {"pytorch-triton": "3.6.0+git1234"},
        (),
        REJECTED,
        ("fla-640-refusal",),
    ),
]


@pytest.mark.parametrize(
    "triton, key_dim, mode, archs, fla_version, extra, allowed, status, issues",
    [row[1:] for row in FLA_640_ROWS],
    ids=[row[0] for row in FLA_640_ROWS],
)
def test_fla_640_rows(
    triton: str | None,
    key_dim: int,
    mode: str,
    archs: tuple[str, ...],
    fla_version: str,
    extra: dict[str, str],
    allowed: tuple[str, ...],
    status: str,
    issues: tuple[str, ...],
) -> None:
    facts = with_fla(replace(BASE, env=make_env(gpus=("9.0",), triton=triton, packages=extra)), fla_version)
    target = Target(archs=archs, arch_source="made up", allow=frozenset(allowed))
    res = resolve(facts, qwen(mode, key_dim=key_dim), target)
    fla = find(res, CHUNK, "package")
    assert (fla.status, fla.issues) == (status, issues), fla.reason
    verdict = find(res, CHUNK)
    assert verdict.ok is (status == SELECTED)
    if status == REJECTED:
        assert fla.reason.startswith(f"known issue {issues[0]} ({FLA_640}): ")
        assert fla.reason.endswith("; rejected")
        # torch 2.13 (make_env's) requires triton==3.7.1: restoring its own pin is the fix.
        assert fla.fix.startswith("pip install 'triton==3.7.1'  (the Triton torch 2.13.0+cu128 requires; ")
        assert find(res, CHUNK, "reference").status == FALLBACK
        assert not res.ok
    elif issues:
        assert f"Note: known issue {issues[0]} ({FLA_640}): " in fla.reason
        assert fla.reason.endswith("allowed by --allow.")
    else:
        assert "known issue" not in fla.reason


def test_fla_640_wrong_grads_sentence_and_fix() -> None:
    facts = replace(BASE, env=make_env(gpus=("9.0",), triton="3.6.0"))
    fla = find(resolve(facts, qwen(key_dim=64), H200), CHUNK, "package")
    assert "corrupt dk and dg when its key-dim tile is 64" in fla.reason
    # The row carries our own measurement, so the user can weigh an --allow.
    assert "(measured: not reproduced on an H200 with Triton 3.6.0 + fla 0.6.0" in fla.reason
    assert fla.reason.endswith("; rejected")
    assert fla.fix == (
        "pip install 'triton==3.7.1'  (the Triton torch 2.13.0+cu128 requires; fla needs >= 3.7.1 on Hopper); or "
        "pip install tilelang z3-solver (fla then uses its TileLang backward); or run `kernelguard check --run "
        "--allow fla-640-wrong-grads` on this machine and, if every tensor passes, train with --allow "
        "fla-640-wrong-grads"
    )


@pytest.mark.parametrize(("torch", "pin"), [("2.11.0", "3.6.0"), ("2.12.0", "3.7.0")])
def test_fla_640_fix_next_to_a_torch_that_pins_an_older_triton_is_a_newer_torch(torch: str, pin: str) -> None:
    # `pip install 'triton>=3.7.1'` would break this torch's exact pin: offer torch >= 2.13 or tilelang instead.
    facts = replace(BASE, env=make_env(gpus=("9.0",), torch=torch, triton=pin))
    fla = find(resolve(facts, TRAIN, H200), CHUNK, "package")
    assert fla.issues == ("fla-640-refusal",)
    assert fla.fix == (
        f"pip install 'torch>=2.13'  (fla needs Triton >= 3.7.1 on Hopper and torch {torch}+cu128 requires "
        f"triton=={pin}, so installing Triton alone breaks torch; torch 2.13 requires triton==3.7.1: install it "
        "from the index of your CUDA build, then rebuild causal-conv1d against it); or pip install tilelang "
        "z3-solver (fla then uses its TileLang backward); or accept with --allow fla-640-refusal (safe at this "
        "key head dim; verify with kernelguard check --run)"
    )


def test_allowing_a_fla_640_row_is_what_lifts_the_refusal() -> None:
    from kernelguard.resolution.known_issues import KNOWN_ISSUES

    lifting = sorted(row.id for row in KNOWN_ISSUES if row.lifts_fla_refusal)
    assert lifting == ["fla-640-refusal", "fla-640-wrong-grads"]


def test_fla_640_refusal_fix_offers_the_allow() -> None:
    facts = replace(BASE, env=make_env(gpus=("9.0",), triton="3.6.0"))
    fla = find(resolve(facts, TRAIN, H200), CHUNK, "package")
    assert "fla raises RuntimeError at the first gated backward" in fla.reason
    assert "--allow fla-640-refusal" in fla.fix


@pytest.mark.parametrize("key_dim, issue", [(64, "fla-640-wrong-grads"), (128, "fla-640-refusal")])
def test_fla_640_with_unknown_arch_is_not_flagged_but_listed_unchecked(key_dim: int, issue: str) -> None:
    facts = replace(BASE, env=make_env(triton="3.6.0"))  # no GPU visible, no --arch
    res = resolve(facts, qwen(key_dim=key_dim), Target())
    fla = find(res, CHUNK, "package")
    assert (fla.status, fla.issues) == (SELECTED, ())
    assert f"{CHUNK}: known issue {issue} applies on compute capability 9.0 (pass --arch)" in res.unchecked
    assert res.unchecked[0].startswith("no GPU visible and no --arch given")


def test_fla_640_with_unknown_key_dim_is_listed_unchecked() -> None:
    facts = replace(BASE, env=make_env(gpus=("9.0",), triton="3.6.0"))
    res = resolve(facts, replace(TRAIN, key_head_dim=None, key_head_dim_source="unknown"), H200)
    assert find(res, CHUNK, "package").status == SELECTED
    assert (
        f"{CHUNK}: known issue fla-640-wrong-grads depends on the key head dim (pass --model CONFIG.json)"
        in res.unchecked
    )


def test_fla_640_matches_arch_specific_target_spelling() -> None:
    facts = replace(BASE, env=make_env(gpus=(), triton="3.6.0"))
    fla = find(resolve(facts, TRAIN, Target(archs=("9.0a",), arch_source="--arch")), CHUNK, "package")
    assert (fla.status, fla.issues) == (REJECTED, ("fla-640-refusal",))


def test_tilelang_without_z3_is_a_global_note() -> None:
    facts = replace(BASE, env=make_env(gpus=("9.0",), packages={"tilelang": "0.1.6"}))
    res = resolve(facts, TRAIN, H200)
    assert any(
        n.startswith("known issue tilelang-without-z3 (") and "fix: pip install z3-solver" in n
        for n in res.notes
    ), res.notes
    with_z3 = replace(
        BASE, env=make_env(gpus=("9.0",), packages={"tilelang": "0.1.6", "z3-solver": "4.15.0"})
    )
    assert resolve(with_z3, TRAIN, H200).notes == ()


# ------------------------------------------------------------------------------------------ package facts


def test_fla_older_than_transformers_minimum_is_rejected() -> None:
    facts = with_fla(BASE, "0.1.0", distribution="flash-linear-attention")
    fla = find(resolve(facts, TRAIN, H200), CHUNK, "package")
    assert fla.status == REJECTED
    assert (
        fla.reason == "flash-linear-attention 0.1.0 is older than 0.2.2, the minimum transformers requires."
    )
    assert fla.fix == "pip install -U 'flash-linear-attention>=0.2.2'"


def test_missing_package_is_rejected_with_install_command() -> None:
    facts = with_package(
        BASE,
        "fla.ops.gated_delta_rule",
        make_pkg("fla", None, import_error="ModuleNotFoundError: No module named 'fla'"),
    )
    res = resolve(facts, TRAIN, H200)
    fla = find(res, CHUNK, "package")
    assert (fla.status, fla.fix) == (REJECTED, INSTALL["fla"])
    assert (
        fla.reason
        == "fla-core / flash-linear-attention is not installed (import 'fla.ops.gated_delta_rule' failed)."
    )
    assert not find(res, CHUNK).ok and not res.ok


def test_import_error_is_reported_verbatim() -> None:
    error = "OSError: libz3.so.4.15: cannot open shared object file: No such file or directory"
    fla = find(resolve(with_fla(BASE, import_error=error), TRAIN, H200), CHUNK, "package")
    assert fla.status == REJECTED
    assert fla.reason == (
        f"importing fla.ops.gated_delta_rule.chunk_gated_delta_rule fails exactly as "
        f"transformers would see it: {error}."
    )


def test_undefined_symbol_extension_is_built_for_another_torch() -> None:
    ext = make_ext(("sm_90",), load_error=UNDEFINED_SYMBOL)
    facts = with_conv(BASE, import_error=UNDEFINED_SYMBOL, built_for_torch="2.11", extensions=(ext,))
    res = resolve(facts, TRAIN, H200)
    conv = find(res, CONV, "package")
    assert conv.status == REJECTED
    assert conv.issues == ("extension-built-for-other-torch",)
    assert conv.reason == (
        f"its compiled extension does not load against the installed torch 2.13.0+cu128 ({UNDEFINED_SYMBOL}): "
        "built for torch 2.11, found torch 2.13."
    )
    assert conv.fix == INSTALL["causal_conv1d"].replace("--no-cache-dir ", "--no-cache-dir --force-reinstall --no-deps ")
    assert not find(res, CONV).ok


def test_undefined_symbol_in_extension_load_only_and_unknown_build_torch() -> None:
    ext = make_ext(("sm_90",), load_error=UNDEFINED_SYMBOL)
    facts = with_conv(replace(BASE, env=make_env(torch="2.12.1", gpus=("9.0",))), extensions=(ext,))
    conv = find(resolve(facts, TRAIN, H200), CONV, "package")
    assert conv.issues == ("extension-built-for-other-torch",)
    assert conv.reason.endswith("built for another torch, found torch 2.12.")


@pytest.mark.parametrize(
    "sass, ptx, arch, status, described",
    [
        (("sm_80", "sm_86"), (), "9.0", REJECTED, None),
        (("sm_80", "sm_86"), (), "8.6", SELECTED, "sm_80, sm_86 SASS and no PTX"),
        (("sm_80", "sm_86"), (), "8.0", SELECTED, "sm_80, sm_86 SASS and no PTX"),
        (("sm_90",), (), "9.0", SELECTED, "sm_90 SASS and no PTX"),
        (("sm_90",), (), "8.0", REJECTED, None),
        ((), ("compute_80",), "9.0", SELECTED, "no SASS and compute_80 PTX"),
        ((), ("compute_90",), "8.0", REJECTED, None),
        (("sm_80",), ("compute_80",), "10.0", SELECTED, "sm_80 SASS and compute_80 PTX"),
    ],
)
def test_extension_arch_against_target(
    sass: tuple[str, ...], ptx: tuple[str, ...], arch: str, status: str, described: str | None
) -> None:
    facts = with_conv(BASE, extensions=(make_ext(sass, ptx),))
    conv = find(resolve(facts, TRAIN, Target(archs=(arch,))), CONV, "package")
    assert conv.status == status, conv.reason
    if status == REJECTED:
        assert conv.reason.startswith(f"{EXT_SO} cannot run on compute capability {arch}: built for ")
        assert conv.fix == INSTALL["causal_conv1d"]
    else:
        assert conv.reason.endswith(f"extensions load and contain {described}.")


def test_extension_arch_mismatch_sentence_is_exact() -> None:
    facts = with_conv(BASE, extensions=(make_ext(("sm_80", "sm_86")),))
    res = resolve(facts, TRAIN, H200)
    conv = find(res, CONV, "package")
    assert conv.reason == (
        f"{EXT_SO} cannot run on compute capability 9.0: built for sm_80, sm_86 (SASS) and no "
        "PTX; needs sm_90 SASS or PTX <= compute_90"
    )
    assert not find(res, CONV).ok and not res.ok
    assert find(res, CONV, "reference").status == FALLBACK


def test_extension_archs_without_target_are_listed_unchecked() -> None:
    facts = with_conv(BASE, extensions=(make_ext(("sm_80", "sm_86")),))
    res = resolve(facts, TRAIN, Target())
    assert find(res, CONV, "package").status == SELECTED
    assert (
        "causal_conv1d (causal_conv1d.causal_conv1d_fn): GPU archs compiled into its extensions were read "
        "(sm_80, sm_86 SASS and no PTX) but not compared with a target (pass --arch, e.g. --arch 9.0)"
        in res.unchecked
    )


def test_unreadable_extension_arch_is_unchecked_and_host_only_helper_is_ignored() -> None:
    helper = make_ext((), arch_error="no embedded CUDA code (no .nv_fatbin section)", name="libhelper.so")
    broken = make_ext((), arch_error="truncated ELF section table", name="weird.so")
    res = resolve(with_conv(BASE, extensions=(helper, broken)), TRAIN, H200)
    assert find(res, CONV, "package").status == SELECTED
    assert res.unchecked == (
        (
            "causal_conv1d (causal_conv1d.causal_conv1d_fn): could not read the GPU code of /site-packages/weird.so: "
            "truncated ELF section table"
        ),
    )


def test_package_that_runs_elsewhere_is_rejected_for_a_cuda_target() -> None:
    facts = with_fla(BASE, devices=("xpu",))
    fla = find(resolve(facts, TRAIN, H200), CHUNK, "package")
    assert (fla.status, fla.reason) == (REJECTED, "it runs on xpu (made up), the target is a CUDA GPU.")


# ---------------------------------------------------------------------------------------------- hub


def _probe(
    repo: str,
    *,
    chosen: str | None = "torch213-cxx11-cu128-x86_64-linux",
    trusted: bool = True,
    variants: tuple[VariantVerdict, ...] = (),
) -> HubKernelProbe:
    return HubKernelProbe(
        repo, "offline cache", "/cache/snap/build", "abc123", chosen, variants, trusted, None
    )


# transformers 5.23/5.24's window holds a release (0.18.3): the fix is the window's own requirement.
WINDOW_FIX = "pip install 'kernels>=0.18.2,<0.19.0'"


def test_kernels_outside_window_is_a_note_and_rejects_hub_candidates() -> None:
    facts = replace(BASE, env=make_env(gpus=("9.0",), kernels="0.17.2"))
    note = (
        "known issue kernels-version: kernels 0.17.2 is outside [0.18.2, 0.19.0), the range this transformers "
        "accepts, so is_kernels_available() is False and from_pretrained(use_kernels=True) raises ValueError: "
        "Kernels are not available; fix: " + WINDOW_FIX
    )
    plain = resolve(facts, TRAIN, H200)
    assert plain.notes == ()  # Hub kernels not asked for: the window is not this job's concern

    assert find(plain, CHUNK, "hub").status == SKIPPED
    assert plain.ok  # the packages still serve: the note is information, not a failure

    hub = resolve(
        replace(facts, hub={"kernels-community/fla": _probe("kernels-community/fla")}),
        TRAIN,
        replace(H200, use_hub=True),
    )
    decision = find(hub, CHUNK, "hub")
    assert decision.status == REJECTED
    assert decision.provider == FLA_HUB_LABEL
    assert decision.reason.startswith(
        "kernels 0.17.2 is outside [0.18.2, 0.19.0), the range this transformers accepts"
    )
    assert decision.fix == WINDOW_FIX
    assert find(hub, CHUNK, "package").status == SELECTED
    assert hub.notes == (note,)  # asked for the Hub (--hub): the window is said


def test_kernels_inside_window_gives_no_note_and_hub_variant_wins() -> None:
    facts = replace(
        BASE,
        hub={
            "kernels-community/fla": _probe("kernels-community/fla"),
            "kernels-community/mamba-ssm": _probe("kernels-community/mamba-ssm"),
        },
    )
    res = resolve(facts, TRAIN, replace(H200, use_hub=True))
    assert res.notes == ()
    assert find(res, CHUNK).selected.provider == FLA_HUB_LABEL
    assert (
        find(res, CHUNK, "hub").reason
        == "build variant torch213-cxx11-cu128-x86_64-linux from offline cache."
    )
    assert find(res, CHUNK, "package").status == ACCEPTED


def test_kernels_not_installed_and_hub_not_probed() -> None:
    missing = resolve(
        replace(BASE, env=make_env(gpus=("9.0",), kernels=None)), TRAIN, replace(H200, use_hub=True)
    )
    # The window's own requirement, not kernelguard-gdn[hub]: the extra's range is wider than one transformers'.
    assert (find(missing, CHUNK, "hub").reason, find(missing, CHUNK, "hub").fix) == (
        ("the kernels package is not installed, so from_pretrained(use_kernels=True) raises ValueError: Kernels "
         "are not available."),
        WINDOW_FIX,
    )
    for window, fix in ((("0.16", "0.17"), "pip install 'kernels>=0.16,<0.17'"), (None, "pip install 'kernelguard-gdn[hub]'")):
        facts = replace(BASE, env=make_env(gpus=("9.0",), kernels=None), kernels_window=window)
        assert find(resolve(facts, TRAIN, replace(H200, use_hub=True)), CHUNK, "hub").fix == fix
    unprobed = find(resolve(BASE, TRAIN, replace(H200, use_hub=True)), CHUNK, "hub")
    assert (unprobed.status, unprobed.reason) == (REJECTED, "the Hub repository was not probed.")


def test_hub_without_matching_variant_lists_kernels_reasons() -> None:
    variant = VariantVerdict(
        "torch213-cxx11-cu130-x86_64-linux",
        False,
        "Rejected by kernels: backend (cu130) does not match selected backend (cu128).",
    )
    facts = replace(
        BASE, hub={"kernels-community/fla": _probe("kernels-community/fla", chosen=None, variants=(variant,))}
    )
    hub = find(resolve(facts, TRAIN, replace(H200, use_hub=True)), CHUNK, "hub")
    assert hub.status == REJECTED
    assert hub.reason.startswith(
        "no build variant matches this system (offline cache at /cache/snap/build). Variants: "
        "torch213-cxx11-cu130-x86_64-linux: Rejected by kernels: backend (cu130) does not match selected backend "
        "(cu128)."
    )
    assert hub.fix == ("USE_HUB_KERNELS=NO with the pip kernels  (or set LOCAL_KERNELS=kernels-community/fla=PATH "
                       "to a build for this system)")


def test_hub_variant_reasons_end_with_one_period() -> None:
    variant = VariantVerdict("v", False, "Rejected by kernels: backend (cu130) does not match.")
    facts = replace(
        BASE, hub={"kernels-community/fla": _probe("kernels-community/fla", chosen=None, variants=(variant,))}
    )
    hub = find(resolve(facts, TRAIN, replace(H200, use_hub=True)), CHUNK, "hub")
    assert not hub.reason.endswith("..")


def test_untrusted_hub_repo_needs_its_allow() -> None:
    requirements = replace(
        TRAIN,
        kernels=tuple(
            replace(k, hub=HubRepo("someone/fla", "chunk_gated_delta_rule", None, "0123456789abcdef"))
            if k.kernel == CHUNK
            else k
            for k in TRAIN.kernels
        ),
    )
    facts = replace(BASE, hub={"someone/fla": _probe("someone/fla", trusted=False)})
    target = replace(H200, use_hub=True)
    hub = find(resolve(facts, requirements, target), CHUNK, "hub")
    assert hub.provider == "hub someone/fla@0123456789ab"
    assert (hub.status, hub.reason) == (
        REJECTED,
        "repository someone/fla is outside the trusted organisations.",
    )
    assert hub.fix == "pass --allow untrusted-hub-repo to accept it"
    allowed = find(resolve(facts, requirements, allow(target, "untrusted-hub-repo")), CHUNK)
    assert allowed.selected.provider == "hub someone/fla@0123456789ab"


# --------------------------------------------------------------------------------------------- allow


@pytest.mark.parametrize("packed", [False, True])
def test_allowed_kernel_fallback_is_selected_only_for_unpacked_training(packed: bool) -> None:
    facts = with_package(
        BASE,
        "fla.ops.gated_delta_rule",
        make_pkg("fla", None, import_error="ModuleNotFoundError: No module named 'fla'"),
    )
    res = resolve(facts, qwen(packed=packed), allow(H200, CHUNK))
    chunk = find(res, CHUNK)
    ref = chunk.candidates[-1]
    assert ref.reason.startswith("torch_chunk_gated_delta_rule is transformers' pure-PyTorch reference")
    assert find(res, CHUNK, "package").status == REJECTED  # the rejection is still shown
    if not packed:
        assert chunk.ok and chunk.selected is ref
        assert (ref.kind, ref.provider, ref.status) == ("reference", "torch reference", SELECTED)
        assert ref.reason.endswith("; explicitly allowed by --allow.")
        return
    assert not chunk.ok and chunk.selected is None and not res.ok
    assert (ref.status, ref.fix) == (FALLBACK, "install a fast provider above, or check unpacked training with --no-packed")
    assert ref.reason.endswith(
        "the torch reference cannot keep packed examples apart (it ignores cu_seqlens / seq_idx: transformers "
        ">= 5.20 raises ValueError at the first packed step, older releases silently mix the examples' state), so "
        "an allow cannot make it acceptable for packed training."
    )


def test_allowed_kernel_still_prefers_a_working_provider() -> None:
    res = resolve(BASE, TRAIN, allow(H200, CHUNK))
    assert find(res, CHUNK).selected.kind == "package"
    assert find(res, CHUNK, "reference").status == FALLBACK


def test_unknown_allow_is_a_usage_error_listing_valid_items() -> None:
    with pytest.raises(ConfigError) as info:
        allow(H200, "fla640")  # near no valid name
    message = info.value.message
    assert message.startswith("allow: 'fla640' is not a known issue ID, kernel name or policy. Known issues: ")
    assert "fla-640-refusal" in message and "chunk_gated_delta_rule" in message and "untrusted-hub-repo" in message


@pytest.mark.parametrize(("item", "meant"), [("chunk_gated_delta_rul", "chunk_gated_delta_rule"),
                                             ("Attention", "attention")])
def test_a_mistyped_allow_item_names_the_nearest_valid_one_not_every_one(item: str, meant: str) -> None:
    with pytest.raises(ConfigError) as info:
        allow(H200, item)
    assert info.value.message.startswith(
        f"allow: {item!r} is not a known issue ID, kernel name or policy; did you mean {meant}")
    assert "Known issues:" not in info.value.message and info.value.details["replace"] == (item, meant)


# ----------------------------------------------------------------------------------------- attention


def test_cpu_torch_build_rejects_torch_varlen_and_needs_allow_attention() -> None:
    facts = replace(BASE, env=make_env(cuda=None, gpus=()), torch_varlen_attention=True)
    res = resolve(facts, TRAIN, H200)
    attn = find(res, ATTN)
    assert not attn.ok and not res.ok
    torch_varlen = find(res, ATTN, "torch")
    assert (torch_varlen.provider, torch_varlen.status) == (VARLEN, REJECTED)
    assert (
        torch_varlen.reason == "torch 2.13.0+cpu is a build without CUDA; varlen_attn runs only on CUDA GPUs."
    )
    assert torch_varlen.fix == (
        "pip install 'torch==2.13.0+cu128' --index-url https://download.pytorch.org/whl/cu128  (the CUDA 12.8 "
        "build, for drivers >= 570; for CUDA 13 use cu130 in both places)"
    )
    sdpa = find(res, ATTN, "reference")
    assert (sdpa.provider, sdpa.status) == (SDPA, FALLBACK)
    assert sdpa.reason.endswith("; used only when nothing above serves (accept it with --allow attention).")

    allowed = resolve(facts, TRAIN, allow(H200, "attention"))
    assert find(allowed, ATTN).ok
    assert find(allowed, ATTN).selected.provider == SDPA
    assert find(allowed, ATTN).selected.reason.endswith("; explicitly allowed by --allow attention.")


def test_torch_without_varlen_module() -> None:
    facts = replace(
        BASE, env=make_env(torch="2.11.0", cuda="12.6", gpus=("9.0",)), torch_varlen_attention=False
    )
    torch_varlen = find(resolve(facts, TRAIN, H200), ATTN, "torch")
    assert torch_varlen.reason == "torch 2.11.0+cu126 has no torch.nn.attention.varlen.varlen_attn."
    assert torch_varlen.fix == "pip install -U 'torch>=2.10'"


def test_varlen_needs_ampere() -> None:
    torch_varlen = find(resolve(BASE, TRAIN, Target(archs=("7.5",))), ATTN, "torch")
    assert torch_varlen.status == REJECTED
    assert (
        torch_varlen.reason == "varlen_attn needs compute capability >= 8.0 (flash backend); target is 7.5."
    )


def test_flash_attn_is_tried_first_and_arch_checked() -> None:
    good = with_package(
        BASE, "flash_attn", make_pkg("flash_attn", "2.8.3", extensions=(make_ext(("sm_90",)),))
    )
    res = resolve(good, TRAIN, H200)
    assert find(res, ATTN).selected.provider == "flash_attn (flash_attn_varlen_func)"
    assert find(res, ATTN, "torch").status == ACCEPTED
    ampere_only = with_package(
        BASE, "flash_attn", make_pkg("flash_attn", "2.8.3", extensions=(make_ext(("sm_80",), name="fa2.so"),))
    )
    flash = find(resolve(ampere_only, TRAIN, H200), ATTN, "package")
    assert flash.status == REJECTED
    assert flash.reason.startswith("fa2.so cannot run on compute capability 9.0: built for sm_80 (SASS)")


@pytest.mark.parametrize("mode, packed", [("inference", False), ("training", False)])
def test_no_attention_verdict_without_packed_training(mode: str, packed: bool) -> None:
    res = resolve(BASE, qwen(mode, packed=packed), H200)
    assert ATTN not in [v.kernel for v in res.verdicts]


def test_torch_import_failure_is_the_varlen_reason() -> None:
    error = "ImportError: libcudart.so.12: cannot open shared object file"
    env = replace(make_env(), torch_error=error)
    env = replace(env, cuda_version=replace(env.cuda_version, value=None, source="import torch"))
    facts = replace(BASE, env=env, torch_varlen_attention=False)
    res = resolve(facts, TRAIN, H200)
    assert f"torch could not be imported: {error}" in res.notes
    torch_varlen = find(res, ATTN, "torch")
    assert "has no torch.nn.attention.varlen" not in torch_varlen.reason
    assert error in torch_varlen.reason


def test_torch_import_failure_is_a_note() -> None:
    error = "ImportError: libcudart.so.12: cannot open shared object file"
    res = resolve(replace(BASE, env=replace(make_env(gpus=("9.0",)), torch_error=error)), TRAIN, H200)
    assert f"torch could not be imported: {error}" in res.notes


@pytest.mark.parametrize("abi", [True, False])
@pytest.mark.parametrize("torch, cuda", [("2.11.0", "12.6"), ("2.12.0", "12.8"), ("2.13.0", "13.0")])
def test_good_stack_is_ok_on_every_torch_cuda_abi(torch: str, cuda: str, abi: bool) -> None:
    res = resolve(replace(BASE, env=make_env(torch=torch, cuda=cuda, abi=abi, gpus=("9.0",))), TRAIN, H200)
    assert res.ok and [v.selected and v.selected.kind for v in res.verdicts] == [
        "package",
        "package",
        "torch",
    ]


# ------------------------------------------------------------------------------------ Resolution.ok


def _verdict(ok: bool) -> KernelVerdict:
    status = SELECTED if ok else FALLBACK
    return KernelVerdict("k", (Decision("k", "p", "package", status, "r"),), ok=ok)


@pytest.mark.parametrize(
    "oks, expected",
    [
        ((), True),
        ((True,), True),
        ((False,), False),
        ((True, True), True),
        ((True, False), False),
        ((False, True), False),
        ((False, False), False),
    ],
)
def test_resolution_ok_truth_table(oks: tuple[bool, ...], expected: bool) -> None:
    res = Resolution(TRAIN, H200, tuple(_verdict(ok) for ok in oks), notes=("a note",), unchecked=("x",))
    assert res.ok is expected  # notes and unchecked items never change the verdict


def test_kda_families_have_a_key_head_dim_for_the_known_issues() -> None:
    """Kimi delta attention's q and k share ``linear_head_dim``: the fla-640 rows (decided by the key head dim)
    apply to ``chunk_kda`` as they do to GDN's kernel, from the family default or from a config.json."""
    family = discovery.resolve_model("kimi_linear")
    version = discovery.transformers_source().version
    default = catalog.requirements(family, "training", packed=True, transformers_version=version)
    assert "chunk_kda" in [k.kernel for k in default.kernels]
    assert (default.key_head_dim, default.key_head_dim_source) == (128, "default of kimi_linear's config class")
    config = ModelSpec(family.family, {"model_type": "kimi_linear", "linear_num_heads": 8, "linear_head_dim": 64},
                       "config.json")
    small = catalog.requirements(config, "training", packed=True, transformers_version=version)
    assert (small.key_head_dim, small.key_head_dim_source) == (64, "linear_head_dim in config.json")
