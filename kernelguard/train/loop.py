"""The training run: gate -> data -> pack -> shard -> train -> checkpoint -> export.

Loss normalisation: each optimizer step sums token cross-entropy over every micro-batch of every rank and
divides by the GLOBAL number of valid label tokens of that step (all-reduced before the first forward), so
the gradient is the same for any split of the same blocks across ranks and micro-steps. FSDP2 averages
gradients over ranks, so each rank backpropagates ``world_size * local_sum / global_count``.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernelguard.errors import ConfigError, DataError, KernelFallbackError

from . import checkpoint as ckpt
from .config import TrainConfig
from .data import load_examples, load_tokenizer, pad_token_id
from .loss import linear_cross_entropy, return_hidden_states_from_head
from .metrics import MetricsLog, peak_flops, plot_metrics, step_flops
from .packing import (
    IGNORE_INDEX,
    MODEL_INPUT_KEYS,
    build_packed_block,
    pack_best_fit_decreasing,
    packing_stats,
    shard_blocks,
)
from .parallel import (
    DTYPES,
    DistInfo,
    apply_activation_checkpointing,
    apply_fsdp,
    build_meta_model,
    materialize,
    mixed_precision,
    model_source,
)


class GuardRefused(Exception):
    """The guard found a slow path that was not allowed; ``report`` is what to print."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


def log(info: DistInfo, message: str) -> None:
    if info.is_main:
        print(f"kernelguard train: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------- gate ---
def choose_attention(choice: str, device: torch.device) -> str:
    from kernelguard.attention import VARLEN_NAME, register_varlen_attention

    name = register_varlen_attention(device_type=device.type)
    if choice == "auto":
        return name
    if choice == "varlen":
        if name != VARLEN_NAME:
            raise ConfigError(
                f"--attention varlen needs torch.nn.attention.varlen.varlen_attn on CUDA; this run would use {name}.",
                fix="use --attention auto, or torch >= 2.10 on a CUDA device",
            )
        return VARLEN_NAME
    return choice


def check_known_issues(model_ref: str, allow: tuple[str, ...], device: torch.device) -> None:
    """The environment-level half of the gate: known-bad stacks for this GPU (e.g. fla #640 on Hopper).

    The guard sees which implementation each layer calls; only the resolver knows that a present fast
    provider is wrong on this GPU/Triton/head-dim combination. It needs the GPU's arch, so CUDA only.
    An allowed fla #640 row (``fla-640-refusal`` at key head dim >= 128, measured correct, or an explicit
    ``fla-640-wrong-grads``) lifts fla's own refusal here, so the accepted path actually runs.
    """
    if device.type != "cuda":
        return
    from kernelguard.report import render
    from kernelguard.require import check

    result = check(model_ref, mode="training", allow=allow, packed=True)
    if not result.ok:
        raise GuardRefused(render(result))
    accepted = {issue for v in result.resolution.verdicts if v.selected for issue in v.selected.issues}
    lift_accepted_fla_refusal(accepted)


def lift_accepted_fla_refusal(accepted: set[str]) -> list[str]:
    from kernelguard.fla_refusal import lift_for_accepted_issues

    return lift_for_accepted_issues(accepted)


def run_gate(model: Any, allow: tuple[str, ...]) -> Any:
    """Guard the model for packed training. Returns the armed GuardReport; raises GuardRefused."""
    from kernelguard.guard import guard

    try:
        report = guard(model, mode="training", packed=True, allow=allow, strict=True)
    except KernelFallbackError as e:
        text = str(e)
        try:  # the full per-layer table, when the guard can give it without raising
            soft = guard(model, mode="training", packed=True, allow=allow, strict=False)
            text = f"{soft.render()}\n\n{text}"
            soft.disarm()
        except Exception as soft_error:  # noqa: BLE001 - the error text above is still complete
            text = f"{text}\n(no per-layer table: {soft_error!r})"
        raise GuardRefused(text) from e
    if not getattr(report, "ok", True):
        text = report.render()
        report.disarm()
        raise GuardRefused(text)
    return report


# ------------------------------------------------------------------------------------------------- steps ---
@dataclass(slots=True)
class Plan:
    blocks: list[list[int]]
    steps_per_epoch: int
    total_steps: int
    stop_step: int
    schedule_steps: int


def make_plan(cfg: TrainConfig, blocks: list[list[int]], world_size: int) -> Plan:
    per_rank = len(blocks) // world_size
    steps_per_epoch = per_rank // cfg.grad_accum
    if steps_per_epoch == 0:
        raise DataError(
            f"the data packs into {len(blocks)} blocks of {cfg.block_size}: not enough for one step of "
            f"{world_size} ranks x {cfg.grad_accum} micro-batches.",
            fix="add data, lower --grad-accum or --block-size, or use fewer ranks",
            details={"file": cfg.data, "row": None, "field": None},
        )
    total = steps_per_epoch * cfg.epochs
    stop = cfg.max_steps if cfg.max_steps is not None else total
    return Plan(blocks, steps_per_epoch, total, stop, cfg.schedule_steps or max(total, stop))


def step_block_ids(
    plan: Plan, step: int, *, rank: int, world_size: int, seed: int, grad_accum: int
) -> list[int]:
    """Block indices this rank trains on at 0-based optimizer step ``step`` (epochs cycle)."""
    epoch, within = divmod(step, plan.steps_per_epoch)
    mine = shard_blocks(len(plan.blocks), rank=rank, world_size=world_size, seed=seed, epoch=epoch)
    return mine[within * grad_accum : (within + 1) * grad_accum]


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Any:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def make_optimizer(
    model: Any, cfg: TrainConfig, device: torch.device, *, schedule_steps: int
) -> tuple[Any, Any]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg.warmup_steps, schedule_steps, cfg.min_lr_ratio)
    )
    return opt, sched


def clip_gradients(model: Any, max_norm: float) -> float:
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def train_step(
    model: Any, micro: list[dict[str, Any]], *, info: DistInfo, head: torch.nn.Linear | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over this rank's micro-batches. Returns (global loss sum, global valid count).

    ``head``: the LM head made to return hidden states (:func:`return_hidden_states_from_head`); the loss is
    then the chunked linear cross-entropy over its weight. ``None``: cross-entropy over the model's logits."""
    count = torch.zeros((), dtype=torch.float64, device=info.device)
    for mb in micro:
        count += (mb["labels"][0, 1:] != IGNORE_INDEX).sum().to(count)
    dist.all_reduce(count)
    loss_sum = torch.zeros((), dtype=torch.float32, device=info.device)
    denom = count.clamp(min=1.0).float()
    for mb in micro:
        inputs = {k: (mb[k].to(info.device) if torch.is_tensor(mb[k]) else mb[k]) for k in MODEL_INPUT_KEYS}
        out = model(**inputs, use_cache=False).logits  # hidden states when `head` is set
        labels = mb["labels"].to(info.device)
        if head is not None:
            local, _ = linear_cross_entropy(out[0, :-1], head.weight, labels[0, 1:], ignore_index=IGNORE_INDEX)
        else:
            local = F.cross_entropy(
                out[0, :-1].float(), labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum"
            )
        (local * info.world_size / denom).backward()
        loss_sum += local.detach()
    dist.all_reduce(loss_sum)
    return loss_sum, count


# -------------------------------------------------------------------------------------------------- run ---
def run(cfg: TrainConfig, info: DistInfo) -> int:
    torch.manual_seed(cfg.seed)
    hf_config, weights = model_source(cfg.model)
    attn = choose_attention(cfg.attention, info.device)
    model = build_meta_model(hf_config, attn_implementation=attn)

    check_known_issues(str(cfg.model), cfg.allow, info.device)
    report = run_gate(model, cfg.allow)  # before any data work
    try:
        return _run_gated(cfg, info, model, hf_config, weights, attn, report)
    finally:
        disarm = getattr(report, "disarm", None)
        if callable(disarm):
            disarm()


def _run_gated(
    cfg: TrainConfig, info: DistInfo, model: Any, hf_config: Any, weights: Path | None, attn: str, report: Any
) -> int:
    log(info, f"guard passed; attention={attn}")
    assert cfg.tokenizer is not None
    tokenizer = load_tokenizer(cfg.tokenizer)
    examples, dstats = load_examples(
        data=cfg.data,
        tokenizer=tokenizer,
        block_size=cfg.block_size,
        column=cfg.messages_column,
        split=cfg.split,
        overlong=cfg.overlong,
        skip_bad_rows=cfg.skip_bad_rows,
        assistant_only=cfg.assistant_only_loss,
    )
    log(info, f"data: {dstats.render()}")
    lengths = examples.lengths()
    blocks = pack_best_fit_decreasing(lengths, cfg.block_size, seed=cfg.seed)
    pstats = packing_stats(
        blocks, lengths, cfg.block_size, truncated=dstats.truncated, dropped=dstats.dropped_overlong
    )
    log(info, pstats.render())
    plan = make_plan(cfg, blocks, info.world_size)
    pad_id = pad_token_id(tokenizer)

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    # Before sharding: the head keeps its parameters and names, only its forward changes.
    head = return_hidden_states_from_head(model) if cfg.loss == "chunked" else None
    apply_fsdp(
        model,
        mesh=mesh,
        mp_policy=mixed_precision(cfg.param_dtype),
        reshard_after_forward=cfg.reshard_after_forward,
    )
    materialize(model, info=info, config=hf_config, weights=weights, seed=cfg.seed)
    model.train()

    optimizer, scheduler = make_optimizer(model, cfg, info.device, schedule_steps=plan.schedule_steps)

    cfg.output.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        ckpt.remove_incomplete(cfg.output)
    dist.barrier()
    start = 0
    if cfg.resume:
        path = ckpt.latest_checkpoint(cfg.output)
        if path is None:
            log(info, f"--resume: no complete checkpoint in {cfg.output}; starting from step 0")
        else:
            state = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, world_size=info.world_size)
            scheduler.load_state_dict(state["scheduler"])
            start = int(state["step"])
            log(info, f"resumed from {path} at step {start}")

    metrics = MetricsLog(cfg.output / "metrics.jsonl", resume_step=start) if info.is_main else None
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else peak_flops(info.device)
    bar = None
    if info.is_main and cfg.progress:
        try:
            from tqdm import tqdm
        except ImportError:
            log(info, "tqdm is not installed: no progress bar (metrics still go to metrics.jsonl)")
        else:
            bar = tqdm(total=plan.stop_step, initial=start, desc="train", unit="step", file=sys.stderr)
    try:
        for step in range(start, plan.stop_step):
            ids = step_block_ids(
                plan,
                step,
                rank=info.rank,
                world_size=info.world_size,
                seed=cfg.seed,
                grad_accum=cfg.grad_accum,
            )
            micro = [
                build_packed_block([examples[i] for i in plan.blocks[b]], cfg.block_size, pad_id) for b in ids
            ]
            seq_lens = [lengths[i] for b in ids for i in plan.blocks[b]]
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            t0 = time.perf_counter()
            loss_sum, count = train_step(model, micro, info=info, head=head)
            grad_norm = clip_gradients(model, cfg.grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            dt = time.perf_counter() - t0
            totals = torch.tensor(
                [float(sum(seq_lens)), step_flops(hf_config, seq_lens)],
                dtype=torch.float64,
                device=info.device,
            )
            dist.all_reduce(totals)
            real_tokens, flops = float(totals[0]), float(totals[1])
            capacity = info.world_size * cfg.grad_accum * cfg.block_size
            record = {
                "step": step + 1,
                "loss": float(loss_sum) / max(1.0, float(count)),
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": real_tokens / dt,
                "loss_tokens": int(count),
                "mfu": (flops / dt / (peak * info.world_size)) if peak else None,
                "padding_pct": 100.0 * (1.0 - real_tokens / capacity),
                "peak_mem_gb": _peak_memory_gb(info.device),
                "step_time_s": dt,
            }
            if metrics is not None:
                metrics.write(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            done = step + 1
            if (cfg.save_every and done % cfg.save_every == 0) or done == plan.stop_step:
                _save(cfg, info, model, optimizer, scheduler, done, plan)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if info.is_main:
            ckpt.remove_incomplete(cfg.output)
    if cfg.export:
        ckpt.export_final(
            cfg.output,
            model=model,
            config=hf_config,
            tokenizer=tokenizer,
            dtype=DTYPES[cfg.param_dtype],
            is_main=info.is_main,
        )
    if info.is_main and cfg.plot and (cfg.output / "metrics.jsonl").exists():
        try:
            plot_metrics(cfg.output / "metrics.jsonl", cfg.output / "metrics.png")
        except ImportError:
            log(info, "matplotlib is not installed: no metrics.png (pip install 'kernelguard[train]')")
    log(info, f"done: {plan.stop_step} steps; output in {cfg.output}")
    return 0


def _save(
    cfg: TrainConfig, info: DistInfo, model: Any, optimizer: Any, scheduler: Any, step: int, plan: Plan
) -> None:
    epoch, within = divmod(step, plan.steps_per_epoch)
    state = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "data": {
            "epoch": epoch,
            "step_in_epoch": within,
            "blocks_per_rank_consumed": within * cfg.grad_accum,
        },
        "world_size": info.world_size,
        "seed": cfg.seed,
        "num_blocks": len(plan.blocks),
    }
    ckpt.save_checkpoint(
        cfg.output, step=step, model=model, optimizer=optimizer, trainer_state=state, is_main=info.is_main
    )
