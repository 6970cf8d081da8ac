"""``kernelguard check`` for a family kernelguard train does not pack (Kimi-Linear: chunk_kda's boundary dropped
by transformers' own layer), and the fla switches it names; the fake fla serves chunk_kda."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_helpers import kg, kg_json

pytest.importorskip("transformers.models.kimi_linear", reason="this transformers has no Kimi delta attention")


def _packed_rows(data: dict) -> dict:
    return next(v for v in data["kernels"] if v["kernel"] == "packed_rows")


def test_packed_training_of_kimi_linear_fails_on_its_rows_not_its_kernels(
    tmp_path: Path, fake_providers: Path
) -> None:
    data = kg_json("--model", "kimi_linear", "--no-hub", "--allow", "attention", cwd=tmp_path, rc=1,
                   pythonpath=(fake_providers,))
    rows = _packed_rows(data)
    assert rows["ok"] is False
    (candidate,) = rows["candidates"]
    assert candidate["provider"] == "transformers' kimi_linear layers"
    assert candidate["reason"].startswith(
        "transformers' layer does not pass `cu_seqlens` to `chunk_kda`, so its state runs on from one packed example "
        "into the next: a packed row's examples are not kept apart and the results are wrong")
    assert [v["ok"] for v in data["kernels"] if v["kernel"] == "chunk_kda"] == [True]  # fla serves the kernel
    text = kg("check", "--model", "kimi_linear", "--no-hub", "--allow", "attention", cwd=tmp_path,
              pythonpath=(fake_providers,)).stdout
    assert "packed_rows                        FAIL  packed examples would run into each other: wrong results" in text
    assert "would run a slow fallback or mix packed examples:\n  packed_rows (exit 1)" in text


@pytest.mark.parametrize("how", [("--no-packed",), ("--allow", "packed-without-boundaries")])
def test_padded_batches_or_the_explicit_allow_pass(tmp_path: Path, fake_providers: Path, how: tuple[str, ...]) -> None:
    data = kg_json("--model", "kimi_linear", "--no-hub", "--allow", "attention", *how, cwd=tmp_path, rc=0,
                   pythonpath=(fake_providers,))
    names = [v["kernel"] for v in data["kernels"]]
    assert ("packed_rows" in names) is (how[0] == "--allow")


def test_a_gdn_family_has_no_packed_rows_verdict(tmp_path: Path, fake_providers: Path) -> None:
    data = kg_json("--model", "qwen3_5", "--no-hub", "--allow", "attention", cwd=tmp_path, rc=0, pythonpath=(fake_providers,))
    assert "packed_rows" not in [v["kernel"] for v in data["kernels"]]
    assert not any("FlashKDA" in n for n in data["notes"])


def test_fla_switches_set_here_and_flashkda_are_named(
    tmp_path: Path, fake_providers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLA_USE_FAST_OPS", "1")
    data = kg_json("--model", "kimi_linear", "--no-hub", "--allow", "attention", "--no-packed", cwd=tmp_path, rc=0,
                   pythonpath=(fake_providers,))
    notes = data["notes"]
    assert "FLA_USE_FAST_OPS=1 is set: =1 swaps exp/log in fla's Triton kernels for the GPU's fast approximations " \
           "(less exact)" in notes
    assert any(n.startswith("chunk_kda: FlashKDA (fla 0.6.0's CUTLASS forward, FLA_FLASH_KDA) is not on") for n in notes)
    monkeypatch.delenv("FLA_USE_FAST_OPS")
    quiet = kg_json("--model", "kimi_linear", "--no-hub", "--allow", "attention", "--no-packed", cwd=tmp_path, rc=0,
                    pythonpath=(fake_providers,))
    assert not any(n.startswith("FLA_") for n in quiet["notes"])
