"""Test double for Dao's ``causal_conv1d`` (same signatures; pure torch; honours ``seq_idx``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = "1.6.0+kernelguard.fake"
# kernelguard's device hook: the devices this provider's kernels can run on.
__kernelguard_devices__ = ("cpu", "cuda")


def _tell_transformers_the_devices(package: str) -> None:
    """transformers 5.25+ hands a pip package only inputs on the devices it lists for it
    (``hub_kernels._PACKAGE_SUPPORTED_DEVICES``: causal_conv1d on cuda, fla on cuda/xpu/mlu/npu); a stand-in that runs on CPU says so
    there too, as it does to kernelguard. transformers imports the package before it reads that table."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return
    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(table, dict):
        table[package] = tuple(dict.fromkeys((*table.get(package, ()), *__kernelguard_devices__)))


_tell_transformers_the_devices('causal_conv1d')

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    return F.silu(out) if activation is not None else out


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [B, D, T] (contiguous or channel-last), weight: [D, W], seq_idx: int32 [B, T]."""
    if seq_idx is not None:
        # Same restrictions as the CUDA kernel.
        assert initial_states is None, "initial_states must be None if seq_idx is not None"
        assert not return_final_states, "If seq_idx is not None, we don't return final_states_out"
    dim = x.shape[1]
    width = weight.shape[-1]
    xw = x.to(weight.dtype)
    if initial_states is not None:
        padded = torch.cat([initial_states.to(weight.dtype), xw], dim=-1)
    else:
        padded = F.pad(xw, (width - 1, 0))
    if seq_idx is None:
        out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=dim)
    else:
        windows = padded.unfold(-1, width, 1)  # [B, D, T, W]: windows[..., t, j] = x[t - (W-1) + j]
        seg = F.pad(seq_idx.to(torch.int64), (width - 1, 0), value=-1).unfold(-1, width, 1)  # [B, T, W]
        same = (seg == seq_idx.to(torch.int64).unsqueeze(-1)).to(windows.dtype).unsqueeze(1)
        out = (windows * same * weight[None, :, None, :]).sum(-1)
        if bias is not None:
            out = out + bias[None, :, None]
    out = _activate(out, activation).to(x.dtype)
    if not return_final_states:
        return out
    final = padded[:, :, -(width - 1):].to(x.dtype) if width > 1 else padded[:, :, :0].to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [B, D] or [B, D, L]; conv_state: [B, D, state_len] updated in place (non-circular buffer)."""
    if cache_seqlens is not None:
        raise NotImplementedError("fake causal_conv1d: circular-buffer cache_seqlens is not modelled")
    unsqueeze = x.dim() == 2
    if unsqueeze:
        x = x.unsqueeze(-1)
    dim, seqlen = x.shape[1], x.shape[-1]
    rows = conv_state if conv_state_indices is None else conv_state[conv_state_indices]
    state_len = rows.shape[-1]
    joined = torch.cat([rows.to(weight.dtype), x.to(weight.dtype)], dim=-1)
    new_state = joined[:, :, -state_len:].to(conv_state.dtype)
    if conv_state_indices is None:
        conv_state.copy_(new_state)
    else:
        conv_state[conv_state_indices] = new_state
    out = F.conv1d(joined, weight.unsqueeze(1), bias, groups=dim)[:, :, -seqlen:]
    out = _activate(out, activation).to(x.dtype)
    return out.squeeze(-1) if unsqueeze else out
