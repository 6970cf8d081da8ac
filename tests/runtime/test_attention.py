"""kernelguard_varlen's plumbing on CPU: segment boundaries (cu_seq_lens or restarting position ids), the
per-segment reference with torch's varlen_attn signature, and the refusals for inputs it does not handle."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernelguard.runtime import attention


def _qkv(total: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, total, dim, generator=g), torch.randn(1, kv_heads, total, dim, generator=g),
            torch.randn(1, kv_heads, total, dim, generator=g))


def _separately(q: Any, k: Any, v: Any, lengths: list[int]) -> Any:
    """Each example on its own through causal SDPA: [1, T, H, D]."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   enable_gqa=True))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_boundaries_from_position_ids() -> None:
    cu, longest = attention.boundaries_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    cu, longest = attention.boundaries_from_position_ids(torch.tensor([[5, 6, 0, 1, 2]]))  # a continued example
    assert cu.tolist() == [0, 2, 5] and longest == 3
    assert attention.boundaries_from_position_ids(torch.arange(6)[None]) is None  # one plain sequence
    assert attention.boundaries_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]])) is None  # not one row
    assert attention.boundaries_from_position_ids(None) is None


def test_packed_row_matches_each_example_alone(cpu_varlen: None) -> None:
    lengths = [3, 5, 4]
    q, k, v = _qkv(sum(lengths))
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    out, weights = attention.varlen_attention_forward(
        None, q, k, v, None, scaling=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5
    )
    assert weights is None and out.shape == (1, 12, 4, 8)
    torch.testing.assert_close(out, _separately(q, k, v, lengths))


def test_position_ids_alone_keep_examples_apart(cpu_varlen: None) -> None:
    """A flattening collator without cu_seq_lens (position ids only) must not attend across examples."""
    lengths = [3, 5, 4]
    q, k, v = _qkv(sum(lengths), seed=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = attention.varlen_attention_forward(None, q, k, v, None, position_ids=positions)
    torch.testing.assert_close(out, _separately(q, k, v, lengths))
    whole, _ = attention.varlen_attention_forward(None, q, k, v, None, position_ids=torch.arange(12)[None])
    torch.testing.assert_close(whole, _separately(q, k, v, [12]))  # one sequence: one causal segment
    assert not torch.allclose(whole, out)


def test_unpacked_batch_is_one_sequence_per_row(cpu_varlen: None) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=g) for _ in range(3))
    out, _ = attention.varlen_attention_forward(None, q, k, v, None, scaling=0.5)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_reference_full_window_is_bidirectional() -> None:
    q, k, v = (t[0].transpose(0, 1) for t in _qkv(6, kv_heads=4, seed=3))  # [T, H, D]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = attention.reference_varlen_attn(q, k, v, cu, cu, 4, 4)
    second = F.scaled_dot_product_attention(q[2:].transpose(0, 1), k[2:].transpose(0, 1), v[2:].transpose(0, 1))
    torch.testing.assert_close(out[2:], second.transpose(0, 1))
    with pytest.raises(ValueError, match=r"window_size \(-1, -1\) or \(-1, 0\), not \(4, 0\)"):
        attention.reference_varlen_attn(q, k, v, cu, cu, 4, 4, window_size=(4, 0))


def test_refuses_what_it_does_not_implement(cpu_varlen: None) -> None:
    q, k, v = _qkv(4)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="takes packed 1D batches"):
        attention.varlen_attention_forward(None, q, k, v, mask)
    with pytest.raises(ValueError, match="set attention_dropout=0"):
        attention.varlen_attention_forward(None, q, k, v, None, dropout=0.1)
    q2, k2, v2 = (torch.cat([t, t]) for t in (q, k, v))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs batch size 1, got 2"):
        attention.varlen_attention_forward(None, q2, k2, v2, None, cu_seq_lens_q=cu)


def test_flash_kernel_gets_the_autocast_dtype_and_fp32_outside_autocast_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trainer's bf16=True keeps fp32 weights under autocast; the flash varlen kernel takes fp16/bf16 only."""
    import torch

    from kernelguard.runtime import attention
    from kernelguard.runtime.registry import REGISTRY, VarlenBinding

    seen: list[torch.dtype] = []

    def flash_like(q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # type: ignore[no-untyped-def]
        seen.append(q.dtype)
        return attention.reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    monkeypatch.setattr(REGISTRY, "varlen", VarlenBinding.of(flash_like))
    q = torch.randn(1, 2, 6, 8)
    kwargs = {"cu_seq_lens_q": torch.tensor([0, 6], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 6], dtype=torch.int32),
              "max_length_q": 6, "max_length_k": 6}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.varlen_attention_forward(None, q, q, q, None, **kwargs)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    with pytest.raises(ValueError, match="takes fp16/bf16; got torch.float32"):
        attention.varlen_attention_forward(None, q, q, q, None, **kwargs)
