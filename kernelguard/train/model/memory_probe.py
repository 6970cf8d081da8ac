"""What one forward of a packed block saves for the backward, measured on the meta device (no memory, no GPU):
the activation term of kernelguard.train.model.memory's estimate.

The model's own forward runs under ``torch.autograd.graph.saved_tensors_hooks`` with one packed block. The fast
kernels are stood in for by autograd functions that save what fla's ``chunk_gated_delta_rule`` (l2-normalised
q/k, their rstd, v, cumulative g, beta, the chunk-local A), Dao's ``causal_conv1d_fn`` (its input) and a varlen
flash attention (q, k, v, out, lse) save; everything else (projections, norms, gates, casts, MLP) is
transformers' code as it runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import boundary_arguments, is_decode_only, text_config

__all__ = ["DTYPE_BYTES", "PROBE_ATTENTION", "ActivationProbe", "build_probe_model", "measure_activations"]

PROBE_ATTENTION = "kernelguard_memory_probe"
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True)
class ActivationProbe:
    """What one forward of ``tokens`` tokens saves for the backward, and the model's parameter split."""

    tokens: int
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_params: int
    root_params: int  # embeddings, final norm, LM head: gathered for the whole step
    max_layer_params: int
    total_saved: int  # every layer + root, no checkpointing
    max_layer_saved: int  # the largest decoder layer's saved activations
    root_saved: int  # outside the decoder layers (embedding output, final norm, ...)
    compute_bytes: int  # bytes per element of param_dtype
    notes: tuple[str, ...] = ()


def build_probe_model(hf_config: Any) -> Any:
    """The model the probe runs: on the meta device (no memory), with the probe's attention stand-in. Its
    parameter shapes are the run's, so --dry-run sizes the host memory from the same model (built once)."""
    from .parallel import build_meta_model

    _register_probe_attention()
    with _quiet_transformers():  # its "falling back to the torch reference" line is about this host, not the job
        return build_meta_model(hf_config, attn_implementation=PROBE_ATTENTION)


def measure_activations(
    hf_config: Any, *, tokens: int, param_dtype: str = "bf16", model: Any = None,
    progress: Callable[[str], None] | None = None,
) -> ActivationProbe:
    """Run the model's forward on the meta device with one packed block and measure the saved tensors.
    ``model``: one :func:`build_probe_model` made (else it is built here); ``progress`` hears each stage."""
    import torch

    from .parallel import decoder_layers

    if param_dtype not in DTYPE_BYTES:
        raise ConfigError(
            f"param_dtype {param_dtype!r} is not one of {', '.join(DTYPE_BYTES)}.", fix="--param-dtype bf16"
        )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[param_dtype]
    say = progress or (lambda _: None)
    if model is None:
        say("building the model on the meta device (no memory is used)")
        model = build_probe_model(hf_config)
    else:
        _register_probe_attention()
    with _quiet_transformers():
        num_params = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model)
        layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        model.to(dtype)
        experts = _meta_experts(model)
        say(f"measuring activations: one forward of a {tokens:,}-token block through {len(layers)} layers "
            "on the meta device")
        with _kernel_stand_ins(model) as notes:
            per_layer, root = _saved_by_layer(model, layers, tokens)
    text = text_config(hf_config)
    return ActivationProbe(
        tokens=tokens,
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        num_layers=len(layers),
        num_params=num_params,
        root_params=num_params - sum(layer_params),
        max_layer_params=max(layer_params, default=0),
        total_saved=sum(per_layer) + root,
        max_layer_saved=max(per_layer, default=0),
        root_saved=root,
        compute_bytes=DTYPE_BYTES[param_dtype],
        notes=(*experts, *notes),
    )


def _meta_experts(model: Any) -> list[str]:
    """MoE experts set to ``eager`` (a config's ``experts_implementation``) loop over the experts a batch hits,
    which needs real routing data: on the meta device that loop cannot run (``nonzero``). The probe measures
    them as ``grouped_mm`` (transformers' default: the same expert matmuls over the tokens each expert gets)."""
    # transformers' experts decorator gives the class _apply_gate; a dense model says "eager" but has none
    if not any(hasattr(type(m), "_apply_gate") for m in model.modules()):
        return []
    try:
        if "eager" not in dict(model.get_experts_implementation()).values():
            return []
        model.set_experts_implementation("grouped_mm")
    except Exception:  # noqa: BLE001 - a transformers without the switch: measured as configured
        return []
    return [("experts_implementation eager: the experts' activations are measured as grouped_mm (eager's "
             "per-expert loop needs real routing, which the meta device has not)")]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _saved_by_layer(model: Any, layers: Any, tokens: int) -> tuple[list[int], int]:
    """Bytes autograd saves per decoder layer (and outside them) for one packed block, deduplicated by
    storage; parameters are not activations and are left out."""
    import torch

    param_storages = {_storage_key(p) for p in model.parameters()}
    seen: set[Any] = set()
    per_layer = [0] * len(layers)
    root = 0
    current = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal root
        key = _storage_key(t)
        if key not in seen and key not in param_storages:
            seen.add(key)
            size = t.untyped_storage().nbytes()
            if current[0] >= 0:
                per_layer[current[0]] += size
            else:
                root += size
        return t

    def enter(i: int) -> Callable[..., None]:
        return lambda *_: current.__setitem__(0, i)

    handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda *_: current.__setitem__(0, -1)) for layer in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**_packed_inputs(tokens), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return per_layer, root


def _storage_key(t: Any) -> Any:
    # Meta tensors have no data pointer; the storage object's identity tells views from new tensors.
    return t.untyped_storage()._cdata


def _packed_inputs(tokens: int) -> dict[str, Any]:
    """One block of 3 examples, laid out as kernelguard.train.step.packing builds it (meta tensors)."""
    import torch

    cuts = [0, tokens // 3, 2 * tokens // 3, tokens]
    meta = torch.device("meta")
    return {
        "input_ids": torch.zeros(1, tokens, dtype=torch.long, device=meta),
        "position_ids": torch.zeros(1, tokens, dtype=torch.long, device=meta),
        **boundary_arguments(torch.tensor(cuts, dtype=torch.int32, device=meta),
                             torch.zeros(1, tokens, dtype=torch.int32, device=meta), tokens // 3 + 1),
    }


# ------------------------------------------------------------------------------------- kernel stand-ins ---
def _stand_in(save: Callable[..., tuple[Any, list[Any]]]) -> Callable[..., Any]:
    """An autograd function whose forward returns ``save(...)[0]`` and saves ``save(...)[1]``."""
    import torch

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:  # type: ignore[override]
            out, saved = save(*args)
            ctx.save_for_backward(*saved)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
            raise RuntimeError("memory probe stand-in: no backward")

    return StandIn.apply


def _chunk_gdn(q: Any, k: Any, v: Any, g: Any, beta: Any, **_: Any) -> tuple[Any, None]:
    """fla 0.6.0 ``ChunkGatedDeltaRuleFunction``: saves l2-normalised q and k (new tensors), their fp32 rstd,
    v, the chunk-cumulative g (fp32, new), beta and the chunk-local ``A`` [B, T, HV, 64] in q's dtype."""
    import torch

    def save(q: Any, k: Any, v: Any, g: Any, beta: Any) -> tuple[Any, list[Any]]:
        b, t, hv, vd = v.shape
        out = v.new_empty(b, t, hv, vd)
        rstd = [torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for x in (q, k)]
        a = q.new_empty(b, t, hv, 64)
        return out, [
            torch.empty_like(q),
            torch.empty_like(k),
            *rstd,
            v,
            torch.empty_like(g, dtype=torch.float32),
            beta,
            a,
        ]

    return _stand_in(save)(q, k, v, g, beta), None


def _conv1d(x: Any, weight: Any, bias: Any = None, **_: Any) -> Any:
    """Dao's ``causal_conv1d_fn``: saves its input (the weight is a parameter); returns a new [B, D, T]."""
    return _stand_in(lambda x: (x.new_empty(x.shape), [x]))(x)


def _attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **_: Any
) -> tuple[Any, None]:
    """A varlen flash attention: saves q, k, v, the output and fp32 log-sum-exp; returns [B, T, H, D]."""
    import torch

    def save(q: Any, k: Any, v: Any) -> tuple[Any, list[Any]]:
        out = q.new_empty(q.shape)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        return out, [q, k, v, out, lse]

    return _stand_in(save)(query, key, value).transpose(1, 2), None


_STAND_INS: dict[str, Callable[..., Any]] = {
    "chunk_gated_delta_rule": _chunk_gdn,
    "causal_conv1d_fn": _conv1d,
}


def _register_probe_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_ATTENTION, _attention)


@contextmanager
def _kernel_stand_ins(model: Any) -> Iterator[list[str]]:
    """Point the modeling module's kernel call sites (from the catalog) at the stand-ins, then restore them."""
    from kernelguard.resolution import call_sites

    module = sys.modules[type(model).__module__]
    notes: list[str] = []
    saved: dict[str, Any] = {}
    for req in call_sites(module):
        if req.kernel in _STAND_INS and hasattr(module, req.call_site):
            saved.setdefault(req.call_site, getattr(module, req.call_site))
            setattr(module, req.call_site, _STAND_INS[req.kernel])
        elif not is_decode_only(req.kernel):
            notes.append(f"{req.kernel}: no stand-in; measured with transformers' torch reference (high)")
    try:
        yield notes
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
