"""Packing: block tensors, best-fit decreasing vs sequential greedy, determinism, sharding."""

from __future__ import annotations

import random

import pytest
import torch

from kernelguard.resolution.packed_batch import IGNORE_INDEX
from kernelguard.train.step.packing import (
    build_packed_block,
    pack_best_fit_decreasing,
    pack_sequential_greedy,
    packing_stats,
    shard_blocks,
)


def _example(start: int, n: int, *, loss_from: int = 0) -> tuple[list[int], list[int]]:
    ids = list(range(start, start + n))
    return ids, [IGNORE_INDEX if i < loss_from else t for i, t in enumerate(ids)]


def test_block_boundaries_positions_seq_idx_and_padding_tail() -> None:
    ex = [_example(10, 3), _example(20, 4, loss_from=2), _example(30, 2)]
    b = build_packed_block(ex, 12, pad_token_id=0)
    assert b["input_ids"].tolist() == [[10, 11, 12, 20, 21, 22, 23, 30, 31, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert b["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]]
    assert b["seq_idx"].dtype == torch.int32
    # the padding tail is ONE segment
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 7, 9, 12]
    assert b["cu_seq_lens_q"].dtype == torch.int32 and b["cu_seq_lens_k"].dtype == torch.int32
    assert b["cu_seq_lens_k"].tolist() == b["cu_seq_lens_q"].tolist()
    assert b["max_length_q"] == b["max_length_k"] == 4
    assert isinstance(b["max_length_q"], int)
    # first token of every example masked; assistant-only labels kept; padding masked
    assert b["labels"].tolist() == [[-100, 11, 12, -100, -100, 22, 23, -100, 31, -100, -100, -100]]
    assert b["num_real_tokens"] == 9
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert b[key].shape == (1, 12)


def test_full_block_has_no_padding_segment() -> None:
    b = build_packed_block([_example(1, 5), _example(1, 3)], 8, pad_token_id=0)
    assert b["cu_seq_lens_q"].tolist() == [0, 5, 8]
    assert b["seq_idx"].tolist() == [[0] * 5 + [1] * 3]
    assert b["max_length_q"] == 5


def test_block_rejects_overflow_and_empty() -> None:
    with pytest.raises(ValueError, match="more than max_length"):
        build_packed_block([_example(0, 5), _example(0, 5)], 8, pad_token_id=0)
    with pytest.raises(ValueError):
        build_packed_block([], 8, pad_token_id=0)
    with pytest.raises(ValueError):
        build_packed_block([([], [])], 8, pad_token_id=0)


def _fixed_lengths() -> list[int]:
    rng = random.Random(1234)
    return [max(1, min(1024, int(rng.lognormvariate(5.0, 0.9)))) for _ in range(3000)]


def _naive_bfd_block_count(lengths: list[int], block_size: int) -> tuple[int, list[int]]:
    """Textbook O(n * blocks) best-fit decreasing, independent of the bisect implementation."""
    remaining: list[int] = []
    for n in sorted(lengths, reverse=True):
        best = -1
        for i, r in enumerate(remaining):
            if n <= r and (best < 0 or r < remaining[best]):
                best = i
        if best < 0:
            remaining.append(block_size - n)
        else:
            remaining[best] -= n
    return len(remaining), sorted(block_size - r for r in remaining)


def test_bfd_beats_sequential_greedy_with_exact_numbers() -> None:
    lengths = _fixed_lengths()
    bfd = pack_best_fit_decreasing(lengths, 1024, seed=0)
    greedy = pack_sequential_greedy(lengths, 1024)
    naive_count, naive_fills = _naive_bfd_block_count(lengths, 1024)
    assert len(bfd) == naive_count
    assert sorted(sum(lengths[i] for i in b) for b in bfd) == naive_fills
    assert len(bfd) <= len(greedy)
    # Pinned figures for this fixed distribution (computed with the naive reference above).
    assert sum(lengths) == 636_808
    assert (len(bfd), len(greedy)) == (623, 749)
    # fill is real tokens / (blocks * block size): exact ratios of the integers above (not rounded literals)
    assert packing_stats(bfd, lengths, 1024).fill == pytest.approx(100 * 636_808 / (623 * 1024), rel=1e-12)
    assert packing_stats(greedy, lengths, 1024).fill == pytest.approx(100 * 636_808 / (749 * 1024), rel=1e-12)


@pytest.mark.parametrize("packer", ["bfd", "greedy"])
def test_every_example_exactly_once_and_blocks_fit(packer: str) -> None:
    lengths = _fixed_lengths()
    blocks = (
        pack_best_fit_decreasing(lengths, 1024, seed=3)
        if packer == "bfd"
        else pack_sequential_greedy(lengths, 1024)
    )
    flat = sorted(i for b in blocks for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in blocks)


def test_sequential_greedy_is_in_order() -> None:
    assert pack_sequential_greedy([5, 4, 3, 6, 2], 10) == [[0, 1], [2, 3], [4]]


def test_bfd_deterministic_per_seed_and_ties_shuffled() -> None:
    lengths = [4] * 20 + [6] * 20
    a = pack_best_fit_decreasing(lengths, 10, seed=7)
    assert a == pack_best_fit_decreasing(lengths, 10, seed=7)
    b = pack_best_fit_decreasing(lengths, 10, seed=8)
    assert a != b  # equal lengths are ordered by the seed
    assert len(a) == len(b) == 20


def test_bfd_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="example 1 has length 0"):
        pack_best_fit_decreasing([3, 0], 8)
    with pytest.raises(ValueError, match="example 0 has length 9"):
        pack_sequential_greedy([9], 8)


def test_shard_blocks_disjoint_equal_and_deterministic() -> None:
    shards = [shard_blocks(103, rank=r, world_size=4, seed=1, epoch=0) for r in range(4)]
    assert all(len(s) == 25 for s in shards)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == 100
    assert shards[2] == shard_blocks(103, rank=2, world_size=4, seed=1, epoch=0)
    assert shards[2] != shard_blocks(103, rank=2, world_size=4, seed=1, epoch=1)


# ------------------------------------------------------------------------------- fla #1077's launch limit ---
def test_segment_counts_see_the_padding_tail_as_one_more_segment() -> None:
    from kernelguard.train.step.packing import segment_counts

    assert segment_counts([[0, 1], [2]], [3, 5, 8], 8) == [2, 1]  # full blocks: no tail
    assert segment_counts([[0, 1], [2]], [3, 4, 6], 8) == [3, 2]


def test_a_block_past_65535_over_hv_segments_is_refused_on_fla_before_0_6() -> None:
    from types import SimpleNamespace

    from kernelguard.errors import GuardRefused
    from kernelguard.train.startup.preflight import check_packed_segments

    config = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128)
    check_packed_segments([2047, 12], config=config, fla_version="0.5.2")  # 2,047 * 32 = 65,504: launches
    with pytest.raises(GuardRefused) as info:
        check_packed_segments([12, 2048, 2050], config=config, fla_version="0.5.2")
    assert info.value.report.startswith(
        "known issue fla-1077-too-many-segments (https://github.com/fla-org/flash-linear-attention/pull/1077 "
    )
    assert ("2 packed block(s) hold more than 2047 segments (65,535 // 32 value heads), the most 2050 in block 2; "
            "fla 0.5.2 would fail the launch of that step with 'Triton Error [CUDA]: invalid argument'.") in info.value.report
    assert info.value.fix.startswith("pip install 'fla-core>=0.6.0' 'flash-linear-attention>=0.6.0'")
    check_packed_segments([2050], config=config, fla_version="0.6.0")  # fixed there: one flat grid axis


def test_off_the_gpu_the_same_count_is_said_not_refused() -> None:
    from types import SimpleNamespace

    from kernelguard.train.startup.preflight import segment_limit_note

    config = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128)
    assert segment_limit_note([2047, 12], config=config) is None
    assert segment_limit_note([12, 2048, 2050], config=config) == (
        "2 packed block(s) hold more than 2047 segments (65,535 // 32 value heads), the most 2050 in block 2: on a "
        "GPU with fla < 0.6.0 this run would be refused before step 1 (known issue fla-1077-too-many-segments); "
        "fla >= 0.6.0 has no such limit")
