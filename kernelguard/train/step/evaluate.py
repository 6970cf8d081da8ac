"""Held-out loss: the eval set packed like the training data and laid out as training lays out its blocks
(``--packing``), the same token-sum / global-count loss.

Besides the loss over every label token, the loss over the first :data:`FIRST_K` label tokens of each example:
where a leak of state across examples bites (a layout without boundaries feeds the previous example's state
into exactly those predictions), so it is measured from the same forward.

Every rank runs the same number of forwards (FSDP2 all-gathers need all ranks): eval block ``i`` goes to rank
``i % world_size``, and a rank short of blocks re-runs one with its loss discarded. The result is the loss
over ALL eval blocks whatever the number of ranks. No gradients; the model is put in eval mode and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kernelguard.resolution import IGNORE_INDEX

from ..settings.packing_modes import PACKED
from .packing import build_batch
from .step import TrainState, label_count, token_loss_sums

__all__ = ["FIRST_K", "EvalResult", "evaluate", "first_k_labels", "rank_eval_blocks"]

FIRST_K = 32


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float  # token-mean over every eval label token
    tokens: int
    first_k_loss: float  # token-mean over the first FIRST_K label tokens of each example
    first_k_tokens: int

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl fields."""
        return {"eval_loss": self.loss, "eval_tokens": self.tokens, "eval_loss_first_k": self.first_k_loss,
                "eval_tokens_first_k": self.first_k_tokens, "eval_first_k": FIRST_K}  # fmt: skip


def first_k_labels(example: tuple[list[int], list[int]], k: int = FIRST_K) -> tuple[list[int], list[int]]:
    """``example`` with only its first ``k`` scored labels kept. Label 0 is never scored (a block masks each
    example's first label), so the count starts at label 1."""
    ids, labels = example
    kept, out = 0, [IGNORE_INDEX] * len(labels)
    out[0] = labels[0]
    for i in range(1, len(labels)):
        if labels[i] != IGNORE_INDEX and kept < k:
            out[i] = labels[i]
            kept += 1
    return ids, out


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
    max_length: int,
    pad_id: int,
    packing: str = PACKED,
) -> EvalResult:
    """The eval losses over every eval block, on every rank."""
    info = state.info
    model = state.model
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=info.device)
    try:
        for b in rank_eval_blocks(len(blocks), rank=info.rank, world_size=info.world_size):
            group = [examples[i] for i in blocks[b if b is not None else 0]]
            batch = build_batch(group, max_length, pad_id, packing=packing)
            first = build_batch([first_k_labels(e) for e in group], max_length, pad_id, packing=packing)
            whole, head_k = token_loss_sums(
                model, batch, [batch["labels"], first["labels"]], device=info.device, head=state.head
            )
            if b is not None:
                totals[0] += whole.double()
                totals[1] += label_count(batch)
                totals[2] += head_k.double()
                totals[3] += label_count(first)
    finally:
        model.train(was_training)
    dist.all_reduce(totals)
    loss, tokens, first_loss, first_tokens = totals.tolist()
    return EvalResult(loss / max(1, tokens), int(tokens), first_loss / max(1, first_tokens), int(first_tokens))
