"""``python -m kernelguard.train ARGS`` with kernelguard's fla autotune pins applied first (bench/ only).

    python bench/gpu/pinned_train.py --model ... --max-steps 30 ...   # same flags as kernelguard train

fla autotunes each kernel the first time a process sees its key (heads, head dims, varlen flag): a search
compiles every candidate config, minutes on a bare machine. ``kernelguard check --run`` and
bench/gpu/train_throughput.py fill fla's autotune caches from kernelguard/fla_autotune_pins.json (the choices
an autotuning run made on the same arch, Triton and fla: kernelguard.resolution.fla_autotune). ``kernelguard train``
pinned them only after its first-row probe had run (and searched) the forward kernels; since issue 49 it pins
before the probe, so this wrapper now does what the product does. It stays so that the bench's commands and
the runs recorded with it stay comparable: the run, its windows and its verdicts are the product's own (a key
without a pin still autotunes, and a window with a search inside is postponed as usual).
Without CUDA (``--tiny``) nothing is imported ahead and the run is exactly ``python -m kernelguard.train``.
"""

from __future__ import annotations

import runpy
import sys

__all__ = ["apply_pins"]


def apply_pins() -> str:
    """Load fla's GDN kernels and pin their autotune choices for this GPU; one sentence for the log."""
    import torch

    if not torch.cuda.is_available():
        return "fla autotune pins: not applied (no CUDA)"
    try:
        import fla.modules  # noqa: F401 - loads the l2norm / norm kernels the pins name
        import fla.ops.gated_delta_rule  # noqa: F401 - loads the chunk kernels the pins name
    except Exception as exc:  # noqa: BLE001 - no fla: the run says what it does without it
        return f"fla autotune pins: not applied (fla not importable: {type(exc).__name__}: {exc})"
    from kernelguard.resolution.fla_autotune import pin_for_this_gpu

    return pin_for_this_gpu()


if __name__ == "__main__":
    print(f"pinned_train: {apply_pins()}", file=sys.stderr, flush=True)
    sys.argv = ["kernelguard.train", *sys.argv[1:]]
    runpy.run_module("kernelguard.train", run_name="__main__", alter_sys=True)
