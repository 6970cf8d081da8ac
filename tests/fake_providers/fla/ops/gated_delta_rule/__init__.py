"""``fla.ops.gated_delta_rule`` stand-in: fla 0.6.0 signatures over transformers' torch references.

Varlen semantics follow fla: with ``cu_seqlens`` the batch must be 1, every segment starts from its own
``initial_state[i]`` and the final state has shape ``[N, HV, K, V]`` (N = number of segments).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


# Resolved once per name: torch.compile cannot trace the closure reading below, so a model is compiled only
# after one eager forward has filled this.
_REFERENCES: dict[tuple[str, str], Callable[..., Any]] = {}
_QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"


def _reference(name: str, module: str = _QWEN3_5) -> Callable[..., Any]:
    found = _REFERENCES.get((module, name))
    if found is None:
        found = _REFERENCES[(module, name)] = _resolve_reference(name, module)
    return found


def _resolve_reference(name: str, module: str) -> Callable[..., Any]:
    # Imported at call time: transformers imports *this* module while decorating those very functions.
    import importlib

    modeling = importlib.import_module(module)

    # The undecorated torch function, never transformers' (or kernelguard's) wrapper. With an in-window
    # `kernels` (transformers 5.17 + kernels 0.16) the module attribute is a kernels Func module that
    # dispatches back to *this* fake: read the torch function out of the decorator's closure instead.
    from kernelguard.resolution.transformers_compat import unpack_closure

    obj = getattr(modeling, name)
    for candidate in (obj, inspect.unwrap(obj)):  # also behind a wrapper of our own (compile's opaque)
        closure = unpack_closure(candidate)
        if closure is not None:
            return closure.torch_function
    return inspect.unwrap(obj)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor | None,
    v: torch.Tensor,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    if v.shape[2] != q.shape[2]:
        # Grouped value attention (HV > H), as fla does it; older torch references (5.17) lack it.
        q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    if beta is None:
        beta = torch.ones(v.shape[:-1], dtype=v.dtype, device=v.device)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    if allow_neg_eigval:
        beta = beta * 2
    head_dim = q.shape[-1]
    if scale is not None and scale != head_dim**-0.5:
        # The reference always scales q by head_dim ** -0.5 after the optional l2norm; fold the rest in here.
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
            use_qk_l2norm_in_kernel = False
        q = q * (scale * head_dim**0.5)
    return q, k, beta, use_qk_l2norm_in_kernel


def _varlen(
    ref: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    common = {"output_final_state": output_final_state, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
    if cu_seqlens is None:
        out, state = ref(q, k, v, g, beta, initial_state=initial_state, **common)
        states = state
    else:
        if q.shape[0] != 1:
            raise ValueError(
                f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                "Please flatten variable-length inputs before processing."
            )
        bounds = [int(b) for b in cu_seqlens.tolist()]
        n_seg = len(bounds) - 1
        hv, kd, vd = v.shape[2], k.shape[-1], v.shape[-1]
        if initial_state is not None and initial_state.shape[0] != n_seg:
            raise ValueError(
                f"The number of initial states is expected to be equal to the number of input sequences, "
                f"i.e., {n_seg} rather than {initial_state.shape[0]}."
            )
        outs, finals = [], []
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            init = None if initial_state is None else initial_state[i : i + 1]
            if end == start:
                outs.append(v.new_zeros((1, 0, hv, vd), dtype=out_dtype))
                zero = torch.zeros((1, hv, kd, vd), dtype=torch.float32, device=v.device)
                finals.append(zero if init is None else init.float())
                continue
            seg = slice(start, end)
            o, s = ref(
                q[:, seg], k[:, seg], v[:, seg], g[:, seg], beta[:, seg], initial_state=init, **common
            )
            outs.append(o)
            finals.append(s)
        out = torch.cat(outs, dim=1)
        states = torch.cat(finals, dim=0) if output_final_state else None
    if states is not None and state_v_first:
        states = states.transpose(-1, -2)
    return out.to(out_dtype), states


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if cp_context is not None or kwargs.get("use_gate_in_kernel"):
        raise NotImplementedError("fake fla: cp_context / use_gate_in_kernel are not modelled")
    out_dtype = v.dtype
    q, k, beta, l2 = _prepare(
        q, k, beta, v, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
    )
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        cu_seqlens = cu_seqlens_cpu
    return _varlen(
        _reference("torch_chunk_gated_delta_rule"), q, k, v, g, beta,
        initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, out_dtype=out_dtype,
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if gk is not None or gv is not None or use_gate_in_kernel:
        raise NotImplementedError("fake fla: gk / gv / use_gate_in_kernel are not modelled")
    if g is None:
        g = torch.zeros(v.shape[:-1], dtype=torch.float32, device=v.device)
    out_dtype = v.dtype
    q, k, beta, l2 = _prepare(
        q, k, beta, v, scale, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval
    )
    return _varlen(
        _reference("torch_recurrent_gated_delta_rule"), q, k, v, g, beta,
        initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, out_dtype=out_dtype,
    )
