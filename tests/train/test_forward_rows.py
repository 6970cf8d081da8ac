"""Several packed blocks in one forward (``--blocks-per-forward``): the merged row gives each block's loss and the
step's gradients exactly as one forward per block does, and a merge that loses the junction between two blocks
(the last segment of one running into the first of the next) is caught by the same comparison."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.resolution.packed_batch import IGNORE_INDEX
from kernelguard.train.step.packing import build_batch, build_packed_block, forward_rows, merge_packed_blocks
from kernelguard.train.step.step import token_loss_sum

BLOCK = 48
# Lengths per block, none a multiple of anything: the first block is full (no padding tail, so its last
# example touches the junction), the others end in a padding tail.
BLOCKS = ((11, 20, 17), (9, 14, 6), (23, 5), (30,))


def _blocks(vocab: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for lengths in BLOCKS:
        examples = []
        for n in lengths:
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            examples.append((ids, [IGNORE_INDEX] * (n // 4) + ids[n // 4 :]))
        out.append(build_packed_block(examples, BLOCK, pad_token_id=0))
    return out


def _loss_and_grads(model: Any, rows: list[dict[str, Any]]) -> tuple[float, torch.Tensor]:
    total = torch.zeros(())
    for row in rows:
        loss = token_loss_sum(model, row, device=torch.device("cpu"), head=None)
        loss.backward()
        total += loss.detach()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return float(total), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _joined_at_the_junction(row: dict[str, Any], junction: int) -> dict[str, Any]:
    """A wrong merge: the segment that starts at ``junction`` is glued to the one before it."""
    cu = row["cu_seq_lens_q"]
    keep = cu != junction
    seq_idx = row["seq_idx"].clone()
    after = seq_idx[0, junction:]
    seq_idx[0, junction:] = after - 1
    positions = row["position_ids"].clone()
    end = int(cu[cu > junction][0])
    positions[0, junction:end] += int(positions[0, junction - 1]) + 1
    return row | {"cu_seq_lens_q": cu[keep], "cu_seq_lens_k": cu[keep].clone(), "seq_idx": seq_idx,
                  "position_ids": positions}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_merged_rows_train_exactly_as_one_forward_per_block(fake_providers: Any, tiny: Any, family: str) -> None:
    model = tiny.tiny_model(family).train()
    blocks = _blocks(model.config.vocab_size)
    alone_loss, alone_grads = _loss_and_grads(model, blocks)
    rows = forward_rows(blocks, 2)
    assert [int(r["input_ids"].shape[1]) for r in rows] == [2 * BLOCK, 2 * BLOCK]
    merged_loss, merged_grads = _loss_and_grads(model, rows)
    one_row_loss, one_row_grads = _loss_and_grads(model, forward_rows(blocks, 4))
    assert abs(merged_loss - alone_loss) <= 1e-5 * abs(alone_loss)
    assert abs(one_row_loss - alone_loss) <= 1e-5 * abs(alone_loss)
    exact = max(_rel(merged_grads, alone_grads), _rel(one_row_grads, alone_grads))
    assert exact <= 1e-5, exact
    # The control: the same row with the junction between its blocks lost differs by far more.
    wrong = [_joined_at_the_junction(rows[0], BLOCK), rows[1]]
    _, wrong_grads = _loss_and_grads(model, wrong)
    leak = _rel(wrong_grads, alone_grads)
    print(f"{family}: merged rows off by {exact:.2e}, the lost junction by {leak:.2e}")
    assert leak >= 1e-3 and leak >= 1000 * exact, (leak, exact)


def test_merge_keeps_every_boundary_and_label() -> None:
    blocks = _blocks(64)
    row = merge_packed_blocks(blocks[:2])
    first, second = blocks[0], blocks[1]
    assert row["cu_seq_lens_q"].tolist() == [*first["cu_seq_lens_q"].tolist(),
                                            *(x + BLOCK for x in second["cu_seq_lens_q"].tolist()[1:])]  # fmt: skip
    assert row["cu_seq_lens_q"].dtype == torch.int32 and row["seq_idx"].dtype == torch.int32
    segments = len(first["cu_seq_lens_q"]) - 1
    assert row["seq_idx"][0, BLOCK:].tolist() == [s + segments for s in second["seq_idx"][0].tolist()]
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(row[key], torch.cat([first[key], second[key]], dim=1))
    assert row["labels"][0, BLOCK] == IGNORE_INDEX  # the next block's first token is never predicted across
    assert row["max_length_q"] == max(first["max_length_q"], second["max_length_q"])
    assert row["num_real_tokens"] == first["num_real_tokens"] + second["num_real_tokens"]
    assert merge_packed_blocks(blocks[:1]) is blocks[0]


def test_layouts_without_boundaries_keep_one_forward_per_block() -> None:
    examples = [([5, 6, 7], [5, 6, 7]), ([8, 9], [8, 9])]
    for packing in ("none", "leaky", "naive"):
        micro = [build_batch(examples, 8, 0, packing=packing) for _ in range(2)]
        assert forward_rows(micro, 2) == micro, packing
    with pytest.raises(ValueError, match="only packed blocks with their boundaries"):
        merge_packed_blocks([build_batch(examples, 8, 0, packing="leaky")] * 2)
