"""This process's place among the ranks, and the few collectives every stage needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from kernelguard.errors import KernelGuardError

__all__: list[str] = [
    "DistInfo",
    "on_main",
    "sync_replicated_grads",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def sync_replicated_grads(model: nn.Module, world_size: int) -> None:
    """Average over ranks the gradients of the parameters FSDP2 does not shard (:func:`apply_fsdp`'s fp32
    ones), as FSDP2 averages the others; one all-reduce of their concatenation (a few KB)."""
    from torch.distributed.tensor import DTensor

    if world_size <= 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p.grad, DTensor)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # SUM then divide: gloo has no AVG
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def on_main(info: DistInfo, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result, or raise its kernelguard error on every rank
    (a rank that raised alone would leave the others waiting in the next collective)."""
    box: list[Any] = [None]
    if info.is_main:
        try:
            box[0] = ("ok", fn())
        except KernelGuardError as e:
            box[0] = ("error", e)
        except Exception as e:  # unexpected: still release the other ranks, then re-raise it here
            box[0] = ("error", RuntimeError(f"rank 0 failed: {e!r}"))
            if info.world_size > 1:
                dist.broadcast_object_list(box, src=0)
            raise
    if info.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
