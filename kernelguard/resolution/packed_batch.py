"""The packed batch: examples laid end to end in one row, and the keyword names that tell every layer where
one example ends.

A row of packed examples reaches a transformers model as ``input_ids`` and ``position_ids`` ([1, T], the
positions restarting at each example) plus the boundary keywords below: transformers' flash-attention
keywords (``cu_seq_lens_q/k`` int32 cumulative lengths, ``max_length_q/k`` ints) and ``seq_idx`` (int32
[1, T], each token's example), which the GDN layers' conv needs. Without them GDN state and conv inputs run on
from one example into the next. kernelguard's packer writes these names, the guard checks them, the Hub probe
checks that a kernel accepts them: this module is their one spelling.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BOUNDARY_KEYWORDS",
    "BOUNDARY_PARAMS",
    "CU_SEQ_LENS_K",
    "CU_SEQ_LENS_Q",
    "IGNORE_INDEX",
    "MAX_LENGTH_K",
    "MAX_LENGTH_Q",
    "MODEL_INPUT_KEYWORDS",
    "NO_BOUNDARY_PARAM",
    "SEQ_IDX",
    "boundary_arguments",
]

# Labels the loss skips (transformers' and torch's cross-entropy default).
IGNORE_INDEX = -100

CU_SEQ_LENS_Q, CU_SEQ_LENS_K = "cu_seq_lens_q", "cu_seq_lens_k"
MAX_LENGTH_Q, MAX_LENGTH_K = "max_length_q", "max_length_k"
SEQ_IDX = "seq_idx"
BOUNDARY_KEYWORDS = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, SEQ_IDX)

# Kernel -> (the kernel's boundary parameter, the batch keyword transformers feeds it from): the kernels whose
# way of keeping packed examples apart kernelguard knows. causal_conv1d_fn's own parameter has the keyword's name.
BOUNDARY_PARAMS: dict[str, tuple[str, str]] = {
    "chunk_gated_delta_rule": ("cu_seqlens", CU_SEQ_LENS_Q),
    "fused_recurrent_gated_delta_rule": ("cu_seqlens", CU_SEQ_LENS_Q),
    "chunk_kda": ("cu_seqlens", CU_SEQ_LENS_Q),
    "fused_recurrent_kda": ("cu_seqlens", CU_SEQ_LENS_Q),
    "causal_conv1d_fn": (SEQ_IDX, SEQ_IDX),
    # mamba-ssm 2.x's Mamba-2 scans take the same int32 [B, T] example index (transformers hands the kernel
    # only the parameters its signature names, so the layer's **kwargs deliver the batch's seq_idx)
    "mamba_chunk_scan_combined": (SEQ_IDX, SEQ_IDX),
    "mamba_split_conv1d_scan_combined": (SEQ_IDX, SEQ_IDX),
}

# State-carrying kernels that take no boundary at all: a packed row through them runs as one sequence whatever
# the batch carries (mamba-ssm's Mamba-1 selective scan, fused or not).
NO_BOUNDARY_PARAM = ("mamba_inner_fn", "selective_scan_fn")

# What kernelguard train hands the model from a packed block (the loss takes the labels itself).
MODEL_INPUT_KEYWORDS = ("input_ids", "position_ids", *BOUNDARY_KEYWORDS)


def boundary_arguments(cu_seq_lens: Any, seq_idx: Any, longest: int) -> dict[str, Any]:
    """The boundary keywords of one packed row, as every builder lays them out: ``cu_seq_lens`` (int32, each
    example's start and the row's end) for the queries and a copy for the keys (one tensor each: a kernel may
    keep either), the longest example for both, and ``seq_idx`` (int32 ``[1, T]``, each token's example)."""
    return {
        CU_SEQ_LENS_Q: cu_seq_lens,
        CU_SEQ_LENS_K: cu_seq_lens.clone(),
        MAX_LENGTH_Q: longest,
        MAX_LENGTH_K: longest,
        SEQ_IDX: seq_idx,
    }
