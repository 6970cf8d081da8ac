"""The non-persistent buffers of a model whose storage ``to_empty`` left uninitialised, recomputed.

Rotary ``inv_freq``, Falcon-H1's ``mup_vector`` and the like are in no checkpoint file and no state dict: after
the meta-device build and ``to_empty`` they hold whatever memory they got. Each is recomputed by building its
owner again from its own config, with every parameter kept on the meta device (no weight is allocated or
initialised, so rebuilding even a whole model costs only its Python construction). The owner alone is tried
first; where the owner's class does not make the buffer (Falcon-H1's model registers each mixer's
``mup_vector``), its nearest ancestor that does. A buffer nothing rebuilds raises: training on uninitialised
memory is never an option.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kernelguard.errors import CheckpointError

__all__ = ["restore_buffers"]

# Wrappers that rename a module's path without changing the model: activation checkpointing, torch.compile.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def restore_buffers(model: nn.Module, config: Any) -> None:
    """Overwrite every non-persistent buffer of ``model`` with the value a fresh build of its owner holds.
    ``config`` is the model's own (used for the root when it carries none)."""
    fresh: dict[str, nn.Module | Exception] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            for buffer in sorted(getattr(module, "_non_persistent_buffers_set", ())):
                target = getattr(module, buffer, None)
                if isinstance(target, torch.Tensor):
                    value = _fresh_value(model, config, name, buffer, fresh)
                    target.copy_(value.to(target.device, target.dtype))


def _fresh_value(model: nn.Module, config: Any, name: str, buffer: str,
                 fresh: dict[str, nn.Module | Exception]) -> torch.Tensor:
    """``buffer`` of the module at ``name``, from the nearest rebuilt module (itself, then each ancestor)."""
    parts = name.split(".") if name else []
    first_error: Exception | None = None
    for depth in range(len(parts), -1, -1):
        holder = ".".join(parts[:depth])
        if holder not in fresh:
            fresh[holder] = _rebuilt(model.get_submodule(holder), config if not holder else None)
        built = fresh[holder]
        if isinstance(built, Exception):
            first_error = first_error or built
            continue
        below = ".".join(p for p in parts[depth:] if p not in _WRAPPER_PARTS)
        try:
            value = getattr(built.get_submodule(below), buffer, None)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor):
            return value
    owner = type(model.get_submodule(name)).__name__
    raise CheckpointError(
        f"cannot recompute the non-persistent buffer {name + '.' if name else ''}{buffer} ({owner}): neither its "
        f"module nor any module above it rebuilds it from its config"
        + (f" (first failure: {first_error!r})" if first_error else "") + ".",
        fix="report the model class: it keeps a buffer that is in no checkpoint file and that kernelguard train "
            "cannot recompute",
    ) from first_error


def _rebuilt(module: nn.Module, root_config: Any) -> nn.Module | Exception:
    """A fresh ``module`` of the same class from its own config, parameters on meta; the error when its
    constructor asks for what the module does not hold. Wrappers (activation checkpointing, compile) are
    never rebuilt: they own no buffer."""
    cls = _plain_class(module)
    if cls.__name__ in ("CheckpointWrapper", "OptimizedModule"):
        return TypeError(f"{cls.__name__} is a wrapper")
    own_config = getattr(module, "config", None) or root_config
    try:
        kwargs = _constructor_arguments(cls, module, own_config)
        with torch.device("cpu"), _parameters_on_meta():
            return cls(**kwargs)
    except Exception as e:
        return e


def _constructor_arguments(cls: type, module: nn.Module, config: Any) -> dict[str, Any]:
    """``config`` and each other required argument from the module's attribute of that name (transformers'
    layers keep their ``layer_idx``)."""
    kwargs: dict[str, Any] = {}
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "config":
            kwargs[name] = config
        elif param.default is param.empty:
            if not hasattr(module, name):
                raise TypeError(f"{cls.__name__}() needs `{name}`, which the module does not keep")
            kwargs[name] = getattr(module, name)
    return kwargs


def _plain_class(module: nn.Module) -> type:
    """The model's own class under FSDP2's per-instance subclass (``FSDPQwen3_5ForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device as it is registered (its uninitialised
    allocation is dropped at once; the init that follows runs on meta); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
