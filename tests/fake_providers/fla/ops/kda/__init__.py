"""``fla.ops.kda`` stand-in: fla 0.6.0's ``chunk_kda`` / ``fused_recurrent_kda`` over transformers' torch
references for Kimi delta attention (``kimi_linear``), with fla's varlen semantics (see the GDN stand-in)."""

from __future__ import annotations

from typing import Any

import torch

from fla.ops.gated_delta_rule import _prepare, _reference, _varlen

__all__ = ["chunk_kda", "fused_recurrent_kda"]

_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"


def _kda(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    modelled = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "state_v_first",
                "cu_seqlens", "cu_seqlens_cpu", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
    odd = [n for n, value in kwargs.items() if n not in modelled and value not in (None, False)]
    if odd:
        raise NotImplementedError(f"fake fla: {', '.join(sorted(odd))} not modelled for KDA")
    if g.dim() != 4 or g.shape[-1] != k.shape[-1]:
        raise ValueError(f"KDA's g is [B, T, HV, K] (one decay per key channel); got {tuple(g.shape)}")
    out_dtype = v.dtype
    q, k, beta, l2 = _prepare(
        q, k, beta, v, kwargs.get("scale"), bool(kwargs.get("use_qk_l2norm_in_kernel")),
        bool(kwargs.get("use_beta_sigmoid_in_kernel")), bool(kwargs.get("allow_neg_eigval")),
    )
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is None:
        cu_seqlens = kwargs.get("cu_seqlens_cpu")
    return _varlen(
        _reference(name, _MODULE), q, k, v, g, beta,
        initial_state=kwargs.get("initial_state"), output_final_state=bool(kwargs.get("output_final_state")),
        use_qk_l2norm_in_kernel=l2, state_v_first=bool(kwargs.get("state_v_first")), cu_seqlens=cu_seqlens,
        out_dtype=out_dtype,
    )


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _kda("chunk_kimi_delta_attention", q, k, v, g, beta, kwargs)


def fused_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _kda("recurrent_kimi_delta_attention", q, k, v, g, beta, kwargs)
