"""Per-rank GPU memory of a `kernelguard train` run, estimated before any GPU is touched (`--dry-run`).

What `kernelguard train` holds per rank (FSDP2, ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``):

- **parameters**: fp32 shards, ``4 N / world`` bytes;
- **gradients**: fp32 shards, ``4 N / world``; they exist from the first backward of a step until
  ``zero_grad(set_to_none=True)``, so they are part of the peak only when the peak falls inside the backward
  or a later micro-batch (``--grad-accum`` > 1);
- **optimizer state**: AdamW ``exp_avg`` + ``exp_avg_sq`` in fp32, ``8 N / world``;
- **unsharded compute copies** (``param_dtype``): the root module (embeddings, final norm, LM head) stays
  gathered for the whole step (``reshard_after_forward=False``), plus up to two decoder layers in flight
  (the one running and the one FSDP2 prefetches) when each layer is freed after its forward
  (``--reshard-after-forward``); kept gathered, every layer from its forward to its backward: the whole model;
- **activations**: what autograd saves for the backward, *measured* by running the model's own forward on
  the meta device (no memory, no GPU) under ``torch.autograd.graph.saved_tensors_hooks`` with one packed
  block of ``block_size`` tokens, the fast kernels stood in for by what they save
  (kernelguard.train.model.memory_probe). With activation checkpointing only each layer's input is kept, plus one
  layer's activations while it is recomputed;
- **loss**: ``--loss chunked`` keeps the hidden-state and LM-head gradients (``T x hidden`` + ``vocab x
  hidden`` in ``param_dtype``) and, one 4,096-token chunk at a time, holds its logits, their fp32 copy
  (``log_softmax(dtype=float32)`` upcasts a bf16 input first) and the fp32 log-softmax - or, when the run
  compiles, its logits and their gradient in ``param_dtype`` (the compiled pass materialises no fp32 chunk);
  ``--loss logits`` keeps the fp32 log-softmax of every token and holds the logits and their fp32 copy
  through the loss;
- **gradient reduction**: FSDP2 reduces each group's gradients in fp32 (``reduce_dtype``): its unsharded
  ``param_dtype`` gradients are copied into an fp32 reduce-scatter input of the whole group, then an fp32
  output shard is allocated. For the root (embeddings + LM head: a third of the memory at Qwen3.5-27B's
  widths on few layers) that happens after the whole backward, with every other group's gradients alive.

``--activation-checkpointing``, ``--blocks-per-forward`` and ``--reshard-after-forward`` left to auto (the
defaults) take the fastest layout whose peak fits the card (:func:`choose_layout`; kernelguard.train.model.build logs it, or refuses the run).

The peak is the largest of three moments: the loss's forward (all saved activations + the loss buffers); the
backward, where each layer's saved tensors are freed as its gradients appear, so the larger of all saved and
all gradients (with checkpointing: plus the layer being recomputed), plus one layer's gradient reduction; and
the root's gradient reduction at the end of the backward. CUDA context, NCCL buffers and allocator slack
are not in torch's ``max_memory_allocated``; "fits" keeps 8% of the card free for them. Checked against
measured peaks (bench/RESULTS.md, memory): the 1.16 B proxy, and Qwen3.5-27B's widths where the root's
reduction is the peak (left out, a 4-layer run the estimate said fits ran out of memory there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kernelguard.errors import ConfigError

from ..common.logs import human_count
from .memory_probe import PROBE_ATTENTION, ActivationProbe, measure_activations
from .memory_terms import BACKWARD, LOSS_FORWARD, ROOT_REDUCE, loss_bytes, reduce_bytes, root_reduction_bytes

GIB = 2**30
HEADROOM = 0.92  # share of the card torch may allocate before "does not fit"
COMMON_GPUS: tuple[tuple[str, float], ...] = (("80 GB (H100/A100)", 80e9), ("141 GB (H200)", 141e9))

__all__ = [
    "COMMON_GPUS",
    "GIB",
    "HEADROOM",
    "PROBE_ATTENTION",
    "ActivationProbe",
    "Layout",
    "LayoutChoice",
    "MemoryEstimate",
    "candidate_layouts",
    "choose_layout",
    "combine",
    "estimate",
    "measure_activations",
    "min_world_size",
]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-rank bytes of one `kernelguard train` configuration; ``fits`` against ``gpu_bytes`` when known."""

    world_size: int
    block_size: int
    activation_checkpointing: bool
    loss: str
    param_dtype: str
    grad_accum: int  # forwards per optimizer step
    num_params: int
    params_per_rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    activation_bytes: int
    loss_bytes: int
    peak_bytes: int
    gpu_bytes: int | None
    gpu_source: str
    notes: tuple[str, ...] = field(default=())
    blocks_per_forward: int = 1  # packed blocks in each forward's row (block_size counts all their tokens)
    compiled_loss: bool = False  # the chunked loss's softmax-gradient pass compiled (the run compiles)
    reshard_after_forward: bool = True  # each layer's gathered weights freed after its forward
    # No GPU visible: whether auto's choice on each of COMMON_GPUS fits it (the choice may differ per card).
    card_fits: tuple[tuple[str, bool], ...] = ()

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_bytes is None else self.peak_bytes <= HEADROOM * self.gpu_bytes

    def fits_on(self, gpu_bytes: float) -> bool:
        return self.peak_bytes <= HEADROOM * gpu_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        data["fits"] = self.fits
        data["fits_common_gpus"] = dict(self.card_fits) or {name: self.fits_on(size) for name, size in COMMON_GPUS}
        return data

    def render(self) -> str:
        ac = "on every decoder layer" if self.activation_checkpointing else "off"
        rows = [
            ("parameters (fp32 shards)", self.parameter_bytes),
            ("gradients (fp32 shards)", self.gradient_bytes),
            ("optimizer state (AdamW, fp32 shards)", self.optimizer_bytes),
            (f"unsharded {self.param_dtype} copies ("
             f"{'root + 2 layers' if self.reshard_after_forward else 'whole model'})",
             self.unsharded_bytes),
            ("activations", self.activation_bytes),
            (f"loss ({self.loss}{', compiled' if self.compiled_loss and self.loss == 'chunked' else ''})",
             self.loss_bytes),
        ]
        head = (
            f"memory per rank: {human_count(self.num_params)} parameters over {self.world_size} rank(s) "
            f"({human_count(self.params_per_rank)} each), {self._rows()}, activation "
            f"checkpointing {ac}, {self.grad_accum} forward{'s' if self.grad_accum != 1 else ''} per step"
        )
        lines = [head]
        lines += [f"  {name:<44} {_gib(value):>9}" for name, value in rows]
        lines.append(f"  {'estimated peak':<44} {_gib(self.peak_bytes):>9}")
        lines.append("  " + self._verdict())
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _rows(self) -> str:
        n = self.blocks_per_forward
        if n == 1:
            return f"{self.block_size:,}-token blocks"
        return f"{n} blocks of {self.block_size // n:,} tokens per forward ({self.block_size:,}-token rows)"

    def _verdict(self) -> str:
        if self.gpu_bytes is not None:
            word = "fits" if self.fits else "does NOT fit"
            return f"{word} on {self.gpu_source} ({_gib(self.gpu_bytes)}, keeping {1 - HEADROOM:.0%} free)"
        fits = dict(self.card_fits) or {name: self.fits_on(size) for name, size in COMMON_GPUS}
        parts = [f"{'fits' if ok else 'does NOT fit'} on {name}" for name, ok in fits.items()]
        return "; ".join(parts) + f" (no GPU visible; keeping {1 - HEADROOM:.0%} free)"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ------------------------------------------------------------------------------------------------ entry ---
def estimate(
    cfg: Any,
    *,
    world_size: int | None = None,
    gpu_bytes: int | None = None,
    model: Any = None,
    progress: Callable[[str], None] | None = None,
) -> MemoryEstimate:
    """Estimate per-rank memory for ``cfg`` (a :class:`kernelguard.train.settings.config.TrainConfig`).

    ``world_size``: default ``$WORLD_SIZE``, else 1. ``gpu_bytes``: default the visible GPU's memory; with no
    GPU the verdict is given for 80 GB and 141 GB cards. Settings left to auto (``--activation-checkpointing``,
    ``--blocks-per-forward``) are estimated as :func:`choose_layout` picks them on that GPU, with its reason in
    the notes; with no GPU, as it picks them on the largest of ``COMMON_GPUS``, and the notes give its choice
    on each. ``model``: the run's model from :func:`kernelguard.train.model.memory_probe.build_probe_model`,
    when the caller has it (else it is built); ``progress`` hears each stage (``--dry-run`` prints them)."""
    estimate_for, gpu, source = _estimator(
        cfg, world_size=world_size, gpu_bytes=gpu_bytes, model=model, progress=progress
    )
    if gpu is None:  # the job's GPU decides; shown: what auto picks on the largest common card
        choices = [(name, _choose(cfg, estimate_for, int(size), name)) for name, size in COMMON_GPUS]
        shown = choices[-1][1]
        if len(candidate_layouts(cfg)) == 1:
            return shown.estimate
        cards = ", ".join(f"{name}: {_picked(choice, _block(cfg))}" for name, choice in choices)
        note = f"auto decides on the job's GPU ({cards}); shown: {COMMON_GPUS[-1][0]}"
        fits = tuple((name, choice.fits) for name, choice in choices)
        return replace(shown.estimate, notes=(*shown.estimate.notes, note), card_fits=fits)
    choice = _choose(cfg, estimate_for, gpu, source)
    if len(candidate_layouts(cfg)) == 1:
        return choice.estimate
    note = f"auto: {choice.layout.describe(_block(cfg))}: {choice.reason}"
    return replace(choice.estimate, notes=(*choice.estimate.notes, note))


def _picked(choice: LayoutChoice, block_size: int) -> str:
    if choice.fits:
        return choice.layout.describe(block_size)
    more = f"; {choice.ranks_that_fit} GPUs in all would fit it" if choice.ranks_that_fit else ""
    return f"nothing fits, the run is refused before loading{more}"


@dataclass(frozen=True, slots=True)
class Layout:
    """How one optimizer step's blocks meet the model: recomputed or saved activations, how many of the step's
    blocks go through the model in one forward (one packed row), and whether each decoder layer's gathered
    weights are freed after its forward (and gathered and cast again for its backward) or kept."""

    activation_checkpointing: bool
    blocks_per_forward: int
    reshard_after_forward: bool = True

    def describe(self, block_size: int) -> str:
        ac = "on" if self.activation_checkpointing else "off"
        n = self.blocks_per_forward
        blocks = f"{n} block{'s' if n != 1 else ''} ({n * block_size:,} tokens)"
        kept = "" if self.reshard_after_forward else ", weights kept gathered"
        return f"activation checkpointing {ac}, {blocks} per forward{kept}"

    def flags(self) -> str:
        """The command-line flags that give exactly this layout (no estimate is made then)."""
        ac = "--activation-checkpointing" if self.activation_checkpointing else "--no-activation-checkpointing"
        rs = "--reshard-after-forward" if self.reshard_after_forward else "--no-reshard-after-forward"
        return f"{ac} --blocks-per-forward {self.blocks_per_forward} {rs}"


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """What auto chose for one run, why (with the figures), and its estimate."""

    layout: Layout
    reason: str
    estimate: MemoryEstimate
    fits: bool = True
    ranks_that_fit: int | None = None  # when nothing fits: the fewest ranks (GPUs) whose share of it would
    budget: str = ""  # "92% of 79.18 GiB on NVIDIA H100 80GB HBM3"


def candidate_layouts(cfg: Any) -> list[Layout]:
    """The layouts auto may pick for ``cfg``, fastest first; a setting given by the user is the only value
    tried for it. No checkpointing beats fewer blocks per forward (measured on the proxy: off 1.2-1.3x, two
    blocks per forward 1.18x, bench/RESULTS.md), which beats keeping the weights gathered (a few per cent), so
    checkpointing is turned on only when no block count fits without it, and the weights are freed after
    each forward before a block count is given up."""
    accum = int(cfg.training.gradient_accumulation_steps)
    rt = cfg.runtime
    acs = [False, True] if rt.activation_checkpointing is None else [bool(rt.activation_checkpointing)]
    counts = [rt.blocks_per_forward] if rt.blocks_per_forward else [n for n in range(accum, 0, -1) if accum % n == 0]
    reshards = [False, True] if rt.reshard_after_forward is None else [bool(rt.reshard_after_forward)]
    return [Layout(ac, n, r) for ac in acs for n in counts for r in reshards]


def choose_layout(
    cfg: Any, *, gpu_bytes: int, gpu_source: str, world_size: int | None = None
) -> LayoutChoice:
    """The first of :func:`candidate_layouts` whose estimated peak fits ``HEADROOM`` of ``gpu_bytes``; when
    none does, the one that needs least memory, said so. Neither setting changes the results: checkpointing
    recomputes the forward exactly, and blocks in one packed row keep their boundaries and their share of the
    step's token-mean loss."""
    estimate_for, _, _ = _estimator(cfg, world_size=world_size, gpu_bytes=gpu_bytes, gpu_source=gpu_source)
    return _choose(cfg, estimate_for, gpu_bytes, gpu_source)


def _block(cfg: Any) -> int:
    return int(cfg.packing.max_length)


def _choose(
    cfg: Any, estimate_for: Callable[..., MemoryEstimate], gpu: int, source: str
) -> LayoutChoice:
    budget = f"{HEADROOM:.0%} of {_gib(gpu)} on {source}"
    candidates = candidate_layouts(cfg)
    estimates: list[MemoryEstimate] = []
    for layout in candidates:
        est = estimate_for(layout)
        estimates.append(est)
        if not est.fits_on(gpu):
            continue
        reason = f"estimated peak {_gib(est.peak_bytes)} fits {budget}"
        if layout != candidates[0]:
            reason += f"; {candidates[0].describe(_block(cfg))} would need {_gib(estimates[0].peak_bytes)}"
        return LayoutChoice(layout, reason, est)
    least = min(estimates, key=lambda e: e.peak_bytes)
    layout = Layout(least.activation_checkpointing, least.blocks_per_forward, least.reshard_after_forward)
    ranks = min_world_size(lambda n: estimate_for(layout, n), gpu)
    more = f"{ranks} GPUs in all would fit it" if ranks else "no number of GPUs would fit it"
    reason = (
        f"estimated peak {_gib(least.peak_bytes)} does not fit {budget} in any layout "
        f"({more}; a smaller --max-length needs less)"
    )
    return LayoutChoice(layout, reason, least, fits=False, ranks_that_fit=ranks, budget=budget)


def _estimator(
    cfg: Any, *, world_size: int | None, gpu_bytes: int | None, gpu_source: str = "the given GPU memory",
    model: Any = None, progress: Callable[[str], None] | None = None,
) -> tuple[Callable[..., MemoryEstimate], int | None, str]:
    """(layout -> the estimate, GPU bytes, where they came from): the model is built once and probed once per
    row length."""
    from .memory_probe import build_probe_model
    from .parallel import model_source

    ranks = _world_size(world_size)
    hf_config = model.config if model is not None else model_source(str(cfg.model.model))[0]
    block = _block(cfg)
    accum = int(cfg.training.gradient_accumulation_steps)
    probes: dict[int, ActivationProbe] = {}
    gpu, source = (gpu_bytes, gpu_source) if gpu_bytes else _visible_gpu()

    def probe(tokens: int) -> ActivationProbe:
        nonlocal model
        if tokens not in probes:
            if model is None:
                model = build_probe_model(hf_config)
            probes[tokens] = measure_activations(
                hf_config, tokens=tokens, param_dtype=cfg.runtime.param_dtype, model=model, progress=progress
            )
        return probes[tokens]

    def estimate_for(layout: Layout, world: int | None = None) -> MemoryEstimate:
        n = layout.blocks_per_forward
        return combine(
            probe(n * block),
            world_size=world or ranks,
            block_size=n * block,
            activation_checkpointing=layout.activation_checkpointing,
            loss=str(cfg.runtime.loss),
            param_dtype=str(cfg.runtime.param_dtype),
            grad_accum=max(1, accum // n),
            blocks_per_forward=n,
            gpu_bytes=gpu,
            gpu_source=source,
            compiled_loss=cfg.runtime.compile is not False,  # auto compiles GPU runs, the ones estimated
            reshard_after_forward=layout.reshard_after_forward,
        )

    return estimate_for, gpu, source


def _world_size(given: int | None) -> int:
    raw = given or os.environ.get("WORLD_SIZE") or 1
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value <= 0:
        raise ConfigError(
            f"world size is {raw!r}; it must be a positive integer.", fix="WORLD_SIZE=8 (or unset)"
        )
    return value


def _visible_gpu() -> tuple[int | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU"
    props = torch.cuda.get_device_properties(0)
    return int(props.total_memory), props.name


# ---------------------------------------------------------------------------------------------- combine ---
def combine(
    probe: ActivationProbe,
    *,
    world_size: int,
    block_size: int,
    activation_checkpointing: bool,
    loss: str,
    param_dtype: str,
    grad_accum: int = 1,
    blocks_per_forward: int = 1,
    gpu_bytes: int | None = None,
    gpu_source: str = "no GPU",
    compiled_loss: bool = False,
    reshard_after_forward: bool = True,
) -> MemoryEstimate:
    """The per-rank figures and peak from a probe (see the module docstring for each term)."""
    n, cb = probe.num_params, probe.compute_bytes
    per_rank = math.ceil(n / world_size)
    params, grads, optim = 4 * per_rank, 4 * per_rank, 8 * per_rank
    in_flight = probe.root_params + 2 * probe.max_layer_params  # kept gathered: every layer, until its backward
    unsharded = cb * (in_flight if reshard_after_forward else max(in_flight, n))
    static = params + optim + unsharded
    kept, transient = loss_bytes(probe, loss, compiled=compiled_loss)
    if activation_checkpointing:
        layer_inputs = probe.num_layers * probe.tokens * probe.hidden_size * cb
        saved_fwd = layer_inputs + probe.root_saved
        activations = saved_fwd + probe.max_layer_saved  # plus the layer being recomputed in the backward
    else:
        saved_fwd = activations = probe.total_saved
    # The backward frees each layer's saved tensors as its gradients appear: saved + gradients peaks at one end
    # (with checkpointing, one recomputed layer on top). An earlier micro-batch's gradients are alive throughout
    # with --grad-accum > 1; otherwise zero_grad(set_to_none=True) freed the last step's.
    accum_grads = grads if grad_accum > 1 else 0
    at_loss = static + saved_fwd + kept + transient + accum_grads
    saved_and_grads = saved_fwd + grads if grad_accum > 1 else max(saved_fwd, grads)
    in_backward = static + kept + saved_and_grads + (activations - saved_fwd)
    in_backward += reduce_bytes(probe.max_layer_params, cb, world_size)
    at_root = params + optim + root_reduction_bytes(probe, grads, world_size, grad_accum)
    moments = [(f"the {LOSS_FORWARD}", at_loss), (f"the {BACKWARD}", in_backward), (f"the {ROOT_REDUCE}", at_root)]
    where, peak = max(moments, key=lambda kv: kv[1])
    notes = [*probe.notes, f"the peak is reached in {where}"]
    return MemoryEstimate(
        world_size=world_size,
        block_size=block_size,
        activation_checkpointing=activation_checkpointing,
        loss=loss,
        param_dtype=param_dtype,
        grad_accum=grad_accum,
        blocks_per_forward=blocks_per_forward,
        num_params=n,
        params_per_rank=per_rank,
        parameter_bytes=params,
        gradient_bytes=grads,
        optimizer_bytes=optim,
        unsharded_bytes=unsharded,
        activation_bytes=activations,
        loss_bytes=kept + transient,
        peak_bytes=peak,
        gpu_bytes=gpu_bytes,
        gpu_source=gpu_source,
        notes=tuple(notes),
        compiled_loss=compiled_loss,
        reshard_after_forward=reshard_after_forward,
    )


def min_world_size(
    estimate_for: Callable[[int], MemoryEstimate], gpu_bytes: float, limit: int = 4096
) -> int | None:
    """The smallest world size whose per-rank peak fits ``gpu_bytes`` (None when even ``limit`` does not)."""
    ranks = 1
    while ranks <= limit:
        if estimate_for(ranks).fits_on(gpu_bytes):
            return ranks
        ranks *= 2
    return None
