"""The per-kernel checks of ``check --run``: each kernel and its torch reference on the same inputs.

Every kernel under test runs forward (and backward where training uses it) in bf16 on small random inputs
shaped like what a gated-delta-net (or Kimi delta attention) layer really passes it, and is compared per tensor with the torch
reference run in fp32 on the *same* bf16-rounded inputs. For packed (varlen) cases the reference runs once per
segment, which is exactly the semantics ``cu_seqlens`` / ``seq_idx`` promise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kernelguard.resolution import SEQ_IDX

from .references import CHUNK, CONV, CONV_UPDATE, FLA_KERNELS, KDA_CHUNK, KDA_KERNELS
from .results import NumericsCase, compare, error_case
from .shapes import GdnShape
from .shapes import bounds as segment_bounds

if TYPE_CHECKING:
    import torch

__all__ = ["conv_shapes", "exercise"]


def _leaf(t: torch.Tensor, device: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.to(device=device, dtype=dtype or t.dtype).detach().requires_grad_(True)


def _grads(
    out: torch.Tensor, dout: torch.Tensor, leaves: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    import torch

    grads = torch.autograd.grad(out, list(leaves), grad_outputs=dout, allow_unused=True)
    return list(grads)


def _gdn_inputs(
    shape: GdnShape, q_heads: int, gen: torch.Generator, *, per_key_gate: bool = False
) -> dict[str, torch.Tensor]:
    """bf16 q/k/v and beta (post-sigmoid), fp32 log-space decay g, bf16 upstream gradient: what the layer
    passes (it computes g in fp32 and beta = sigmoid in the model dtype). ``per_key_gate``: KDA's g, one decay
    per key channel ([B, T, H, K]), as its forget gate makes it: ``-exp(A_log) * softplus(f + dt_bias)`` with
    A in [1, 16] and dt in [1e-3, 1e-1] as the layer's init draws them."""
    import torch
    import torch.nn.functional as F

    b, t = shape.batch, shape.seq_len
    hv, kd, vd = shape.num_v_heads, shape.key_dim, shape.value_dim
    if per_key_gate:
        rate = torch.empty(1, 1, hv, 1).uniform_(1.0, 16.0, generator=gen)
        dt = torch.empty(hv, kd).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) == dt
        g = -rate * F.softplus(torch.randn(b, t, hv, kd, generator=gen) + dt_bias)
    else:
        g = F.logsigmoid(torch.randn(b, t, hv, generator=gen))
    return {
        "q": torch.randn(b, t, q_heads, kd, generator=gen),
        "k": torch.randn(b, t, q_heads, kd, generator=gen),
        "v": torch.randn(b, t, hv, vd, generator=gen),
        "g": g,
        "beta": torch.randn(b, t, hv, generator=gen).sigmoid(),
        "do": torch.randn(b, t, hv, vd, generator=gen),
    }


def _cu_seqlens(shape: GdnShape, device: str) -> torch.Tensor | None:
    import torch

    if shape.segments is None:
        return None
    bounds = [0] + [e for _, e in shape.segment_bounds()]
    # int32, as the layer forwards the collator's cu_seq_lens_q.
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _reference_gdn(
    ref: Callable[..., Any], shape: GdnShape, x: Mapping[str, torch.Tensor], **kw: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 reference, once per packed segment (each from a zero / its own initial state)."""
    import torch

    init = kw.pop("initial_state", None)
    outs, finals = [], []
    for i, (s, e) in enumerate(shape.segment_bounds()):
        seg_init = None if init is None else init[i : i + 1] if shape.segments is not None else init
        o, h = ref(
            x["q"][:, s:e],
            x["k"][:, s:e],
            x["v"][:, s:e],
            g=x["g"][:, s:e],
            beta=x["beta"][:, s:e],
            initial_state=seg_init,
            use_qk_l2norm_in_kernel=True,
            **kw,
        )
        outs.append(o)
        finals.append(h)
    final = torch.cat(finals, dim=0) if finals[0] is not None else None
    return torch.cat(outs, dim=1), final


def _check_chunk(
    kernel: str,
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    q_heads: int,
    label: str,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    import torch

    raw = _gdn_inputs(shape, q_heads, gen, per_key_gate=kernel in KDA_KERNELS)
    names = ("q", "k", "v", "g", "beta")
    # The kernel gets what the layer gives it: bf16 q/k/v/beta, fp32 g; the reference gets the same values
    # (already bf16-rounded) in fp32, so only the kernel's arithmetic differs.
    kin = {n: _leaf(raw[n], device, torch.float32 if n == "g" else dtype) for n in names}
    rin = {n: _leaf(kin[n].detach().float(), device) for n in names}
    do = raw["do"].to(device=device, dtype=dtype)
    try:
        o, _ = fn(
            kin["q"],
            kin["k"],
            kin["v"],
            g=kin["g"],
            beta=kin["beta"],
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=_cu_seqlens(shape, device),
        )
        kgrads = _grads(o, do, [kin[n] for n in names])
    except Exception as exc:  # noqa: BLE001
        return [error_case(kernel, label, exc)]
    try:
        ro, _ = _reference_gdn(ref, shape, rin, output_final_state=False)
        rgrads = _grads(ro, do.float(), [rin[n] for n in names])
    except Exception as exc:  # noqa: BLE001
        return [error_case(kernel, label, exc, where="reference")]
    cases = [compare(kernel, label, "o", o, ro, tol)]
    cases += [compare(kernel, label, "d" + n, kg, rg, tol) for n, kg, rg in zip(names, kgrads, rgrads)]
    return cases


def _check_recurrent(
    kernel: str,
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    q_heads: int,
    label: str,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    """Decode-style forward (fla has no backward here): a few tokens per row from a random fp32 state."""
    import torch

    steps = 1
    b = shape.batch if shape.segments is None else len(shape.segments)
    small = GdnShape(
        num_k_heads=shape.num_k_heads,
        num_v_heads=shape.num_v_heads,
        key_dim=shape.key_dim,
        value_dim=shape.value_dim,
        batch=b,
        seq_len=steps,
    )
    raw = _gdn_inputs(small, q_heads, gen, per_key_gate=kernel in KDA_KERNELS)
    state = torch.randn(b, shape.num_v_heads, shape.key_dim, shape.value_dim, generator=gen) * 0.1
    kin = {
        n: raw[n].to(device=device, dtype=torch.float32 if n == "g" else dtype)
        for n in ("q", "k", "v", "g", "beta")
    }
    rin = {n: t.float() for n, t in kin.items()}
    label = small.label(q_heads=q_heads) + " decode from a random state"

    def decode_step(impl: Callable[..., Any], t: dict[str, torch.Tensor]) -> Any:
        with torch.no_grad():
            return impl(
                t["q"],
                t["k"],
                t["v"],
                g=t["g"],
                beta=t["beta"],
                initial_state=state.to(device).clone(),
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )

    try:
        o, ht = decode_step(fn, kin)
    except Exception as exc:  # noqa: BLE001
        return [error_case(kernel, label, exc)]
    try:
        ro, rh = decode_step(ref, rin)
    except Exception as exc:  # noqa: BLE001
        return [error_case(kernel, label, exc, where="reference")]
    return [
        compare(kernel, label, "o", o, ro, tol),
        compare(kernel, label, "final_state", ht, rh, tol),
    ]


def _conv_label(shape: GdnShape, segments: tuple[int, ...] | None) -> str:
    text = f"B{shape.batch} T{shape.seq_len} D{shape.conv_dim} W{shape.conv_kernel}"
    if segments is not None:
        text += " seq_idx[" + ",".join(map(str, segments)) + "]"
    return text


def _conv_segments(shape: GdnShape) -> tuple[int, ...] | None:
    """Packed conv cases also get a segment shorter than the conv width (short examples do occur)."""
    if shape.segments is None:
        return None
    short = max(1, shape.conv_kernel - 1)
    first = shape.segments[0]
    return (short, first - short, *shape.segments[1:]) if first > short + 1 else shape.segments


def _check_conv(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    import torch

    segments = _conv_segments(shape)
    label = _conv_label(shape, segments)
    b, t, d, w = shape.batch, shape.seq_len, shape.conv_dim, shape.conv_kernel
    x_raw = torch.randn(b, t, d, generator=gen)
    w_raw = torch.randn(d, w, generator=gen) / math.sqrt(w)
    dy_raw = torch.randn(b, t, d, generator=gen).transpose(1, 2)  # autograd hands the conv channel-last grads
    # The layer calls with mixed_qkv.transpose(1, 2): [B, D, T] with channels contiguous (channel-last).
    kx, kw_ = _leaf(x_raw, device, dtype), _leaf(w_raw, device, dtype)
    rx, rw = _leaf(kx.detach().float(), device), _leaf(kw_.detach().float(), device)
    dy = dy_raw.to(device=device, dtype=dtype)
    seq_idx = None
    bounds = [(0, t)]
    if segments is not None:
        ids = [i for i, n in enumerate(segments) for _ in range(n)]
        seq_idx = torch.tensor([ids], dtype=torch.int32, device=device)
        bounds = segment_bounds(segments)
    try:
        extra = {} if seq_idx is None else {SEQ_IDX: seq_idx}  # causal_conv1d_fn's parameter, the batch's name
        y = fn(kx.transpose(1, 2), kw_, None, activation="silu", **extra)
        kdx, kdw = _grads(y, dy, [kx, kw_])
    except Exception as exc:  # noqa: BLE001
        return [error_case(CONV, label, exc)]
    try:
        xt = rx.transpose(1, 2)
        ry = torch.cat([ref(xt[:, :, s:e], rw, None, activation="silu") for s, e in bounds], dim=-1)
        rdx, rdw = _grads(ry, dy.float(), [rx, rw])
    except Exception as exc:  # noqa: BLE001
        return [error_case(CONV, label, exc, where="reference")]
    return [
        compare(CONV, label, "y", y, ry, tol),
        compare(CONV, label, "dx", kdx, rdx, tol),
        compare(CONV, label, "dw", kdw, rdw, tol),
    ]


def _check_conv_update(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    """Single-token decode step, as the layer calls it: x [B, D, 1], conv_state [B, D, W] updated in place."""
    import torch

    b = shape.batch if shape.segments is None else len(shape.segments)
    d, w = shape.conv_dim, shape.conv_kernel
    label = f"B{b} T1 decode D{d} W{w}"
    x = torch.randn(b, d, 1, generator=gen).to(device=device, dtype=dtype)
    state = torch.randn(b, d, w, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(d, w, generator=gen) / math.sqrt(w)).to(device=device, dtype=dtype)
    kstate, rstate = state.clone(), state.float().clone()
    try:
        with torch.no_grad():
            y = fn(x, kstate, weight, None, "silu")
    except Exception as exc:  # noqa: BLE001
        return [error_case(CONV_UPDATE, label, exc)]
    try:
        with torch.no_grad():
            ry = ref(x.float(), rstate, weight.float(), None, "silu")
    except Exception as exc:  # noqa: BLE001
        return [error_case(CONV_UPDATE, label, exc, where="reference")]
    return [
        compare(CONV_UPDATE, label, "y", y, ry, tol),
        compare(CONV_UPDATE, label, "conv_state", kstate, rstate, tol),
    ]


def conv_shapes(shapes: Sequence[GdnShape]) -> list[GdnShape]:
    """``shapes`` with one per conv geometry: the conv sees channels and width, not the head split."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for s in shapes:
        key = (s.conv_dim, s.conv_kernel, s.batch, s.seq_len, s.segments)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _kda_shapes(shapes: Sequence[GdnShape]) -> list[GdnShape]:
    """KDA layers give q, k and v the same heads (transformers' reference has no grouped value heads): a
    grouped shape is checked with as many key heads as value heads."""
    out: list[GdnShape] = []
    for s in shapes:
        same = dataclasses.replace(s, num_k_heads=s.num_v_heads)
        if same not in out:
            out.append(same)
    return out


def exercise(
    kernel: str,
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shapes: Sequence[GdnShape],
    *,
    key_heads: bool,
    device: str,
    gen: torch.Generator,
    dtype: torch.dtype,
    tol: float,
) -> list[NumericsCase]:
    """Every case of one kernel: GDN and KDA kernels per shape, conv kernels per distinct channel geometry."""
    cases: list[NumericsCase] = []
    if kernel in FLA_KERNELS:
        check = _check_chunk if kernel in (CHUNK, KDA_CHUNK) else _check_recurrent
        for shape in _kda_shapes(shapes) if kernel in KDA_KERNELS else shapes:
            q_heads = shape.num_k_heads if key_heads or kernel in KDA_KERNELS else shape.num_v_heads
            label = shape.label(q_heads=q_heads)
            cases += check(kernel, fn, ref, shape, q_heads, label, device, dtype, gen, tol)
    elif kernel == CONV:
        for shape in conv_shapes(shapes):
            cases += _check_conv(fn, ref, shape, device, dtype, gen, tol)
    else:
        for shape in conv_shapes([s for s in shapes if s.segments is None] or shapes):
            cases += _check_conv_update(fn, ref, shape, device, dtype, gen, tol)
    return cases
