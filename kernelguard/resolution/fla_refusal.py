"""fla's own refusal of the gated Triton backward on Hopper with Triton 3.4-3.7.0 (fla issue 640), and its lift.

Lifted only in-process, and only when the user accepted a known-issue row that marks the refusal as
conservative for their shapes (``KnownIssue.lifts_fla_refusal``), so the accepted path actually runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["FLA_REFUSAL_FLAG", "lift_fla_hopper_refusal", "lift_for_accepted_issues"]

FLA_REFUSAL_FLAG = "TRITON_ABOVE_3_7_1"


def lift_fla_hopper_refusal() -> list[str]:
    """Let fla 0.6.0 run its gated Triton backward on Hopper with Triton 3.4-3.7.0, for this process.

    fla raises in ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` when ``not TRITON_ABOVE_3_7_1`` (fla issue 640).
    The flag is imported *by value* (``from fla.utils import TRITON_ABOVE_3_7_1``), so it is set in every
    loaded ``fla`` module holding it (``fla.utils.env``, ``fla.utils``, ``fla.ops.common.chunk_o``; the last
    is the one read at call time). Returns the modules changed. Upstream reports wrong gradients at key-dim
    tile 64 (not reproduced on an H200 with Triton 3.6.0, bench/RESULTS.md): use this to *measure* (the
    numerics then judge the stack), or after an explicit --allow, never to train silently.
    """
    import importlib

    importlib.import_module("fla.ops.common.chunk_o")  # the consumer; also loads fla.utils
    changed = []
    for name, module in list(sys.modules.items()):
        in_fla = name == "fla" or name.startswith("fla.")
        if in_fla and module is not None and getattr(module, FLA_REFUSAL_FLAG, None) is False:
            setattr(module, FLA_REFUSAL_FLAG, True)
            changed.append(name)
    return changed


def lift_for_accepted_issues(accepted: Iterable[str]) -> list[str]:
    """Lift the refusal when an accepted known issue says so; returns the fla modules changed.

    An fla without the module that holds the refusal (a stand-in, another layout) has nothing to lift."""
    from .known_issues import by_id

    if not any((row := by_id(i)) is not None and row.lifts_fla_refusal for i in accepted):
        return []
    try:
        return lift_fla_hopper_refusal()
    except ImportError:
        return []
