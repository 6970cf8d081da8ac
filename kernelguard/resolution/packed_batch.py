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

__all__ = ["BOUNDARY_KEYWORDS", "IGNORE_INDEX", "MODEL_INPUT_KEYWORDS"]

# Labels the loss skips (transformers' and torch's cross-entropy default).
IGNORE_INDEX = -100

BOUNDARY_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

# What kernelguard train hands the model from a packed block (the loss takes the labels itself).
MODEL_INPUT_KEYWORDS = ("input_ids", "position_ids", *BOUNDARY_KEYWORDS)
