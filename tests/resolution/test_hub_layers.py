"""`check --hub`: the installed kernels accepts the layer of the variant a Hub mapping resolves to (kernels' own
loading and validation, asked offline on CPU: :mod:`kernelguard.resolution.providers.kernels_verdict`), and its forward takes
transformers' call (bound by Python). Local fake Hub kernel repositories (LOCAL_KERNELS, offline) whose layers are
real torch layers: kernels imports them, as kernelize() would. The classes of layer kernels itself refuses or
accepts (has_backward, kernels-minver, __init__, inherited forward, alias) are in tests/resolution/test_hub_provider.py, which
CI runs against every kernels window it installs."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from kernelguard.resolution import discovery
from kernelguard.resolution.providers.hub_layers import check_hub_layer
from kernelguard.resolution.transformers_calls import CallShape, Parameter, call_shape, reference_parameters

pytest.importorskip("kernels", reason="the Hub tests need the hub extra: pip install -e '.[dev]'")
pytest.importorskip("torch")
KERNELS = f"kernels {metadata.version('kernels')}"

VARIANT = "torch213-cxx11-cpu-x86_64-linux"
GDN_CALL = CallShape("torch_chunk_gated_delta_rule", 3,
                     ("g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens"),
                     popped=("cu_seq_lens_q",), spreads=True)
CONV_CALL = CallShape("causal_conv1d_fn", 3, ("activation",), spreads=True)


def _ref(*names: str) -> tuple[Parameter, ...]:
    """A torch reference's parameters: plain ones (``name=`` has a default), ``**name`` a catch-all."""
    return tuple(Parameter(n[2:], "VAR_KEYWORD", False) if n.startswith("**") else
                 Parameter(n.rstrip("="), "POSITIONAL_OR_KEYWORD", n.endswith("=")) for n in names)


# transformers 5.17-5.25's torch references (tests below check the modeling file still says so)
GDN_REF = _ref("query", "key", "value", "g", "beta", "chunk_size=", "initial_state=", "output_final_state=",
               "use_qk_l2norm_in_kernel=", "**kwargs")
CONV_REF = _ref("hidden_states", "weight", "bias=", "activation=", "**kwargs")
GOOD_GDN = """
class chunk_gated_delta_rule(torch.nn.Module):
    def forward(self, q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        pass
"""
GOOD_CONV = """
class causal_conv1d_fn(torch.nn.Module):
    def forward(self, x, weight, bias=None, activation=None, **kwargs):
        pass
"""


def _variant(root: Path, layers: str, *, name: str = VARIANT, package: bool = False,
             extra: dict[str, str] | None = None, init: str = "from . import layers\n",
             depends: tuple[str, ...] = ()) -> Path:
    folder = root / "build" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(init)
    (folder / "metadata.json").write_text(json.dumps({"id": "demo", "name": "demo", "version": 1,
                                                      "license": "Apache-2.0", "python-depends": list(depends),
                                                      "backend": {"type": "cpu"}}))
    target = folder / "layers" / "__init__.py" if package else folder / "layers.py"
    target.parent.mkdir(exist_ok=True)
    target.write_text("import torch\n" + textwrap.dedent(layers))
    for file, text in (extra or {}).items():
        (folder / file).write_text("import torch\n" + textwrap.dedent(text))
    return folder


def _check(folder: Path, layers_name: str = "chunk_gated_delta_rule", call: CallShape = GDN_CALL,
           packed: bool = True) -> str | None:
    kernel, reference = ("causal_conv1d_fn", CONV_REF) if layers_name == "causal_conv1d_fn" else \
        ("chunk_gated_delta_rule", GDN_REF)
    return check_hub_layer(kernel, "kernels-community/fla", layers_name, folder, call, packed=packed,
                           reference=reference).problem


# --------------------------------------------------------------------------------------- the two checks ---
def test_a_fitting_layer_passes_both_checks(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN)
    result = check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule", folder,
                             GDN_CALL, packed=True, reference=GDN_REF)
    assert result.problem is None and result.file == str(folder / "layers.py")
    assert (result.judged_by, result.note) == (KERNELS, None)
    assert result.call == ("chunk_gated_delta_rule(3 positional, g=, beta=, initial_state=, output_final_state=, "
                           "use_qk_l2norm_in_kernel=, cu_seqlens=, cu_seq_lens_k=, max_length_q=, max_length_k=, "
                           "seq_idx=)")


def test_a_layer_imported_into_a_layers_package_is_found(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "from ..gdn import GatedDeltaLayer as chunk_gated_delta_rule\n", package=True,
                      extra={"gdn.py": GOOD_GDN.replace("class chunk_gated_delta_rule", "class GatedDeltaLayer")})
    assert _check(folder) is None


def test_a_package_that_does_not_import_its_layers_is_refused_as_kernels_refuses_it(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN, init="")
    assert _check(folder) == (
        f"check 1 (kernels accepts the layer) failed: {KERNELS} refuses it for training: Kernel repo "
        f"`kernels-community/fla` (variant {VARIANT}), layer `chunk_gated_delta_rule` does not define any layers.")


def test_the_mapped_layer_is_missing(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN.replace("class chunk_gated_delta_rule", "class ChunkGatedDeltaRule"))
    assert _check(folder) == (
        f"check 1 (kernels accepts the layer) failed: {KERNELS} refuses it for training: Layer "
        f"`chunk_gated_delta_rule` not found in kernel repo `kernels-community/fla` (variant {VARIANT}), layer "
        "`chunk_gated_delta_rule`.")


def test_a_forward_unlike_the_reference_is_refused_by_kernels(tmp_path: Path) -> None:
    """kernels compares parameter counts and kinds with the torch reference: a conv forward without **kwargs."""
    folder = _variant(tmp_path, """
        class causal_conv1d_fn(torch.nn.Module):
            def forward(self, x, weight, bias=None, activation=None, seq_idx=None):
                pass
        """)
    for packed in (False, True):
        assert _check(folder, "causal_conv1d_fn", CONV_CALL, packed=packed) == (
            f"check 1 (kernels accepts the layer) failed: {KERNELS} refuses it for training: Forward signature of "
            f"`kernels-community/fla` (variant {VARIANT}), layer `causal_conv1d_fn` does not match `Func`: different "
            "kind of arguments (seq_idx=None (POSITIONAL_OR_KEYWORD) and **kwargs (VAR_KEYWORD)")


def test_multiple_values_for_seq_idx_transformers_47526(tmp_path: Path) -> None:
    """A conv layer kernels accepts (same count and kinds as the reference) whose 4th parameter is seq_idx: a call
    passing 4 positionals (activation by position) and seq_idx by name is the #47526 failure."""
    folder = _variant(tmp_path, """
        class causal_conv1d_fn(torch.nn.Module):
            def forward(self, x, weight, bias=None, seq_idx=None, **kwargs):
                pass
        """)
    four = CallShape("causal_conv1d_fn", 4, (), spreads=True)
    assert _check(folder, "causal_conv1d_fn", four) == (
        f"check 2 (its forward takes transformers' call) failed: `causal_conv1d_fn.forward` ({KERNELS} accepts the "
        "layer) does not bind it: multiple values for argument 'seq_idx'")
    assert _check(folder, "causal_conv1d_fn", four, packed=False) is None


def test_a_missing_required_argument(tmp_path: Path) -> None:
    folder = _variant(tmp_path, GOOD_GDN.replace("chunk_size=64", "scale"))
    assert _check(folder) == (
        f"check 2 (its forward takes transformers' call) failed: `chunk_gated_delta_rule.forward` ({KERNELS} "
        "accepts the layer) does not bind it: missing a required argument: 'scale'")


def test_a_variant_that_cannot_be_imported_here_is_read_from_its_source(tmp_path: Path) -> None:
    """A native library this machine cannot load: kernels cannot be asked, the source is read (and says so)."""
    broken = "raise OSError('libcudart.so.12: cannot open shared object file')\n"
    folder = _variant(tmp_path, GOOD_GDN.replace("class chunk_gated_delta_rule", "class Other"), init=broken)
    result = check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule", folder,
                             GDN_CALL, packed=True, reference=GDN_REF)
    assert result.problem == ("check 1 (the layer exists) failed: the variant's `layers` (layers.py) has no layer "
                              "`chunk_gated_delta_rule` (it defines: Other)")
    assert result.judged_by == "kernelguard's reading of the variant's source"
    assert result.note == (
        f"kernels' layer validation cannot run here: importing variant {VARIANT} failed here: OSError: "
        "libcudart.so.12: cannot open shared object file; judged from the variant's source instead")


def test_transformers_call_is_read_from_the_modeling_source() -> None:
    family = discovery.families()["qwen3_5"]
    sites = {k.kernel: k.call_site for k in family.kernels}
    gdn = call_shape(family.source, sites["chunk_gated_delta_rule"])
    assert gdn is not None and gdn.positional == 3 and gdn.spreads and "cu_seqlens" in gdn.keywords
    assert gdn.popped == ("cu_seq_lens_q",)
    conv = call_shape(family.source, sites["causal_conv1d_fn"])
    assert conv is not None and (conv.positional, conv.keywords, conv.spreads) == (3, ("activation",), True)
    assert reference_parameters(family.source, sites["chunk_gated_delta_rule"]) == GDN_REF
    assert reference_parameters(family.source, sites["causal_conv1d_fn"]) == CONV_REF


def test_a_call_inside_a_helper_the_forward_calls_is_found(tmp_path: Path) -> None:
    """5.25 calls causal_conv1d_fn from causal_conv1d_forward (a kernels Func), not from a forward: the call is
    read there, and a forward's own call still wins over a helper's."""
    source = tmp_path / "modeling_demo.py"
    source.write_text(textwrap.dedent("""
        def conv_forward(conv, x, cache, **kwargs):
            return causal_conv1d_fn(x, conv.weight, conv.bias, activation="silu", **kwargs)

        def unrelated(x):
            return gdn(x, x)

        class Layer:
            def forward(self, x, **kwargs):
                x = conv_forward(self.conv, x, None, **kwargs)
                return gdn(x, x, x, beta=1)
        """))
    assert call_shape(str(source), "causal_conv1d_fn") == CallShape("causal_conv1d_fn", 3, ("activation",),
                                                                      spreads=True)
    assert call_shape(str(source), "gdn") == CallShape("gdn", 3, ("beta",))
    assert call_shape(str(source), "missing") is None


# ------------------------------------------------------------------------------------ through `check --hub` ---
def test_check_hub_names_the_failed_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import __version__ as kernels_version

    from kernelguard.stack.compose import CheckOptions, run_check
    from kernelguard.stack.report import render

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
        f"build variant {VARIANT} from LOCAL_KERNELS, loaded for transformers' call chunk_gated_delta_rule(3 "
        "positional, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=, cu_seqlens=, "
        "cu_seq_lens_k=, max_length_q=, max_length_k=, seq_idx=): check 1 (kernels accepts the layer) failed: "
        f"{KERNELS} refuses it for training: Layer `chunk_gated_delta_rule` not found in kernel repo "
        f"`kernels-community/fla` (variant {VARIANT}), layer `chunk_gated_delta_rule`.")
    assert gdn_hub.fix == ("use a revision of kernels-community/fla whose `chunk_gated_delta_rule` layer the "
                           "installed kernels accepts and that takes this call, or load without use_kernels=True "
                           "and install the package")
    [conv_hub] = [c for c in verdicts["causal_conv1d_fn"].candidates if c.kind == "hub"]
    assert conv_hub.status in ("selected", "accepted") and conv_hub.reason == (
        f"build variant {VARIANT} from LOCAL_KERNELS; {KERNELS} accepts its `causal_conv1d_fn` layer.")
    assert "check 1 (kernels accepts the layer)" in render(result)


def test_a_declared_python_dependency_that_does_not_import_is_refused_with_its_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels 0.18+ refuse to load a variant whose "python-depends" do not import (`from_pretrained()` raises
    under transformers 5.25's default); `check --hub` says so with the one command that fixes it. The same
    variant with the dependency importable (a stub `einops` on the path) is accepted: the control."""
    from kernels import __version__ as kernels_version

    from kernelguard.stack.compose import CheckOptions, run_check

    if importlib.util.find_spec("einops") is not None:
        pytest.skip("einops is installed here: the refusal needs a machine without it")
    fla = _variant(tmp_path / "fla", GOOD_GDN, depends=("einops",))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/fla={fla.parent.parent}")
    monkeypatch.setattr(discovery, "kernels_version_window", lambda source=None: ("0", f"{kernels_version}.1"))

    def hub_candidate() -> Any:
        result = run_check(CheckOptions(model="qwen3_5", hub=True, allow=("*",)))
        [verdict] = [v for v in result.resolution.verdicts if v.kernel == "chunk_gated_delta_rule"]
        return next(c for c in verdict.candidates if c.kind == "hub")

    refused = hub_candidate()
    assert refused.status == "rejected" and refused.fix == "pip install einops"
    assert refused.reason.endswith(
        f"check 1 (kernels accepts the layer) failed: {KERNELS} refuses it for training: Kernel module `demo` "
        "requires Python dependency `einops`. Please install with: pip install einops.")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "einops.py").write_text("")
    monkeypatch.syspath_prepend(str(stub))
    assert hub_candidate().status in ("selected", "accepted")


def test_a_zip_build_is_read_in_place_when_kernels_cannot_be_asked(tmp_path: Path) -> None:
    """kernels 0.19's "zip" layout: the package is ``<id>.zip`` beside metadata.json, no layers.py on disk. The
    source reading finds the layer inside the archive (it said "no `layers` module" before); the control: the
    same archive without the class is refused by name."""
    import zipfile

    broken = "raise OSError('libcudart.so.12: cannot open shared object file')\n"

    def zipped(body: str, where: Path) -> Path:
        folder = _variant(where, GOOD_GDN, init=broken)
        layers = (folder / "layers.py").read_text()
        (folder / "layers.py").unlink()
        with zipfile.ZipFile(folder / "demo.zip", "w") as archive:
            archive.writestr("__init__.py", broken)
            archive.writestr("layers.py", layers if body == "good" else layers.replace(
                "class chunk_gated_delta_rule", "class Other"))
        return folder

    good = check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule",
                           zipped("good", tmp_path / "a"), GDN_CALL, packed=True, reference=GDN_REF)
    assert good.problem is None and good.judged_by == "kernelguard's reading of the variant's source"
    assert good.file is not None and good.file.endswith("demo.zip/layers.py")
    other = check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule",
                            zipped("other", tmp_path / "b"), GDN_CALL, packed=True, reference=GDN_REF)
    assert other.problem == ("check 1 (the layer exists) failed: the variant's `layers` (layers.py) has no layer "
                             "`chunk_gated_delta_rule` (it defines: Other)")


@pytest.mark.parametrize(("qla", "refused"), [("0.1.2", True), ("0.1.3", False)])
def test_check_hub_refuses_a_build_that_hands_its_op_to_a_flash_qla_with_wrong_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qla: str, refused: bool
) -> None:
    """A Hub fla build that vendors fla's dispatcher runs FlashQLA whenever flash_qla imports: flash-qla < 0.1.3's
    wrong A_log / dt_bias gradients (known issue flash-qla-wrong-grads) are then on transformers 5.25's default
    path, with no fla installed. Read from the build's own files; the fixed release is the control."""
    from check_helpers import write_distribution
    from kernels import __version__ as kernels_version

    from kernelguard.stack.compose import CheckOptions, run_check

    dispatch = "def backend():\n    try:\n        import flash_qla\n    except ImportError:\n        return 'triton'\n" \
        "    return 'flash_qla'\n"
    fla = _variant(tmp_path / "fla", GOOD_GDN, extra={"backends.py": dispatch})
    site = tmp_path / "site"
    write_distribution(site, "flash-qla", qla, {"flash_qla/__init__.py": f"__version__ = {qla!r}\n"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/fla={fla.parent.parent}")
    monkeypatch.setattr(discovery, "kernels_version_window", lambda source=None: ("0", f"{kernels_version}.1"))
    result = run_check(CheckOptions(model="qwen3_5", hub=True, allow=("attention",)))
    [verdict] = [v for v in result.resolution.verdicts if v.kernel == "chunk_gated_delta_rule"]
    hub = next(c for c in verdict.candidates if c.kind == "hub")
    assert result.env.version_of("flash-qla") == qla
    assert (hub.status == "rejected", hub.issues) == (refused, ("flash-qla-wrong-grads",) if refused else ())
    if refused:
        assert "; it hands the op to flash_qla when that imports: known issue flash-qla-wrong-grads" in hub.reason
        assert hub.fix == "pip install 'flash-qla>=0.1.3'; or export FLA_FLASH_QLA=0 (fla then runs its own " \
            "Triton/TileLang op)"
