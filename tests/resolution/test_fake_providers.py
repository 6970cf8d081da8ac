"""The fake providers are only useful if they are right: packed (cu_seqlens / seq_idx) == per-segment calls."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

SEGMENTS = [5, 70, 1, 24]  # crosses the 64-token chunk boundary; includes a length-1 segment


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


def _cu_seqlens(lengths: list[int]) -> Any:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _gdn_inputs(total: int, h: int = 2, hv: int = 4, k: int = 16, v: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(1, total, h, k, generator=g),
        "k": torch.randn(1, total, h, k, generator=g),
        "v": torch.randn(1, total, hv, v, generator=g),
        "g": -torch.rand(1, total, hv, generator=g),
        "beta": torch.rand(1, total, hv, generator=g),
    }


def _reference(name: str):  # type: ignore[no-untyped-def]
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from kernelguard.resolution.transformers_compat import unpack_closure

    # The torch function itself: with an in-window kernels the attribute is a kernels Func module.
    obj = getattr(modeling_qwen3_5, name)
    closure = unpack_closure(obj)
    return closure.torch_function if closure is not None else inspect.unwrap(obj)


@pytest.mark.parametrize(
    ("fake_name", "ref_name"),
    [
        ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
        ("fused_recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    ],
)
def test_fake_fla_packed_equals_per_segment(fake_providers: object, fake_name: str, ref_name: str) -> None:
    import fla.ops.gated_delta_rule as gdr

    fake, ref = getattr(gdr, fake_name), _reference(ref_name)
    x = _gdn_inputs(sum(SEGMENTS))
    init = torch.randn(len(SEGMENTS), 4, 16, 8)
    out, final = fake(
        **x, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=_cu_seqlens(SEGMENTS),
    )
    assert out.shape == x["v"].shape
    assert final.shape == (len(SEGMENTS), 4, 16, 8)
    # Expand grouped heads up front: the torch reference of transformers 5.17 does not do it itself.
    q, k = (x[n].repeat_interleave(2, dim=2) for n in ("q", "k"))
    for i, (s, e) in enumerate(_bounds(SEGMENTS)):
        o_ref, f_ref = ref(
            q[:, s:e], k[:, s:e], x["v"][:, s:e], x["g"][:, s:e], x["beta"][:, s:e],
            initial_state=init[i : i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, s:e], o_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final[i : i + 1], f_ref, rtol=1e-4, atol=1e-5)


def test_fake_fla_requires_batch_one_with_cu_seqlens(fake_providers: object) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    x = {name: t.expand(2, *t.shape[1:]) for name, t in _gdn_inputs(8).items()}
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        chunk_gated_delta_rule(**x, cu_seqlens=_cu_seqlens([3, 5]))


def test_fake_fla_explicit_default_scale_matches(fake_providers: object) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    x = _gdn_inputs(10)
    a, _ = chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    b, _ = chunk_gated_delta_rule(**x, scale=16**-0.5, use_qk_l2norm_in_kernel=True)
    c, _ = chunk_gated_delta_rule(**x, scale=0.5, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("channel_last", [False, True])
def test_fake_causal_conv1d_seq_idx_equals_per_segment(fake_providers: object, channel_last: bool) -> None:
    from causal_conv1d import causal_conv1d_fn

    ref = _reference("causal_conv1d_fn")
    g = torch.Generator().manual_seed(1)
    dim, total = 12, sum(SEGMENTS)
    x: torch.Tensor = (
        torch.randn(1, total, dim, generator=g).transpose(1, 2) if channel_last else torch.randn(1, dim, total)
    )
    weight, bias = torch.randn(dim, 4, generator=g), torch.randn(dim, generator=g)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(SEGMENTS)])[None]
    out: Any = causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    for s, e in _bounds(SEGMENTS):
        torch.testing.assert_close(out[:, :, s:e], ref(x[:, :, s:e], weight, bias, activation="silu"))
    # Without seq_idx it is one long sequence: identical to the reference on the whole input.
    torch.testing.assert_close(causal_conv1d_fn(x, weight, bias, activation="silu"), ref(x, weight, bias, "silu"))


def test_fake_causal_conv1d_states_and_update(fake_providers: object) -> None:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

    ref_update = _reference("causal_conv1d_update")
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(2, 6, 9, generator=g), torch.randn(6, 4, generator=g)
    full: Any = causal_conv1d_fn(x, weight)
    head, state = causal_conv1d_fn(x[:, :, :5], weight, return_final_states=True)
    tail: Any = causal_conv1d_fn(x[:, :, 5:], weight, initial_states=state)
    torch.testing.assert_close(torch.cat([head, tail], -1), full)

    state_a, state_b = torch.randn(2, 6, 3, generator=g), None
    state_b = state_a.clone()
    step = torch.randn(2, 6, 1, generator=g)
    out = causal_conv1d_update(step, state_a, weight, activation="silu")
    torch.testing.assert_close(out, ref_update(step, state_b, weight, None, "silu"))
    torch.testing.assert_close(state_a, state_b)
    assert causal_conv1d_update(step[:, :, 0], state_a, weight).shape == (2, 6)


def test_tiny_model_packed_forward_equals_separate(fake_providers: object) -> None:
    """End to end through transformers: a packed row with cu_seq_lens/seq_idx == each example alone."""
    import tiny_models

    model = tiny_models.tiny_model("qwen3_5")
    lengths = [7, 12]
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    cu = _cu_seqlens(lengths)
    packed_kwargs = {
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
        "seq_idx": torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None],
    }
    with torch.no_grad():
        packed = model(ids, use_cache=False, **packed_kwargs).logits
        for s, e in _bounds(lengths):
            alone = model(ids[:, s:e], use_cache=False).logits
            torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-4, atol=1e-4)
