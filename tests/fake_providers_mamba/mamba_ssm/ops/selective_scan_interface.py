"""Test double for mamba-ssm's Mamba-1 kernels: ``selective_scan_fn`` and ``mamba_inner_fn`` with mamba-ssm 2.2's
signatures, pure torch (mamba-ssm's own ``selective_scan_ref`` / ``mamba_inner_ref``). Like the real kernels they
take no example boundary: a packed row runs through them as one sequence (what the guard must refuse)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def selective_scan_fn(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                      delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                      return_last_state: bool = False) -> Any:
    """u, delta, z: (batch, dim, L); A: (dim, state); B, C: (batch, state, L); D, delta_bias: (dim,)."""
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias[..., None].float()
    if delta_softplus:
        delta = F.softplus(delta)
    delta_a = torch.exp(torch.einsum("bdl,dn->bdln", delta, A.float()))
    delta_b_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B.float(), u)
    state = u.new_zeros((u.shape[0], A.shape[0], A.shape[1]))
    ys = []
    for i in range(u.shape[2]):
        state = delta_a[:, :, i] * state + delta_b_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, :, i].float()))
    out = torch.stack(ys, dim=2)
    if D is not None:
        out = out + u * D.float()[..., None]
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(dtype_in)
    return (out, state) if return_last_state else out


def mamba_inner_fn(xz: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                   x_proj_weight: torch.Tensor, delta_proj_weight: torch.Tensor, out_proj_weight: torch.Tensor,
                   out_proj_bias: torch.Tensor | None, A: torch.Tensor, B: Any = None, C: Any = None,
                   D: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None, B_proj_bias: Any = None,
                   C_proj_bias: Any = None, delta_softplus: bool = True, checkpoint_lvl: int = 1,
                   b_rms_weight: Any = None, c_rms_weight: Any = None, dt_rms_weight: Any = None,
                   b_c_dt_rms_eps: float = 1e-6) -> torch.Tensor:
    """The fused Mamba-1 block (conv, x/dt projections, scan, out projection) as mamba-ssm's reference."""
    if any(w is not None for w in (b_rms_weight, c_rms_weight, dt_rms_weight)):
        raise NotImplementedError("the stand-in's mamba_inner_fn has no B/C/dt RMS norms (Falcon-Mamba)")
    length, rank, state = xz.shape[-1], delta_proj_weight.shape[1], A.shape[-1]
    x, z = xz.chunk(2, dim=1)
    x = F.silu(F.conv1d(x, conv1d_weight, conv1d_bias, padding=conv1d_weight.shape[-1] - 1,
                        groups=x.shape[1])[..., :length])
    x_dbl = F.linear(x.transpose(1, 2).reshape(-1, x.shape[1]), x_proj_weight)
    delta = (delta_proj_weight @ x_dbl[:, :rank].t()).reshape(-1, xz.shape[0], length).transpose(0, 1)
    b = x_dbl[:, rank:rank + state].reshape(xz.shape[0], length, state).transpose(1, 2)
    c = x_dbl[:, -state:].reshape(xz.shape[0], length, state).transpose(1, 2)
    y = selective_scan_fn(x, delta, A, b, c, D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)
