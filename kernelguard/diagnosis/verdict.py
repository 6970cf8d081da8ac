"""Why a training step is slow, from one profiled window: a verdict that does not rest on "GPU busy".

The report this product starts from is about a slow run that read 98% GPU utilization. On a host with fast
cores the torch fallback keeps an H200 ~80% busy (bench/RESULTS.md, "Is the step on the slow path?"), and the
fastest compiled product step reads *less* busy than the default one: busy ranks nothing. So the figures here
attribute GPU kernel time instead:

* **by what launched it** (:func:`attribute_kernels`): a kernel launched from inside one of transformers' torch
  reference functions (``torch_chunk_gated_delta_rule``, ``torch_causal_conv1d_fn``, ...) is slow-path work.
  The tripwire on each reference opens a profiler range named ``kernelguard.reference:<function>@<layer>``
  while a profiler records (:data:`kernelguard.runtime.tripwires.REFERENCE_RANGE`); a kernel counts for it when its
  launching op is inside that range (forward, and the forward recomputed by activation checkpointing) or
  inside the backward node created by an op inside it (autograd's sequence number links the two);
* **by class** (:func:`kernelguard.diagnosis.kernel_classes.classify_kernel`): GEMM, fused GDN / conv / attention,
  norm, loss, elementwise, copy, optimizer, communication.

Verdicts, most severe first (:func:`diagnose`), one line each:

* ``slow_path``: at least ``SLOW_PATH_PCT`` of GPU kernel time was launched from torch reference functions.
  Every such kernel is slow-path work by definition; the threshold only keeps a stray call out of the alarm.
  Measured on the H200 (bench/RESULTS.md): the fallback puts most of its kernel time there, the product and
  the stock recipe none.
* ``small_kernels``: no reference ran, but elementwise and copy kernels take at least ``SMALL_KERNEL_PCT`` of
  kernel time at more than ``SMALL_KERNELS_PER_LAYER`` kernels per decoder layer: unfused work (a reference
  outside transformers' wrapped functions, a compiled-away fallback, hand-written ops), named by the ops that
  launch the most of them.
* ``gpu_idle``: the GPU ran kernels less than ``IDLE_BUSY_PCT`` of a steady step *and* one stretch without
  any kernel took at least ``IDLE_GAP_PCT`` of it: the GPU waited for the host (input, a sync, Python work),
  not for many small launches. Judged only on steady steps (the profiler decides when: never warm-up,
  autotune, compile, eval or checkpoint steps).
* ``healthy``: otherwise, with the MFU and the top three classes. A small model's product step can keep the GPU
  only half busy because the host dispatches ~2,000 kernels per step; that is what the model size gives,
  not a fault, so it is reported as figures, never as an alarm.

The thresholds sit far from every variant measured on the H200 (fallback, stock recipe, product, product with
compile, at the proxy and at real widths): bench/RESULTS.md lists each variant's figures beside them. Both
stages are pure functions of plain records, tested on CPU with event lists recorded from real H200 traces
(tests/data/profiles/).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kernelguard.runtime import REFERENCE_RANGE

from .events import WRAPPERS, Event, busy_and_gap_us
from .kernel_classes import FUSED_CLASSES, KERNEL_CLASSES, classify_kernel

__all__ = [
    "IDLE_BUSY_PCT",
    "IDLE_GAP_PCT",
    "SLOW_PATH_PCT",
    "SMALL_KERNELS_PER_LAYER",
    "SMALL_KERNEL_PCT",
    "Diagnosis",
    "KernelRecord",
    "attribute_kernels",
    "diagnose",
    "layer_span",
]

SLOW_PATH_PCT = 5.0
SMALL_KERNEL_PCT = 50.0
SMALL_KERNELS_PER_LAYER = 700.0
IDLE_BUSY_PCT = 40.0
IDLE_GAP_PCT = 25.0
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


@dataclass(frozen=True, slots=True)
class KernelRecord:
    """One GPU kernel (or memcpy/memset) of a window: where it ran, what launched it.

    ``reference``: ``function@layer`` of the torch reference it was launched from, or None. ``op``: the
    outermost op of the training code that launched it (a backward node for backward work)."""

    name: str
    start_us: float
    end_us: float
    op: str = "(no enclosing op)"
    reference: str | None = None
    copy: bool = False

    @property
    def cls(self) -> str:
        return "copy" if self.copy else classify_kernel(self.name)

    @property
    def duration_us(self) -> float:
        return max(0.0, self.end_us - self.start_us)

    def to_list(self) -> list[Any]:
        return [self.name, round(self.start_us, 3), round(self.end_us, 3), self.op, self.reference, self.copy]

    @classmethod
    def from_list(cls, row: Sequence[Any]) -> KernelRecord:
        return cls(str(row[0]), float(row[1]), float(row[2]), str(row[3]), row[4], bool(row[5]))


# ----------------------------------------------------------------------------------------- attribution ---
def attribute_kernels(events: Sequence[Event]) -> list[KernelRecord]:
    """The kernels of a window of :class:`~kernelguard.diagnosis.events.Event` records, each with its launcher.

    A kernel's ``parent`` is the op that launched it (the profiler's correlation id); ops nest by ``parent``;
    an op's ``seq`` is autograd's sequence number (the backward node of a forward op carries the same one)."""
    reference_of: dict[int, str | None] = {}

    def enclosing_reference(index: int | None) -> str | None:
        chain: list[int] = []
        found: str | None = None
        while index is not None:
            if index in reference_of:
                found = reference_of[index]
                break
            chain.append(index)
            name = events[index].name
            if name.startswith(REFERENCE_RANGE):
                found = name[len(REFERENCE_RANGE):]
                break
            index = events[index].parent
        for i in chain:
            reference_of[i] = found
        return found

    forward_seq: dict[int, str] = {}  # autograd sequence number of a forward op -> its reference
    for i, e in enumerate(events):
        if e.kind == "op" and e.seq >= 0 and not e.name.startswith(_BACKWARD_NODE):
            ref = enclosing_reference(i)
            if ref is not None:
                forward_seq.setdefault(e.seq, ref)

    records = []
    for e in events:
        if e.kind not in ("kernel", "copy"):
            continue
        ref, op = None, "(no enclosing op)"
        if e.parent is not None:
            ref = enclosing_reference(e.parent)
            op, node_seq = _outer_op(events, e.parent)
            if ref is None and node_seq is not None:
                ref = forward_seq.get(node_seq)
        records.append(KernelRecord(e.name, e.start_us, e.end_us, op, ref, e.kind == "copy"))
    return records


def _outer_op(events: Sequence[Event], index: int | None) -> tuple[str, int | None]:
    """The outermost enclosing op that is not a whole-step wrapper, and the sequence number of the nearest
    enclosing backward node (None in forward code)."""
    blamed, node_seq = "(no enclosing op)", None
    while index is not None:
        e = events[index]
        if not e.name.startswith(WRAPPERS) and not e.name.startswith(REFERENCE_RANGE):
            blamed = e.name
        if node_seq is None and e.name.startswith(_BACKWARD_NODE) and e.seq >= 0:
            node_seq = e.seq
        index = e.parent
    return blamed, node_seq


# ------------------------------------------------------------------------------------------- diagnosis ---
@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The verdict of one window and the figures behind it (per step)."""

    verdict: str  # slow_path | small_kernels | gpu_idle | healthy
    kernels: float
    kernel_s: float  # summed kernel durations (overlaps count twice)
    busy_pct: float | None  # union of kernel intervals over the steady step time
    largest_gap_pct: float | None
    by_class_pct: dict[str, float]  # share of kernel time per class
    reference_pct: float
    references: tuple[tuple[str, str, float], ...]  # (function, layers, % of kernel time)
    kernels_per_layer: float | None
    mfu: float | None
    small_kernel_ops: tuple[tuple[str, float], ...]  # ops launching the most elementwise/copy kernels, per step
    line: str

    @property
    def alarm(self) -> bool:
        return self.verdict != "healthy"

    def record(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "verdict_line": self.line,
            "gpu_kernel_s_per_step": round(self.kernel_s, 5),
            "gpu_time_by_class_pct": {k: round(v, 1) for k, v in self.by_class_pct.items() if v > 0},
            "reference_pct": round(self.reference_pct, 1),
            "reference_functions": [
                {"function": f, "layers": layers, "pct": round(p, 1)} for f, layers, p in self.references
            ],
            "kernels_per_layer": None if self.kernels_per_layer is None else round(self.kernels_per_layer, 1),
            "largest_gap_pct": None if self.largest_gap_pct is None else round(self.largest_gap_pct, 1),
            "profile_mfu": None if self.mfu is None else round(self.mfu, 4),
            "small_kernel_ops": [{"op": op, "per_step": round(n, 1)} for op, n in self.small_kernel_ops],
        }


def diagnose(
    records: Sequence[KernelRecord],
    *,
    steps: int = 1,
    step_s: float | None,
    layers: int | None = None,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    fix: str | None = None,
) -> Diagnosis:
    """The verdict for a window of ``steps`` steps whose kernels are ``records``.

    ``step_s``: the steady (unprofiled) step time, for busy, gaps and MFU; ``layers``: decoder layers, for
    kernels per layer; ``fix``: what the guard would print for the slow path (its install command)."""
    figures, small_pct = _measure(records, max(1, steps), step_s, layers)
    mfu = (flops_per_step / step_s / peak_flops) if (flops_per_step and step_s and peak_flops) else None
    figures["mfu"] = mfu
    verdict, line = _judge(figures, small_pct, fix)
    return Diagnosis(verdict, line=line, **figures)


def _measure(
    records: Sequence[KernelRecord], steps: int, step_s: float | None, layers: int | None
) -> tuple[dict[str, Any], float]:
    """Diagnosis's figures (all but MFU) and the share of kernel time in elementwise/copy kernels."""
    kernel_us = sum(r.duration_us for r in records)
    by_class: dict[str, float] = dict.fromkeys(KERNEL_CLASSES, 0.0)
    per_ref: dict[str, float] = defaultdict(float)
    ref_layers: dict[str, set[str]] = defaultdict(set)
    small_ops: Counter[str] = Counter()
    small_us = 0.0
    for r in records:
        cls = r.cls
        by_class[cls] += r.duration_us
        if r.reference is not None:
            function, _, layer = r.reference.partition("@")
            per_ref[function] += r.duration_us
            if layer:
                ref_layers[function].add(layer)
        if cls in ("elementwise", "copy"):
            small_us += r.duration_us
            small_ops[r.op] += 1

    def pct(us: float) -> float:
        return 100.0 * us / kernel_us if kernel_us > 0 else 0.0

    references = tuple(
        sorted(((f, layer_span(ref_layers[f]), pct(us)) for f, us in per_ref.items()), key=lambda t: -t[2])
    )
    busy_pct, gap_pct = _busy_and_gap(records, steps=steps, step_s=step_s)
    kernels = len(records) / steps
    figures: dict[str, Any] = {
        "kernels": kernels, "kernel_s": kernel_us / 1e6 / steps, "busy_pct": busy_pct,
        "largest_gap_pct": gap_pct, "by_class_pct": {k: pct(v) for k, v in by_class.items()},
        "reference_pct": pct(sum(per_ref.values())), "references": references,
        "kernels_per_layer": kernels / layers if layers else None,
        "small_kernel_ops": tuple((op, n / steps) for op, n in small_ops.most_common(3)),
    }
    return figures, pct(small_us)


def _judge(f: dict[str, Any], small_pct: float, fix: str | None) -> tuple[str, str]:
    """(verdict, line), most severe first; see the module docstring."""
    if f["reference_pct"] >= SLOW_PATH_PCT:
        names = "; ".join(
            f"`{fn}` {p:.0f}%" + (f" (layers {span})" if span else "") for fn, span, p in f["references"]
        )
        return "slow_path", (
            f"slow path: {f['reference_pct']:.0f}% of GPU time is in kernels launched from transformers' torch "
            f"reference functions: {names}" + (f". Fix: {fix}" if fix else "")
        )
    per_layer = f["kernels_per_layer"]
    if small_pct >= SMALL_KERNEL_PCT and per_layer is not None and per_layer > SMALL_KERNELS_PER_LAYER:
        ops = ", ".join(f"{op} x{n:,.0f}" for op, n in f["small_kernel_ops"])
        return "small_kernels", (
            f"small-kernel bound: {small_pct:.0f}% of GPU time in elementwise/copy kernels, {per_layer:,.0f} "
            f"kernels per decoder layer per step; most launched by: {ops}"
        )
    busy, gap = f["busy_pct"], f["largest_gap_pct"]
    if busy is not None and gap is not None and busy < IDLE_BUSY_PCT and gap >= IDLE_GAP_PCT:
        return "gpu_idle", (
            f"GPU idle: kernels ran {busy:.0f}% of a steady step and the GPU waited {gap:.0f}% of it in one "
            "stretch: the host (input pipeline, a sync, Python work) is holding it up"
        )
    by_class = f["by_class_pct"]
    top = sorted(((v, k) for k, v in by_class.items() if v > 0), reverse=True)[:3]
    classes = ", ".join(f"{k} {v:.0f}%" for v, k in top) or "no kernels"
    mfu_text = f"MFU {100 * f['mfu']:.1f}%" if f["mfu"] is not None else "MFU n/a"
    fused = sum(by_class[k] for k in FUSED_CLASSES)
    return "healthy", f"healthy: {mfu_text}; GPU time: {classes}; fused GDN/conv/attention {fused:.0f}%"


def _busy_and_gap(
    records: Sequence[KernelRecord], *, steps: int, step_s: float | None
) -> tuple[float | None, float | None]:
    """Union of kernel intervals, and the longest stretch with none, each as % of the steady step time."""
    if not records or not step_s or step_s <= 0:
        return None, None
    busy, gap = busy_and_gap_us([(r.start_us, r.end_us) for r in records])
    step_us = step_s * 1e6
    return min(100.0, 100.0 * busy / steps / step_us), min(100.0, 100.0 * gap / step_us)


def layer_span(layers: Iterable[str]) -> str:
    """``model.layers.0.linear_attn``, ``...1...``, ``...2...``, ``...5...`` -> ``0-2, 5`` (by the first layer
    index in each path; paths without one are listed as they are)."""
    indices: set[int] = set()
    others: set[str] = set()
    for path in layers:
        m = re.search(r"layers\.(\d+)", path)
        if m:
            indices.add(int(m.group(1)))
        else:
            others.add(path)
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(parts + sorted(others))
