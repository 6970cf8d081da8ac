"""Held-out loss: the eval set packed like the training data and laid out as training lays out its blocks
(``--packing``), the same token-sum / global-count loss.

Every rank runs the same number of forwards (FSDP2 all-gathers need all ranks): eval block ``i`` goes to rank
``i % world_size``, and a rank short of blocks re-runs one with its loss discarded. The result is the loss
over ALL eval blocks whatever the number of ranks. No gradients; the model is put in eval mode and back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .packing import PACKED, build_batch, pack_best_fit_decreasing
from .step import TrainState, label_count, token_loss_sum

__all__ = ["evaluate", "pack_eval_blocks", "rank_eval_blocks"]


def pack_eval_blocks(examples: Any, block_size: int, *, seed: int) -> list[list[int]]:
    """Example indices per eval block (best-fit decreasing, like training)."""
    return pack_best_fit_decreasing(examples.lengths(), block_size, seed=seed)


def rank_eval_blocks(num_blocks: int, *, rank: int, world_size: int) -> list[int | None]:
    """Block indices this rank evaluates; ``None`` marks a padding turn (same count on every rank)."""
    turns = -(-num_blocks // world_size)
    return [i if (i := t * world_size + rank) < num_blocks else None for t in range(turns)]


@torch.no_grad()
def evaluate(
    state: TrainState,
    examples: Any,
    blocks: list[list[int]],
    *,
    block_size: int,
    pad_id: int,
    packing: str = PACKED,
) -> tuple[float, int]:
    """(token-mean eval loss, number of eval label tokens) over every eval block, on every rank."""
    info = state.info
    model = state.model
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    try:
        for b in rank_eval_blocks(len(blocks), rank=info.rank, world_size=info.world_size):
            batch = build_batch(
                [examples[i] for i in blocks[b if b is not None else 0]], block_size, pad_id, packing=packing
            )
            loss = token_loss_sum(model, batch, device=info.device, head=state.head)
            if b is not None:
                totals[0] += loss.double()
                totals[1] += label_count(batch)
    finally:
        model.train(was_training)
    dist.all_reduce(totals)
    tokens = int(totals[1])
    return float(totals[0]) / max(1, tokens), tokens
