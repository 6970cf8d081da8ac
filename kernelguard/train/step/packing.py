"""Packing tokenized examples into fixed 1D blocks, and which blocks each step trains on.

:func:`pack_run` is the stage's one call: the run's examples packed, counted and planned over the steps.

Pure Python for the bin packing (no torch import at module level), torch only to build block tensors.

Best-fit decreasing keeps one sorted list of the *distinct* remaining capacities (at most ``max_length``
values) and, per capacity, a stack of open blocks. Placing an example is one ``bisect`` on that list, so
packing n examples is O(n log max_length), not O(n * blocks) like the textbook loop.
"""

from __future__ import annotations

import random
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kernelguard.resolution import (
    BOUNDARY_KEYWORDS,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    MAX_LENGTH_Q,
    SEQ_IDX,
    boundary_arguments,
)

from ..settings.packing_modes import NAIVE, NO_BOUNDARIES, NO_PACKING, PACKED, PACKING_MODES
from .plan import Plan, dropped_blocks_note, make_plan

if TYPE_CHECKING:
    import torch

    from ..inputs.data import Inputs
    from ..settings.config import TrainConfig

__all__ = [
    "PackedRun",
    "PackingStats",
    "build_batch",
    "build_packed_block",
    "build_padded_batch",
    "forward_rows",
    "merge_packed_blocks",
    "pack_best_fit_decreasing",
    "pack_run",
    "pack_sequential_greedy",
    "packing_stats",
    "padded_shape",
    "segment_counts",
    "shard_blocks",
    "step_block_ids",
]



@dataclass(kw_only=True, slots=True)
class PackingStats:
    """What packing did. ``fill`` is real tokens / (blocks * max_length), in percent."""

    blocks: int
    examples: int
    tokens: int
    max_length: int
    truncated: int = 0
    dropped: int = 0

    @property
    def fill(self) -> float:
        capacity = self.blocks * self.max_length
        return 100.0 * self.tokens / capacity if capacity else 0.0

    @property
    def padding(self) -> float:
        return 100.0 - self.fill if self.blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fill": round(self.fill, 3), "padding": round(self.padding, 3)}

    def render(self, packing: str = "packed") -> str:
        """One line; ``packing`` ``none`` words it as the padded batches those groups become."""
        if packing == NO_PACKING:
            return (
                f"grouped {self.examples} examples ({self.tokens} tokens) into {self.blocks} padded batches "
                f"of at most {self.max_length} real tokens: {self.truncated} truncated, {self.dropped} dropped"
            )
        return (
            f"packed {self.examples} examples ({self.tokens} tokens) into {self.blocks} blocks of "
            f"{self.max_length}: fill {self.fill:.2f}%, {self.truncated} truncated, {self.dropped} dropped"
        )


def _check_lengths(lengths: Sequence[int], max_length: int) -> None:
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    for i, n in enumerate(lengths):
        if n <= 0 or n > max_length:
            # Zero-length segments break fla's varlen kernels; overlong ones must be truncated or dropped first.
            raise ValueError(
                f"example {i} has length {n}; every length must be in [1, max_length={max_length}]"
            )


def segment_counts(blocks: Sequence[Sequence[int]], lengths: Sequence[int], max_length: int) -> list[int]:
    """Segments per packed block as the GDN kernels see them (cu_seqlens): its examples, plus the padding tail,
    which is one more segment whenever the examples do not fill the block."""
    return [len(b) + (sum(lengths[i] for i in b) < max_length) for b in blocks]


def pack_best_fit_decreasing(lengths: Sequence[int], max_length: int, *, seed: int = 0) -> list[list[int]]:
    """Best-fit decreasing: longest example first, each into the open block it fills most tightly.

    Returns example indices per block, in block creation order. Deterministic for a given ``seed``; examples
    of equal length are ordered by a seeded shuffle (so the same data never packs the same duplicates
    together across seeds). Among open blocks with the same remaining capacity the most recently touched
    one is used.
    """
    _check_lengths(lengths, max_length)
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lengths.__getitem__, reverse=True)  # stable: ties keep the seeded order

    blocks: list[list[int]] = []
    capacities: list[int] = []  # sorted distinct remaining capacities that have at least one open block
    open_by_capacity: dict[int, list[int]] = {}
    for idx in order:
        n = lengths[idx]
        pos = bisect_left(capacities, n)
        if pos == len(capacities):
            block_id = len(blocks)
            blocks.append([idx])
            remaining = max_length - n
        else:
            cap = capacities[pos]
            stack = open_by_capacity[cap]
            block_id = stack.pop()
            if not stack:
                del open_by_capacity[cap]
                del capacities[pos]
            blocks[block_id].append(idx)
            remaining = cap - n
        if remaining > 0:
            same = open_by_capacity.get(remaining)
            if same is None:
                open_by_capacity[remaining] = [block_id]
                insort(capacities, remaining)
            else:
                same.append(block_id)
    return blocks


def pack_sequential_greedy(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """The stock baseline: examples in order; start a new block when the next one does not fit."""
    _check_lengths(lengths, max_length)
    blocks: list[list[int]] = []
    used = max_length  # forces a new block for the first example
    for idx, n in enumerate(lengths):
        if used + n > max_length:
            blocks.append([])
            used = 0
        blocks[-1].append(idx)
        used += n
    return blocks


def packing_stats(
    blocks: Sequence[Sequence[int]],
    lengths: Sequence[int],
    max_length: int,
    *,
    truncated: int = 0,
    dropped: int = 0,
) -> PackingStats:
    return PackingStats(
        blocks=len(blocks),
        examples=sum(len(b) for b in blocks),
        tokens=sum(lengths[i] for b in blocks for i in b),
        max_length=max_length,
        truncated=truncated,
        dropped=dropped,
    )


@dataclass(slots=True)
class PackedRun:
    """The run's examples as blocks, planned over its steps (:func:`pack_run`)."""

    plan: Plan
    stats: PackingStats
    eval_blocks: list[list[int]]  # empty: no eval set
    dropped_note: str | None  # the blocks each epoch leaves out to even the ranks, said when there are any


def pack_run(inputs: Inputs, cfg: TrainConfig, *, world_size: int) -> PackedRun:
    """Best-fit-decreasing blocks of ``--max-length`` for the training examples (seeded by ``--seed``) and the
    eval examples (seed 0, not --seed: runs of several seeds measure the same eval blocks), and the plan of
    which blocks each optimizer step of each rank trains on."""
    lengths, max_length = inputs.lengths, cfg.packing.max_length
    blocks = pack_best_fit_decreasing(lengths, max_length, seed=cfg.training.seed)
    stats = packing_stats(blocks, lengths, max_length, truncated=inputs.stats.truncated,
                          dropped=inputs.stats.dropped_overlong)
    eval_blocks = pack_best_fit_decreasing(inputs.eval_lengths, max_length, seed=0) if inputs.eval_lengths else []
    training = cfg.training
    plan = make_plan(blocks, world_size=world_size, grad_accum=training.gradient_accumulation_steps,
                     epochs=training.num_train_epochs, max_steps=training.max_steps,
                     schedule_steps=training.schedule_steps, max_length=max_length, data=cfg.data.data)
    note = dropped_blocks_note(plan, world_size=world_size, grad_accum=training.gradient_accumulation_steps)
    return PackedRun(plan, stats, eval_blocks, note)


def step_block_ids(
    plan: Plan, step: int, *, rank: int, world_size: int, seed: int, grad_accum: int
) -> list[int]:
    """Block indices this rank trains on at 0-based optimizer step ``step`` (epochs cycle)."""
    epoch, within = divmod(step, plan.steps_per_epoch)
    mine = shard_blocks(len(plan.blocks), rank=rank, world_size=world_size, seed=seed, epoch=epoch)
    return mine[within * grad_accum : (within + 1) * grad_accum]


def shard_blocks(num_blocks: int, *, rank: int, world_size: int, seed: int, epoch: int = 0) -> list[int]:
    """This rank's block indices for one epoch: a seeded permutation, dealt round-robin, cut so every rank
    gets the same count (ranks must run the same number of collective steps)."""
    order = list(range(num_blocks))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    usable = (num_blocks // world_size) * world_size
    return order[rank:usable:world_size]


def build_packed_block(
    examples: Sequence[tuple[list[int], list[int]]], max_length: int, pad_token_id: int
) -> dict[str, torch.Tensor | int]:
    """Concatenate ``(input_ids, labels)`` examples into one [1, max_length] block with varlen kwargs.

    - ``labels``: each example's labels (unshifted, as transformers expects), with the first token of every
      example set to -100 so the shifted loss never predicts across a boundary; padding is -100.
    - ``position_ids`` restart at 0 for every example; the padding tail is ONE extra segment (positions
      0..pad-1, its own ``seq_idx``) so ``cu_seq_lens`` shapes stay stable and no segment has length 0.
    - ``cu_seq_lens_q``/``cu_seq_lens_k`` int32 [segments + 1]; ``max_length_q``/``max_length_k`` ints;
      ``seq_idx`` int32 [1, max_length].
    """
    import torch

    if not examples:
        raise ValueError("a packed block needs at least one example")
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    seq_idx: list[int] = []
    seg_lens: list[int] = []
    for segment, (ids, labs) in enumerate(examples):
        n = len(ids)
        if n == 0 or n != len(labs):
            raise ValueError(
                f"example {segment}: {n} input ids and {len(labs)} labels (need equal, non-zero)"
            )
        input_ids.extend(ids)
        labels.append(IGNORE_INDEX)
        labels.extend(labs[1:])
        positions.extend(range(n))
        seq_idx.extend([segment] * n)
        seg_lens.append(n)
    real = len(input_ids)
    if real > max_length:
        raise ValueError(f"examples hold {real} tokens, more than max_length={max_length}")
    pad = max_length - real
    if pad:
        input_ids.extend([pad_token_id] * pad)
        labels.extend([IGNORE_INDEX] * pad)
        positions.extend(range(pad))
        seq_idx.extend([len(examples)] * pad)
        seg_lens.append(pad)
    cu = [0]
    for n in seg_lens:
        cu.append(cu[-1] + n)
    cu_q = torch.tensor(cu, dtype=torch.int32)
    max_len = max(seg_lens)
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        **boundary_arguments(cu_q, torch.tensor([seq_idx], dtype=torch.int32), max_len),
        "num_real_tokens": real,
    }



def merge_packed_blocks(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Packed blocks of :func:`build_packed_block` as ONE packed row: the same examples with the same
    boundaries (``cu_seq_lens`` offset, ``seq_idx`` renumbered, positions and labels as they were), so every
    token sees and predicts exactly what it did in its own block; only the launches are fewer and larger.
    Each block's padding tail stays one segment of its own. Keys starting with ``_`` holding lists (a caller's
    bookkeeping) are concatenated."""
    import torch

    if len(blocks) == 1:
        return blocks[0]
    if not blocks or any(CU_SEQ_LENS_Q not in b or SEQ_IDX not in b for b in blocks):
        raise ValueError(f"only packed blocks with their boundaries ({CU_SEQ_LENS_Q}, {SEQ_IDX}) can share a row")
    cu, seq_idx, offset, segments = [blocks[0][CU_SEQ_LENS_Q][:1]], [], 0, 0
    for b in blocks:
        cu.append(b[CU_SEQ_LENS_Q][1:] + offset)
        seq_idx.append(b[SEQ_IDX] + segments)
        offset += int(b["input_ids"].shape[1])
        segments += len(b[CU_SEQ_LENS_Q]) - 1
    longest = max(int(b[MAX_LENGTH_Q]) for b in blocks)
    merged: dict[str, Any] = {
        key: torch.cat([b[key] for b in blocks], dim=1) for key in ("input_ids", "labels", "position_ids")
    }
    merged |= boundary_arguments(torch.cat(cu), torch.cat(seq_idx, dim=1), longest)
    merged["num_real_tokens"] = sum(int(b["num_real_tokens"]) for b in blocks)
    for key, value in blocks[0].items():
        if key.startswith("_") and isinstance(value, list):
            merged[key] = [x for b in blocks for x in b[key]]
    return merged


def forward_rows(micro: Sequence[dict[str, Any]], blocks_per_forward: int) -> list[dict[str, Any]]:
    """A step's micro-batches as the rows its forwards take: consecutive packed blocks merged
    ``blocks_per_forward`` at a time (:func:`merge_packed_blocks`). Layouts without boundaries (padded
    batches, the leaky/naive controls) keep one forward per block: merging them would change what they are."""
    if blocks_per_forward <= 1 or not all(CU_SEQ_LENS_Q in b for b in micro):
        return list(micro)
    return [
        merge_packed_blocks(micro[i : i + blocks_per_forward]) for i in range(0, len(micro), blocks_per_forward)
    ]


def padded_shape(rows: int, longest: int, max_length: int) -> tuple[int, int]:
    """The ``[rows, length]`` a padded batch is laid out in: each rounded up to a power of two (the length
    never beyond ``max(longest, max_length)``).

    fla's kernels autotune per batch size and Triton compiles per shape class, so every new ``[rows,
    longest]`` costs a search of seconds; a packer's blocks hold anywhere from one to hundreds of examples, so
    exact shapes mean a search every few steps for the whole run. Powers of two bound the shapes to a handful
    (about 13 on 4,017 real conversations at 8,192 tokens) for the price of extra padding."""
    return _next_power_of_two(rows), min(_next_power_of_two(longest), max(longest, max_length))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def build_padded_batch(
    examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int, *, max_length: int | None = None
) -> dict[str, torch.Tensor | int]:
    """The examples of one block as a right-padded batch with an attention mask, laid out in
    :func:`padded_shape` (``max_length`` given) or exactly ``[len(examples), longest]``.

    Labels as in :func:`build_packed_block` (each example's first label and the padding are -100), so a step
    predicts exactly the tokens its packed block predicts; right padding leaves every real token's causal
    context, and so its loss, as it is in the packed block. Filler rows (to reach the row count) attend to
    one pad token and predict nothing: a row with no attended token would give attention an empty softmax."""
    import torch

    if not examples:
        raise ValueError("a padded batch needs at least one example")
    longest = max(len(ids) for ids, _ in examples)
    rows, length = (len(examples), longest) if max_length is None else padded_shape(
        len(examples), longest, max_length
    )
    input_ids = torch.full((rows, length), pad_token_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.long)
    mask[len(examples) :, 0] = 1
    for row, (ids, labs) in enumerate(examples):
        n = len(ids)
        if n == 0 or n != len(labs):
            raise ValueError(f"example {row}: {n} input ids and {len(labs)} labels (need equal, non-zero)")
        input_ids[row, :n] = torch.tensor(ids)
        labels[row, 1:n] = torch.tensor(labs[1:])
        mask[row, :n] = 1
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": mask,
        "num_real_tokens": sum(len(ids) for ids, _ in examples),
    }


def build_batch(
    examples: Sequence[tuple[list[int], list[int]]], max_length: int, pad_token_id: int, *, packing: str
) -> dict[str, torch.Tensor | int]:
    """One micro-batch of ``examples`` in the ``packing`` layout (see PACKING_MODES)."""
    if packing == NO_PACKING:
        return build_padded_batch(examples, pad_token_id, max_length=max_length)
    block = build_packed_block(examples, max_length, pad_token_id)
    if packing in NO_BOUNDARIES:
        for key in BOUNDARY_KEYWORDS:
            del block[key]
        if packing == NAIVE:
            import torch

            block["position_ids"] = torch.arange(max_length, dtype=torch.long).unsqueeze(0)
    elif packing != PACKED:
        raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKING_MODES)}")
    return block
