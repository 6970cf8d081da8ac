"""Causal-LM loss without materialising the full-vocabulary logits.

The stock path computes ``logits = lm_head(hidden)`` for every token (8,192 x 151,936 in bf16 is 2.5 GB),
upcasts them to fp32 (5 GB) and runs log-softmax and its backward over that tensor: several passes of HBM
traffic and the step's largest allocation, for a loss that needs one number per token.

:func:`linear_cross_entropy` walks the tokens in chunks. For each chunk it computes the logits, their
log-sum-exp in fp32, the loss, and - in the same pass - the gradient of the summed loss with respect to the
chunk's logits (``softmax - onehot``), which it immediately turns into the chunk's hidden-state gradient and
adds into the weight gradient. Nothing of size tokens x vocab outlives a chunk, and no matmul is recomputed
(unlike checkpointing the head), so the FLOPs are the stock path's. The backward only scales the stored
gradients by the incoming one.

The idea is the one of Liger-Kernel's fused linear cross-entropy, written here in plain torch ops.

With ``compiled_chunks`` (what `kernelguard train` passes when it compiles the model) the per-chunk work between
the two matmuls - log-sum-exp, the label's logit, ``softmax - onehot`` with ignored rows zeroed, the cast back -
is one ``torch.compile``d function: a reduction and a pointwise pass over the bf16 logits instead of an fp32
buffer written, exponentiated in place and cast (five passes over ``chunk x vocab``), and no ``[chunk, hidden]``
masking afterwards. The eager path stays the reference the tests compare against.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernelguard.errors import ConfigError
from kernelguard.resolution import IGNORE_INDEX

DEFAULT_CHUNK_TOKENS = 4096

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "chunk_loss_and_grad",
    "linear_cross_entropy",
    "return_hidden_states_from_head",
]


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 log-probabilities of one chunk (one fused log-softmax over the matmul's logits), the per-token loss
    (0 where ignored), the valid mask and the labels with ignored ones replaced by 0 (safe to index with)."""
    log_probs = torch.log_softmax(hidden @ weight.t(), dim=-1, dtype=torch.float32)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    per_token = -log_probs.gather(1, safe[:, None]).squeeze(1) * valid
    return log_probs, per_token, valid, safe


def chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed fp32 loss of one chunk's logits and d(summed loss)/d(logits) in the logits' dtype, ignored rows
    zero. Written for ``torch.compile`` (fp32 only inside the fused kernels); eagerly it materialises fp32
    copies, which the eager loss avoids by working in place."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = lf.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - target) * valid).sum()
    columns = torch.arange(lf.shape[1], device=lf.device)
    grad = (torch.exp(lf - lse[:, None]) - (columns[None, :] == safe[:, None]).float()) * valid[:, None]
    return loss, grad.to(logits.dtype)


_compiled_chunk: Any = None


def _compiled_chunk_loss_and_grad() -> Any:
    """One compiled :func:`chunk_loss_and_grad` per process (compiled lazily, at the first chunk)."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: the input's, except bf16/fp16 on a CPU, which runs in fp32. A CPU without bf16
    matrix instructions takes a slow path for a half-precision matmul whose reduction runs over the vocabulary
    (the gradient of the hidden states): ~100x an fp32 one, most of a CPU training step. fp32 is also the
    exact side of what the loss promises."""
    if hidden.device.type == "cpu" and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return hidden.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        compiled_chunks: bool,
    ) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        compute = _compute_dtype(hidden)
        w = weight.to(compute)  # the weight itself unless a CPU run upcasts
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(w) if want_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        fused = _compiled_chunk_loss_and_grad() if compiled_chunks else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            h = hidden[start:stop].to(compute)
            if fused is not None:
                chunk_loss, grad_logits = fused(h @ w.t(), labels[start:stop], ignore_index)
                total += chunk_loss
                if grad_hidden is not None:
                    grad_hidden[start:stop] = torch.mm(grad_logits, w)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t(), h)
                continue
            log_probs, per_token, valid, safe = _chunk_log_probs(h, w, labels[start:stop], ignore_index)
            total += per_token.sum()
            # d(summed loss)/d(logits) = softmax - onehot(label), built in place in the fp32 buffer. Ignored
            # rows are masked on the [chunk, hidden] side below: cheaper than a pass over [chunk, vocab].
            probs = log_probs.exp_()
            probs[torch.arange(probs.shape[0], device=probs.device), safe] -= 1.0
            grad_logits = probs.to(compute)
            del log_probs, probs  # free the fp32 chunk buffer before the matmuls allocate
            keep = valid.to(compute)[:, None]
            if grad_hidden is not None:
                if compute == hidden.dtype:
                    torch.mm(grad_logits, w, out=grad_hidden[start:stop])
                    grad_hidden[start:stop].mul_(keep)
                else:
                    grad_hidden[start:stop] = torch.mm(grad_logits, w).mul_(keep)
            if grad_weight is not None:
                # cuBLAS adds in fp32 and rounds once per chunk (the stock path rounds once per matmul too).
                grad_weight.addmm_(grad_logits.t(), h * keep)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)  # type: ignore[arg-type]  # None: no gradient wanted
        return total

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        # A scalar upstream gradient (1/token_count for a mean): scale in place, no extra copy. The fp32
        # 0-dim factor is applied at fp32 precision (opmath) even to bf16 tensors, so the scale is exact.
        return (
            grad_hidden.mul_(grad_total) if grad_hidden is not None else None,
            grad_weight.mul_(grad_total) if grad_weight is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    compiled_chunks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of ``hidden @ weight.T`` against ``labels``, and the number of counted tokens.

    ``hidden``: ``[N, H]`` (already aligned with ``labels``: shift before calling), ``weight``: ``[V, H]``
    (the LM head), ``labels``: ``[N]`` with ``ignore_index`` for tokens that do not count. Returns
    ``(loss_sum, count)`` with ``loss_sum`` an fp32 scalar equal to
    ``F.cross_entropy(hidden @ weight.T, labels, ignore_index=..., reduction="sum")`` computed in fp32; divide
    by ``count`` (or a global count) for the mean. Peak extra memory is one ``chunk_tokens x V`` fp32 buffer
    (bf16 logits and gradient with ``compiled_chunks``, which needs a working ``torch.compile``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shapes do not line up: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    count = (labels != ignore_index).sum()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        total = _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, ignore_index, compiled_chunks)
        return total, count
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        _, per_token, _, _ = _chunk_log_probs(
            hidden[start : start + chunk_tokens], weight, labels[start : start + chunk_tokens], ignore_index
        )
        total += per_token.sum()
    return total, count


class _HiddenStatesHead(nn.Linear):
    """An LM head that returns its input, so ``model(...).logits`` are the final (normed) hidden states.

    Why not call ``model.model(...)`` instead: under FSDP2 the root module owns the embeddings, the final
    norm and the head, and only its own forward all-gathers them. Keeping the root's forward and making the
    head an identity leaves every parameter, name and state-dict key as it was; the head's weight (unsharded
    after the root's forward, which does not reshard) then feeds :func:`linear_cross_entropy`.
    """

    compiled_chunks = False  # set by the trainer when it compiles the model: see linear_cross_entropy

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input


def return_hidden_states_from_head(model: nn.Module) -> nn.Linear:
    """Make ``model``'s LM head return the hidden states; return the head (its ``weight`` is the one to use)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear or head.bias is not None:
        raise ConfigError(
            f"the chunked loss needs a bias-free nn.Linear LM head; {type(model).__name__} has "
            f"{type(head).__name__ if head is not None else 'none'}.",
            fix="kernelguard train --loss logits",
        )
    head.__class__ = _HiddenStatesHead  # same object, parameters and names; only forward changes
    return head
