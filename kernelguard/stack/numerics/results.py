"""Result types of ``check --run`` and the one comparison of a kernel's tensor with its reference.

Error measure, per tensor: ``rel = ||kernel - ref||_2 / ||ref||_2`` computed in fp32 (plus the max absolute
difference, reported for context). Tolerances (bf16 inputs, fp32 reference):

- ``REL_TOL = 2%`` for every output and gradient. bf16 rounds at 2**-9 ~ 0.2% per value and correct fla GDN
  kernels sit near 0.5% (bench/RESULTS.md), Dao's conv lower. 2% leaves ~3.5x headroom over correct kernels,
  while real bugs — fla issue 640 (wrong dk/dg at key-dim tile 64 on Hopper, Triton 3.4-3.7.0), state leaking
  across packed segments, a gradient off by a factor — are tens of percent or more.
- Non-finite values anywhere fail the case outright.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["REL_TOL", "NumericsCase", "NumericsReport", "compare", "error_case"]

REL_TOL = 0.02
"""Relative-error threshold (||a-b|| / ||b||, fp32) for bf16 kernels vs the fp32 torch reference."""


@dataclass(frozen=True, slots=True)
class NumericsCase:
    """One tensor of one kernel call. ``tensor == "error"`` means the call itself failed (see ``detail``)."""

    kernel: str
    shape: str
    tensor: str
    rel_error: float
    max_abs_error: float
    tolerance: float
    ok: bool
    detail: str = ""

    def render(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        if self.tensor == "error":
            return f"{status} {self.kernel} [{self.shape}]: {self.detail}"
        cmp = "<=" if self.ok else ">"
        line = (
            f"{status} {self.kernel} [{self.shape}] {self.tensor}: rel error {_pct(self.rel_error)} {cmp} "
            f"{_pct(self.tolerance)} (max abs {self.max_abs_error:.3g})"
        )
        return f"{line}; {self.detail}" if self.detail else line


@dataclass(frozen=True, slots=True)
class NumericsReport:
    cases: tuple[NumericsCase, ...]
    seconds: float
    skipped: tuple[str, ...]
    ok: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def failures(self) -> tuple[NumericsCase, ...]:
        return tuple(c for c in self.cases if not c.ok)

    def render(self) -> str:
        failures = self.failures
        head = (
            f"kernel numerics: {len(self.cases) - len(failures)}/{len(self.cases)} tensors within tolerance "
            f"({self.seconds:.1f} s)"
        )
        lines = [head + (" — FAILED" if not self.ok else "")]
        if failures:
            lines.append("Failures (kernel [shape] tensor: relative error vs fp32 torch reference):")
            lines += ["  " + c.render() for c in failures]
        lines.append("All cases:" if failures else "Cases:")
        lines += ["  " + c.render() for c in self.cases]
        lines += [f"  skipped: {s}" for s in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "tolerance_definition": "rel_error = ||kernel - reference||_2 / ||reference||_2 in fp32",
            "cases": [_finite_dict(asdict(c)) for c in self.cases],
            "failures": [_finite_dict(asdict(c)) for c in self.failures],
            "skipped": list(self.skipped),
            "notes": list(self.notes),
        }


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%" if math.isfinite(x) else str(x)


def _finite_dict(d: dict[str, Any]) -> dict[str, Any]:
    # JSON has no inf/nan: write them as strings so json.dumps(allow_nan=False) consumers survive.
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _failed(kernel: str, shape: str, tensor: str, tol: float, detail: str) -> NumericsCase:
    return NumericsCase(kernel, shape, tensor, math.inf, math.inf, tol, False, detail)


def compare(
    kernel: str, shape: str, tensor: str, got: torch.Tensor | None, ref: torch.Tensor | None, tol: float
) -> NumericsCase:
    """One tensor of the kernel against the reference's: relative L2 error in fp32, failed on inf/nan."""
    import torch

    if got is None or ref is None:
        which = "kernel" if got is None else "reference"
        return _failed(kernel, shape, tensor, tol, f"{which} produced no {tensor}")
    if tuple(got.shape) != tuple(ref.shape):
        detail = f"shape {tuple(got.shape)} differs from reference {tuple(ref.shape)}"
        return _failed(kernel, shape, tensor, tol, detail)
    a, b = got.detach().float(), ref.detach().float()
    if not bool(torch.isfinite(a).all()):
        return _failed(kernel, shape, tensor, tol, "kernel output has inf/nan")
    diff = a - b
    denom = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(diff))
    rel = num / denom if denom > 0 else (0.0 if num == 0 else math.inf)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return NumericsCase(kernel, shape, tensor, rel, max_abs, tol, bool(rel <= tol))


def error_case(kernel: str, shape: str, exc: BaseException, where: str = "kernel") -> NumericsCase:
    """The failed case of a call that raised (message on one line, cut at 600 characters)."""
    msg = " ".join(str(exc).split())
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    return _failed(kernel, shape, "error", REL_TOL, f"{where} raised {type(exc).__name__}: {msg}")
