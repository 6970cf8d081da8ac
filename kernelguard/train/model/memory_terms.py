"""The terms of :mod:`kernelguard.train.model.memory`'s plan that are not parameters, optimizer state or saved
activations: the loss's buffers and FSDP2's fp32 gradient reduction, and the names of the moments the peak can
fall in (see that module's docstring for what each term holds and when)."""

from __future__ import annotations

import math

from .memory_probe import ActivationProbe

__all__ = ["BACKWARD", "LOSS_FORWARD", "ROOT_REDUCE", "loss_bytes", "reduce_bytes", "root_reduction_bytes"]

LOSS_FORWARD = "loss's forward (saved activations + its chunk buffers)"
BACKWARD = "backward (gradients + one recomputed layer + its gradient reduction)"
ROOT_REDUCE = "root's gradient reduction (embeddings + LM head, in fp32) at the end of the backward"


def root_reduction_bytes(probe: ActivationProbe, grads: int, world_size: int, grad_accum: int) -> int:
    """Beyond parameters and optimizer state when the root reduces, last: every other group's gradient shards
    (with --grad-accum > 1 its own too), the gathered root, its reduction; no saved activations, every layer
    resharded."""
    root, cb = probe.root_params, probe.compute_bytes
    own_shard = 0 if grad_accum > 1 else 4 * math.ceil(root / world_size)
    return cb * root + grads - own_shard + reduce_bytes(root, cb, world_size)


def reduce_bytes(group_params: int, compute_bytes: int, world_size: int) -> int:
    """Transient bytes of FSDP2 reducing one group's gradients in fp32: its unsharded ``param_dtype``
    gradients beside the fp32 reduce-scatter input of the whole group, then that input beside its fp32
    output shard once the unsharded gradients are freed."""
    shard = math.ceil(group_params / world_size)
    return max(compute_bytes * group_params, 4 * shard) + 4 * group_params


def loss_bytes(probe: ActivationProbe, loss: str, *, compiled: bool = False) -> tuple[int, int]:
    """(kept for the backward, transient at the loss's forward) bytes of the loss."""
    from ..step.loss import DEFAULT_CHUNK_TOKENS

    t, h, v, cb = probe.tokens, probe.hidden_size, probe.vocab_size, probe.compute_bytes
    # log_softmax(x, dtype=float32) of a bf16/fp16 x first makes an fp32 copy of x (only CUDA fp16 skips it)
    upcast = 4 if cb != 4 else 0
    if loss == "chunked":
        chunk = min(DEFAULT_CHUNK_TOKENS, t)
        # kept: d(hidden) and d(LM head); per chunk: its logits, their fp32 copy and the fp32 log-softmax,
        # or, compiled, its logits and their gradient (the compiled pass keeps fp32 inside its kernels)
        per_chunk = chunk * v * (2 * cb if compiled else cb + upcast + 4)
        return cb * (t * h + v * h), per_chunk
    # the fp32 log-softmax is kept; the logits and their fp32 copy live through the loss's forward
    return 4 * t * v, t * v * (cb + 4)
