"""A varlen attention for packed sequences, plugged into transformers without any extra package.

``register_varlen_attention()`` registers ``"kernelguard_varlen"`` through ``transformers.AttentionInterface``.
It calls ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; a flash kernel, CUDA only) with the
``cu_seq_lens_q/k`` and ``max_length_q/k`` that packed batches carry, so full-attention layers never build
the O(T^2) block mask SDPA derives from packed position ids. Unknown implementation names make transformers'
mask builder return no mask, which is what a varlen kernel wants.

Packed rows carry their boundaries as ``cu_seq_lens_q/k`` (transformers' ``DataCollatorWithFlattening(
return_flash_attn_kwargs=True)``, TRL >= 1.16's ``padding_free=True`` collator); a batch-1 row with only ``position_ids``
gets its boundaries from where the positions restart, as transformers' flash-attention path does, so a packed row
never attends across examples. ``reference_varlen_attn`` is a per-segment SDPA with torch's ``varlen_attn``
signature: the CPU stand-in for tests and debugging (``set_varlen_impl(reference_varlen_attn)``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from kernelguard.resolution import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, MAX_LENGTH_K, MAX_LENGTH_Q
from kernelguard.runtime.registry import REGISTRY, VarlenBinding

__all__ = [
    "VARLEN_NAME",
    "boundaries_from_position_ids",
    "reference_varlen_attn",
    "register_varlen_attention",
    "set_varlen_impl",
    "torch_varlen_attn",
    "varlen_attention_forward",
    "varlen_impl",
]

VARLEN_NAME = "kernelguard_varlen"


def torch_varlen_attn() -> Callable[..., Any] | None:
    """torch's ``varlen_attn`` when this torch has it (2.13 does; checked with hasattr, not by version)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def set_varlen_impl(fn: Callable[..., Any] | None) -> None:
    """Point ``kernelguard_varlen`` at ``fn`` (``varlen_attn``'s signature); ``None`` until registration.
    Tests point it at :func:`reference_varlen_attn`; :func:`kernelguard.runtime.registry.reset` unbinds it."""
    REGISTRY.varlen = VarlenBinding.of(fn)


def varlen_impl() -> Callable[..., Any] | None:
    """The function ``kernelguard_varlen`` calls now (None before registration)."""
    return REGISTRY.varlen.impl


def reference_varlen_attn(
    query: Any,
    key: Any,
    value: Any,
    cu_seq_q: Any,
    cu_seq_k: Any,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    **_: Any,
) -> Any:
    """torch's ``varlen_attn`` semantics in plain SDPA, one segment at a time (any device; slow, exact).

    query/key/value are [total_tokens, heads, dim]. Only full and causal windows are implemented, the two
    ``kernelguard_varlen`` asks for."""
    import torch
    import torch.nn.functional as F

    if window_size not in ((-1, -1), (-1, 0)):
        raise ValueError(f"reference_varlen_attn implements window_size (-1, -1) or (-1, 0), not {window_size}")
    outs = []
    for i in range(len(cu_seq_q) - 1):
        a, b = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        c, d = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        out = F.scaled_dot_product_attention(
            query[a:b].transpose(0, 1),
            key[c:d].transpose(0, 1),
            value[c:d].transpose(0, 1),
            is_causal=window_size == (-1, 0),
            scale=scale,
            enable_gqa=enable_gqa,
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else query.new_empty((0, *query.shape[1:-1], value.shape[-1]))


def boundaries_from_position_ids(position_ids: Any) -> tuple[Any, int] | None:
    """(cu_seqlens int32, longest segment) of a [1, T] packed row whose positions restart at 0 per example;
    ``None`` when the row is one plain sequence or the shape is not a single packed row."""
    import torch

    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten()
    if starts.numel() == 0 or (starts.numel() == 1 and int(starts[0]) == 0):
        return None
    total = torch.tensor([position_ids.shape[1]], device=starts.device, dtype=starts.dtype)
    if int(starts[0]) != 0:
        starts = torch.cat([torch.zeros_like(total), starts])
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int(cu.diff().max())


def _segments(query: Any, key: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, int, int]:
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of this batch: the packed row's own boundaries when it carries
    them (or position ids that restart), else one sequence per row."""
    import torch

    bsz, q_len, k_len = query.shape[0], query.shape[2], key.shape[2]
    cu_q: Any = kwargs.get(CU_SEQ_LENS_Q)
    cu_k: Any = kwargs.get(CU_SEQ_LENS_K, cu_q)
    if cu_q is not None:
        if bsz != 1:
            raise ValueError(f"packed varlen attention needs batch size 1, got {bsz}")
        max_q = int(kwargs.get(MAX_LENGTH_Q) or q_len)
        return cu_q, cu_k, max_q, int(kwargs.get(MAX_LENGTH_K) or max_q)
    derived = boundaries_from_position_ids(kwargs.get("position_ids")) if q_len == k_len else None
    if derived is not None:  # a flattened row without cu_seq_lens_*: never attend across its examples
        return derived[0], derived[0], derived[1], derived[1]
    rows = torch.arange(bsz + 1, device=query.device, dtype=torch.int32)
    return rows * q_len, rows * k_len, q_len, k_len


def varlen_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention-interface function. query/key/value are [B, H, T, D]; returns [B, T, H, D]."""
    import torch

    binding = REGISTRY.varlen  # read once: a concurrent set_varlen_impl cannot mix two bindings
    if binding.impl is None:
        raise RuntimeError(
            "kernelguard_varlen was called before register_varlen_attention() found varlen_attn"
        )
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor) and bool(attention_mask.all())
    ):
        raise ValueError("kernelguard_varlen takes packed 1D batches (cu_seq_lens_*), not an attention mask")
    if dropout:
        raise ValueError("kernelguard_varlen does not implement attention dropout; set attention_dropout=0")
    bsz, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    cu_q, cu_k, max_q, max_k = _segments(query, key, kwargs)
    q = query.transpose(1, 2).reshape(bsz * q_len, heads, dim)
    k = key.transpose(1, 2).reshape(bsz * k_len, kv_heads, dim)
    v = value.transpose(1, 2).reshape(bsz * k_len, kv_heads, value.shape[-1])
    extra: dict[str, Any] = {}
    if kv_heads != heads:
        if "enable_gqa" in binding.params:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    causal = True if is_causal is None else bool(is_causal)
    if "is_causal" in binding.params:  # torch 2.10/2.11 spelling
        extra["is_causal"] = causal
    elif causal:  # torch 2.13: causal is window (-1, 0); the default (-1, -1) is bidirectional
        extra["window_size"] = (-1, 0)
    if scaling is not None and "scale" in binding.params:
        extra["scale"] = scaling
    q, k, v, back_to = _flash_dtype(q, k, v, exact=binding.impl is reference_varlen_attn)
    out = binding.impl(
        q, k, v, cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32), max_q, max_k, **extra
    )
    if isinstance(out, tuple):
        out = out[0]
    return out.to(back_to).reshape(bsz, q_len, heads, -1), None


def _flash_dtype(q: Any, k: Any, v: Any, *, exact: bool) -> tuple[Any, Any, Any, Any]:
    """varlen_attn is a flash kernel: fp16/bf16 only. Under autocast with fp32 master weights (Trainer's
    ``bf16=True``, a plain ``torch.autocast`` loop) the q/k norms hand it fp32 tensors: run it in the autocast
    dtype (what SDPA would do) and return the caller's dtype. Outside autocast, fp32 is a clear error."""
    import torch

    dtype = q.dtype  # ``exact``: the CPU stand-in, which takes any dtype
    if exact or (dtype in (torch.float16, torch.bfloat16) and k.dtype == dtype and v.dtype == dtype):
        return q, k, v, dtype
    if torch.is_autocast_enabled(q.device.type):
        low = torch.get_autocast_dtype(q.device.type)
        return q.to(low), k.to(low), v.to(low), dtype
    raise ValueError(
        f"kernelguard_varlen runs torch's flash varlen kernel, which takes fp16/bf16; got {dtype}. Load the model "
        "in bf16 (dtype=torch.bfloat16), train under torch.autocast, or use attn_implementation='sdpa'"
    )


def register_varlen_attention(*, device_type: str | None = None) -> str:
    """Register ``kernelguard_varlen`` and return the attention implementation name to use for packed training.

    - torch has ``varlen_attn`` and the device is CUDA: ``"kernelguard_varlen"``;
    - else ``flash_attn`` is importable on CUDA: ``"flash_attention_2"`` (transformers' own varlen path);
    - else ``"sdpa"`` — which builds a block mask from packed position ids; the guard decides whether that is
      allowed (``--allow attention``).
    """
    import torch

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    impl = torch_varlen_attn()
    if impl is not None:
        from transformers import AttentionInterface

        if REGISTRY.varlen.impl is None:
            set_varlen_impl(impl)
        AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
        if device_type == "cuda":
            return VARLEN_NAME
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"
