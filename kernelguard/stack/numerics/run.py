"""``check --run``: every resolved fast kernel against transformers' own torch reference, and its CLI.

``python -m kernelguard.stack.numerics`` runs the same outside ``kernelguard check``. Torch and the kernels are
imported inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernelguard.resolution import FLA_REFUSAL_FLAG
from kernelguard.resolution import lift_fla_hopper_refusal as _lift_refusal

from . import references as lookup
from .cases import exercise
from .references import CHUNK, FLA_KERNELS, KERNELS
from .results import REL_TOL, NumericsCase, NumericsReport
from .shapes import GdnShape, plan_shapes, shapes_for_model

if TYPE_CHECKING:
    import torch

__all__ = ["SLOW_RUN_S", "main", "run_numerics", "slow_run_note"]


def run_numerics(
    kernels: Iterable[str],
    *,
    providers: Mapping[str, Callable[..., Any]] | None = None,
    config: Any | None = None,
    device: str = "cuda",
    seed: int = 0,
    lift_fla_hopper_refusal: bool = False,
    shapes: Sequence[GdnShape] | None = None,
    tolerance: float = REL_TOL,
    dtype: torch.dtype | None = None,
    pin_autotune: bool = True,
) -> NumericsReport:
    """Run each kernel fwd (+bwd) on ``shapes`` (default :func:`shapes_for_model`, planned by
    :func:`plan_shapes`) vs the fp32 torch reference. ``providers``: kernel -> callable under test (default:
    imported from where the catalog says transformers imports it). A kernel that raises is a failed case with
    its message; an unimportable provider is skipped and fails the report; an unknown or unprovided kernel is
    only listed; no case at all (e.g. no CUDA) is not a pass. ``lift_fla_hopper_refusal``: process-wide (see
    :func:`kernelguard.resolution.fla_refusal.lift_fla_hopper_refusal`); ``pin_autotune``: fla autotune pins for this
    stack (``fla_autotune``)."""
    import torch

    run = _Run(start=time.perf_counter(), dtype=dtype or torch.bfloat16, tolerance=tolerance)
    wanted = run.known_kernels(kernels)
    family = lookup.family_of(config)
    if lift_fla_hopper_refusal and any(k in FLA_KERNELS for k in wanted):
        run.notes.append(_lift_note())
    provs, import_failures = _providers_for(wanted, providers, family, run.skipped)
    if device.startswith("cuda") and not torch.cuda.is_available():
        return run.early(provs, "device cuda requested but torch.cuda.is_available() is False")
    if not provs:
        return run.finish([], import_failures)
    if pin_autotune and device.startswith("cuda") and any(k in FLA_KERNELS for k in provs):
        run.notes.append(_pin_note())
    try:
        refs, ref_module = lookup.torch_references([k for k in wanted if k in provs], family=family)
    except RuntimeError as exc:
        return run.early(provs, str(exc))
    key_heads = CHUNK not in refs or lookup.kernel_gets_key_heads(refs[CHUNK])
    heads = ("key heads (GVA inside the kernel)" if key_heads else "value heads (repeated in the layer)")
    run.notes.append(
        f"reference: {ref_module} (fp32, per packed segment)"
        + (f"; the GDN layer passes q/k with {heads}" if CHUNK in refs else "")
    )
    plan = plan_shapes(list(shapes) if shapes is not None else shapes_for_model(config), run.notes)
    gen = torch.Generator().manual_seed(seed)  # inputs made on CPU: identical on every device
    for kernel in wanted:
        if kernel in provs:
            run.cases += exercise(kernel, provs[kernel], refs[kernel], plan, key_heads=key_heads, device=device,
                                  gen=gen, dtype=run.dtype, tol=run.tolerance)
            _sync(device)
    if pin_autotune and device.startswith("cuda") and any(k in FLA_KERNELS for k in provs):
        missed = _search_note()
        if missed:
            run.notes.append(missed)
    return run.finish([k for k in wanted if k in provs], import_failures)


@dataclass(slots=True)
class _Run:
    """What one run_numerics call accumulates."""

    start: float
    dtype: Any
    tolerance: float
    cases: list[NumericsCase] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def known_kernels(self, kernels: Iterable[str]) -> list[str]:
        wanted = list(dict.fromkeys(kernels))
        self.skipped += [
            f"{k}: unknown kernel (known: {', '.join(KERNELS)})" for k in wanted if k not in KERNELS
        ]
        return [k for k in wanted if k in KERNELS]

    def early(self, provs: Mapping[str, Any], reason: str) -> NumericsReport:
        self.skipped.extend(f"{k}: {reason}" for k in provs)
        return NumericsReport(
            (), time.perf_counter() - self.start, tuple(self.skipped), False, tuple(self.notes)
        )

    def finish(self, exercised: Sequence[str], import_failures: Sequence[str]) -> NumericsReport:
        # A provider that cannot even be imported fails the run; an unknown name or one the caller left out
        # is only listed.
        ok = bool(self.cases) and all(c.ok for c in self.cases) and not import_failures
        if not self.cases:
            self.notes.append("no kernel was exercised: nothing to vouch for")
        seconds = time.perf_counter() - self.start
        slow = slow_run_note(seconds, exercised)
        if slow:
            self.notes.append(slow)
        return NumericsReport(tuple(self.cases), seconds, tuple(self.skipped), ok, tuple(self.notes))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def _lift_note() -> str:
    try:
        changed = _lift_refusal()
    except Exception as exc:  # noqa: BLE001 - no fla (or another layout): say so, run anyway
        return f"could not lift fla's Hopper refusal: {type(exc).__name__}: {exc}"
    return (
        f"fla's Hopper/Triton<3.7.1 refusal lifted in this process ({FLA_REFUSAL_FLAG}=True in "
        f"{', '.join(changed) or 'no module: flag already True'}); figures are from fla's Triton path."
    )


def _pin_note() -> str:
    from kernelguard.resolution import pin_for_this_gpu

    try:
        return pin_for_this_gpu()
    except Exception as exc:  # noqa: BLE001 - pins only save time: never fail the check over them
        return f"fla autotune pins not applied ({type(exc).__name__}: {exc}); fla autotunes as usual"


def _providers_for(
    wanted: Sequence[str],
    given: Mapping[str, Callable[..., Any]] | None,
    family: str | None,
    skipped: list[str],
) -> tuple[dict[str, Callable[..., Any]], list[str]]:
    if given is None:
        provs, failures = lookup.default_providers(wanted, family=family)
        skipped += failures
        return provs, failures
    skipped += [f"{k}: no provider given" for k in wanted if k not in given]
    return {k: given[k] for k in wanted if k in given}, []


SLOW_RUN_S = 30.0


def _search_note() -> str | None:
    from kernelguard.resolution import search_note

    try:
        return search_note()
    except Exception:  # noqa: BLE001 - a diagnostic only: never fail the check over it
        return None


def slow_run_note(seconds: float, kernels: Sequence[str]) -> str | None:
    """Why a run was slow, when fla's Triton kernels were among those exercised and it took > 30 s."""
    if seconds <= SLOW_RUN_S or not any(k in FLA_KERNELS for k in kernels):
        return None
    return (
        f"this run took {seconds:.0f} s: fla autotunes each Triton kernel the first time a process sees its shape "
        "(every candidate config is compiled and timed) unless kernelguard ships a pinned choice for this GPU "
        "arch, Triton, fla and call layout (kernelguard/fla_autotune_pins.json; a note above names the kernels "
        "that were searched). Compiled kernels are cached on disk (TRITON_CACHE_DIR, default ~/.triton/cache), "
        "autotune choices are not: keep that cache in the image or a volume, and expect unpinned shapes to be "
        "searched again in each new process."
    )


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - thin manual entry point
    """``python -m kernelguard.stack.numerics``: the numerics of the named kernels, as text or JSON; exit 1 on failure."""
    import argparse

    parser = argparse.ArgumentParser(description="GDN/conv kernel numerics vs the fp32 torch reference")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lift-fla-hopper-refusal", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run_numerics(
        args.kernels.split(","), device=args.device, lift_fla_hopper_refusal=args.lift_fla_hopper_refusal
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1
