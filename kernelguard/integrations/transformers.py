"""kernelguard inside ``transformers.Trainer`` and TRL's ``SFTTrainer``: the ``kernelguard train`` gate as a callback.

    from kernelguard.integrations.transformers import KernelGuardCallback, register_varlen_attention

    attn = register_varlen_attention()  # "kernelguard_varlen" on CUDA (torch >= 2.10), no flash-attn needed
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=attn, dtype=torch.bfloat16)
    trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, ...), train_dataset=...,
                         callbacks=[KernelGuardCallback()])
    trainer.train()  # a kernel that would fall back stops the job here, before step 1, with the per-layer table

On train begin the callback runs the same gate as ``kernelguard train`` on the real, already-built model: the
known-bad-stack check for this model on this GPU (CUDA only: it needs the GPU's arch), then
``kernelguard.guard(model, mode="training", packed=...)`` — packed when the collator packs. A refusal raises the
kernelguard error out of ``trainer.train()`` before any optimizer step; under torchrun/accelerate every rank stops
together and the report is printed once. When it passes, the tripwires stay armed for the run (a reference path
entered later still raises) and are disarmed on train end; the provider table is printed on rank 0 and the
resolved providers are recorded in ``trainer.state.log_history`` (saved in every checkpoint's
``trainer_state.json``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from kernelguard.errors import ConfigError, KernelFallbackError, KernelGuardError
from kernelguard.resolution import (
    CU_SEQ_LENS_Q,
    PACKED_WITHOUT_BOUNDARIES,
    PYTHON,
    SEQ_IDX,
    AllowPolicy,
    allow_hint,
)
from kernelguard.runtime import VARLEN_NAME, gate, register_varlen_attention

__all__ = [
    "VARLEN_NAME",
    "KernelGuardCallback",
    "Packing",
    "check_stack",
    "detect_packing",
    "failing_ranks",
    "guard_model",
    "packing_note",
    "providers_summary",
    "register_varlen_attention",
    "training_gate",
]

LOG_KEY = "kernelguard"
PROFILE_KEY = "kernelguard_profile"  # log_history entries of the step diagnosis's profiled steps
# Trainer arguments (TRL's SFTConfig) under which the collator flattens a batch into one packed row.
_PACKING_STRATEGIES_THAT_FLATTEN = ("bfd", "bfd_split")


# ----------------------------------------------------------------------------------------------- packing ---
@dataclass(frozen=True, slots=True)
class Packing:
    """Whether batches are packed rows, why we think so, and whether they carry the example boundaries."""

    packed: bool
    source: str  # e.g. "SFTConfig.padding_free=True", "DataCollatorWithFlattening", "KernelGuardCallback(packed=True)"
    boundaries: bool | None  # cu_seq_lens_* and seq_idx reach the model; None: not known for this collator


def detect_packing(args: Any, collator: Any, *, packed: bool | None = None) -> Packing:
    """How this run batches: TRL's ``padding_free`` / bfd packing, transformers' ``DataCollatorWithFlattening``,
    any collator with ``padding_free=True``; ``packed`` (not None) overrides the detection."""
    boundaries = _collator_boundaries(collator)
    if packed is not None:
        return Packing(bool(packed), f"KernelGuardCallback(packed={bool(packed)})", boundaries)
    name = type(args).__name__
    if getattr(args, "padding_free", False) is True:
        return Packing(True, f"{name}.padding_free=True", boundaries)
    strategy = getattr(args, "packing_strategy", None)
    if getattr(args, "packing", False) is True and strategy in _PACKING_STRATEGIES_THAT_FLATTEN:
        return Packing(True, f"{name}.packing=True (packing_strategy={strategy!r})", boundaries)
    if _is_flattening(collator) or getattr(collator, "padding_free", False) is True:
        return Packing(True, type(collator).__name__, boundaries)
    return Packing(False, "padded batches (no padding-free or flattening collator)", boundaries)


def packing_note(args: Any) -> str | None:
    """A line for a packing that mixes examples by design, which no batch shows: TRL's ``wrapped`` strategy joins
    the examples and cuts rows mid-example, so every layer (attention and GDN alike) sees the previous one. Said,
    not refused: it is the user's choice, not a kernel's fallback."""
    if getattr(args, "packing", False) is True and getattr(args, "packing_strategy", None) == "wrapped":
        return (f"kernelguard: note: {type(args).__name__}.packing_strategy='wrapped' joins the examples and cuts "
                "rows mid-example: each row's examples see one another in every layer (attention and GDN state "
                "alike). packing_strategy='bfd' keeps them apart.")
    return None


def _is_flattening(collator: Any) -> bool:
    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:
        return False
    return isinstance(collator, DataCollatorWithFlattening)


def _collator_boundaries(collator: Any) -> bool | None:
    """GDN layers read example boundaries only from ``cu_seq_lens_q`` and ``seq_idx``, never from position ids:
    a flattened row without them silently carries recurrent and conv state from one example into the next."""
    if _is_flattening(collator):
        return bool(getattr(collator, "return_flash_attn_kwargs", False) and getattr(collator, "return_seq_idx", False))
    if getattr(collator, "padding_free", False) is not True:
        return None
    try:  # TRL's padding-free collator needs only input_ids; ask it rather than trusting a version table
        out = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    except Exception:  # noqa: BLE001 - an unknown collator: say "unknown", never fail the run on a probe
        return None
    return isinstance(out, Mapping) and CU_SEQ_LENS_Q in out and SEQ_IDX in out


def _collator_of(train_dataloader: Any) -> Any:
    """The user's collator behind the dataloader (Trainer wraps it in a ``RemoveColumnsCollator``)."""
    collator = getattr(train_dataloader, "collate_fn", None)
    for _ in range(4):
        inner = getattr(collator, "data_collator", None)
        if inner is None or not callable(inner):
            break
        collator = inner
    return collator


# ------------------------------------------------------------------------------------------------- gate ---
def _check_reference(model: Any, model_ref: str | None, folder: Path) -> str | None:
    """What ``kernelguard check`` should resolve: the user's ``model=``, else the model's own config written to
    ``folder`` (so the check sees its real key head dim); None for a model family kernelguard does not know."""
    if model_ref is not None:
        return model_ref
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return None
    path = folder / "config.json"
    config.to_json_file(str(path), use_diff=False)
    from kernelguard.resolution import discovery

    try:
        discovery.resolve_model(str(path))
    except ConfigError:  # not a family with fallback kernels: the guard still checks attention
        return None
    return str(path)


def check_stack(model: Any, *, allow: tuple[str, ...], packed: bool, model_ref: str | None = None) -> Any:
    """The environment half of the gate (known-bad stacks on this GPU, e.g. fla #640 on Hopper):
    :func:`kernelguard.runtime.gate.check_stack` on the model's own config (or ``model_ref``), CUDA only. Returns the
    CheckResult or None; raises ``ResolutionError`` with the full ``kernelguard check`` trace, as
    ``kernelguard.require`` does."""
    device = gate.model_device(model)
    if device.type != "cuda":
        return None
    from kernelguard.stack import resolution_error

    with tempfile.TemporaryDirectory(prefix="kernelguard-") as folder:
        ref = _check_reference(model, model_ref, Path(folder))
        if ref is None:
            return None
        # The Hub as the model was loaded (transformers 5.25+ defaults to use_kernels=True): checked, not assumed.
        result = gate.check_stack(ref, allow=allow, packed=packed, device=device, env=True,
                                  hub=bool(getattr(model, "use_kernels", False)))
    if result is not None and not result.ok:
        raise resolution_error(result)
    return result


CALLBACK_ALLOW = "KernelGuardCallback({})"
PADDED = "padding_free=False, no flattening collator"


def guard_model(model: Any, *, allow: tuple[str, ...], packed: bool, verbose: bool = False,
                first_row_probe: bool = True) -> Any:
    """:func:`kernelguard.runtime.gate.guard_model`, strict; on refusal the error carries the guard's summary (the
    per-layer table with ``verbose``) and fixes that name this callback's ``allow=`` and padded batches."""
    try:
        return gate.guard_model(model, allow=allow, packed=packed, strict=True, first_row_probe=first_row_probe)
    except KernelFallbackError as e:
        raise _callback_refusal(e, model, allow=allow, packed=packed, verbose=verbose) from None


def _callback_refusal(
    e: KernelFallbackError, model: Any, *, allow: tuple[str, ...], packed: bool, verbose: bool
) -> KernelFallbackError:
    """The guard's refusal restated for a Trainer user: before step 1, the report ending in why / fix, fixes
    naming this callback (an allow only where one can help: no allow keeps packed rows apart on a GDN
    torch reference, so padded batches are offered instead)."""
    from kernelguard.runtime import inspect
    from kernelguard.stack import fix_text

    try:  # the same sites, judged again without arming or raising, for the summary and the fixes
        report = inspect(model, mode="training", packed=packed, allow=allow)
    except KernelGuardError:
        return e
    _, fixes = report.why_and_fix(call=CALLBACK_ALLOW, padded=PADDED)
    text = report.render(verbose=verbose, call=CALLBACK_ALLOW, padded=PADDED, fixes=False)  # the error's Fix:
    return KernelFallbackError(
        f"kernelguard refused to start training (before step 1).\n{text}",
        fix=fix_text(fixes), layer=e.layer, kernel=e.kernel,
        reason=e.reason, details=e.details,
    )


def _check_packed_sequences(report: Any, packing: Packing, *, allowed: bool = False) -> None:
    """A flattened row must carry its example boundaries (``cu_seq_lens_q`` / ``seq_idx``) for GDN layers.
    Known from the collator before step 1; a collator this cannot read is checked at each forward by the guard
    (kernelguard.runtime.boundaries). ``allowed``: the allow item ``packed-without-boundaries`` was given."""
    # GDN torch references on packed rows are refused by the guard itself (allowed or not).
    if not packing.packed or allowed:
        return
    gdn = sorted({e.kernel for e in report.entries if e.kernel != "attention"})
    if packing.boundaries is not False or not gdn:
        return
    report.disarm()
    raise ConfigError(
        f"kernelguard refused to start training: batches are packed ({packing.source}) but carry no "
        f"cu_seq_lens_q/seq_idx, and this model's {', '.join(gdn)} layers find example boundaries only there: "
        "recurrent and conv state would leak from each example into the next (silently wrong training).",
        fix="DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True), or TRL >= 1.16's "
        "SFTConfig(padding_free=True) (pip install 'trl>=1.16': TRL 1.15's padding-free batches carry position_ids "
        "only); or accept it explicitly with "
        f"{CALLBACK_ALLOW.format(allow_hint([PACKED_WITHOUT_BOUNDARIES], PYTHON))}",
    )


def training_gate(
    model: Any, *, allow: Iterable[str] = (), packing: Packing, model_ref: str | None = None, verbose: bool = False,
    first_row_probe: bool = True,
) -> tuple[Any, Any]:
    """Check the stack, guard the model, check the packed batches' boundaries. Returns (GuardReport armed for the
    run, CheckResult or None); raises the kernelguard error that says what is slow or wrong and the fix."""
    allowed = tuple(allow)
    result = check_stack(model, allow=allowed, packed=packing.packed, model_ref=model_ref)
    report = guard_model(model, allow=allowed, packed=packing.packed, verbose=verbose, first_row_probe=first_row_probe)
    _check_packed_sequences(report, packing,
                            allowed=AllowPolicy.parse(allowed).allows_packed_without_boundaries())
    return report, result


# ---------------------------------------------------------------------------------------------- ranks ---
def _rank_and_world(args: Any) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return int(getattr(args, "process_index", 0) or 0), int(getattr(args, "world_size", 1) or 1)


def failing_ranks(failed: bool, args: Any) -> list[int]:
    """Every rank's verdict, on every rank. Without this a rank that passes would wait in its first collective
    (NCCL's timeout: 10+ minutes) for a rank that stopped; with it, all ranks stop together."""
    import torch
    import torch.distributed as dist

    rank, world = _rank_and_world(args)
    if world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return [rank] if failed else []
    on_gpu = dist.get_backend() == "nccl"
    device = getattr(args, "device", None) if on_gpu else torch.device("cpu")
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[rank] = int(failed)
    dist.all_reduce(flags)
    return [i for i, flag in enumerate(flags.tolist()) if flag]


def _stop_everywhere(error: KernelGuardError | None, args: Any) -> None:
    """Raise on every rank when any rank refused; the full report only from the first refusing rank."""
    failing = failing_ranks(error is not None, args)
    if not failing:
        return
    rank, _ = _rank_and_world(args)
    if error is not None and rank == failing[0]:
        raise error
    cls = type(error) if error is not None else KernelFallbackError
    raise cls(
        f"kernelguard refused to start training on rank(s) {failing} (the report is printed by rank "
        f"{failing[0]}); this rank {rank} {'also refused' if error is not None else 'passed'} and stops with them.",
        fix=error.fix if error is not None else None,
    )


# ------------------------------------------------------------------------------------------- callback ---
def _parse_allow(values: Iterable[str]) -> tuple[str, ...]:
    """Parsed once, at construction: an unknown ID is a ConfigError listing the valid ones, not a silent no-op."""
    return tuple(AllowPolicy.parse(values, source="KernelGuardCallback(allow=...)").values())


def providers_summary(report: Any, packing: Packing, check: Any = None) -> dict[str, Any]:
    """The resolved providers as a JSON-friendly dict (what ``log_history`` gets); ``check``: the stack check's
    CheckResult on CUDA, summarised by its verdict line."""
    providers: dict[str, list[str]] = {}
    allowed: list[str] = []
    for e in report.entries:
        label = f"{e.implementation} ({e.provider_kind})"
        if label not in providers.setdefault(e.kernel, []):
            providers[e.kernel].append(label)
        if e.allowed and e.kernel not in allowed:
            allowed.append(e.kernel)
    return {
        "ok": bool(report.ok),
        "device": report.device,
        "packed": packing.packed,
        "packed_source": packing.source,
        "transformers": report.transformers_version,
        "providers": {kernel: ", ".join(labels) for kernel, labels in providers.items()},
        "allowed_slow": allowed,
        "armed_sites": list(report.tripwires.sites),
        "check": _verdict(check),
    }


def _verdict(check: Any) -> str:
    if check is None:
        return "not run (the stack check needs the model on a CUDA device)"
    from kernelguard.stack import verdict_line

    return verdict_line(check).removeprefix("verdict: ")


def _step_profiler(settings: tuple[int | None, int, Any], model: Any, state: Any) -> Any:
    """The step diagnosis of `kernelguard train`, on rank 0 only (None elsewhere or when off). Without
    ``profile_step``: from step 10 on a GPU, never on a CPU-only run (nothing to judge there)."""
    first, every, trace = settings
    if not getattr(state, "is_world_process_zero", True):
        return None
    from kernelguard.diagnosis import DEFAULT_FIRST_STEP, StepProfiler
    from kernelguard.resolution import layer_types
    from kernelguard.train import peak_flops

    device = next((p.device for p in model.parameters()), None)
    if first is None:
        first = DEFAULT_FIRST_STEP if getattr(device, "type", None) == "cuda" or trace else 0
    if first <= 0:
        return None
    config = getattr(model, "config", None)
    return StepProfiler(
        first_step=first, every=every, trace_dir=Path(trace) if trace else None, device=device,
        log=lambda message: print(f"kernelguard: {message}", file=sys.stderr, flush=True),
        layers=(len(layer_types(config)) or None) if config is not None else None,
        peak_flops=(peak_flops(device) or None) if device is not None else None,
    )


class KernelGuardCallback(TrainerCallback):  # type: ignore[misc]
    """Stops ``Trainer`` / ``SFTTrainer`` before step 1 when a kernel would run its slow torch fallback.

    ``allow``: kernel names (``"chunk_gated_delta_rule"``), ``"attention"``, known-issue IDs or ``"*"`` — slow
    paths accepted explicitly (logged). ``model``: family name, config.json or model folder for the stack check
    (default: the trained model's own config). ``packed``: ``None`` detects it from the trainer arguments and
    the collator. On rank 0 a passing gate prints one line per kernel (status, provider, layer count);
    ``verbose=True`` prints the per-layer table instead, on success and in a refusal. ``profile_step``,
    ``profile_every``, ``profile_trace``: `kernelguard train`'s step diagnosis (its flags of the same names;
    default: from step 10 on a GPU, off on a CPU-only run; 0 turns it off); rank 0's figures and verdict go to
    ``log_history`` under ``"kernelguard_profile"``. ``first_row_probe`` (default True): the first packed batch's
    first examples also run alone, once, and a decoder layer whose outputs differ stops training
    (:mod:`kernelguard.runtime.equivalence`).
    """

    def __init__(
        self,
        *,
        allow: Iterable[str] = (),
        model: str | None = None,
        packed: bool | None = None,
        verbose: bool = False,
        profile_step: int | None = None,
        profile_every: int = 500,
        profile_trace: str | Path | None = None,
        lock: str | Path | None = None,
        first_row_probe: bool = True,
    ) -> None:
        self.allow = _parse_allow(allow)
        self.first_row_probe = first_row_probe
        self.lock = lock  # None: KERNELGUARD_LOCK, when set
        self.model_ref = model
        self.packed = packed
        self.verbose = verbose
        self.report: Any = None  # the armed GuardReport while training runs
        self.check_result: Any = None
        self.packing: Packing | None = None
        self.summary: dict[str, Any] | None = None
        self.profile = (profile_step, profile_every, profile_trace)
        self.profiler: Any = None  # kernelguard.diagnosis.profiler.StepProfiler on rank 0 while training runs

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.disarm()  # a previous train() that crashed never reached on_train_end
        model = kwargs.get("model")
        if model is None:
            raise ConfigError("KernelGuardCallback got no model from the trainer.", fix="pass model= to the Trainer")
        self.packing = detect_packing(args, _collator_of(kwargs.get("train_dataloader")), packed=self.packed)
        error: KernelGuardError | None = None
        try:
            # The image's lock first: a node whose stack differs stops here, whatever the guard would say.
            # The run's own allow items (as the stack check reads them): they must be the lock's.
            env_allow = tuple(a.strip() for a in os.environ.get("KERNELGUARD_ALLOW", "").split(",") if a.strip())
            gate.check_lock(self.lock, allow=self.allow + env_allow, syntax="python",
                            option="KernelGuardCallback(lock=...)")
            self.report, self.check_result = training_gate(
                model, allow=self.allow, packing=self.packing, model_ref=self.model_ref, verbose=self.verbose,
                first_row_probe=self.first_row_probe,
            )
        except KernelGuardError as e:
            error = e
        try:
            _stop_everywhere(error, args)
        except KernelGuardError:
            self.disarm()  # this rank may have passed while another refused
            raise
        self.summary = providers_summary(self.report, self.packing, self.check_result)
        state.log_history.append({LOG_KEY: self.summary, "step": state.global_step})
        if getattr(state, "is_world_process_zero", True):
            print(f"kernelguard: guard passed ({self.packing.source}).\n{self.report.render(verbose=self.verbose)}",
                  file=sys.stderr, flush=True)
            note = packing_note(args)
            if note is not None:
                print(note, file=sys.stderr, flush=True)

        self.profiler = _step_profiler(self.profile, model, state)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None:
            self.profiler.begin(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        figures = self.profiler.end(state.global_step) if self.profiler is not None else {}
        if figures:
            state.log_history.append({PROFILE_KEY: figures, "step": state.global_step})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None and self.profiler.summary():
            print(f"kernelguard: {self.profiler.summary()}", file=sys.stderr, flush=True)
        self.profiler = None
        self.disarm()

    def disarm(self) -> None:
        """Restore every torch reference path this callback wrapped (idempotent)."""
        if self.report is not None:
            self.report.disarm()
            self.report = None
