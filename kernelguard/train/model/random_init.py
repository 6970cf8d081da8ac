"""A seeded random init made on every rank's own device, shard by shard: `kernelguard train --init random`.

The rank-0 path (:func:`kernelguard.train.model.parallel.materialize`) builds the whole model on rank 0's host
(a CPU ``normal_`` over every parameter: about a minute for four of Qwen3.5-27B's layers) and broadcasts it.
Here each rank fills only its own shards, on its GPU: module by module, the module's parameters are made whole
on the device for a moment, initialised by the model's own ``_init_weights`` (transformers' scheme, whatever
the family: normal linears and embeddings, norms, the GDN decay), and each rank keeps its slice.

The random numbers depend on the seed and the module's name only, never on the world size or the rank: each
module is initialised from its own seed (``crc32(seed:name)``, names as the unwrapped model has them), and every
rank generates the whole module before slicing. So 1, 2 or 64 ranks train from the same weights (on one device
type: CPU and CUDA generators differ). The global RNG is left as it was.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

__all__ = ["init_sharded", "supports_sharded_init"]

# Wrappers that rename a module's path without changing the model: activation checkpointing, torch.compile.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


def supports_sharded_init(model: nn.Module) -> bool:
    """Whether the model can be initialised here: it has transformers' ``_init_weights`` and no persistent
    buffers (those come only from a full model: the rank-0 path keeps them)."""
    persistent = [
        name for module in model.modules() for name, b in module._buffers.items()
        if b is not None and name not in module._non_persistent_buffers_set
    ]  # fmt: skip
    return callable(getattr(model, "_init_weights", None)) and not persistent


def init_sharded(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Fill every parameter of ``model`` (after ``fully_shard``, parameters on the meta device or
    uninitialised) with transformers' init for its module, the same numbers at any world size."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.no_grad():
        for name, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            whole = {key: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                     for key, p in own.items()}  # fmt: skip
            for key, p in whole.items():
                module._parameters[key] = p
            try:
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(_module_seed(seed, name))
                    model._init_weights(module)  # type: ignore[operator]
            finally:
                for key, p in own.items():
                    module._parameters[key] = p
            for key, p in own.items():
                full = whole[key].data
                if isinstance(p, DTensor):
                    mine = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(mine.to_local())
                else:
                    p.data.copy_(full)


def _module_seed(seed: int, name: str) -> int:
    canonical = ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)
    return zlib.crc32(f"{seed}:{canonical}".encode())

