"""`kernelguard train --fused-norms`: Liger-Kernel's fused RMSNorm and SiLU-gate kernels for a model's own norms
and MLPs, chosen by what each module computes, not by a list of classes.

A module is an RMSNorm candidate when its only parameter is a ``weight`` over the last dimension and it has an
``eps`` (or ``variance_epsilon``); an MLP candidate when it has ``gate_proj``, ``up_proj`` and ``down_proj``
linears. Each candidate's class is tried once, on the CPU, on a small copy with random weights, against the
formulas Liger implements: ``rms(x) * w`` (Llama, Qwen3) or ``rms(x) * (1 + w)`` (Qwen3.5, Qwen3-Next), cast to
the input dtype at the end (``gemma`` casting: everything in fp32) or before the weight (``llama``), in bf16 and
fp32; ``down(silu(gate(x)) * up(x))`` for an MLP. Only a bit-exact match is replaced, and only that instance's
``forward``: a gated norm (``Qwen3_5RMSNormGated``), a norm with a bias, or anything else is left as it is and
named in :meth:`FusedNorms.describe`.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernelguard.errors import ConfigError

__all__ = ["FusedNorms", "fuse_norms", "liger_missing", "mlp_matches", "norm_kind"]

LIGER_FIX = "pip install liger-kernel (pure Python; its Triton kernels need a CUDA GPU), or drop --fused-norms"


def liger_missing() -> str | None:
    """Why --fused-norms cannot run in this environment, or None."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "--fused-norms uses Liger-Kernel's fused kernels, and liger_kernel is not installed."
    return None


@dataclass(slots=True)
class FusedNorms:
    """What :func:`fuse_norms` replaced, by class, and what it left (with why)."""

    norms: dict[str, int] = field(default_factory=dict)  # class -> instances
    mlps: dict[str, int] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)  # class -> why not

    def describe(self) -> str:
        def counts(d: dict[str, int]) -> str:
            return ", ".join(f"{n} x {c}" for c, n in sorted(d.items())) or "none"

        text = f"fused norms (Liger): RMSNorm {counts(self.norms)}; SiLU-gate MLP {counts(self.mlps)}"
        if self.left:
            text += "; left as they are: " + "; ".join(f"{c} ({why})" for c, why in sorted(self.left.items()))
        return text


def _eps(module: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_norm_candidate(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (list(params) == ["weight"] and params["weight"].dim() == 1 and _eps(module) is not None
            and not list(module.children()))


def _is_mlp_candidate(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _cpu_copy(module: nn.Module, dtype: torch.dtype, gen: torch.Generator) -> nn.Module:
    twin = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(dtype))
    return twin


def norm_kind(module: nn.Module) -> tuple[float, str] | None:
    """(offset, casting mode) of Liger's RMSNorm that reproduces ``module`` bit for bit in bf16 and fp32, or
    None."""
    if not _is_norm_candidate(module):
        return None
    eps = _eps(module)
    gen = torch.Generator().manual_seed(0)
    width = module.weight.shape[0]
    for offset in (0.0, 1.0):
        for casting in ("gemma", "llama"):
            ok = True
            for dtype in (torch.float32, torch.bfloat16):
                twin = _cpu_copy(module, dtype, gen)
                x = torch.randn(3, width, generator=gen).to(dtype)
                try:
                    with torch.no_grad():
                        ok = ok and torch.equal(twin(x), _rms_reference(x, twin.weight, eps, offset, casting))
                except (TypeError, RuntimeError):  # another signature (a gated norm takes a gate), other shapes
                    return None
            if ok:
                return offset, casting
    return None


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (normed * (offset + w.float())).to(x.dtype)
    return (offset + w) * normed.to(x.dtype)


def mlp_matches(module: nn.Module) -> bool:
    """True when ``module`` computes ``down(silu(gate(x)) * up(x))`` (fp32, bit for bit)."""
    if not _is_mlp_candidate(module):
        return False
    gen = torch.Generator().manual_seed(0)
    twin = _cpu_copy(module, torch.float32, gen)
    x = torch.randn(3, module.gate_proj.in_features, generator=gen)
    try:
        with torch.no_grad():
            want = twin.down_proj(nn.functional.silu(twin.gate_proj(x)) * twin.up_proj(x))
            return torch.equal(twin(x), want)
    except (TypeError, RuntimeError):
        return False


def fuse_norms(model: nn.Module) -> FusedNorms:
    """Replace the forward of every matching norm and MLP instance of ``model`` (meta or real; before FSDP2)."""
    if (why := liger_missing()) is not None:
        raise ConfigError(why, fix=LIGER_FIX)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    done = FusedNorms()
    kinds: dict[type, Any] = {}
    for module in model.modules():
        cls = type(module)
        if _is_norm_candidate(module):
            if cls not in kinds:
                kinds[cls] = norm_kind(module)
            kind = kinds[cls]
            if kind is None:
                done.left[cls.__name__] = "not an RMSNorm Liger computes bit for bit"
                continue
            offset, casting = kind
            eps = _eps(module)

            def norm_forward(self: nn.Module, x: torch.Tensor, _o: float = offset, _c: str = casting,
                             _e: float = eps) -> torch.Tensor:
                return LigerRMSNormFunction.apply(x, self.weight, _e, _o, _c, False)

            module.forward = types.MethodType(norm_forward, module)
            done.norms[cls.__name__] = done.norms.get(cls.__name__, 0) + 1
        elif _is_mlp_candidate(module):
            if cls not in kinds:
                kinds[cls] = mlp_matches(module)
            if not kinds[cls]:
                done.left[cls.__name__] = "not down(silu(gate(x)) * up(x))"
                continue

            def mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

            module.forward = types.MethodType(mlp_forward, module)
            done.mlps[cls.__name__] = done.mlps.get(cls.__name__, 0) + 1
    return done
