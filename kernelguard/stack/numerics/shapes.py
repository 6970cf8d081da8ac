"""The layer geometries and token layouts ``check --run`` exercises: the model's own and generic ones."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kernelguard.resolution import delta_rule_dims, field, text_config

__all__ = [
    "PACKED_LAYOUT",
    "PADDED_LAYOUT",
    "GdnShape",
    "bounds",
    "generic_shapes",
    "plan_shapes",
    "shapes_for_model",
]


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

    def segment_bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] of each packed segment; the whole sequence when not packed."""
        return [(0, self.seq_len)] if self.segments is None else bounds(self.segments)

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


def bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive segments with these lengths."""
    cuts = [0, *itertools.accumulate(lengths)]
    return list(itertools.pairwise(cuts))


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


def shapes_for_model(config: Any | None, *, generic: bool = True) -> list[GdnShape]:
    """The model's own GDN (or KDA) geometry (heads, GVA ratio, head dims, conv width) in a padded-batch and a
    packed layout, followed by :func:`generic_shapes` (key head dim 64 and 128) unless ``generic=False``.

    The generic key-dim-64 shapes make a stack that is wrong only at small head dims (fla issue 640) fail
    even for a model whose own head dim is 128; pass ``generic=False`` to judge the model's shapes alone."""
    extra = generic_shapes() if generic or config is None else []
    if config is None:
        return extra
    text = text_config(config)
    dims = delta_rule_dims(text)
    if dims is None:
        raise ValueError(
            f"{type(text).__name__} has no gated-delta-net fields (linear_num_key_heads, linear_key_head_dim, ...)"
            " and no Kimi-delta-attention fields (linear_num_heads, linear_head_dim)"
        )
    origin = field(text, "model_type") or type(text).__name__
    common: dict[str, Any] = {
        "num_k_heads": dims.num_k_heads,
        "num_v_heads": dims.num_v_heads,
        "key_dim": dims.key_dim,
        "value_dim": dims.value_dim,
        "conv_kernel": dims.conv_kernel,
        "origin": origin,
    }
    return [GdnShape(**common, **PADDED_LAYOUT), GdnShape(**common, **PACKED_LAYOUT), *extra]
