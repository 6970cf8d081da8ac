"""TRL's padding-free batches by TRL release: 1.15 sent ``position_ids`` only; 1.16.0 adds the boundaries GDN
layers need (``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``). KernelGuardCallback's packing detection asks
the collator itself, so each release is judged by the batch it really sends.

The 1.16 collator is the installed TRL's own; the 1.15 one is a stand-in that returns exactly TRL 1.15.0's
padding-free keys (``DataCollatorForLanguageModeling.torch_call``: input_ids, position_ids, labels). Checked
against the real trl 1.15.0 wheel (``pip download --no-deps trl==1.15.0``, 2026-12-03): on EXAMPLES its collator
returns exactly the batch asserted in ``test_trl_115_padding_free_batch_has_position_ids_only``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kernelguard.errors import ConfigError
from kernelguard.integrations.transformers import Packing, _check_packed_sequences, detect_packing

trl_collator = pytest.importorskip("trl.trainer.sft_trainer").DataCollatorForLanguageModeling
EXAMPLES = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
BOUNDARY_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


@dataclass
class Trl115PaddingFree:
    """TRL 1.15.0's padding-free batch: one flattened row, position ids restarting per example, nothing else."""

    padding_free: bool = True

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.tensor(e["input_ids"]) for e in examples]
        labels = [torch.cat([torch.tensor([-100]), i[1:]]) for i in ids]
        return {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat([torch.arange(len(i)) for i in ids])[None],
                "labels": torch.cat(labels)[None]}


@dataclass
class SFTConfig:  # what detect_packing reads of TRL's SFTConfig: its class name and padding_free
    padding_free: bool = True
    packing: bool = False


@dataclass
class _Site:
    kernel: str


@dataclass
class _Report:
    entries: list[_Site] = field(default_factory=lambda: [_Site("chunk_gated_delta_rule"), _Site("attention")])
    disarmed: bool = False

    def disarm(self) -> None:
        self.disarmed = True


def test_trl_116_padding_free_batch_carries_the_boundaries() -> None:
    out = trl_collator(pad_token_id=0, padding_free=True)(EXAMPLES)
    assert BOUNDARY_KEYS <= set(out)
    assert out["cu_seq_lens_q"].tolist() == out["cu_seq_lens_k"].tolist() == [0, 3, 5]
    assert (out["max_length_q"], out["max_length_k"]) == (3, 3)
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1]] and out["seq_idx"].dtype == torch.int32


def test_trl_115_padding_free_batch_has_position_ids_only() -> None:
    out = Trl115PaddingFree()(EXAMPLES)
    assert set(out) == {"input_ids", "position_ids", "labels"}
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert (out["input_ids"].tolist(), out["labels"].tolist()) == ([[1, 2, 3, 4, 5]], [[-100, 2, 3, -100, 5]])


@pytest.mark.parametrize(
    ("collator", "boundaries"),
    [(Trl115PaddingFree(), False), (trl_collator(pad_token_id=0, padding_free=True), True)],
    ids=["trl-1.15", "trl-1.16"],
)
def test_packing_detection_judges_each_release_by_its_batch(collator: Any, boundaries: bool) -> None:
    assert detect_packing(SFTConfig(), collator) == Packing(True, "SFTConfig.padding_free=True", boundaries)


def test_trl_115_batches_are_refused_for_gdn_layers_and_116_pass() -> None:
    old, new = _Report(), _Report()
    with pytest.raises(ConfigError, match="carry no cu_seq_lens_q/seq_idx") as info:
        _check_packed_sequences(old, detect_packing(SFTConfig(), Trl115PaddingFree()))
    assert "chunk_gated_delta_rule" in str(info.value) and old.disarmed
    _check_packed_sequences(new, detect_packing(SFTConfig(), trl_collator(pad_token_id=0, padding_free=True)))
    assert not new.disarmed
