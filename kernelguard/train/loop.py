"""The training run, top to bottom: gate -> data -> shard -> resume -> train (eval, save) -> finish.

Each stage is one function below, in the order it runs. The per-step math (loss normalisation, clipping,
optimizer) is :mod:`kernelguard.train.step`; building and sharding the model is :mod:`kernelguard.train.build`.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kernelguard.policy import AllowPolicy

from . import checkpoint as ckpt
from .build import BuiltModel, build_model, prepare_training
from .config import TrainConfig
from .data import chat_template_name, load_examples, load_tokenizer, pad_token_id, template_choice
from .gate import GuardRefused, lift_accepted_fla_refusal, run_gate
from .metrics import MetricsLog, peak_flops, plot_metrics, step_flops
from .packing import build_packed_block, pack_best_fit_decreasing, packing_stats
from .parallel import DTYPES, DistInfo
from .step import Plan, StepResult, TrainState, lr_lambda, make_plan, optimizer_step, step_block_ids

__all__ = ["GuardRefused", "lift_accepted_fla_refusal", "lr_lambda", "run"]


def log(info: DistInfo, message: str) -> None:
    if info.is_main:
        print(f"kernelguard train: {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class TrainData:
    tokenizer: Any
    examples: Any  # data.ExampleStore: (input_ids, labels) per example
    lengths: list[int]
    plan: Plan
    pad_id: int


# -------------------------------------------------------------------------------------------------- run ---
def run(cfg: TrainConfig, info: DistInfo) -> int:
    """The whole run; raises GuardRefused (exit 3) or ConfigError/DataError (exit 2) before any output."""
    torch.manual_seed(cfg.seed)
    policy = AllowPolicy.parse(cfg.allow, source="--allow")
    built = build_model(cfg, info)
    report = run_gate(built.model, model_ref=str(cfg.model), policy=policy, device=info.device)
    try:
        log(info, f"guard passed; attention={built.attention}")
        data = load_training_data(cfg, info)
        state = prepare_training(built, cfg, info, schedule_steps=data.plan.schedule_steps)
        start = resume(cfg, info, state)
        train(cfg, info, state, data, built, start=start)
        finish(cfg, info, state, built, data)
    finally:
        report.disarm()
    return 0


# ------------------------------------------------------------------------------------------------- data ---
def load_training_data(cfg: TrainConfig, info: DistInfo) -> TrainData:
    """Tokenize, pack best-fit-decreasing into blocks and plan which blocks each step of each rank trains on."""
    assert cfg.tokenizer is not None
    tokenizer = load_tokenizer(cfg.tokenizer, chat_template=cfg.chat_template)
    log(info, f"chat template: {chat_template_name(tokenizer)} ({template_choice(tokenizer).reason})")
    examples, dstats = read_examples(cfg, tokenizer, take="train")
    log(info, f"data: {dstats.render()}")
    lengths = examples.lengths()
    blocks = pack_best_fit_decreasing(lengths, cfg.block_size, seed=cfg.seed)
    pstats = packing_stats(
        blocks, lengths, cfg.block_size, truncated=dstats.truncated, dropped=dstats.dropped_overlong
    )
    log(info, pstats.render())
    plan = make_plan(
        blocks,
        world_size=info.world_size,
        grad_accum=cfg.grad_accum,
        epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        schedule_steps=cfg.schedule_steps,
        block_size=cfg.block_size,
        data=cfg.data,
    )
    return TrainData(tokenizer, examples, lengths, plan, pad_token_id(tokenizer))


def read_examples(cfg: TrainConfig, tokenizer: Any, *, take: str) -> tuple[Any, Any]:
    """The examples of one split: ``train`` (minus a held-out ``--eval-fraction``), ``eval`` (that fraction)
    or, for ``--eval-data``, every row of that file."""
    data, fraction = cfg.data, cfg.eval_fraction
    if take == "eval" and cfg.eval_data:
        data, fraction, take = cfg.eval_data, 0.0, "all"
    return load_examples(
        data=data,
        tokenizer=tokenizer,
        block_size=cfg.block_size,
        column=cfg.messages_column,
        split=cfg.split,
        overlong=cfg.overlong,
        skip_bad_rows=cfg.skip_bad_rows,
        assistant_only=cfg.assistant_only_loss,
        dataset_format=cfg.dataset_format,
        eval_fraction=fraction,
        seed=cfg.seed,
        take=take,
    )


def step_batches(cfg: TrainConfig, info: DistInfo, data: TrainData, step: int) -> tuple[list[Any], list[int]]:
    """This rank's packed blocks for 0-based ``step`` and the lengths of the examples in them."""
    plan = data.plan
    ids = step_block_ids(
        plan, step, rank=info.rank, world_size=info.world_size, seed=cfg.seed, grad_accum=cfg.grad_accum
    )
    micro = [
        build_packed_block([data.examples[i] for i in plan.blocks[b]], cfg.block_size, data.pad_id)
        for b in ids
    ]
    return micro, [data.lengths[i] for b in ids for i in plan.blocks[b]]


# ----------------------------------------------------------------------------------------------- resume ---
def resume(cfg: TrainConfig, info: DistInfo, state: TrainState) -> int:
    """Restore the newest complete checkpoint when ``--resume``; return the step to start from."""
    cfg.output.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        ckpt.remove_incomplete(cfg.output)
    dist.barrier()
    if not cfg.resume:
        return 0
    path = ckpt.latest_checkpoint(cfg.output)
    if path is None:
        log(info, f"--resume: no complete checkpoint in {cfg.output}; starting from step 0")
        return 0
    saved = ckpt.load_checkpoint(
        path, model=state.model, optimizer=state.optimizer, world_size=info.world_size
    )
    state.scheduler.load_state_dict(saved["scheduler"])
    start = int(saved["step"])
    log(info, f"resumed from {path} at step {start}")
    return start


# ------------------------------------------------------------------------------------------------ train ---
def train(
    cfg: TrainConfig, info: DistInfo, state: TrainState, data: TrainData, built: BuiltModel, *, start: int
) -> None:
    """Steps ``start`` .. ``plan.stop_step``: one metrics record per step, checkpoints every ``save_every``."""
    plan = data.plan
    metrics = MetricsLog(cfg.output / "metrics.jsonl", resume_step=start) if info.is_main else None
    bar = progress_bar(cfg, info, total=plan.stop_step, initial=start)
    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else peak_flops(info.device)
    try:
        for step in range(start, plan.stop_step):
            micro, seq_lens = step_batches(cfg, info, data, step)
            result, seconds = timed_step(state, micro)
            record = step_record(cfg, info, step + 1, result, seconds, seq_lens, built.config, peak)
            if metrics is not None:
                metrics.write(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            done = step + 1
            if (cfg.save_every and done % cfg.save_every == 0) or done == plan.stop_step:
                save(cfg, info, state, done, plan)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if info.is_main:
            ckpt.remove_incomplete(cfg.output)


def progress_bar(cfg: TrainConfig, info: DistInfo, *, total: int, initial: int) -> Any:
    if not (info.is_main and cfg.progress):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        log(info, "tqdm is not installed: no progress bar (metrics still go to metrics.jsonl)")
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr)


def timed_step(state: TrainState, micro: list[Any]) -> tuple[StepResult, float]:
    """:func:`optimizer_step` and its wall time (the device synchronised on both sides)."""
    device = state.info.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = optimizer_step(state, micro)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


def step_record(
    cfg: TrainConfig,
    info: DistInfo,
    step: int,
    result: StepResult,
    seconds: float,
    seq_lens: list[int],
    hf_config: Any,
    peak: float,
) -> dict[str, Any]:
    """The metrics.jsonl record of one step; throughput counts real (non-pad) tokens of all ranks."""
    totals = torch.tensor(
        [float(sum(seq_lens)), step_flops(hf_config, seq_lens)], dtype=torch.float64, device=info.device
    )
    dist.all_reduce(totals)
    real_tokens, flops = float(totals[0]), float(totals[1])
    capacity = info.world_size * cfg.grad_accum * cfg.block_size
    return {
        "step": step,
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": real_tokens / seconds,
        "loss_tokens": result.loss_tokens,
        "mfu": (flops / seconds / (peak * info.world_size)) if peak else None,
        "padding_pct": 100.0 * (1.0 - real_tokens / capacity),
        "peak_mem_gb": _peak_memory_gb(info.device),
        "step_time_s": seconds,
    }


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def save(cfg: TrainConfig, info: DistInfo, state: TrainState, step: int, plan: Plan) -> None:
    epoch, within = divmod(step, plan.steps_per_epoch)
    trainer_state = {
        "step": step,
        "scheduler": state.scheduler.state_dict(),
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
        cfg.output,
        step=step,
        model=state.model,
        optimizer=state.optimizer,
        trainer_state=trainer_state,
        is_main=info.is_main,
    )


# ----------------------------------------------------------------------------------------------- finish ---
def finish(cfg: TrainConfig, info: DistInfo, state: TrainState, built: BuiltModel, data: TrainData) -> None:
    """Export ``final/`` (safetensors + config + tokenizer) and plot the metrics."""
    if cfg.export:
        ckpt.export_final(
            cfg.output,
            model=state.model,
            config=built.config,
            tokenizer=data.tokenizer,
            dtype=DTYPES[cfg.param_dtype],
            is_main=info.is_main,
        )
    if info.is_main and cfg.plot and (cfg.output / "metrics.jsonl").exists():
        try:
            plot_metrics(cfg.output / "metrics.jsonl", cfg.output / "metrics.png")
        except ImportError:
            log(info, "matplotlib is not installed: no metrics.png (pip install 'kernelguard[train]')")
    log(info, f"done: {data.plan.stop_step} steps; output in {cfg.output}")
