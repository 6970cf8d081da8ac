"""``mamba_ssm.ops.triton.ssd_combined`` stand-in: mamba-ssm 2.x's ``mamba_chunk_scan_combined`` and
``mamba_split_conv1d_scan_combined`` (the signatures of mamba-ssm 2.2), computed by transformers' torch
reference of the chunked scan (``modeling_mamba2``) one example at a time when ``seq_idx`` marks a packed row.

``LEAK`` (set it, or KERNELGUARD_FAKE_MAMBA_LEAK=1 in a child process): both ignore ``seq_idx``, a kernel that
carries state across a packed row's examples: the negative control of the packed tests.
"""

from __future__ import annotations

from collections.abc import Callable
import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"]

LEAK = os.environ.get("KERNELGUARD_FAKE_MAMBA_LEAK") == "1"
_REFERENCE: list[Callable[..., Any]] = []


def _reference() -> Callable[..., Any]:
    # Imported at call time: transformers imports this module while decorating that very function.
    if not _REFERENCE:
        import importlib

        from kernelguard.resolution.transformers_compat import unpack_closure

        modeling = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
        closure = unpack_closure(modeling.mamba2_chunk_scan)
        _REFERENCE.append(closure.torch_function if closure is not None else modeling.mamba2_chunk_scan)
    return _REFERENCE[0]


def _segments(seq_idx: torch.Tensor | None, row: int, length: int) -> list[tuple[int, int]]:
    """[start, end) of each example of row ``row``: runs of one ``seq_idx`` value (the whole row without one)."""
    if seq_idx is None or LEAK:
        return [(0, length)]
    ids = seq_idx[row].tolist()
    starts = [0, *(t for t in range(1, length) if ids[t] != ids[t - 1])]
    return list(zip(starts, [*starts[1:], length], strict=True))


def mamba_chunk_scan_combined(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Any:
    """x: [B, T, H, P], dt: [B, T, H], A: [H], B/C: [B, T, G, N], seq_idx: int32 [B, T]."""
    if return_varlen_states or cu_seqlens is not None:
        raise NotImplementedError("fake mamba_ssm: varlen states are not modelled")
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise NotImplementedError("fake mamba_ssm: states with seq_idx are not modelled")
    ref = _reference()
    rows = []
    for b in range(x.shape[0]):
        parts = []
        for start, end in _segments(seq_idx, b, x.shape[1]):
            part = ref(x[b:b + 1, start:end], dt[b:b + 1, start:end], A, B[b:b + 1, start:end],
                       C[b:b + 1, start:end], chunk_size, D=D, dt_bias=dt_bias,
                       initial_states=None if initial_states is None else initial_states[b:b + 1],
                       dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states)
            parts.append(part)
        rows.append(parts)
    if return_final_states:
        out = torch.cat([parts[0][0] for parts in rows])
        final = torch.cat([parts[0][1] for parts in rows])
    else:
        out, final = torch.cat([torch.cat(parts, dim=1) for parts in rows]), None
    out = out.to(x.dtype)
    if z is not None:
        out = out * F.silu(z)
    return (out, final) if return_final_states else out


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None, dt_bias: torch.Tensor,
    A: torch.Tensor, D: torch.Tensor, chunk_size: int, initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None, dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False, activation: str = "silu", rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6, outproj_weight: torch.Tensor | None = None, outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None, ngroups: int = 1, norm_before_gate: bool = True,
) -> torch.Tensor:
    """mamba-ssm's ``mamba_split_conv1d_scan_ref``: split, causal conv (per example), chunked scan (per example),
    gated RMSNorm, output projection. zxbcdt: [B, T, dim + conv_dim + H]."""
    if initial_states is not None or return_final_states:
        raise NotImplementedError("fake mamba_ssm: states are not modelled")
    from causal_conv1d import causal_conv1d_fn  # the causal-conv1d stand-in: it honours seq_idx

    batch, length, _ = zxbcdt.shape
    nheads = D.shape[0]
    headdim = headdim if headdim is not None else (conv1d_weight.shape[0] - 2 * ngroups) // nheads
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    conv_seq = None if LEAK else seq_idx
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=conv_seq,
                           activation=activation).transpose(1, 2)
    x, b, c = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    out = mamba_chunk_scan_combined(
        x.reshape(batch, length, nheads, headdim), dt, A, b.reshape(batch, length, ngroups, dstate),
        c.reshape(batch, length, ngroups, dstate), chunk_size, D=D, z=None if rmsnorm_weight is not None else
        z.reshape(batch, length, nheads, headdim), dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx,
        dt_limit=dt_limit).reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = _gated_rmsnorm(out, z, rmsnorm_weight, rmsnorm_eps, dim // ngroups, norm_before_gate)
    return F.linear(out.to(zxbcdt.dtype), outproj_weight, outproj_bias) if outproj_weight is not None else out


def _gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                   norm_before_gate: bool) -> torch.Tensor:
    """mamba-ssm's ``rmsnorm_fn(x, weight, None, z=z, group_size=group, norm_before_gate=...)``."""
    dtype, x, gate = x.dtype, x.float(), F.silu(z.float())
    if not norm_before_gate:
        x = x * gate
    grouped = x.view(*x.shape[:-1], x.shape[-1] // group, group)
    x = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(x.shape)
    x = x * weight.float()
    if norm_before_gate:
        x = x * gate
    return x.to(dtype)


