"""Which packed blocks each optimizer step of `kernelguard train` trains on: epochs of a seeded per-rank
permutation (the permutation itself: :func:`kernelguard.train.step.packing.shard_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass

from kernelguard.errors import DataError

__all__ = ["Plan", "dropped_blocks_note", "make_plan"]


@dataclass(slots=True)
class Plan:
    """Which packed blocks each optimizer step trains on: epochs of a seeded per-rank permutation."""

    blocks: list[list[int]]
    steps_per_epoch: int
    total_steps: int
    stop_step: int
    schedule_steps: int


def make_plan(
    blocks: list[list[int]],
    *,
    world_size: int,
    grad_accum: int,
    epochs: int,
    max_steps: int | None,
    schedule_steps: int | None,
    max_length: int,
    data: str = "",
) -> Plan:
    per_rank = len(blocks) // world_size
    steps_per_epoch = per_rank // grad_accum
    if steps_per_epoch == 0:
        raise DataError(
            f"the data packs into {len(blocks)} blocks of {max_length}: not enough for one step of "
            f"{world_size} ranks x {grad_accum} micro-batches.",
            fix="add data, lower --grad-accum or --block-size, or use fewer ranks",
            details={"file": data, "row": None, "field": None},
        )
    total = steps_per_epoch * epochs
    stop = max_steps if max_steps is not None else total
    return Plan(blocks, steps_per_epoch, total, stop, schedule_steps or max(total, stop))


def dropped_blocks_note(plan: Plan, *, world_size: int, grad_accum: int) -> str | None:
    """The blocks each epoch leaves out so that every rank and micro-step gets whole blocks, said out loud."""
    used = plan.steps_per_epoch * grad_accum * world_size
    dropped = len(plan.blocks) - used
    if dropped <= 0:
        return None
    return (
        f"{dropped} of {len(plan.blocks)} packed blocks are left out of each epoch to even the ranks "
        f"({world_size} rank(s) x {grad_accum} micro-batch(es) x {plan.steps_per_epoch} steps); the blocks are "
        "reshuffled every epoch, so a different set is left out each time"
    )
