"""One optimizer step of `kernelguard train` (which blocks each step trains on: :mod:`.plan`).

Loss normalisation: each optimizer step sums token cross-entropy over every micro-batch of every rank and
divides by the GLOBAL number of valid label tokens of that step (all-reduced before the first forward), so
the gradient is the same for any split of the same blocks across ranks and micro-steps. FSDP2 averages
gradients over ranks, so each rank backpropagates ``world_size * local_sum / global_count``. Evaluation
(:func:`kernelguard.train.step.evaluate.evaluate`) uses the same token sum / global count.

:func:`optimizer_step` is the product's step; ``bench/train_throughput.py`` times exactly this function.
A micro-batch is any dict with ``labels`` (unshifted, ``-100`` where no loss) and model inputs: a packed
block from :func:`kernelguard.train.step.packing.build_packed_block` ([1, T] plus varlen kwargs), or a padded
[B, T] batch with ``attention_mask``. Keys in :data:`NON_MODEL_KEYS` and keys starting with ``_`` are not
passed to the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernelguard.resolution import IGNORE_INDEX

from ..common.ranks import DistInfo, sync_replicated_grads
from .grad_norm import clip_divisor, clip_gradients, clip_gradients_, gradient_norm
from .loss import linear_cross_entropy
from .packing import forward_rows

__all__ = [
    "NON_MODEL_KEYS",
    "StepResult",
    "TrainState",
    "clip_gradients",
    "clip_gradients_",
    "extended_schedule_note",
    "forward_backward",
    "label_count",
    "lr_lambda",
    "model_inputs",
    "optimizer_step",
    "restart_schedule_at",
    "token_loss_sum",
    "token_loss_sums",
    "warmup_length",
]

NON_MODEL_KEYS = frozenset({"labels", "num_real_tokens"})


def lr_lambda(warmup: int, total: int, min_ratio: float, kind: str = "cosine") -> Any:
    """The LR factor at 0-based step: linear warmup over ``warmup`` steps, then by ``kind`` (Hugging Face's
    names): ``cosine`` or ``linear`` from 1 to ``min_ratio`` at step ``total`` (held there after it),
    ``constant`` / ``constant_with_warmup`` 1."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind.startswith("constant"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * shape

    return f


def warmup_length(steps: int, ratio: float, schedule_steps: int) -> int:
    """``--warmup-steps``, or ``--warmup-ratio`` of the schedule rounded up (as Hugging Face does)."""
    return steps or math.ceil(ratio * schedule_steps)


def extended_schedule_note(saved: int, now: int, *, step: int) -> str:
    """The one line a resumed run logs when its LR schedule grew (a larger --max-steps): the schedule is
    rebuilt for the new length, as Hugging Face's Trainer does, so the LR goes on from where the longer
    schedule is at ``step``."""
    return (
        f"--resume: the LR schedule now spans {now} steps (it was {saved}); from step {step} the LR follows "
        f"the {now}-step schedule. To hold the final LR of the old one instead, pass --schedule-steps {saved}"
    )


def restart_schedule_at(scheduler: Any) -> None:
    """After loading a checkpoint's scheduler state into a schedule of another length: set each group's LR
    to the new schedule's value at the restored step (the optimizer state holds the old schedule's)."""
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


# ------------------------------------------------------------------------------------------------ step ---
@dataclass(slots=True)
class TrainState:
    """Everything one optimizer step touches (built by :func:`kernelguard.train.model.build.setup_training`).

    ``head``: the LM head made to return hidden states (chunked loss), or None for the model's logits.
    ``blocks_per_forward``: how many of a step's packed blocks share one forward's row
    (:func:`kernelguard.train.step.packing.forward_rows`)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    info: DistInfo
    head: torch.nn.Linear | None = None
    grad_clip: float = 1.0
    blocks_per_forward: int = 1


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # global token-mean cross-entropy of the step
    loss_tokens: int  # global number of tokens with a label
    grad_norm: float  # before clipping
    lr: float  # the learning rate this step used
    finite: bool = True  # False: loss or grad norm was NaN/inf on some rank, and the update was NOT applied


def model_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
        for k, v in batch.items()
        if k not in NON_MODEL_KEYS and not k.startswith("_")
    }


def label_count(batch: dict[str, Any]) -> int:
    """Tokens that are predicted (shifted labels that are not ignored)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, Any], *, device: torch.device, head: torch.nn.Linear | None
) -> torch.Tensor:
    """Summed (not averaged) next-token cross-entropy of one micro-batch, fp32."""
    return token_loss_sums(model, batch, [batch["labels"]], device=device, head=head)[0]


def token_loss_sums(
    model: torch.nn.Module,
    batch: dict[str, Any],
    label_sets: list[torch.Tensor],
    *,
    device: torch.device,
    head: torch.nn.Linear | None,
) -> list[torch.Tensor]:
    """:func:`token_loss_sum` for each of ``label_sets`` (each shaped like ``batch["labels"]``), one forward."""
    out = model(**model_inputs(batch, device), use_cache=False).logits  # hidden states when `head` is set
    shifted = out[:, :-1].reshape(-1, out.shape[-1])
    sums = []
    for label_set in label_sets:
        labels = label_set.to(device)[:, 1:].reshape(-1)
        if head is not None:
            total, _ = linear_cross_entropy(shifted, head.weight, labels, ignore_index=IGNORE_INDEX,
                                            compiled_chunks=getattr(head, "compiled_chunks", False))
            sums.append(total)
        else:
            sums.append(F.cross_entropy(shifted.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"))
    return sums


def forward_backward(
    model: torch.nn.Module,
    micro: list[dict[str, Any]],
    *,
    info: DistInfo,
    head: torch.nn.Linear | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over this rank's micro-batches. Returns (global loss sum, global label count)."""
    count = torch.tensor(float(sum(label_count(mb) for mb in micro)), dtype=torch.float64, device=info.device)
    dist.all_reduce(count)
    denom = count.clamp(min=1.0).float()
    loss_sum = torch.zeros((), dtype=torch.float32, device=info.device)
    for mb in micro:
        local = token_loss_sum(model, mb, device=info.device, head=head)
        (local * info.world_size / denom).backward()
        loss_sum += local.detach()
    sync_replicated_grads(model, info.world_size)
    dist.all_reduce(loss_sum)
    return loss_sum, count


def optimizer_step(state: TrainState, micro: list[dict[str, Any]]) -> StepResult:
    """One optimizer step over this rank's micro-batches (its packed blocks, merged into rows of
    ``state.blocks_per_forward``): forward/backward, clip, AdamW, LR schedule.

    A fused AdamW is told on the device whether the step is finite (``found_inf``, the mechanism
    ``torch.amp.GradScaler`` uses) and skips a non-finite update itself, and clips by dividing each gradient
    inside its own kernel (``grad_scale``, kernelguard.train.step.grad_norm), so the host reads nothing until the
    whole step is queued: the one synchronisation is at the end, for the figures the step returns."""
    rows = forward_rows(micro, state.blocks_per_forward)
    loss_sum, count = forward_backward(state.model, rows, info=state.info, head=state.head)
    fused = bool(state.optimizer.defaults.get("fused"))
    if fused:
        grad_norm = gradient_norm(state.model)
        if state.grad_clip > 0:
            state.optimizer.grad_scale = clip_divisor(grad_norm, state.grad_clip)
    else:
        grad_norm = clip_gradients_(state.model, state.grad_clip)
    lr = float(state.optimizer.param_groups[0]["lr"])
    # Both values are already global; the flag is still agreed on explicitly so that every rank skips the
    # update and stops together even if one rank's reduction saw something the others did not.
    bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm.to(loss_sum.device))).float()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if fused:
        state.optimizer.found_inf = bad  # a NaN update would poison every weight and AdamW moment: skipped
        try:
            state.optimizer.step()
        finally:
            del state.optimizer.found_inf
            state.optimizer.__dict__.pop("grad_scale", None)
        finite = not bool(bad)
    else:
        finite = not bool(bad)
        if finite:
            state.optimizer.step()
    if finite:
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    tokens = float(count)
    return StepResult(float(loss_sum) / max(1.0, tokens), int(tokens), float(grad_norm), lr, finite)
