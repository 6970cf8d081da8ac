"""`check --hub`: the variant a Hub mapping resolves to has the mapped layer, and its forward takes transformers'
call. Local fake Hub kernel repositories (LOCAL_KERNELS, offline), read with ast: nothing of them is run (each
fake's module body raises, so an import would fail the test)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kernelguard import discovery
from kernelguard.providers.hub_layers import check_hub_layer
from kernelguard.transformers_calls import CallShape, call_shape

pytest.importorskip("kernels", reason="the Hub tests need the hub extra: pip install -e '.[dev]'")

VARIANT = "torch213-cxx11-cpu-x86_64-linux"
NEVER_RUN = "raise RuntimeError('kernelguard must not execute a Hub variant')\n"
GDN_CALL = CallShape("torch_chunk_gated_delta_rule", 3,
                     ("g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens"),
                     popped=("cu_seq_lens_q",), spreads=True)
CONV_CALL = CallShape("causal_conv1d_fn", 3, ("activation",), spreads=True)
GOOD_GDN = """
class chunk_gated_delta_rule:
    def forward(self, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        pass
"""
GOOD_CONV = """
class causal_conv1d_fn:
    def forward(self, x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
        pass
"""


def _variant(root: Path, layers: str, *, name: str = VARIANT, package: bool = False, extra: dict[str, str] | None = None) -> Path:
    folder = root / "build" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(NEVER_RUN)
    (folder / "metadata.json").write_text(json.dumps({"id": "demo", "name": "demo", "version": 1,
                                                      "license": "Apache-2.0", "python-depends": [],
                                                      "backend": {"type": "cpu"}}))
    target = folder / "layers" / "__init__.py" if package else folder / "layers.py"
    target.parent.mkdir(exist_ok=True)
    target.write_text(NEVER_RUN + textwrap.dedent(layers))
    for file, text in (extra or {}).items():
        (folder / file).write_text(NEVER_RUN + textwrap.dedent(text))
    return folder


def _check(folder: Path, layers_name: str = "chunk_gated_delta_rule", call: CallShape = GDN_CALL,
           packed: bool = True) -> str | None:
    kernel = "causal_conv1d_fn" if call is CONV_CALL else "chunk_gated_delta_rule"
    return check_hub_layer(kernel, "kernels-community/fla", layers_name, folder, call, packed=packed).problem


# --------------------------------------------------------------------------------------- the two checks ---
def test_a_fitting_layer_passes_both_checks(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN)
    result = check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule", folder,
                             GDN_CALL, packed=True)
    assert result.problem is None and result.file == str(folder / "layers.py")
    assert result.call == ("chunk_gated_delta_rule(3 positional, g=, beta=, initial_state=, output_final_state=, "
                           "use_qk_l2norm_in_kernel=, cu_seqlens=, cu_seq_lens_k=, max_length_q=, max_length_k=, "
                           "seq_idx=)")


def test_a_layer_imported_into_a_layers_package_is_found(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "from ..gdn import GatedDeltaLayer as chunk_gated_delta_rule\n", package=True,
                      extra={"gdn.py": GOOD_GDN.replace("class chunk_gated_delta_rule", "class GatedDeltaLayer")})
    assert _check(folder) is None


def test_no_layers_module(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN)
    (folder / "layers.py").unlink()
    assert _check(folder) == (
        f"check 1 (the layer exists) failed: variant {VARIANT} has no `layers` module (no layers.py or "
        "layers/__init__.py), so kernels finds no layer in it")


def test_the_mapped_layer_is_missing(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN.replace("class chunk_gated_delta_rule", "class ChunkGatedDeltaRule"))
    assert _check(folder) == ("check 1 (the layer exists) failed: the variant's `layers` (layers.py) has no layer "
                              "`chunk_gated_delta_rule` (it defines: ChunkGatedDeltaRule)")


def test_multiple_values_for_seq_idx_transformers_47526(tmp_path: Path) -> None:
    """A conv layer whose 4th parameter is seq_idx: transformers' 3 positionals + activation= fit, but a
    call passing 4 positionals (activation by position) and seq_idx by name is the #47526 failure."""
    folder = _variant(tmp_path, """
        class causal_conv1d_fn:
            def forward(self, x, weight, bias=None, seq_idx=None, activation=None, **kwargs):
                pass
        """)
    four = CallShape("causal_conv1d_fn", 4, (), spreads=True)
    assert _check(folder, "causal_conv1d_fn", four) == (
        f"check 2 (its forward takes transformers' call) failed: `causal_conv1d_fn.forward` in {VARIANT}/layers.py "
        "got multiple values for argument 'seq_idx': the call passes it by position and by name")


def test_packed_keywords_without_kwargs_are_refused_only_in_packed_training(tmp_path: Path) -> None:
    folder = _variant(tmp_path, """
        class causal_conv1d_fn:
            def forward(self, x, weight, bias=None, activation=None, seq_idx=None):
                pass
        """)
    assert _check(folder, "causal_conv1d_fn", CONV_CALL, packed=False) is None
    assert _check(folder, "causal_conv1d_fn", CONV_CALL) == (
        f"check 2 (its forward takes transformers' call) failed: `causal_conv1d_fn.forward` in {VARIANT}/layers.py "
        "got an unexpected keyword argument 'cu_seq_lens_q' (no such parameter and no **kwargs)")


def test_too_many_positionals_and_a_missing_required_argument(tmp_path: Path) -> None:
    folder = _variant(tmp_path, """
        class chunk_gated_delta_rule:
            def forward(self, q, k, **kwargs):
                pass
        """)
    assert _check(folder).endswith("takes 2 positional arguments after self, but the call passes 3")
    folder = _variant(tmp_path / "b", """
        class chunk_gated_delta_rule:
            def forward(self, q, k, v, g, beta, scale, **kwargs):
                pass
        """)
    assert _check(folder).endswith("is missing required argument(s) 'scale' that the call does not pass")


def test_transformers_call_is_read_from_the_modeling_source() -> None:
    family = discovery.families()["qwen3_5"]
    sites = {k.kernel: k.call_site for k in family.kernels}
    gdn = call_shape(family.source, sites["chunk_gated_delta_rule"])
    assert gdn is not None and gdn.positional == 3 and gdn.spreads and "cu_seqlens" in gdn.keywords
    assert gdn.popped == ("cu_seq_lens_q",)
    conv = call_shape(family.source, sites["causal_conv1d_fn"])
    assert conv is not None and (conv.positional, conv.keywords, conv.spreads) == (3, ("activation",), True)


# ------------------------------------------------------------------------------------ through `check --hub` ---
def test_check_hub_names_the_failed_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import __version__ as kernels_version

    from kernelguard.check import CheckOptions, run_check
    from kernelguard.report import render

    fla = _variant(tmp_path / "fla", GOOD_GDN.replace("class chunk_gated_delta_rule", "class Other"))
    conv = _variant(tmp_path / "conv", GOOD_CONV)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/fla={fla.parent.parent}:"
                                        f"kernels-community/mamba-ssm={conv.parent.parent}")
    # The check is about the variant: put the installed kernels inside transformers' window for this run.
    monkeypatch.setattr(discovery, "kernels_version_window", lambda source=None: ("0", f"{kernels_version}.1"))
    result = run_check(CheckOptions(model="qwen3_5", hub=True, allow=("*",)))
    verdicts = {v.kernel: v for v in result.resolution.verdicts}
    [gdn_hub] = [c for c in verdicts["chunk_gated_delta_rule"].candidates if c.kind == "hub"]
    assert gdn_hub.status == "rejected"
    assert gdn_hub.reason == (
        f"build variant {VARIANT} from LOCAL_KERNELS does not fit transformers' call chunk_gated_delta_rule(3 "
        "positional, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=, cu_seqlens=, "
        "cu_seq_lens_k=, max_length_q=, max_length_k=, seq_idx=): check 1 (the layer exists) failed: the variant's "
        "`layers` (layers.py) has no layer `chunk_gated_delta_rule` (it defines: Other); kernelize() would fall "
        "back or fail at the first call.")
    assert gdn_hub.fix == ("use a revision of kernels-community/fla whose `chunk_gated_delta_rule` layer takes this "
                           "call, or load without use_kernels=True and install the package")
    [conv_hub] = [c for c in verdicts["causal_conv1d_fn"].candidates if c.kind == "hub"]
    assert conv_hub.status in ("selected", "accepted") and conv_hub.reason == (
        f"build variant {VARIANT} from LOCAL_KERNELS.")
    assert "check 1 (the layer exists) failed" in render(result)
