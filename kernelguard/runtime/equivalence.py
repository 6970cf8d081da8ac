"""The first packed row, run example by example: the boundary check by construction.

The static checks (:mod:`kernelguard.runtime.boundary_check`) know the ways of building a packed row that have been
seen to fail. This probe catches the ones nobody listed: on the first packed row a decoder stack receives, it runs
the row again without gradients and dropout, then a few of its examples alone (their own position ids, no
boundary keywords, no mask), and compares every decoder layer's output on each example's tokens. A row whose
layers keep the examples apart gives each example the outputs it has alone, to rounding; one that leaks (a
kernel that ignores its ``cu_seqlens``, a collator's boundaries that do not match its examples, an attention that
reaches across) differs, most at the first layer that leaks. That layer is named in the refusal.

What is compared, per decoder layer and example: the largest per-token relative difference
``|packed - alone| / |alone|`` (L2 over the hidden size). The first example of the row has nothing before it to
leak from: its difference is the rounding of this model, dtype and kernels, measured the same way. A later
example differs too much when it exceeds both ``RATIO`` times the first example's difference at that layer and
the dtype's floor (:data:`FLOORS`).

The probe measures the path the call takes: with autograd on when the call has it (a kernel or a wrapper may run
another path for the backward), in the module's train/eval mode. It runs again when what it measured changes
(:func:`probe_key`): autograd switched, train/eval switched, a module below the stack wrapped, hooked, swapped or
given its own ``forward``, or (one rank alone) a row of another length class. Its cost is one extra forward of the
row and of each probed example per such change (bench/RESULTS.md, "What does the first-row probe cost?"). A mixture-of-experts router that breaks a near
tie the other way alone is given the packed run's choice for that token (:mod:`kernelguard.runtime.probe_routing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.resolution import BOUNDARY_KEYWORDS
from kernelguard.runtime.probe_routing import Route, record_hooks, replay_hooks
from kernelguard.runtime.segments import RowSegments

__all__ = ["FLOORS", "PROBED_EXAMPLES", "RATIO", "FirstRowProbe", "LayerDifference", "probe_key", "probing"]

PROBED_EXAMPLES = 3  # the first example (the rounding reference) and up to two after it
RATIO = 20.0
# The smallest difference called a leak, by the dtype the stack computes in: above what rounding gives a token
# through a whole stack (fp32 ~2e-7, bf16 ~7e-3 on the CPU tests' models: bench/RESULTS.md). In bf16 a leak
# smaller than its rounding cannot be seen by comparing outputs; the static checks are the guard there.
FLOORS = {"float32": 2e-6, "float64": 1e-12, "bfloat16": 3e-2, "float16": 4e-3}
_MIN_TOKENS = 2  # a one-token example (a padding segment) says little
_DROPPED = (*BOUNDARY_KEYWORDS, "attention_mask", "position_ids", "input_ids", "inputs_embeds", "labels")
_RUNNING: list[FirstRowProbe] = []  # probes measuring now (their forwards are not the user's calls)


def probing() -> bool:
    """Whether a probe is running its own forwards: every boundary check stays out of them (a second watch on
    the same stack, the plugin's, would otherwise check, and probe, the probe's calls)."""
    return bool(_RUNNING)


@dataclass(frozen=True, slots=True)
class LayerDifference:
    """The probe's measurement at one decoder layer: the first example's difference (rounding) and the largest
    later one, with the example it came from (its start and end in the row)."""

    layer: str
    reference: float
    worst: float
    example: tuple[int, int]
    tolerance: float
    kind: str = "decoder"  # the layer's own word for what it mixes with ("full attention", "linear attention")
    rerouted: int = 0  # tokens whose expert choice alone was a near tie, replayed from the packed run

    @property
    def differs(self) -> bool:
        return self.worst > self.tolerance


class FirstRowProbe:
    """The probe of one decoder stack (``stack``: the module whose forward receives the batch; ``path``: its
    name in the guarded model). :meth:`__call__` is :class:`~kernelguard.runtime.boundary_check.BoundaryCheck`'s
    ``probe``. ``compare=False`` measures without refusing (a negative control, and ``measure``)."""

    def __init__(self, stack: Any, path: str, *, quiet: Callable[[bool], None], compare: bool = True) -> None:
        self.stack = stack
        self.path = path
        self.compare = compare
        self.measured: list[LayerDifference] = []  # the latest run's
        self.runs = 0  # rows measured
        self._probed: set[tuple[Any, ...]] = set()  # the probe_key of each row measured
        self._quiet = quiet  # silences the stack's own check while the probe calls it

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], seg: RowSegments, *,
                 lockstep: bool = False, blind: bool = False) -> PackedWithoutBoundariesError | None:
        """The refusal for this row, or None (the caller raises it, or logs it under the allow item).
        ``lockstep``: one of several ranks, which must all run the same number of forwards (FSDP gathers
        parameters in each): always ``PROBED_EXAMPLES`` examples, repeats standing in for missing ones.
        ``blind``: a row the probe cannot compare (masked tokens inside a packed row: alone, an example's
        pads would attend); it only keeps step with the other ranks.
        Called on every call the check reads; it measures a row only when :func:`probe_key` is new (a row it
        cannot measure leaves the key unspent, except in lockstep, where every rank must agree)."""
        if args:  # positional calls: the stack's own caller always passes keywords
            return None
        key = probe_key(self.stack, None if lockstep else seg.length)
        if key in self._probed:
            return None
        spans = [] if blind else _chosen(seg)
        real = len(spans)
        if lockstep:
            spans = (spans or [(0, seg.length)]) + [spans[0] if spans else (0, seg.length)] * PROBED_EXAMPLES
            spans = spans[:PROBED_EXAMPLES]
        elif real < 2:
            return None
        self._probed.add(key)
        self.runs += 1
        self.measured = self.measure(kwargs, spans)
        if real < 2:
            self.measured = []
            return None
        first = next((d for d in self.measured if d.differs), None)
        return _error(first, self.measured) if first is not None and self.compare else None

    def measure(self, kwargs: dict[str, Any], spans: list[tuple[int, int]]) -> list[LayerDifference]:
        layers = _decoder_layers(self.stack, self.path)
        kinds = {name: _kind(layer) for name, layer in layers}
        self._quiet(True)
        _RUNNING.append(self)
        restore = _without_dropout(self.stack)
        offsets = [0]
        for a, b in spans:
            offsets.append(offsets[-1] + b - a)
        routes: list[Route] = []
        replayed: dict[str, int] = {}
        try:  # autograd as the call has it, the path the step takes; the outputs kept are detached, so each
            # forward's graph is freed when the stack returns
            packed = _outputs(self.stack, layers, kwargs, spans, routing=record_hooks(layers, routes, spans))
            floor = FLOORS.get(str(packed[0][1].dtype).removeprefix("torch."), FLOORS["float32"]) if packed else 0.0
            alone = [_outputs(self.stack, layers, _alone(kwargs, a, b),
                              routing=replay_hooks(layers, routes, start=offsets[i], floor=floor, replayed=replayed))
                     for i, (a, b) in enumerate(spans)]
        finally:
            restore()
            _RUNNING.remove(self)
            self._quiet(False)
        out = []
        for index, (name, kept) in enumerate(packed):
            diffs = [_relative(kept[0, offsets[i]:offsets[i + 1]], alone[i][index][1][0]) for i in range(len(spans))]
            worst = max(range(1, len(spans)), key=lambda i: diffs[i])
            out.append(LayerDifference(name, diffs[0], diffs[worst], spans[worst], max(floor, RATIO * diffs[0]),
                                       kinds.get(name, "decoder"), replayed.get(name, 0)))
        return out


def probe_key(stack: Any, length: int | None) -> tuple[Any, ...]:
    """What a probe's measurement holds for: autograd on or off, the stack's train/eval mode, every module below
    it as it is wrapped (its class, an instance ``forward``, its hooks), and the row's length class (a power of two;
    ``None``: not part of the key, as for ranks in lockstep, whose rows may differ)."""
    import torch

    modules = tuple(
        (type(m), id(m.__dict__.get("forward")), *(tuple(getattr(m, h, None) or ()) for h in _HOOKS))
        for m in stack.modules()
    )
    return torch.is_grad_enabled(), bool(stack.training), hash(modules), None if length is None else length.bit_length()


_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _chosen(seg: RowSegments) -> list[tuple[int, int]]:
    """The first example, then up to two more (the shortest of two tokens or more: the cheapest to run)."""
    starts = seg.by_cu_seq_lens or (seg.by_positions[0] if seg.by_positions else None) or seg.by_seq_idx
    if not starts or seg.rows != 1:
        return []
    spans = list(zip(starts, (*starts[1:], seg.length)))
    later = sorted((s for s in spans[1:] if s[1] - s[0] >= _MIN_TOKENS), key=lambda s: (s[1] - s[0], s[0]))
    return [spans[0], *sorted(later[: PROBED_EXAMPLES - 1])]


def _alone(kwargs: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    """The call for tokens [a, b) of the row as a sequence of its own."""
    import torch

    out = {k: v for k, v in kwargs.items() if k not in _DROPPED}
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            out[key] = kwargs[key][:, a:b]
    like = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    out["position_ids"] = torch.arange(b - a, device=like.device).unsqueeze(0).expand(like.shape[0], -1)
    out["use_cache"] = False
    return out


def _outputs(stack: Any, layers: list[tuple[str, Any]], kwargs: dict[str, Any],
             spans: list[tuple[int, int]] | None = None, routing: list[Any] = ()) -> list[tuple[str, Any]]:
    """Every decoder layer's output hidden states for one call of the stack (only the tokens of ``spans``, one
    after the other, when given: at 27B widths a whole row's outputs of every layer would take gigabytes).
    ``routing``: the routers' hooks for this call (kernelguard.runtime.probe_routing), removed with the others."""
    seen: list[tuple[str, Any]] = []
    handles = [*routing, *(module.register_forward_hook(_keep(name, seen, spans)) for name, module in layers)]
    try:
        stack(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _keep(name: str, seen: list[tuple[str, Any]], spans: list[tuple[int, int]] | None) -> Any:
    import torch

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, (tuple, list)) else getattr(output, "last_hidden_state", output)
        if spans is not None:
            hidden = torch.cat([hidden[:, a:b] for a, b in spans], dim=1)
        seen.append((name, hidden.detach()))

    return hook


def _relative(packed: Any, alone: Any) -> float:
    """The largest per-token |packed - alone| / |alone| (L2 over the last dimension), in fp32."""
    p, a = packed.float(), alone.float()
    return float(((p - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)).max())


def _decoder_layers(stack: Any, path: str) -> list[tuple[str, Any]]:
    """The numbered layers the stack runs (its ModuleList of decoder layers), by their path in the model: a child
    of the stack, else the first one below it (a whole causal LM probed from its outermost call: the plugin)."""
    import torch

    def numbered(module: Any) -> bool:
        return isinstance(module, torch.nn.ModuleList) and len(module) > 0 and \
            all(k.isdigit() for k, _ in module.named_children())

    found = [(n, c) for n, c in stack.named_children() if numbered(c)] or \
        [(n, m) for n, m in stack.named_modules() if n and numbered(m)][:1]
    for name, child in found[:1]:
        prefix = f"{path}.{name}" if path else name
        return [(f"{prefix}.{i}", layer) for i, layer in enumerate(child)]
    return []


def _kind(layer: Any) -> str:
    """What a decoder layer mixes its tokens with: its own ``layer_type`` (Qwen3.5, Qwen3-Next, ...), else an
    attention when it has one and no gated-delta module."""
    declared = getattr(layer, "layer_type", None)
    if isinstance(declared, str):
        return declared.replace("_", " ")
    names = [type(m).__name__ for m in layer.modules()]
    if any("GatedDelta" in n for n in names):
        return "linear attention"
    return "full attention" if any("Attention" in n for n in names) else "decoder"


def _without_dropout(module: Any) -> Callable[[], None]:
    """Zero every dropout probability under ``module`` (modules and attention layers' ``attention_dropout``)
    without a train()/eval() switch (transformers >= 5.25 re-kernelizes on a mode change); returns the undo."""
    import torch

    saved: list[tuple[Any, str, Any]] = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p:
            saved.append((sub, "p", sub.p))
            sub.p = 0.0
        if isinstance(getattr(sub, "attention_dropout", None), float) and sub.attention_dropout:
            saved.append((sub, "attention_dropout", sub.attention_dropout))
            sub.attention_dropout = 0.0

    def restore() -> None:
        for owner, attr, value in saved:
            setattr(owner, attr, value)

    return restore


def _error(first: LayerDifference, measured: list[LayerDifference]) -> PackedWithoutBoundariesError:
    a, b = first.example
    where = ", ".join(f"{d.layer.rsplit('.', 1)[-1]}: {d.worst:.1e}" for d in measured)
    message = (
        f"kernelguard: the first packed row, run example by example, differs from the packed run from "
        f"{first.layer} ({first.kind}) on: the example at tokens {a}-{b - 1} differs by {first.worst:.1e} relative (tolerance "
        f"{first.tolerance:.0e}; the row's first example, which nothing precedes, differs by {first.reference:.1e}). "
        "The layers do not keep the row's examples apart, whatever its boundary keywords say: the results are "
        f"wrong, not only slow, and nothing else raises. Per layer: {where}"
    )
    if "attention" in first.kind and "linear" not in first.kind:  # the first to leak is an attention layer
        fix = ("its attention reaches across the row's examples: sdpa and eager keep them apart only from the "
               "position ids, with no cache (use_cache=False, as the config may say otherwise) and no 2-D "
               "attention_mask; or give a varlen attention the boundaries (attn_implementation="
               "'kernelguard_varlen' or 'flash_attention_2', with cu_seq_lens_q/k); or train on padded batches")
    else:
        fix = ("check that each layer's kernels (GDN, KDA, Mamba-2 scan, conv) honour cu_seqlens / seq_idx and that the collator writes its boundaries "
               "from the same examples (DataCollatorWithFlattening(return_flash_attn_kwargs=True, "
               "return_seq_idx=True)); or train on padded batches")
    return PackedWithoutBoundariesError(
        message, fix=fix, layer=first.layer, examples=0, missing=(),
        details={"kind": "probe", "layers": [(d.layer, d.reference, d.worst, d.tolerance) for d in measured]},
    )
