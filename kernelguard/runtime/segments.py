"""Where the examples of a packed row begin, by every boundary signal a call carries, and whether they agree.

A packed row can say where its examples begin in four ways: position ids that restart (or jump), transformers'
flash-attention keywords ``cu_seq_lens_q/k``, ``seq_idx`` (the conv's), and an attention mask. Each consumer reads
one of them: the gated-delta kernels ``cu_seqlens``, the conv ``seq_idx``, attention ``cu_seq_lens`` or the
position ids, depending on its implementation. A row whose signals disagree runs each layer on different
examples, so every signal that is present must give the same starts. An attention mask is a padding mask only
when it masks something: an all-ones mask (a tokenizer's, kept by a hand-made collator) says nothing about
where a packed row's examples begin.

:func:`read_segments` reads the signals (a few device reads: callers decide how often), :class:`RowSegments`
compares them. Pure functions of tensors; no model, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernelguard.resolution import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, SEQ_IDX

__all__ = [
    "RowSegments",
    "block_mask_starts",
    "examples_per_row",
    "position_starts",
    "read_segments",
    "readable_mask",
    "signals_disagree_on_device",
]


def position_starts(position_ids: Any) -> list[list[int]]:
    """Per row, the indices where an example begins by the position ids: 0, and every place the positions do
    not continue (a restart at 0, a jump). ``position_ids``: [B, T], [T], or [3 or 4, B, T] (multimodal rope:
    the first plane is the text positions)."""
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape[-1] < 2:
        return [[0] for _ in range(positions.shape[0])]
    breaks = positions[:, 1:] != positions[:, :-1] + 1
    return [[0, *(int(i) + 1 for i in row.nonzero().flatten().tolist())] for row in breaks]


def examples_per_row(position_ids: Any) -> list[int]:
    """Examples in each row of a batch, by where its position ids do not continue."""
    return [len(starts) for starts in position_starts(position_ids)]


@dataclass(frozen=True, slots=True)
class RowSegments:
    """The example starts of one call's rows, by each signal it carries (None: the signal is absent)."""

    rows: int
    length: int
    by_positions: tuple[tuple[int, ...], ...] | None = None  # one tuple per row
    by_cu_seq_lens: tuple[int, ...] | None = None  # cu_seq_lens_q: the starts of row 0 (packed rows are batch 1)
    cu_end: int | None = None  # cu_seq_lens_q's last entry: where the last example ends
    cu_k_differs: bool = False  # cu_seq_lens_k is not cu_seq_lens_q (self-attention over one row: it must be)
    by_seq_idx: tuple[int, ...] | None = None
    mask_all_ones: bool | None = None  # None: no attention mask
    # A 4-D mask that is exactly causal and block-diagonal: the starts of its blocks (row 0). None for no 4-D mask
    # or another structure (a shared prefix, a tree): nothing is claimed about those.
    by_mask: tuple[int, ...] | None = None
    # With a 2-D mask that masks something: the most examples any row holds among its unmasked tokens, by where
    # their position ids restart (None: no such mask, or no position ids to tell).
    examples_unmasked: int | None = None

    @property
    def padded(self) -> bool:
        """A padding mask that masks something, over one example per row, as transformers' mask code assumes.
        A row whose unmasked tokens hold several examples (pads between or after packed examples) is packed."""
        return self.mask_all_ones is False and (self.examples_unmasked or 1) <= 1

    @property
    def masked_packed(self) -> bool:
        """Packed rows with masked tokens in them: checked, but not probed (alone, an example's pads would
        attend)."""
        return self.mask_all_ones is False and not self.padded

    @property
    def examples(self) -> int:
        """Examples in the busiest row, by the signals present (they agree, or :meth:`disagreement` says not)."""
        if self.masked_packed:
            return int(self.examples_unmasked or 1)
        counts = [len(s) for s in (self.by_cu_seq_lens, self.by_seq_idx, self.by_mask) if s is not None]
        counts += [len(row) for row in self.by_positions or ()]
        return max(counts, default=1)

    @property
    def source(self) -> str:
        """The signal the example count is quoted from in a message."""
        for name, starts in ((CU_SEQ_LENS_Q, self.by_cu_seq_lens), (SEQ_IDX, self.by_seq_idx)):
            if starts is not None and len(starts) == self.examples:
                return name
        return "position_ids"

    def signals(self) -> dict[str, tuple[int, ...]]:
        """Each present signal's starts for row 0 (the row every per-row signal describes)."""
        out: dict[str, tuple[int, ...]] = {}
        if self.by_positions is not None:
            out["position_ids"] = self.by_positions[0]
        if self.by_cu_seq_lens is not None:
            out[CU_SEQ_LENS_Q] = self.by_cu_seq_lens
        if self.by_seq_idx is not None:
            out[SEQ_IDX] = self.by_seq_idx
        if self.by_mask is not None:
            out["attention_mask"] = self.by_mask
        return out

    def disagreement(self) -> str | None:
        """Why the signals present do not describe the same examples, or None when they do."""
        if self.by_cu_seq_lens is not None:
            starts = self.by_cu_seq_lens
            if self.rows != 1:
                return f"cu_seq_lens_q describes one packed row, but the batch has {self.rows} rows"
            if not starts or starts[0] != 0:
                return "cu_seq_lens_q does not start at 0"
            if any(b <= a for a, b in zip(starts, (*starts[1:], self.cu_end))):
                return "cu_seq_lens_q has an empty or decreasing segment (its kernels need every segment non-empty)"
            if self.cu_end != self.length:
                return f"cu_seq_lens_q ends at {self.cu_end}, but the row has {self.length} tokens"
        if self.cu_k_differs:
            return "cu_seq_lens_k differs from cu_seq_lens_q (one packed row attends to itself: they must match)"
        seen = self.signals()
        if len(set(seen.values())) <= 1:
            return None
        told = ", ".join(f"{name} {_examples(len(starts))}{_at(starts)}" for name, starts in seen.items())
        return f"boundary signals disagree: {told}"


def _examples(n: int) -> str:
    return f"{n} example{'s' if n != 1 else ''}"


def _at(starts: tuple[int, ...], most: int = 6) -> str:
    shown = ", ".join(str(s) for s in starts[:most]) + (", ..." if len(starts) > most else "")
    return f" (starting at {shown})"


def readable_mask(attention_mask: Any) -> Any:
    """The mask a call's boundaries are read from: the tensor itself, or from a dict of masks by layer type
    (what generate() hands a hybrid model with a static cache: ``{"full_attention": 4-D, "linear_attention":
    2-D}``) its 2-D padding mask, else its 4-D one; None when it holds no tensor."""
    if not isinstance(attention_mask, dict):
        return attention_mask
    tensors = [m for m in attention_mask.values() if hasattr(m, "dim")]
    return next((m for m in tensors if m.dim() == 2), next((m for m in tensors if m.dim() == 4), None))


def read_segments(position_ids: Any, kwargs: dict[str, Any], attention_mask: Any) -> RowSegments:
    """The starts of every signal one call carries (a few device reads). ``attention_mask`` may be a 2D padding
    mask, or anything else transformers accepts (a 4D mask, a dict of masks: :func:`readable_mask`)."""
    attention_mask = readable_mask(attention_mask)
    rows, length = _shape(position_ids, kwargs)
    found: dict[str, Any] = {"rows": rows, "length": length}
    if position_ids is not None and hasattr(position_ids, "dim"):
        found["by_positions"] = tuple(tuple(r) for r in position_starts(position_ids))
    cu = kwargs.get(CU_SEQ_LENS_Q)
    if cu is not None and hasattr(cu, "tolist"):
        values = [int(v) for v in cu.reshape(-1).tolist()]
        while len(values) > 2 and values[-1] == values[-2]:  # padded to a static shape: repeats describe nothing
            values.pop()
        found["by_cu_seq_lens"], found["cu_end"] = tuple(values[:-1]), (values[-1] if values else 0)
        cu_k = kwargs.get(CU_SEQ_LENS_K)
        found["cu_k_differs"] = cu_k is not None and cu_k is not cu and (
            tuple(cu_k.shape) != tuple(cu.shape) or bool((cu_k.to(cu.device) != cu).any()))
    seq_idx = kwargs.get(SEQ_IDX)
    if seq_idx is not None and hasattr(seq_idx, "dim"):
        row = seq_idx.reshape(-1) if seq_idx.dim() == 1 else seq_idx[0]
        changes = (row[1:] != row[:-1]).nonzero().flatten() + 1 if row.numel() > 1 else row.new_empty(0)
        found["by_seq_idx"] = (0, *(int(i) for i in changes.tolist()))
    if attention_mask is not None and hasattr(attention_mask, "dim") and attention_mask.dim() == 2:
        found["mask_all_ones"] = bool(attention_mask.bool().all())
        if not found["mask_all_ones"] and position_ids is not None and hasattr(position_ids, "dim"):
            found["examples_unmasked"] = _examples_unmasked(position_ids, attention_mask)
    if attention_mask is not None and hasattr(attention_mask, "dim") and attention_mask.dim() == 4:
        found["by_mask"] = block_mask_starts(attention_mask)
        if found["by_mask"] is None and "by_positions" in found:  # a mask of its own structure: a tree, ...
            found["by_positions"] = _restarts_at_zero(position_ids, found["by_positions"])
    return RowSegments(**found)


def _restarts_at_zero(position_ids: Any, starts: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Under a 4-D mask that is not block-diagonal, the starts where the positions begin again at 0: a packed
    example's. A shared-prefix tree's branches repeat a depth (``[0, 1, 2, 3, 3, 3]``) and are not examples."""
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids
    positions = positions.unsqueeze(0) if positions.dim() == 1 else positions
    out = []
    for row, row_starts in zip(positions.tolist(), starts):
        out.append(tuple(s for s in row_starts if s == 0 or row[s] == 0))
    return tuple(out)


def _examples_unmasked(position_ids: Any, mask: Any) -> int:
    """The most examples a row holds among its unmasked tokens: where the positions of those tokens, in order,
    begin again at 0 (a packed example's start). A padded row has one (its pads, left or right, are masked), also
    when its positions repeat or jump (generate() on a right-padded row: ``[0, 1, <pads>, 1]``); a packed row
    with pads more."""
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if tuple(positions.shape) != tuple(mask.shape):
        return 1
    most = 1
    for row, keep in zip(positions, mask.bool()):
        kept = row[keep.to(row.device)]
        if kept.numel() > 1:
            most = max(most, 1 + int((kept[1:] == 0).sum()))
    return most


def signals_disagree_on_device(position_ids: Any, kwargs: dict[str, Any], attention_mask: Any) -> Any:
    """A device bool (no host read): whether a one-row call's boundary signals - position ids, ``cu_seq_lens_q``,
    ``seq_idx`` - mark different example starts, or ``cu_seq_lens_q`` does not end at the row's length. None
    when fewer than two signals are there or the call is not one row. A 2-D mask that masks something makes it
    False (a padded batch; :func:`read_segments` judges those when it reads them). Between the calls the host
    reads, this is what keeps watching: a stale ``cu_seq_lens``, an all-zero ``seq_idx``."""
    import torch

    attention_mask = readable_mask(attention_mask)
    markers = []
    length = None
    if position_ids is not None and hasattr(position_ids, "dim"):
        positions = position_ids[0] if position_ids.dim() == 3 else position_ids
        positions = positions.unsqueeze(0) if positions.dim() == 1 else positions
        if positions.shape[0] != 1 or positions.shape[-1] < 2:
            return None
        row = positions[0]
        length = row.shape[0]
        markers.append(torch.cat([row.new_ones(1, dtype=torch.bool), row[1:] != row[:-1] + 1]))
    seq_idx = kwargs.get(SEQ_IDX)
    if seq_idx is not None and hasattr(seq_idx, "dim") and (seq_idx.dim() == 1 or seq_idx.shape[0] == 1):
        row = seq_idx.reshape(-1)
        if length is not None and row.shape[0] != length:
            return None
        length = row.shape[0]
        markers.append(torch.cat([row.new_ones(1, dtype=torch.bool), row[1:] != row[:-1]]))
    cu = kwargs.get(CU_SEQ_LENS_Q)
    ends_wrong = None
    if cu is not None and hasattr(cu, "dim") and cu.dim() == 1 and length is not None and markers:
        device = markers[0].device
        cu = cu.to(device, non_blocking=True).long()
        marker = torch.zeros(length + 1, dtype=torch.bool, device=device)
        # index_fill_ takes the value as a kernel argument (`marker[i] = True` would copy a host scalar and sync);
        # repeats at the end (a static shape) land on `length`: dropped
        marker.index_fill_(0, cu.clamp(0, length), True)
        markers.append(marker[:length])
        ends_wrong = cu[-1] != length
    if len(markers) < 2:
        return None
    bad = torch.stack([(m != markers[0]).any() for m in markers[1:]]).any()
    if ends_wrong is not None:
        bad = bad | ends_wrong
    if attention_mask is not None and hasattr(attention_mask, "dim") and attention_mask.dim() == 2:
        bad = bad & attention_mask.to(bad.device).bool().all()
    return bad


def block_mask_starts(mask: Any) -> tuple[int, ...] | None:
    """The starts of a 4-D mask's blocks (row 0, head 0) when it is exactly a causal block-diagonal mask, the
    packed row's own; None for any other structure. Bool masks: True attends; float masks: 0 attends (additive)."""
    import torch

    m = mask[0, 0]
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
        return None
    allowed = m if m.dtype == torch.bool else m == 0
    starts = [0, *(int(i) + 1 for i in (~allowed.diagonal(-1)).nonzero().flatten().tolist())]
    segment = torch.zeros(m.shape[0], dtype=torch.long, device=m.device)
    segment[starts[1:]] = 1
    segment = segment.cumsum(0)
    index = torch.arange(m.shape[0], device=m.device)
    expected = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    return tuple(starts) if bool((allowed == expected).all()) else None


def _shape(position_ids: Any, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(rows, tokens per row) of the call, from whichever tensor tells it."""
    for tensor in (position_ids, kwargs.get("input_ids"), kwargs.get(SEQ_IDX), kwargs.get("inputs_embeds")):
        if tensor is None or not hasattr(tensor, "dim"):
            continue
        if tensor is position_ids and tensor.dim() == 3:
            return int(tensor.shape[1]), int(tensor.shape[2])
        if tensor.dim() == 1:
            return 1, int(tensor.shape[0])
        return int(tensor.shape[0]), int(tensor.shape[1])
    return 1, 0
