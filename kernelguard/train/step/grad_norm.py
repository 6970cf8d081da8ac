"""The gradient norm of one optimizer step, and clipping to ``--max-grad-norm``, with few kernels.

``torch._foreach_norm`` and ``torch._foreach_mul_`` launch one kernel per 320 chunks of 65,536 elements
whatever the tensors (torch's multi_tensor_apply): ~55 launches each for a 1.2 B-parameter model, every step.
Two things make that unnecessary here:

- FSDP2 hands each rank its sharded gradients as views of one reduce-scatter output per parameter group
  (``torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce``). Gradients that tile one buffer
  exactly, end to end, are normed as that buffer in one reduction; anything else (padding between shards,
  a gradient accumulated into its own tensor, parameters kept whole) is normed tensor by tensor, as before.
- The fused AdamW divides each gradient by ``grad_scale`` inside its own kernel (the mechanism
  ``torch.amp.GradScaler`` uses to unscale), so clipping is one scalar on the device instead of a pass over
  every gradient: :func:`clip_divisor`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["clip_divisor", "clip_gradients", "clip_gradients_", "gradient_norm", "tiled_buffers"]

EPS = 1e-6  # torch.nn.utils.clip_grads_with_norm_'s: the clip coefficient is max_norm / (norm + EPS)


def tiled_buffers(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(one flat view per run of gradients that tile a buffer end to end with no gap or overlap, the gradients
    that do not). Only contiguous tensors of one dtype and device are grouped; a run of one stays as it is."""
    groups: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
    rest: list[torch.Tensor] = []
    for g in grads:
        if g.is_contiguous() and g.numel():
            groups.setdefault((g.untyped_storage().data_ptr(), g.dtype, g.device), []).append(g)
        else:
            rest.append(g)
    flats: list[torch.Tensor] = []
    for group in groups.values():
        group.sort(key=lambda t: t.storage_offset())
        start = end = group[0].storage_offset()
        for g in group:
            if g.storage_offset() != end:
                break
            end += g.numel()
        else:
            if len(group) > 1:
                flats.append(torch.as_strided(group[0], (end - start,), (1,), start))
                continue
        rest.extend(group)
    return flats, rest


def _square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flats, rest = tiled_buffers(grads)
    norms = [torch.linalg.vector_norm(f, 2.0, dtype=torch.float32) for f in flats]
    if rest:
        norms += [n.float() for n in torch._foreach_norm(rest, 2.0)]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(norms).square().sum()


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The 2-norm of all gradients over all ranks (sharded gradients: this rank's shards, summed over the
    shards' process group; parameters kept whole on every rank: counted once), as an fp32 tensor on the
    gradients' device: nothing is read on the host."""
    from torch.distributed.tensor import DTensor

    sharded, whole, group = [], [], None
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded.append(p.grad.to_local())
            group = group or p.grad.device_mesh.get_group()
        else:
            whole.append(p.grad)
    if not sharded and not whole:
        return torch.zeros(())
    device = (sharded or whole)[0].device
    total = _square_sum(sharded, device)
    if group is not None and dist.is_initialized():
        dist.all_reduce(total, group=group)
    return (total + _square_sum(whole, device)).sqrt()


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the fused AdamW divides every gradient by (``optimizer.grad_scale``) to clip them to ``max_norm``:
    ``(norm + EPS) / max_norm`` when that is above 1, else 1 - the reciprocal of
    ``clip_grads_with_norm_``'s coefficient."""
    return ((norm.float() + EPS) / max_norm).clamp(min=1.0)


def clip_gradients_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip every gradient in place to a total norm of ``max_norm`` (when > 0) and return the norm before
    clipping (:func:`gradient_norm`), on the device. For an optimizer that cannot take :func:`clip_divisor`."""
    from torch.distributed.tensor import DTensor

    total = gradient_norm(model)
    if max_norm > 0:
        params = [p for p in model.parameters() if p.grad is not None]
        for sharded in (True, False):  # foreach kernels take DTensors or plain tensors, not a mix
            kind = [p for p in params if isinstance(p.grad, DTensor) == sharded]
            if kind:  # clip_grads_with_norm_ takes the parameters and scales their .grad
                torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total, foreach=True)
    return total


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """:func:`clip_gradients_`, the norm read on the host."""
    return float(clip_gradients_(model, max_norm))
