"""Numerics of the resolved fast kernels against transformers' own torch reference (``check --run``).

Every kernel under test runs forward (and backward where training uses it) in bf16 on small random inputs
shaped like what a gated-delta-net layer really passes it, and is compared per tensor with the torch
reference run in fp32 on the *same* bf16-rounded inputs. The reference is transformers' undecorated torch
function (``inspect.unwrap`` of the module-level name; ``use_kernel_func_from_hub_with_fallback`` decorates
with ``functools.wraps``, so ``__wrapped__`` leads to it); for packed (varlen) cases it runs once per segment,
which is exactly the semantics ``cu_seqlens`` / ``seq_idx`` promise.

Error measure, per tensor: ``rel = ||kernel - ref||_2 / ||ref||_2`` computed in fp32 (plus the max absolute
difference, reported for context). Tolerances (bf16 inputs, fp32 reference):

- ``REL_TOL = 2%`` for every output and gradient. bf16 rounds at 2**-9 ~ 0.2% per value; correct fla GDN
  kernels measured 0.50-0.58% on an H200 (o, dq, dk, dv, dg, dbeta; DEVICE.md), Dao's conv sits lower.
  2% leaves ~3.5x headroom over correct kernels, while real bugs — fla issue 640 (wrong dk/dg at key-dim
  tile 64 on Hopper, Triton 3.4-3.7.0), state leaking across packed segments, a gradient off by a factor —
  are tens of percent or more.
- Non-finite values anywhere fail the case outright.

Torch and the kernels are imported inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from kernelguard.fla_refusal import _FLA_REFUSAL_FLAG, lift_fla_hopper_refusal

__all__ = [
    "KERNELS",
    "REL_TOL",
    "GdnShape",
    "KernelSource",
    "NumericsCase",
    "NumericsReport",
    "default_providers",
    "generic_shapes",
    "kernel_sources",
    "lift_fla_hopper_refusal",
    "plan_shapes",
    "run_numerics",
    "shapes_for_model",
]

REL_TOL = 0.02
"""Relative-error threshold (||a-b|| / ||b||, fp32) for bf16 kernels vs the fp32 torch reference."""

CHUNK = "chunk_gated_delta_rule"
RECURRENT = "fused_recurrent_gated_delta_rule"
CONV = "causal_conv1d_fn"
CONV_UPDATE = "causal_conv1d_update"
KERNELS = (CHUNK, RECURRENT, CONV, CONV_UPDATE)

# Families whose modeling file is tried first for the references (when the model's own family is not known or
# lacks a kernel); any other catalog family that calls the kernel follows, alphabetically.
_PREFERRED_FAMILIES = ("qwen3_5", "qwen3_next")


@dataclass(frozen=True, slots=True)
class KernelSource:
    """Where one kernel under test and its torch reference live, read from the catalog (one kernel table)."""

    kernel: str
    provider_module: str  # what transformers imports, e.g. "fla.ops.gated_delta_rule"
    reference_name: str  # the decorated torch function, e.g. "torch_chunk_gated_delta_rule"
    reference_module: str  # "transformers.models.qwen3_5.modeling_qwen3_5"


def modeling_module_name(source: str) -> str:
    """``.../site-packages/transformers/models/qwen3_5/modeling_qwen3_5.py`` -> its import name."""
    parts = Path(source).with_suffix("").parts
    if "transformers" not in parts:
        raise ValueError(f"{source} is not inside a transformers package")
    start = len(parts) - 1 - parts[::-1].index("transformers")
    return ".".join(parts[start:])


def kernel_sources(kernel: str, *, family: str | None = None) -> list[KernelSource]:
    """Every catalog family that calls ``kernel``: ``family`` first, then Qwen3.5, Qwen3-Next, the rest."""
    from kernelguard import discovery

    known = discovery.families()
    order = [f for f in (family, *_PREFERRED_FAMILIES) if f in known]
    order += sorted(set(known) - set(order))
    out = []
    for name in dict.fromkeys(order):
        fam = known[name]
        for req in fam.kernels:
            if req.kernel == kernel and req.module:
                out.append(KernelSource(kernel, req.module, req.call_site, modeling_module_name(fam.source)))
    return out


# --------------------------------------------------------------------------------------------- data types
@dataclass(frozen=True, slots=True)
class GdnShape:
    """One GDN layer geometry plus a token layout. ``segments`` set = one packed row (batch 1, varlen)."""

    num_k_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    batch: int = 1
    seq_len: int = 256
    segments: tuple[int, ...] | None = None
    origin: str = "generic"

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"value heads {self.num_v_heads} must be a multiple of key heads {self.num_k_heads}"
            )
        if self.segments is not None:
            if self.batch != 1:
                raise ValueError("packed (varlen) shapes have batch 1")
            if sum(self.segments) != self.seq_len or min(self.segments) <= 0:
                raise ValueError(
                    f"segments {self.segments} must be positive and sum to seq_len {self.seq_len}"
                )

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short conv: q, k (key heads) and v (value heads) side by side."""
        return 2 * self.num_k_heads * self.key_dim + self.num_v_heads * self.value_dim

    def label(self, *, q_heads: int | None = None) -> str:
        heads = f"H{self.num_k_heads}"
        if self.num_v_heads != self.num_k_heads:
            heads += f" HV{self.num_v_heads}"
        if q_heads is not None and q_heads != self.num_k_heads:
            heads += f" (q/k repeated to {q_heads})"
        text = f"B{self.batch} T{self.seq_len} {heads} K{self.key_dim} V{self.value_dim}"
        if self.segments is not None:
            text += " varlen[" + ",".join(map(str, self.segments)) + "]"
        return text


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


# --------------------------------------------------------------------------------------------- shapes
# The layouts every geometry is checked in. fla autotunes per (heads, head dims, varlen flag), never per length,
# so each geometry costs two autotune/compile sets however long its sequences are (cold ``check --run`` time).
# Padded batch: 2 rows of 200 tokens (not a multiple of fla's chunk 64: exercises the partial last chunk).
# Packed row: 3 segments, none a multiple of 64 (state must reset at each boundary).
PADDED_LAYOUT: dict[str, Any] = {"batch": 2, "seq_len": 200}
PACKED_LAYOUT: dict[str, Any] = {"seq_len": 1024, "segments": (300, 500, 224)}


def generic_shapes() -> list[GdnShape]:
    """Small model-independent shapes. Key head dim 64 is where fla issue 640 is reported (key-dim tile 64),
    padded and packed with grouped value heads (GVA); 128 is the Qwen3.5 geometry measured correct."""
    k64: dict[str, Any] = {"num_k_heads": 4, "num_v_heads": 8, "key_dim": 64, "value_dim": 128}
    return [
        GdnShape(**k64, **PADDED_LAYOUT, origin="generic"),
        GdnShape(**k64, **PACKED_LAYOUT, origin="generic"),
        GdnShape(num_k_heads=4, num_v_heads=4, key_dim=128, value_dim=128, **PACKED_LAYOUT, origin="generic"),
    ]


def plan_shapes(shapes: Sequence[GdnShape], notes: list[str] | None = None) -> list[GdnShape]:
    """``shapes`` without the generic ones that a model shape already covers: same head dims and layout, and
    grouped value heads in the model shape whenever the generic one has them. Each distinct geometry costs a
    full fla autotune on a machine's first run, and a covered one finds nothing the model's own would not."""
    model = [s for s in shapes if s.origin != "generic"]
    out = []
    for s in shapes:
        cover = next((m for m in model if s.origin == "generic" and _covers(m, s)), None)
        if cover is None:
            out.append(s)
        elif notes is not None:
            notes.append(f"generic shape {s.label()} skipped: covered by the model's {cover.label()}")
    return out


def _covers(model: GdnShape, generic: GdnShape) -> bool:
    same_dims = (model.key_dim, model.value_dim) == (generic.key_dim, generic.value_dim)
    same_layout = (model.segments is None) == (generic.segments is None)
    gva = model.num_v_heads != model.num_k_heads or generic.num_v_heads == generic.num_k_heads
    return same_dims and same_layout and gva


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter()
        except (AttributeError, TypeError, ValueError):  # odd configs: fall back to the object itself
            return getattr(config, "text_config", None) or config
    return getattr(config, "text_config", None) or config


def shapes_for_model(config: Any | None, *, generic: bool = True) -> list[GdnShape]:
    """The model's own GDN geometry (heads, GVA ratio, head dims, conv width) in a padded-batch and a packed
    layout, followed by :func:`generic_shapes` (key head dim 64 and 128) unless ``generic=False``.

    The generic key-dim-64 shapes make a stack that is wrong only at small head dims (fla issue 640) fail
    even for a model whose own head dim is 128; pass ``generic=False`` to judge the model's shapes alone."""
    extra = generic_shapes() if generic or config is None else []
    if config is None:
        return extra
    text = _text_config(config)
    try:
        hk = int(text.linear_num_key_heads)
        hv = int(getattr(text, "linear_num_value_heads", None) or hk)
        kd = int(text.linear_key_head_dim)
        vd = int(getattr(text, "linear_value_head_dim", None) or kd)
        width = int(getattr(text, "linear_conv_kernel_dim", 4) or 4)
    except (AttributeError, TypeError) as exc:
        raise ValueError(
            f"{type(text).__name__} has no gated-delta-net fields (linear_num_key_heads, linear_key_head_dim, ...)"
        ) from exc
    origin = getattr(text, "model_type", None) or type(text).__name__
    common: dict[str, Any] = {
        "num_k_heads": hk,
        "num_v_heads": hv,
        "key_dim": kd,
        "value_dim": vd,
        "conv_kernel": width,
        "origin": origin,
    }
    model = [GdnShape(**common, **PADDED_LAYOUT), GdnShape(**common, **PACKED_LAYOUT)]
    return model + extra


# --------------------------------------------------------------------------------------------- fla refusal
_lift_refusal = lift_fla_hopper_refusal  # run_numerics' keyword of the same name shadows it


# --------------------------------------------------------------------------------------------- providers
def default_providers(
    kernels: Iterable[str], *, family: str | None = None
) -> tuple[dict[str, Callable[..., Any]], list[str]]:
    """Import each kernel from the module transformers imports it from (the catalog's ``module``); returns
    (providers, reasons for those that failed to import)."""
    import importlib

    providers: dict[str, Callable[..., Any]] = {}
    missing: list[str] = []
    for kernel in kernels:
        sources = kernel_sources(kernel, family=family)
        if not sources:
            missing.append(f"{kernel}: no transformers model family calls it (catalog)")
            continue
        module_name = sources[0].provider_module
        try:
            providers[kernel] = getattr(importlib.import_module(module_name), kernel)
        except Exception as exc:  # noqa: BLE001 - any import failure is a finding, not a crash
            missing.append(f"{kernel}: cannot import {module_name}.{kernel}: {type(exc).__name__}: {exc}")
    return providers, missing


def hub_wrapper(obj: Any) -> Callable[..., Any] | None:
    """transformers' ``wrapped`` function (from ``use_kernel_func_from_hub_with_fallback``) behind a
    module-level GDN/conv name: the name itself, or — when the ``kernels`` package is active and turned it
    into a ``Func`` module — the function that module's ``forward`` closes over."""
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None)
    if inspect.isfunction(forward) and forward.__closure__:
        cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__)))
        inner = cells.get("func")
        if inspect.isfunction(inner):
            return inner
    return None


def undecorated(obj: Any) -> Callable[..., Any] | None:
    """The undecorated torch function behind a decorated module-level name (``functools.wraps`` sets
    ``__wrapped__``), or None when it cannot be found."""
    wrapper = hub_wrapper(obj)
    return inspect.unwrap(wrapper) if wrapper is not None else None


def _references(
    kernels: Sequence[str] = KERNELS, *, family: str | None = None
) -> tuple[dict[str, Callable[..., Any]], str]:
    """The undecorated torch references of ``kernels``, all from ONE modeling module (the first, in the
    catalog's preference order, that defines every one of them), and that module's name."""
    import importlib

    names_by_module: dict[str, dict[str, str]] = {}
    for kernel in kernels:
        for src in kernel_sources(kernel, family=family):
            names_by_module.setdefault(src.reference_module, {})[kernel] = src.reference_name
    errors = []
    for module_name, names in names_by_module.items():
        if any(k not in names for k in kernels):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - try the next family's module
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        found = {k: undecorated(getattr(module, names[k], None)) for k in kernels}
        odd = [k for k, fn in found.items() if fn is None]
        if odd:  # e.g. a Kernel Hub wrapper without __wrapped__: never compare a kernel with itself
            errors.append(f"{module_name}: no undecorated torch function behind {odd}")
            continue
        return {k: fn for k, fn in found.items() if fn is not None}, module_name
    if not errors:
        errors.append(f"no model family calls all of {', '.join(kernels)}")
    raise RuntimeError("no transformers modeling module with the torch references: " + "; ".join(errors))


def _kernel_gets_key_heads(chunk_reference: Callable[..., Any]) -> bool:
    """Does the layer hand the kernel q/k with *key* heads (GVA inside the kernel)?

    transformers <= 5.17 repeats q/k to the value heads in the layer before the call (its reference has no
    GVA support); newer releases pass key heads and the reference repeats internally. The reference's own
    code tells which convention this install uses.
    """
    try:
        return "repeat_interleave" in inspect.getsource(chunk_reference)
    except (OSError, TypeError):
        return True


# --------------------------------------------------------------------------------------------- comparing
def _compare(
    kernel: str, shape: str, tensor: str, got: torch.Tensor | None, ref: torch.Tensor | None, tol: float
) -> NumericsCase:
    import torch

    if got is None or ref is None:
        which = "kernel" if got is None else "reference"
        return NumericsCase(
            kernel, shape, tensor, math.inf, math.inf, tol, False, f"{which} produced no {tensor}"
        )
    if tuple(got.shape) != tuple(ref.shape):
        return NumericsCase(
            kernel,
            shape,
            tensor,
            math.inf,
            math.inf,
            tol,
            False,
            f"shape {tuple(got.shape)} differs from reference {tuple(ref.shape)}",
        )
    a, b = got.detach().float(), ref.detach().float()
    if not bool(torch.isfinite(a).all()):
        return NumericsCase(
            kernel, shape, tensor, math.inf, math.inf, tol, False, "kernel output has inf/nan"
        )
    diff = a - b
    denom = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(diff))
    rel = num / denom if denom > 0 else (0.0 if num == 0 else math.inf)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return NumericsCase(kernel, shape, tensor, rel, max_abs, tol, bool(rel <= tol))


def _error_case(kernel: str, shape: str, exc: BaseException, where: str = "kernel") -> NumericsCase:
    msg = " ".join(str(exc).split())
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    return NumericsCase(
        kernel,
        shape,
        "error",
        math.inf,
        math.inf,
        REL_TOL,
        False,
        f"{where} raised {type(exc).__name__}: {msg}",
    )


def _segments(shape: GdnShape) -> list[tuple[int, int]]:
    if shape.segments is None:
        return [(0, shape.seq_len)]
    return _bounds(shape.segments)


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive segments with these lengths."""
    cuts = [0, *itertools.accumulate(lengths)]
    return list(itertools.pairwise(cuts))


def _leaf(t: torch.Tensor, device: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.to(device=device, dtype=dtype or t.dtype).detach().requires_grad_(True)


def _grads(
    out: torch.Tensor, dout: torch.Tensor, leaves: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    import torch

    grads = torch.autograd.grad(out, list(leaves), grad_outputs=dout, allow_unused=True)
    return list(grads)


# --------------------------------------------------------------------------------------------- GDN chunk
def _gdn_inputs(shape: GdnShape, q_heads: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """bf16 q/k/v and beta (post-sigmoid), fp32 log-space decay g, bf16 upstream gradient: what the layer
    passes (it computes g in fp32 and beta = sigmoid in the model dtype)."""
    import torch
    import torch.nn.functional as F

    b, t = shape.batch, shape.seq_len
    hv, kd, vd = shape.num_v_heads, shape.key_dim, shape.value_dim
    return {
        "q": torch.randn(b, t, q_heads, kd, generator=gen),
        "k": torch.randn(b, t, q_heads, kd, generator=gen),
        "v": torch.randn(b, t, hv, vd, generator=gen),
        "g": F.logsigmoid(torch.randn(b, t, hv, generator=gen)),
        "beta": torch.randn(b, t, hv, generator=gen).sigmoid(),
        "do": torch.randn(b, t, hv, vd, generator=gen),
    }


def _cu_seqlens(shape: GdnShape, device: str) -> torch.Tensor | None:
    import torch

    if shape.segments is None:
        return None
    bounds = [0] + [e for _, e in _segments(shape)]
    # int32, as the layer forwards the collator's cu_seq_lens_q.
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _reference_gdn(
    ref: Callable[..., Any], shape: GdnShape, x: Mapping[str, torch.Tensor], **kw: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 reference, once per packed segment (each from a zero / its own initial state)."""
    import torch

    init = kw.pop("initial_state", None)
    outs, finals = [], []
    for i, (s, e) in enumerate(_segments(shape)):
        seg_init = None if init is None else init[i : i + 1] if shape.segments is not None else init
        o, h = ref(
            x["q"][:, s:e],
            x["k"][:, s:e],
            x["v"][:, s:e],
            g=x["g"][:, s:e],
            beta=x["beta"][:, s:e],
            initial_state=seg_init,
            use_qk_l2norm_in_kernel=True,
            **kw,
        )
        outs.append(o)
        finals.append(h)
    final = torch.cat(finals, dim=0) if finals[0] is not None else None
    return torch.cat(outs, dim=1), final


def _check_chunk(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    q_heads: int,
    label: str,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    import torch

    raw = _gdn_inputs(shape, q_heads, gen)
    names = ("q", "k", "v", "g", "beta")
    # The kernel gets what the layer gives it: bf16 q/k/v/beta, fp32 g; the reference gets the same values
    # (already bf16-rounded) in fp32, so only the kernel's arithmetic differs.
    kin = {n: _leaf(raw[n], device, torch.float32 if n == "g" else dtype) for n in names}
    rin = {n: _leaf(kin[n].detach().float(), device) for n in names}
    do = raw["do"].to(device=device, dtype=dtype)
    try:
        o, _ = fn(
            kin["q"],
            kin["k"],
            kin["v"],
            g=kin["g"],
            beta=kin["beta"],
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=_cu_seqlens(shape, device),
        )
        kgrads = _grads(o, do, [kin[n] for n in names])
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CHUNK, label, exc)]
    try:
        ro, _ = _reference_gdn(ref, shape, rin, output_final_state=False)
        rgrads = _grads(ro, do.float(), [rin[n] for n in names])
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CHUNK, label, exc, where="reference")]
    cases = [_compare(CHUNK, label, "o", o, ro, tol)]
    cases += [_compare(CHUNK, label, "d" + n, kg, rg, tol) for n, kg, rg in zip(names, kgrads, rgrads)]
    return cases


def _check_recurrent(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    q_heads: int,
    label: str,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    """Decode-style forward (fla has no backward here): a few tokens per row from a random fp32 state."""
    import torch

    steps = 1
    b = shape.batch if shape.segments is None else len(shape.segments)
    small = GdnShape(
        num_k_heads=shape.num_k_heads,
        num_v_heads=shape.num_v_heads,
        key_dim=shape.key_dim,
        value_dim=shape.value_dim,
        batch=b,
        seq_len=steps,
    )
    raw = _gdn_inputs(small, q_heads, gen)
    state = torch.randn(b, shape.num_v_heads, shape.key_dim, shape.value_dim, generator=gen) * 0.1
    kin = {
        n: raw[n].to(device=device, dtype=torch.float32 if n == "g" else dtype)
        for n in ("q", "k", "v", "g", "beta")
    }
    rin = {n: t.float() for n, t in kin.items()}
    label = small.label(q_heads=q_heads) + " decode from a random state"

    def decode_step(impl: Callable[..., Any], t: dict[str, torch.Tensor]) -> Any:
        with torch.no_grad():
            return impl(
                t["q"],
                t["k"],
                t["v"],
                g=t["g"],
                beta=t["beta"],
                initial_state=state.to(device).clone(),
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )

    try:
        o, ht = decode_step(fn, kin)
    except Exception as exc:  # noqa: BLE001
        return [_error_case(RECURRENT, label, exc)]
    try:
        ro, rh = decode_step(ref, rin)
    except Exception as exc:  # noqa: BLE001
        return [_error_case(RECURRENT, label, exc, where="reference")]
    return [
        _compare(RECURRENT, label, "o", o, ro, tol),
        _compare(RECURRENT, label, "final_state", ht, rh, tol),
    ]


# --------------------------------------------------------------------------------------------- conv
def _conv_label(shape: GdnShape, segments: tuple[int, ...] | None) -> str:
    text = f"B{shape.batch} T{shape.seq_len} D{shape.conv_dim} W{shape.conv_kernel}"
    if segments is not None:
        text += " seq_idx[" + ",".join(map(str, segments)) + "]"
    return text


def _conv_segments(shape: GdnShape) -> tuple[int, ...] | None:
    """Packed conv cases also get a segment shorter than the conv width (short examples do occur)."""
    if shape.segments is None:
        return None
    short = max(1, shape.conv_kernel - 1)
    first = shape.segments[0]
    return (short, first - short, *shape.segments[1:]) if first > short + 1 else shape.segments


def _check_conv(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    import torch

    segments = _conv_segments(shape)
    label = _conv_label(shape, segments)
    b, t, d, w = shape.batch, shape.seq_len, shape.conv_dim, shape.conv_kernel
    x_raw = torch.randn(b, t, d, generator=gen)
    w_raw = torch.randn(d, w, generator=gen) / math.sqrt(w)
    dy_raw = torch.randn(b, t, d, generator=gen).transpose(1, 2)  # autograd hands the conv channel-last grads
    # The layer calls with mixed_qkv.transpose(1, 2): [B, D, T] with channels contiguous (channel-last).
    kx, kw_ = _leaf(x_raw, device, dtype), _leaf(w_raw, device, dtype)
    rx, rw = _leaf(kx.detach().float(), device), _leaf(kw_.detach().float(), device)
    dy = dy_raw.to(device=device, dtype=dtype)
    seq_idx = None
    bounds = [(0, t)]
    if segments is not None:
        ids = [i for i, n in enumerate(segments) for _ in range(n)]
        seq_idx = torch.tensor([ids], dtype=torch.int32, device=device)
        bounds = _bounds(segments)
    try:
        extra = {} if seq_idx is None else {"seq_idx": seq_idx}
        y = fn(kx.transpose(1, 2), kw_, None, activation="silu", **extra)
        kdx, kdw = _grads(y, dy, [kx, kw_])
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CONV, label, exc)]
    try:
        xt = rx.transpose(1, 2)
        ry = torch.cat([ref(xt[:, :, s:e], rw, None, activation="silu") for s, e in bounds], dim=-1)
        rdx, rdw = _grads(ry, dy.float(), [rx, rw])
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CONV, label, exc, where="reference")]
    return [
        _compare(CONV, label, "y", y, ry, tol),
        _compare(CONV, label, "dx", kdx, rdx, tol),
        _compare(CONV, label, "dw", kdw, rdw, tol),
    ]


def _check_conv_update(
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shape: GdnShape,
    device: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    tol: float,
) -> list[NumericsCase]:
    """Single-token decode step, as the layer calls it: x [B, D, 1], conv_state [B, D, W] updated in place."""
    import torch

    b = shape.batch if shape.segments is None else len(shape.segments)
    d, w = shape.conv_dim, shape.conv_kernel
    label = f"B{b} T1 decode D{d} W{w}"
    x = torch.randn(b, d, 1, generator=gen).to(device=device, dtype=dtype)
    state = torch.randn(b, d, w, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(d, w, generator=gen) / math.sqrt(w)).to(device=device, dtype=dtype)
    kstate, rstate = state.clone(), state.float().clone()
    try:
        with torch.no_grad():
            y = fn(x, kstate, weight, None, "silu")
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CONV_UPDATE, label, exc)]
    try:
        with torch.no_grad():
            ry = ref(x.float(), rstate, weight.float(), None, "silu")
    except Exception as exc:  # noqa: BLE001
        return [_error_case(CONV_UPDATE, label, exc, where="reference")]
    return [
        _compare(CONV_UPDATE, label, "y", y, ry, tol),
        _compare(CONV_UPDATE, label, "conv_state", kstate, rstate, tol),
    ]


# --------------------------------------------------------------------------------------------- driver
def _conv_shapes(shapes: Sequence[GdnShape]) -> list[GdnShape]:
    # The conv does not care about the head split, only channels and width: skip duplicate geometries.
    seen: set[tuple[Any, ...]] = set()
    out = []
    for s in shapes:
        key = (s.conv_dim, s.conv_kernel, s.batch, s.seq_len, s.segments)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


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
    :func:`lift_fla_hopper_refusal`); ``pin_autotune``: fla autotune pins for this stack (``fla_autotune``)."""
    import torch

    run = _Run(start=time.perf_counter(), dtype=dtype or torch.bfloat16, tolerance=tolerance)
    wanted = run.known_kernels(kernels)
    family = _family_of(config)
    if lift_fla_hopper_refusal and any(k in _FLA_KERNELS for k in wanted):
        run.notes.append(_lift_note())
    provs, import_failures = _providers_for(wanted, providers, family, run.skipped)
    if device.startswith("cuda") and not torch.cuda.is_available():
        return run.early(provs, "device cuda requested but torch.cuda.is_available() is False")
    if not provs:
        return run.finish([], import_failures)
    if pin_autotune and device.startswith("cuda") and any(k in _FLA_KERNELS for k in provs):
        run.notes.append(_pin_note())
    try:
        refs, ref_module = _references(wanted, family=family)
    except RuntimeError as exc:
        return run.early(provs, str(exc))
    key_heads = CHUNK not in refs or _kernel_gets_key_heads(refs[CHUNK])
    run.notes.append(
        f"reference: {ref_module} (fp32, per packed segment); the layer passes q/k with "
        + ("key heads (GVA inside the kernel)" if key_heads else "value heads (repeated in the layer)")
    )
    plan = plan_shapes(list(shapes) if shapes is not None else shapes_for_model(config), run.notes)
    gen = torch.Generator().manual_seed(seed)  # inputs made on CPU: identical on every device
    for kernel in wanted:
        if kernel in provs:
            run.cases += _exercise(kernel, provs[kernel], refs[kernel], plan, key_heads, device, gen, run)
            _sync(device)
    return run.finish([k for k in wanted if k in provs], import_failures)


_FLA_KERNELS = (CHUNK, RECURRENT)


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


def _lift_note() -> str:
    try:
        changed = _lift_refusal()
    except Exception as exc:  # noqa: BLE001 - no fla (or another layout): say so, run anyway
        return f"could not lift fla's Hopper refusal: {type(exc).__name__}: {exc}"
    return (
        f"fla's Hopper/Triton<3.7.1 refusal lifted in this process ({_FLA_REFUSAL_FLAG}=True in "
        f"{', '.join(changed) or 'no module: flag already True'}); figures are from fla's Triton path."
    )


def _pin_note() -> str:
    from kernelguard.fla_autotune import pin_for_this_gpu

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
        provs, failures = default_providers(wanted, family=family)
        skipped += failures
        return provs, failures
    skipped += [f"{k}: no provider given" for k in wanted if k not in given]
    return {k: given[k] for k in wanted if k in given}, []


def _family_of(config: Any | None) -> str | None:
    """The catalog family of a model config (by model_type), for picking its own modeling module first."""
    if config is None:
        return None
    model_type = getattr(_text_config(config), "model_type", None) or getattr(config, "model_type", None)
    if not model_type:
        return None
    from kernelguard import discovery

    for name, fam in discovery.families().items():
        if model_type == name or model_type in fam.model_types:
            return name
    return None


def _exercise(
    kernel: str,
    fn: Callable[..., Any],
    ref: Callable[..., Any],
    shapes: Sequence[GdnShape],
    key_heads: bool,
    device: str,
    gen: torch.Generator,
    run: _Run,
) -> list[NumericsCase]:
    """Every case of one kernel: GDN kernels per shape, conv kernels per distinct channel geometry."""
    dtype, tol = run.dtype, run.tolerance
    cases: list[NumericsCase] = []
    if kernel in _FLA_KERNELS:
        check = _check_chunk if kernel == CHUNK else _check_recurrent
        for shape in shapes:
            q_heads = shape.num_k_heads if key_heads else shape.num_v_heads
            label = shape.label(q_heads=q_heads)
            cases += check(fn, ref, shape, q_heads, label, device, dtype, gen, tol)
    elif kernel == CONV:
        for shape in _conv_shapes(shapes):
            cases += _check_conv(fn, ref, shape, device, dtype, gen, tol)
    else:
        for shape in _conv_shapes([s for s in shapes if s.segments is None] or shapes):
            cases += _check_conv_update(fn, ref, shape, device, dtype, gen, tol)
    return cases


SLOW_RUN_S = 30.0


def slow_run_note(seconds: float, kernels: Sequence[str]) -> str | None:
    """Why a run was slow, when fla's Triton kernels were among those exercised and it took > 30 s."""
    if seconds <= SLOW_RUN_S or not any(k in (CHUNK, RECURRENT) for k in kernels):
        return None
    return (
        f"this run took {seconds:.0f} s: fla autotunes its Triton kernels the first time each shape is seen on "
        "a machine (minutes) unless kernelguard ships pinned choices for this GPU arch, Triton and fla "
        "(kernelguard/fla_autotune_pins.json: 43 s cold on an H200); the results are cached on disk "
        "(TRITON_CACHE_DIR, default ~/.triton/cache), so the next run in a fresh process takes seconds (19 s on "
        "an H200, bench/RESULTS.md). Keep that cache in the image or a volume to make --run cheap on every node."
    )


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - thin manual entry point
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
