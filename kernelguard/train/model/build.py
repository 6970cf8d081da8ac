"""Build what a run trains: the model (meta first, for the guard), then AC + compile + FSDP2 + weights, then
AdamW.

    model = build_model(model=cfg.model, runtime=cfg.runtime, info=info)  # meta device: the guard inspects it
    state = prepare_training(model, cfg, info, schedule_steps=N)   # AC, compile, FSDP2, weights, optimizer
    result = optimizer_step(state, blocks)               # kernelguard.train.step.step

:func:`setup_training` does both for callers that have no gate of their own (the benchmark).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernelguard.errors import ConfigError

from ..common.logs import logger
from ..common.ranks import DistInfo, on_main
from ..settings.config import ModelSection, OptimizerSection, RuntimeSection, TrainConfig
from ..step.loss import return_hidden_states_from_head
from ..step.step import TrainState, lr_lambda, warmup_length
from .parallel import (
    apply_activation_checkpointing,
    apply_fsdp,
    build_meta_model,
    decoder_layers,
    mixed_precision,
    model_source,
)
from .weight_files import weights_to_load
from .weights import load_weights, plan_weights

__all__ = [
    "BuiltModel",
    "StepLayout",
    "build_model",
    "choose_attention",
    "make_optimizer",
    "prepare_training",
    "resolve_step_layout",
    "setup_training",
]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """How a run's steps run (what auto chose, or the flags): the one line that says it, and why."""

    activation_checkpointing: bool
    blocks_per_forward: int
    compile: bool
    line: str
    reshard_after_forward: bool = True


@dataclass(slots=True)
class BuiltModel:
    """The model on the meta device and where its config and weights came from."""

    model: torch.nn.Module
    config: Any  # transformers PretrainedConfig
    weights: Path | None  # None: seeded random init
    attention: str  # the attn_implementation it was built with
    activation_checkpointing: bool | None = None  # what prepare_training applied (None: not yet prepared)
    layout: StepLayout | None = None  # what prepare_training chose, with its line (None: not yet prepared)
    compiled: Any = None  # kernelguard.train.model.compile.RegionalCompile with --compile, once prepared
    weight_plan: Any = None  # kernelguard.train.model.weights.WeightPlan: the sharded load (None: rank 0 loads)
    weight_note: str | None = None  # why rank 0 loads, when it does
    load_seconds: float | None = None  # the weight load's wall time, once prepared (all ranks done)


def choose_attention(choice: str, device: torch.device, *, padded: bool = False) -> str:
    """``auto``: torch's varlen attention when this device has it, else sdpa; ``varlen`` insists on it.
    Padded batches (``--packing none``) carry an attention mask, which the varlen path does not take: sdpa."""
    from kernelguard.runtime import VARLEN_NAME, register_varlen_attention

    name = register_varlen_attention(device_type=device.type)
    if padded and choice in ("auto", "varlen"):
        if choice == "varlen":
            raise ConfigError(
                "--attention varlen takes packed rows (cu_seq_lens), not the padded batches of --packing none.",
                fix="use --attention auto (sdpa for padded batches), or drop --packing none",
            )
        return "sdpa"
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


def build_model(
    *, model: ModelSection, runtime: RuntimeSection, info: DistInfo, padded: bool = False
) -> BuiltModel:
    """The model on the meta device (no memory, no weights read): what the guard inspects."""
    config, _ = model_source(model.model)
    weights, _ = weights_to_load(model.model, init=model.init)  # refuses a folder without loadable weights
    attention = choose_attention(runtime.attention, info.device, padded=padded)
    meta = build_meta_model(config, attn_implementation=attention)
    attention = str(getattr(meta.config, "_attn_implementation", None) or attention)  # eager where refused
    decoder_layers(meta)  # a layout the trainer cannot shard is refused now, before anything is written
    # Headers only: a checkpoint that does not fit the config is refused before any memory is used.
    plan, note = plan_weights(meta, weights) if weights is not None else (None, None)
    return BuiltModel(meta, config, weights, attention, weight_plan=plan, weight_note=note)


def make_optimizer(
    model: torch.nn.Module, *, optimizer: OptimizerSection, device: torch.device, schedule_steps: int
) -> tuple[Any, Any]:
    """AdamW (no decay on norms and biases) and the warmup + --lr-scheduler-type LambdaLR over
    ``schedule_steps``."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": optimizer.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # Parameters FSDP2 keeps whole (parallel.apply_fsdp's fp32 ones) get a group of their own: a fused or
    # foreach AdamW step takes DTensors or plain tensors, not both in one group.
    from torch.distributed.tensor import DTensor

    whole = [p for p in decay + no_decay if not isinstance(p, DTensor)]
    if whole and len(whole) < len(decay) + len(no_decay):
        for group in groups:
            group["params"] = [p for p in group["params"] if isinstance(p, DTensor)]
        groups.append({"params": whole, "weight_decay": 0.0})  # the GDN decay: never weight-decayed
    # Fused on CPU too: CPU runs (the test suite) take the GPU's optimizer path, found_inf included (step.py).
    opt = torch.optim.AdamW(
        groups, lr=optimizer.learning_rate, betas=optimizer.adam_betas, fused=device.type in ("cuda", "cpu")
    )
    warmup = warmup_length(optimizer.warmup_steps, optimizer.warmup_ratio, schedule_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(warmup, schedule_steps, optimizer.min_lr_ratio, optimizer.lr_scheduler_type)
    )
    return opt, sched


def resolve_step_layout(cfg: TrainConfig, info: DistInfo) -> StepLayout:
    """Activation checkpointing, blocks per forward, resharding and compile for this run; the user's flags win.

    auto on a GPU: the fastest layout whose memory estimate fits the card (kernelguard.train.model.memory.
    choose_layout; rank 0 decides for every rank) and compile on. auto on CPU: checkpointing on, all of a step's
    blocks in one forward, weights freed after each forward, no compile (CPU runs are tests: there is no GPU
    memory to budget, compiling costs more than it saves there, and the suite keeps covering the checkpointed
    path). None of the four changes the math."""
    rt = cfg.runtime
    gpu = info.device.type == "cuda"
    compile_on = gpu if rt.compile is None else bool(rt.compile)
    compile_why = (
        f"auto: a {'GPU' if gpu else info.device.type} run" if rt.compile is None
        else "--compile" if rt.compile else "--no-compile"
    )
    given = [
        *(["--activation-checkpointing" if rt.activation_checkpointing else "--no-activation-checkpointing"]
          if rt.activation_checkpointing is not None else []),
        *([f"--blocks-per-forward {rt.blocks_per_forward}"] if rt.blocks_per_forward else []),
        *(["--reshard-after-forward" if rt.reshard_after_forward else "--no-reshard-after-forward"]
          if rt.reshard_after_forward is not None else []),
    ]
    from .memory import Layout, choose_layout

    if len(given) == 3 or not gpu:
        ac = True if rt.activation_checkpointing is None else bool(rt.activation_checkpointing)
        auto = [] if len(given) == 3 else [f"auto: a {info.device.type} run has no GPU memory to budget"]
        why = "; ".join([*given, *auto, f"compile: {compile_why}"])
        # Off the GPU all of a step's blocks share one row: the fewest forwards, nothing to budget.
        blocks = rt.blocks_per_forward or cfg.training.gradient_accumulation_steps
        reshard = True if rt.reshard_after_forward is None else bool(rt.reshard_after_forward)
        return _layout(Layout(ac, blocks, reshard), compile_on, why, cfg)
    props = torch.cuda.get_device_properties(info.device)
    try:
        choice = on_main(
            info,
            lambda: choose_layout(
                cfg, gpu_bytes=int(props.total_memory), gpu_source=props.name, world_size=info.world_size
            ),
        )
    except Exception as e:  # noqa: BLE001 - the estimate only advises: never fail a run that would train
        ac = True if rt.activation_checkpointing is None else bool(rt.activation_checkpointing)
        reshard = True if rt.reshard_after_forward is None else bool(rt.reshard_after_forward)
        return _layout(Layout(ac, rt.blocks_per_forward or 1, reshard), compile_on,
                       f"auto: the memory estimate failed: {e}; compile: {compile_why}", cfg)
    if not choice.fits:  # before any weight is read: an out-of-memory traceback at the first step says less
        raise does_not_fit(choice, block_size=int(cfg.packing.max_length), world_size=info.world_size)
    why = "; ".join([*given, f"auto: {choice.reason}"])
    return _layout(choice.layout, compile_on, f"{why}; compile: {compile_why}", cfg)


def does_not_fit(choice: Any, *, block_size: int, world_size: int) -> ConfigError:
    """The error a GPU run raises, before loading anything, when no layout fits its card (a
    :class:`~kernelguard.train.model.memory.LayoutChoice` with ``fits`` false): the figures, where the peak
    falls, and what would fit. The user's own layout flags still win: with all three given, nothing is
    estimated."""
    from .memory import GIB, HEADROOM

    est, ranks, layout = choice.estimate, choice.ranks_that_fit, choice.layout
    where = est.notes[-1].removeprefix("the peak is reached in ") if est.notes else "the step"
    ways = "a smaller --max-length needs less activation memory (--dry-run shows every term)"
    fix = "kernelguard train --dry-run ...   (every term of the estimate)"
    if ranks is not None:
        launch = f"--nproc-per-node {ranks}" if ranks <= 8 else f"--nnodes {-(-ranks // 8)} --nproc-per-node 8"
        ways = f"{ranks} GPUs in all would fit it (docs/multi-node.md); " + ways
        fix = f"kernelguard train {launch} ..."
    return ConfigError(
        f"the training step does not fit this GPU: its least-memory layout ({layout.describe(block_size)}) is "
        f"estimated at {est.peak_bytes / GIB:.2f} GiB per rank over {world_size} rank(s), reached in {where}; "
        f"the budget is {choice.budget} ({HEADROOM * (est.gpu_bytes or 0) / GIB:.2f} GiB). Nothing was loaded. "
        f"{ways}. To try this layout anyway, give it: {layout.flags()}.",
        fix=fix,
    )


def _layout(layout: Any, compile_on: bool, why: str, cfg: TrainConfig) -> StepLayout:
    text = layout.describe(int(cfg.packing.max_length))
    line = f"step: {text}, compile {'on' if compile_on else 'off'} ({why})"
    return StepLayout(layout.activation_checkpointing, layout.blocks_per_forward, compile_on, line,
                      layout.reshard_after_forward)


def prepare_training(
    built: BuiltModel, cfg: TrainConfig, info: DistInfo, *, schedule_steps: int
) -> TrainState:
    """Activation checkpointing, regional compile, FSDP2 over a 1D mesh, weights from rank 0, optimizer: ready
    to step."""
    from torch.distributed.device_mesh import init_device_mesh

    model = built.model
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))
    # Compile before fully_shard (torchtitan's order) and before AC: dynamo cannot trace a checkpoint region
    # with graph breaks in it (the opaque kernels), so a compiled checkpoint wrapper would run all eager; a
    # checkpoint of the compiled layer recomputes the compiled forward instead.
    if cfg.runtime.fused_norms:  # before compile: the compiled layers trace the fused forwards
        from .fused_norms import fuse_norms

        _log(info, fuse_norms(model).describe())
    layout = built.layout = resolve_step_layout(cfg, info)
    _log(info, layout.line)
    if layout.compile:
        from .compile import compile_layers

        built.compiled = compile_layers(model)
        _log(info, built.compiled.describe())
    built.activation_checkpointing = layout.activation_checkpointing
    if built.activation_checkpointing:
        apply_activation_checkpointing(model)
    # Before sharding: the head keeps its parameters and names, only its forward changes.
    head = return_hidden_states_from_head(model) if cfg.runtime.loss == "chunked" else None
    if head is not None:
        head.compiled_chunks = layout.compile  # the loss's softmax-gradient pass compiled with the layers
        # The model's output is then a slice of the hidden states (a view); FSDP2 warns that an in-place op
        # on it would skip its pre-backward hook. The loss only reads it.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    apply_fsdp(
        model,
        mesh=mesh,
        mp_policy=mixed_precision(cfg.runtime.param_dtype),
        reshard_after_forward=layout.reshard_after_forward,
    )
    t0 = time.perf_counter()
    how = load_weights(
        model, plan=built.weight_plan, note=built.weight_note, info=info, config=built.config,
        weights=built.weights, seed=cfg.training.seed,
    )
    built.load_seconds = _all_done(info, t0)
    _log(info, f"weights: {_LOADED[how]} in {built.load_seconds:.1f} s")
    model.train()
    optimizer, scheduler = make_optimizer(
        model, optimizer=cfg.optimizer, device=info.device, schedule_steps=schedule_steps
    )
    return TrainState(
        model, optimizer, scheduler, info, head=head, grad_clip=cfg.optimizer.max_grad_norm,
        blocks_per_forward=layout.blocks_per_forward,
    )


_LOADED = {
    "sharded": "loaded (each rank read its own slices)",
    "rank0": "loaded (rank 0 read them and broadcast)",
    "random": "initialised (seeded random init, each rank its own shards on its device)",
}


def _all_done(info: DistInfo, t0: float) -> float:
    """Seconds since ``t0`` once every rank (and its device) has finished."""
    import torch.distributed as dist

    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return time.perf_counter() - t0


def _log(info: DistInfo, message: str) -> None:
    if info.is_main:
        logger.info(message)


def setup_training(cfg: TrainConfig, info: DistInfo, *, schedule_steps: int) -> tuple[BuiltModel, TrainState]:
    """:func:`build_model` + :func:`prepare_training` without the guard (the benchmark's entry point)."""
    torch.manual_seed(cfg.training.seed)
    built = build_model(model=cfg.model, runtime=cfg.runtime, info=info)
    return built, prepare_training(built, cfg, info, schedule_steps=schedule_steps)
