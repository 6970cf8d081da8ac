"""Regional ``torch.compile`` for `kernelguard train --compile`: each decoder layer compiled in place before
FSDP2's ``fully_shard`` (torchtitan's order), with the fast kernels opaque.

Unlike torchtitan, before activation checkpointing too: the opaque kernels are graph breaks, and dynamo cannot
trace a checkpoint region with a graph break in it, so a compiled checkpoint wrapper runs entirely eager
(measured on CPU: no graph at all). ``checkpoint(compiled layer)`` recomputes the compiled forward instead.

Opaque (``torch.compiler.disable``): every hub-wrapped kernel a layer calls through a module-level name of its
modeling file (fla's ``chunk_gated_delta_rule``, causal-conv1d's ``causal_conv1d_fn``, ... as found by
:mod:`kernelguard.resolution.discovery`, so no model list) and the registered attention function. They are Triton / CUDA
extension calls with their own autotuning and varlen arguments: dynamo gains nothing inside them, and tracing
their Python (or kernelguard's tripwire, which reads the caller's frames) breaks or slows the compile. What is
compiled is everything around them: projections, norms, gates, the MLP, their fusion. Measured on one H200
(bench/RESULTS.md, 2026-12-01): +12.6% tokens/s over the product without activation checkpointing.

``layer.compile()`` compiles in place (no ``_orig_mod.`` wrapper), so parameter and checkpoint names do not
change. The opaque call sites are module globals, changed for the process; :meth:`RegionalCompile.restore` puts
back each one that still holds the wrapper installed here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["OPAQUE_ATTR", "RegionalCompile", "compile_layers"]

OPAQUE_ATTR = "__kernelguard_opaque__"  # marks a wrapper installed here (what it wraps is its __wrapped__)


@dataclass(slots=True)
class RegionalCompile:
    """What :func:`compile_layers` did: how many layers, which call sites it made opaque, and how to undo it."""

    layers: int
    opaque: list[str] = field(default_factory=list)  # "module.name", and "attention:NAME"
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        sites = ", ".join(site.rsplit(".", 1)[-1] for site in self.opaque) or "none"
        return f"torch.compile: {self.layers} decoder layers compiled in place; opaque: {sites}"

    def restore(self) -> None:
        """Put back the original call sites (where they still hold our wrapper); compiled layers stay."""
        while self._undo:
            self._undo.pop()()


def compile_layers(model: Any, **compile_kwargs: Any) -> RegionalCompile:
    """Make the model's fast kernels and attention opaque, then ``layer.compile(**compile_kwargs)`` each
    decoder layer in place (call before activation checkpointing and ``fully_shard``)."""
    from .parallel import decoder_layers

    layers = decoder_layers(model)
    done = RegionalCompile(layers=len(layers))
    for module in _modeling_modules(model):
        for name in _kernel_call_sites(module):
            _make_opaque(done, module, name, label=f"{module.__name__}.{name}")
    _make_attention_opaque(done, model)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return done


def _modeling_modules(model: Any) -> list[ModuleType]:
    """The modules that define the model's classes (a multimodal model may span several)."""
    names = dict.fromkeys(type(m).__module__ for m in model.modules())
    return [sys.modules[n] for n in names if n in sys.modules and n.startswith("transformers.models.")]


def _kernel_call_sites(module: ModuleType) -> list[str]:
    """The module-level names through which the module's layers call hub-wrapped kernels (discovery reads
    the ``use_kernel_func_from_hub_with_fallback`` decorators of its source)."""
    from kernelguard.resolution import call_sites

    return [req.call_site for req in call_sites(module) if callable(vars(module).get(req.call_site))]


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind ``torch.compiler.disable``, in a plain function (``fn`` may be a kernels ``Func`` module
    or a tripwire), marked as ours."""
    import functools

    import torch

    def kernelguard_opaque(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    functools.update_wrapper(kernelguard_opaque, fn, updated=())
    wrapper = torch.compiler.disable(kernelguard_opaque)
    setattr(wrapper, OPAQUE_ATTR, True)
    return wrapper


def _make_opaque(done: RegionalCompile, owner: ModuleType, name: str, *, label: str) -> None:
    original = vars(owner)[name]
    if getattr(original, OPAQUE_ATTR, False):  # already opaque (a second compile_layers): nothing to do
        return
    wrapper = _opaque(original)
    setattr(owner, name, wrapper)
    done.opaque.append(label)

    def undo() -> None:
        if vars(owner).get(name) is wrapper:
            setattr(owner, name, original)

    done._undo.append(undo)


def _make_attention_opaque(done: RegionalCompile, model: Any) -> None:
    """The attention function registered under the model's ``_attn_implementation`` (``eager`` is not
    registered: it is plain torch and is compiled with the layer)."""
    from transformers import AttentionInterface

    name = getattr(model.config, "_attn_implementation", None)
    mapping: dict[str, Any] = AttentionInterface._global_mapping
    original: Any = mapping.get(name) if isinstance(name, str) else None
    if original is None or getattr(original, OPAQUE_ATTR, False):
        return
    assert isinstance(name, str)
    wrapper = _opaque(original)
    AttentionInterface.register(name, wrapper)
    done.opaque.append(f"attention:{name}")

    def undo() -> None:
        if mapping.get(name) is wrapper:
            AttentionInterface.register(name, original)

    done._undo.append(undo)
