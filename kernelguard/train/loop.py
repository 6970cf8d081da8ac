"""The training run, top to bottom: preflight -> gate -> data -> claim output -> shard -> resume -> train
(eval, save) -> finish.

Each stage is one function below, in the order it runs. The per-step math (loss normalisation, clipping,
optimizer) is :mod:`kernelguard.train.step.step`; building and sharding the model is :mod:`kernelguard.train.model.build`;
what is checked before any expensive work is :mod:`kernelguard.train.startup.preflight`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from kernelguard.diagnosis import CompileWatch
from kernelguard.errors import CheckpointError, Preempted
from kernelguard.resolution import AllowPolicy
from kernelguard.runtime import allowed_line, check_stack, run_gate

from .common.command_line import command_with, resume_command
from .common.logs import log
from .common.ranks import DistInfo, on_main
from .common.run_folder import FINAL, METRICS_FILE
from .inputs.data import read_inputs
from .inputs.tokenizer import chat_template_name, template_choice
from .model.build import BuiltModel, build_model, prepare_training
from .model.parallel import DTYPES
from .output import checkpoint as ckpt
from .output.checkpoint import diverged
from .output.export import export_run, start_warnings
from .output.metrics import peak_flops, plot_run_metrics, step_flops
from .output.profiling import step_profiler, unprofiled_warning
from .output.provenance import write_source
from .output.reporting import Reporter, process_age_s, step_record
from .settings.config import TrainConfig
from .settings.packing_modes import (
    LEAKY,
    LEAKY_WARNING,
    NAIVE,
    NAIVE_WARNING,
    NO_PACKING,
    check_control_allowed,
    eval_layout,
)
from .signals import stop_request
from .startup.input_check import check_inputs_early
from .startup.preflight import (
    StartPlan,
    check_checkpoint_shapes,
    check_image_lock,
    check_packed_segments,
    check_something_left,
    claim_output,
    nothing_left_to_train,
    preflight,
    segment_limit_note,
)
from .step.evaluate import evaluate
from .step.packing import build_batch, pack_run, segment_counts, step_block_ids
from .step.plan import Plan
from .step.step import StepResult, TrainState, extended_schedule_note, optimizer_step, restart_schedule_at

__all__ = ["run"]


@dataclass(slots=True)
class TrainData:
    tokenizer: Any
    examples: Any  # data.ExampleStore: (input_ids, labels) per example
    lengths: list[int]
    plan: Plan
    pad_id: int
    eval_examples: Any = None  # None: no eval set
    eval_blocks: list[list[int]] = dataclasses.field(default_factory=list)


# -------------------------------------------------------------------------------------------------- run ---
def run(cfg: TrainConfig, info: DistInfo) -> int:
    """The whole run. Refusals (GuardRefused: exit 3; ConfigError/DataError: exit 2) leave the output folder
    as it was."""
    torch.manual_seed(cfg.training.seed)
    policy = AllowPolicy.parse(cfg.runtime.allow, source="--allow")
    check_control_allowed(cfg.packing.packing, allowed=policy.allows_packed_without_boundaries())
    start = on_main(info, lambda: preflight(cfg, world_size=info.world_size))
    for warning in start.warnings:
        log(info, warning, logging.WARNING)
    for notice in start.notices:
        log(info, notice)
    warning = {LEAKY: LEAKY_WARNING, NAIVE: NAIVE_WARNING}.get(cfg.packing.packing)
    if warning:
        log(info, warning, logging.WARNING)
    # Inputs before the stack check and the model build: a wrong tokenizer, template or row fails in seconds.
    template = on_main(info, lambda: _template_line(check_inputs_early(cfg)))
    log(info, template)
    packed = cfg.packing.packing != NO_PACKING  # padded batches carry no boundaries a torch reference could drop
    on_main(info, lambda: check_image_lock(cfg.runtime.lock, policy))
    stack = check_stack(str(cfg.model.model), allow=policy, packed=packed, device=info.device)
    built = build_model(model=cfg.model, runtime=cfg.runtime, info=info, padded=not packed)
    for said in start_warnings(built, cfg.checkpoint, dtype=DTYPES[cfg.runtime.param_dtype]):
        log(info, f"warning: {said}", logging.WARNING)  # said now, not after hours of training
    on_main(info, lambda: check_checkpoint_shapes(built.model, start.resume_from))  # before anything is written
    on_main(info, lambda: check_something_left(cfg, start.resume_from))
    if info.device.type == "cuda":  # before the gate's probe runs fla's kernels: a pinned shape is never searched
        from kernelguard.resolution import pin_for_this_gpu

        log(info, pin_for_this_gpu())
    report = run_gate(built.model, policy=policy, packed=packed, stack=stack,
                      first_row_probe=cfg.packing.first_row_probe, command=command_with)
    try:
        # The table, not just "passed": which provider serves each layer's kernels is what a log reader needs.
        log(info, f"guard passed; attention={built.attention}\n{report.render()}")
        allowed = allowed_line(report)
        if allowed:
            log(info, allowed)
        data = load_training_data(cfg, info)
        if packed:  # counted everywhere (cheap); refused only where fla runs, said elsewhere
            counts = segment_counts(data.plan.blocks, data.lengths, cfg.packing.max_length)
            if info.device.type == "cuda":
                on_main(info, lambda: check_packed_segments(counts, config=built.model.config))
            elif said := segment_limit_note(counts, config=built.model.config):
                log(info, f"warning: {said}", logging.WARNING)
        saved = on_main(info, lambda: check_resume_plan(cfg, start, data.plan))
        claim(cfg, info, start)
        first = int(saved["step"]) if saved else 0
        with Reporter(cfg, info, start=first, total=data.plan.stop_step) as out:
            state = prepare_training(built, cfg, info, schedule_steps=data.plan.schedule_steps)
            resume(cfg, info, state, start, saved, schedule_steps=data.plan.schedule_steps)
            out.start()  # after the model is built and loaded: no setup line or loading bar inside ours
            train(cfg, info, state, data, built, out, start=first, identity=start.identity)
        finish(cfg, info, state, built, data)
    finally:
        report.disarm()
    return 0


# ------------------------------------------------------------------------------------------------- data ---
def _template_line(tokenizer: Any) -> str:
    return f"chat template: {chat_template_name(tokenizer)} ({template_choice(tokenizer).reason})"


def load_training_data(cfg: TrainConfig, info: DistInfo) -> TrainData:
    """The run's examples (the inputs stage), packed into blocks and planned over the steps (the packing)."""
    inputs = read_inputs(cfg)
    log(info, f"data: {inputs.stats.render()}")
    packed = pack_run(inputs, cfg, world_size=info.world_size)
    log(info, packed.stats.render(cfg.packing.packing))
    if packed.dropped_note:
        log(info, packed.dropped_note)
    if inputs.eval_stats is not None:
        log(info, f"eval data: {inputs.eval_stats.render()}; {len(packed.eval_blocks)} blocks")
    if inputs.eval_overlap:
        log(info, f"warning: {inputs.eval_overlap}")
    return TrainData(inputs.tokenizer, inputs.examples, inputs.lengths, packed.plan, inputs.pad_id,
                     inputs.eval_examples, packed.eval_blocks)


def step_batches(cfg: TrainConfig, info: DistInfo, data: TrainData, step: int) -> tuple[list[Any], list[int]]:
    """This rank's blocks for 0-based ``step`` (laid out as ``--packing`` says) and the lengths of the examples
    in them."""
    plan = data.plan
    ids = step_block_ids(
        plan,
        step,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.training.seed,
        grad_accum=cfg.training.gradient_accumulation_steps,
    )
    micro = [
        build_batch(
            [data.examples[i] for i in plan.blocks[b]],
            cfg.packing.max_length,
            data.pad_id,
            packing=cfg.packing.packing,
        )
        for b in ids
    ]
    return micro, [data.lengths[i] for b in ids for i in plan.blocks[b]]


# ----------------------------------------------------------------------------------------------- resume ---
def check_resume_plan(cfg: TrainConfig, start: StartPlan, plan: Plan) -> dict[str, Any] | None:
    """The chosen checkpoint's trainer state, refused when its data plan differs from this run's. A longer
    LR schedule (it follows a larger --max-steps when --schedule-steps is not given) extends the run:
    :func:`resume` rebuilds the schedule for it."""
    if start.resume_from is None:
        return None
    saved = ckpt.read_trainer_state(start.resume_from)
    export_pending = cfg.checkpoint.export and not (cfg.checkpoint.output_dir / FINAL).exists()
    if int(saved.get("step", 0)) > plan.stop_step or (int(saved.get("step", 0)) == plan.stop_step
                                                      and not export_pending):
        raise nothing_left_to_train(start.resume_from, int(saved.get("step", 0)), plan.stop_step)
    now = {"num_blocks": len(plan.blocks), "schedule_steps": plan.schedule_steps}
    diffs = [
        f"{k}: was {saved[k]!r}, now {v!r}"
        for k, v in now.items()
        if k in saved and saved[k] != v and not (k == "schedule_steps" and v > saved[k])
    ]
    if diffs and not cfg.checkpoint.resume_anyway:
        raise CheckpointError(
            f"--resume: {start.resume_from} was trained on another plan; what differs:\n  "
            + "\n  ".join(diffs),
            fix="resume with the original data and --max-steps/--schedule-steps (a shorter LR schedule than "
            "the checkpoint's cannot continue it), or --resume-anyway to continue anyway",
        )
    return saved


def claim(cfg: TrainConfig, info: DistInfo, start: StartPlan) -> None:
    """Create the output folder and write this run's identity (after --overwrite removed the old run)."""
    removed = on_main(info, lambda: claim_output(cfg, start))
    if removed:
        log(
            info,
            f"--overwrite: removed the previous run's {', '.join(removed)} from {cfg.checkpoint.output_dir}",
        )


def resume(
    cfg: TrainConfig,
    info: DistInfo,
    state: TrainState,
    start: StartPlan,
    saved: dict[str, Any] | None,
    *,
    schedule_steps: int | None = None,
) -> int:
    """Restore the verified checkpoint preflight chose when ``--resume``; return the step to start from.
    ``schedule_steps``: this run's LR schedule length, which may exceed the checkpoint's (an extended run)."""
    if not cfg.checkpoint.resume:
        return 0
    if start.resume_from is None or saved is None:
        log(info, f"--resume: no complete checkpoint in {cfg.checkpoint.output_dir}; starting from step 0")
        return 0
    ckpt.load_checkpoint(start.resume_from, model=state.model, optimizer=state.optimizer)
    state.scheduler.load_state_dict(saved["scheduler"])
    step = int(saved["step"])
    log(info, f"resumed from {start.resume_from} at step {step}")
    was = saved.get("schedule_steps")
    if schedule_steps is not None and was is not None and schedule_steps != was:
        restart_schedule_at(state.scheduler)
        log(info, extended_schedule_note(int(was), schedule_steps, step=step))
    return step


# ------------------------------------------------------------------------------------------------ train ---
def train(
    cfg: TrainConfig,
    info: DistInfo,
    state: TrainState,
    data: TrainData,
    built: BuiltModel,
    out: Reporter,
    *,
    start: int,
    identity: dict[str, Any],
) -> None:
    """Steps ``start`` .. ``plan.stop_step``: a metrics record per step, eval and checkpoints when due."""
    plan = data.plan
    peak = cfg.runtime.peak_tflops * 1e12 if cfg.runtime.peak_tflops else peak_flops(info.device)
    say = lambda message: log(info, message)
    profiler = step_profiler(cfg, info, built.config, peak, log=say, last_step=plan.stop_step)
    stop = stop_request()
    stop.deferring = True  # SIGTERM from here on: finish the step, save, exit 143
    compiles = CompileWatch()  # a compile after the warm-up steps: the slow path a busy GPU hides
    once: dict[str, Any] = {}
    finished = False
    try:
        for step in range(start, plan.stop_step + 1):
            if stop.agreed(info.device):
                stop_for_sigterm(cfg, info, state, step, plan, identity, start=start, built=built)
            if step == plan.stop_step:
                break
            micro, seq_lens = step_batches(cfg, info, data, step)
            if step == start:  # this process's first step: how long the start and the weight load took
                once = {"start_s": process_age_s(), "load_s": built.load_seconds}
            flops = step_flops(built.config, seq_lens) / info.world_size if profiler.due(step + 1) else None
            (result, seconds), profile = profiler.run(step + 1, timed_step, state, micro, flops=flops)
            if not result.finite:
                raise diverged(cfg, step + 1, result)
            computed = sum(int(mb["input_ids"].numel()) for mb in micro)
            record = step_record(
                info, step + 1, result, seconds, seq_lens, built.config, peak, computed_tokens=computed
            )
            out.write(record | profile | once)
            if once and info.device.type == "cuda":
                _say_autotune_searches(info)
            if said := compiles.step_done(step + 1):
                log(info, said, logging.WARNING)
            once = {}
            done = step + 1
            if data.eval_examples is not None and _due(cfg.evaluation.eval_every, done, plan.stop_step):
                out.write({"step": done} | _evaluate(cfg, state, data).record())
            if _due(cfg.checkpoint.save_steps, done, plan.stop_step):
                save(cfg, info, state, done, plan, identity, built)
        for said, level in ((profiler.summary(), logging.INFO), (compiles.summary(), logging.WARNING),
                            (unprofiled_warning(cfg, profiler, stop_step=plan.stop_step), logging.WARNING)):
            if said:
                log(info, said, level)
        finished = True
    finally:
        stop.deferring = False
        # On an error (a peer rank lost mid-step) the agent's SIGTERM can come while it unwinds: not an export.
        stop.when = (
            "during the final export; the last checkpoint is complete" if finished
            else "while a failed step unwound; the last complete checkpoint is kept"
        )
        if info.is_main:
            ckpt.remove_incomplete(cfg.checkpoint.output_dir)


def _evaluate(cfg: TrainConfig, state: TrainState, data: TrainData) -> Any:
    return evaluate(state, data.eval_examples, data.eval_blocks, max_length=cfg.packing.max_length,
                    pad_id=data.pad_id, packing=eval_layout(cfg.packing.packing))


def _say_autotune_searches(info: DistInfo) -> None:
    """After this process's first step: the fla kernel shapes searched for lack of a pin (a slow step 1's cause)."""
    from kernelguard.resolution import SEARCH_CACHE_VARIABLE, search_note

    note = search_note()
    if note is None:
        return
    if os.environ.get(SEARCH_CACHE_VARIABLE) == "1":
        note += "; their results are kept in Triton's cache folder (TRITON_CACHE_DIR): the next start here skips them"
    else:
        note += f"; {SEARCH_CACHE_VARIABLE} is not 1, so every start searches them again"
    log(info, note)


def stop_for_sigterm(
    cfg: TrainConfig, info: DistInfo, state: TrainState, step: int, plan: Plan, identity: dict[str, Any],
    *, start: int, built: BuiltModel | None = None,
) -> NoReturn:  # fmt: skip
    """SIGTERM reached a rank: checkpoint the ``step`` steps done (unless that checkpoint exists), then stop."""
    if step > start and not _due(cfg.checkpoint.save_steps, step, plan.stop_step):
        save(cfg, info, state, step, plan, identity, built)
    what = f"checkpoint step_{step} is saved" if step else "nothing was trained yet, nothing saved"
    raise Preempted(
        f"kernelguard train: stopped by SIGTERM after step {step} of {plan.stop_step}; {what} (exit 143). "
        f"Continue exactly from step {step} with the command below.",
        fix=resume_command(),
    )


def _due(every: int, done: int, stop: int) -> bool:
    return bool(every and done % every == 0) or done == stop


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


def save(
    cfg: TrainConfig, info: DistInfo, state: TrainState, step: int, plan: Plan, identity: dict[str, Any],
    built: BuiltModel | None = None,
) -> None:
    epoch, within = divmod(step, plan.steps_per_epoch)
    trainer_state = {
        "step": step,
        "scheduler": state.scheduler.state_dict(),
        "data": {
            "epoch": epoch,
            "step_in_epoch": within,
            "blocks_per_rank_consumed": within * cfg.training.gradient_accumulation_steps,
        },
        "world_size": info.world_size,
        "seed": cfg.training.seed,
        "num_blocks": len(plan.blocks),
        "schedule_steps": plan.schedule_steps,
        "identity": identity,
    }
    ckpt.save_checkpoint(
        cfg.checkpoint.output_dir,
        step=step,
        model=state.model,
        optimizer=state.optimizer,
        trainer_state=trainer_state,
        is_main=info.is_main,
        keep=cfg.checkpoint.save_total_limit,
        carry=lambda folder: write_source(folder, cfg.model, plan=built.weight_plan if built else None),
    )


# ----------------------------------------------------------------------------------------------- finish ---
def finish(cfg: TrainConfig, info: DistInfo, state: TrainState, built: BuiltModel, data: TrainData) -> None:
    """Export ``final/`` (safetensors + config + tokenizer) and plot the metrics."""
    if cfg.checkpoint.export:
        t0 = time.perf_counter()
        final = export_run(
            cfg.checkpoint.output_dir,
            model=state.model,
            built=built,
            tokenizer=data.tokenizer,
            dtype=DTYPES[cfg.runtime.param_dtype],
            info=info,
            max_shard_size=cfg.checkpoint.max_shard_size,
            source=cfg.model.model,
        )
        files = len(list(final.glob("*.safetensors"))) if info.is_main else 0
        log(info, f"exported {final} in {time.perf_counter() - t0:.1f} s ({files} safetensors file"
                  + ("s)" if files != 1 else ")"))
    if info.is_main and cfg.metrics.plot and (cfg.checkpoint.output_dir / METRICS_FILE).exists():
        if said := plot_run_metrics(cfg.checkpoint.output_dir):
            log(info, said, logging.WARNING if said.startswith("warning") else logging.INFO)
    steps = data.plan.stop_step
    log(info, f"done: {steps} step{'' if steps == 1 else 's'}; output in {cfg.checkpoint.output_dir}")
