"""Which families ``kernelguard train`` packs (kernelguard.resolution.family_support): read from the modeling
source of the installed transformers; the docs table is generated from the same list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernelguard.resolution import discovery, family_table, packing_support
from kernelguard.resolution.catalog import Family, KernelRequirement

ROOT = Path(__file__).resolve().parents[2]


def _family(tmp_path: Path, call: str, kernel: str = "chunk_kda") -> Family:
    """A made-up family whose layer forward calls its kernel's decorated function as ``call`` says."""
    source = tmp_path / "modeling_made_up.py"
    source.write_text(
        "def chunk_made_up(q, k, v, **kwargs):\n    return q\n\n\n"
        "class MadeUpLayer:\n    def forward(self, q, k, v, **kwargs):\n"
        f"        return {call}\n"
    )
    req = KernelRequirement(kernel, "chunk_made_up", "fla", "fla.ops.kda", None)
    return Family("made_up", ("made_up",), (req,), True, False, 64, str(source))


@pytest.mark.parametrize(("call", "packs"), [
    ("chunk_made_up(q, k, v, cu_seqlens=kwargs.pop('cu_seq_lens_q', None))", True),
    ("chunk_made_up(q, k, v, **kwargs)", False),  # the batch's cu_seq_lens_q reaches the kernel under its own name
    ("chunk_made_up(q, k, v)", False),
])
def test_a_family_packs_only_when_its_layer_hands_the_kernel_the_boundary(
    tmp_path: Path, call: str, packs: bool
) -> None:
    support = packing_support(_family(tmp_path, call))
    assert support.packs is packs
    if not packs:
        assert support.packed_problem == ("transformers' layer does not pass `cu_seqlens` to `chunk_kda`, so its "
                                          "state runs on from one packed example into the next")


def test_a_kernel_kernelguard_knows_no_boundary_for_is_not_packed(tmp_path: Path) -> None:
    support = packing_support(_family(tmp_path, "chunk_made_up(q, k, v, seq_idx=1)", kernel="made_up_scan"))
    assert support.packed_problem == ("kernelguard cannot check that `made_up_scan` keeps packed examples apart "
                                      "(no boundary parameter it knows)")


def test_a_scan_without_a_boundary_and_a_causal_lm_that_drops_the_keywords_are_not_packed(tmp_path: Path) -> None:
    scan = packing_support(_family(tmp_path, "chunk_made_up(q, k, v, **kwargs)", kernel="selective_scan_fn"))
    assert scan.packed_problem == ("`selective_scan_fn` takes no boundary at all: its scan runs on from one packed "
                                   "example into the next")
    source = tmp_path / "modeling_made_up.py"
    passes = "class MadeUpForCausalLM:\n    def forward(self, input_ids, **kwargs):\n" \
        "        return self.model(input_ids=input_ids, **kwargs)\n"
    seq = "chunk_made_up(q, k, v, **kwargs)"
    family = _family(tmp_path, seq, kernel="mamba_chunk_scan_combined")
    source.write_text(source.read_text() + passes)
    assert packing_support(family).packs  # the control: the keywords reach the layer, seq_idx the scan
    source.write_text(source.read_text().replace("input_ids=input_ids, **kwargs)", "input_ids=input_ids)"))
    from kernelguard.resolution.transformers_calls import clear_caches

    clear_caches()
    assert packing_support(family).packed_problem == (
        "`MadeUpForCausalLM.forward` calls `self.model(...)` without its **kwargs, so a batch's packed-sequence "
        "keywords never reach its layers")


SUBMODULE_FILE = """
def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, **kwargs):
    return x


class ShortConv(nn.Module):
    def forward(self, hidden_states, cache=None, **kwargs):
        return causal_conv1d_fn(hidden_states, self.w, seq_idx=kwargs.get("seq_idx"))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        self.sconv = ShortConv(config.hidden_size).to(dtype=torch.float32)

    def forward(self, hidden_states, cache=None, **kwargs):
        return self.sconv(CALL)
"""


@pytest.mark.parametrize(("call", "dropped"), [
    ("hidden_states, cache=cache", True),  # Inkling's decoder layer: the conv's **kwargs are always empty
    ("hidden_states, cache=cache, **kwargs", False),
    ("hidden_states, seq_idx=kwargs.get('seq_idx')", False),
])
def test_a_submodule_called_without_the_batch_keywords_drops_its_kernels_boundary(
    tmp_path: Path, call: str, dropped: bool
) -> None:
    from kernelguard.resolution.transformers_calls import clear_caches, submodule_call_drops

    source = tmp_path / "modeling_made_up.py"
    source.write_text(SUBMODULE_FILE.replace("CALL", call))
    clear_caches()
    found = submodule_call_drops(str(source), "causal_conv1d_fn", "seq_idx")
    assert found == ("`DecoderLayer.forward` calls `self.sconv(...)` without its **kwargs" if dropped else None)


def test_the_installed_families_as_transformers_ships_them() -> None:
    families = discovery.families()
    for name in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
        assert packing_support(families[name]).packs, name
    if "kimi_linear" in families:  # its layer spreads **kwargs: the kernel gets cu_seq_lens_q, not cu_seqlens
        problem = packing_support(families["kimi_linear"]).packed_problem
        assert problem is not None and "`cu_seqlens` to `chunk_kda`" in problem
    if "mamba2" in families:  # 5.24's Mamba2ForCausalLM calls its backbone without the batch's keywords; 5.25's not
        from kernelguard.resolution.transformers_calls import dropped_keywords

        problem = packing_support(families["mamba2"]).packed_problem
        if dropped_keywords(families["mamba2"].source, "Mamba2ForCausalLM") is None:
            assert problem is None
        else:
            assert problem is not None and "`Mamba2ForCausalLM.forward` calls `self.backbone(...)`" in problem
    if "nemotron_h" in families:  # passes them on, and seq_idx reaches each Mamba-2 scan
        assert packing_support(families["nemotron_h"]).packs
    if "granitemoehybrid" in families:  # packs, but its causal mask never sees the position ids
        from kernelguard.resolution.transformers_calls import mask_sees_positions

        support = packing_support(families["granitemoehybrid"])
        assert support.packs
        assert support.varlen_attention_only is (mask_sees_positions(families["granitemoehybrid"].source) is False)
    assert not packing_support(families["qwen3_5"]).varlen_attention_only  # the control: its mask sees them
    if "inkling" in families:  # its layers call their short convolutions without the batch's keywords
        problem = packing_support(families["inkling"]).packed_problem
        assert problem is not None and "calls `self.k_sconv(...)` without its **kwargs" in problem
    for name in ("qwen3_5", "qwen3_next", "nemotron_h", "lfm2", "olmo_hybrid"):  # the controls: they hand them on
        assert name not in families or packing_support(families[name]).packs, name
    if "jamba" in families:  # Mamba-1: no boundary at all
        problem = packing_support(families["jamba"]).packed_problem
        assert problem is not None and "`selective_scan_fn` takes no boundary at all" in problem


def test_docs_table_is_generated_from_the_one_list() -> None:
    text = (ROOT / "docs" / "families.md").read_text(encoding="utf-8")
    version = re.search(r"Generated from transformers (\S+) by", text)
    assert version is not None
    installed = discovery.transformers_source().version
    if installed != version.group(1):
        pytest.skip(f"docs/families.md is for transformers {version.group(1)}; this is {installed}")
    assert text == family_table(discovery.families(), installed), (
        "regenerate: python -m kernelguard.resolution.family_support > docs/families.md")
