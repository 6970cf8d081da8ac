"""Peak host (CPU) memory per rank of loading, checkpointing and exporting, for `--dry-run`.

Beyond the process itself (Python, torch, transformers), what each stage holds in host memory at once:

- **load** (kernelguard.train.model.weights, sharded): the slice of one tensor a rank's shard covers, in the file's
  dtype, before it is copied into the parameter; the safetensors files are memory-mapped, so the pages read
  are page cache the kernel can drop, not the process's own. The rank-0 path (a ``pytorch_model.bin``, a
  random init, unfused MoE experts) instead holds the whole model in fp32 on rank 0, shown beside it;
- **checkpoint** (DCP ``save``): each local shard (parameter or AdamW state, fp32) is copied to the host one
  at a time while it is written, plus DCP's 10 MB copy-ahead;
- **export** (kernelguard.train.output.export): each tensor is cast to the export dtype on its shards and gathered
  whole; the rank that writes it holds it on the host until it is on disk, at most ``export.IN_FLIGHT`` bytes
  at once (or the largest tensor alone), plus a carried (vision) tensor copied as it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..settings.config import TrainConfig

__all__ = ["HostMemory", "host_memory"]

_COPY_AHEAD = 10_000_000  # DCP FileSystemWriter's per-thread copy-ahead
_FILE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}


@dataclass(frozen=True, slots=True)
class HostMemory:
    world_size: int
    sharded: bool  # False: rank 0 loads the full model (the reason is in ``note``)
    load_bytes: int
    rank0_path_bytes: int
    checkpoint_bytes: int
    export_bytes: int
    note: str | None = None

    def render(self) -> str:
        load = "load (sharded from safetensors)" if self.sharded else "load (on rank 0, then broadcast)"
        rows = [
            (load, self.load_bytes if self.sharded else self.rank0_path_bytes),
            ("checkpoint (DCP save, one shard at a time)", self.checkpoint_bytes),
            ("export (tensors in flight to disk)", self.export_bytes),
        ]
        lines = [f"host memory per rank over {self.world_size} rank(s), beyond the process itself:"]
        lines += [f"  {name:<44} {_gib(value):>9}" for name, value in rows]
        if self.sharded:
            lines.append(f"  note: the rank-0 load path would hold {_gib(self.rank0_path_bytes)} on rank 0")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_memory(
    cfg: TrainConfig, *, world_size: int | None = None, model: Any = None,
    progress: Callable[[str], None] | None = None,
) -> HostMemory:
    """The figures for ``cfg`` (a TrainConfig): shapes from the model built on the meta device (``model``, when
    the caller built it already: --dry-run builds it once), dtypes and carried tensors from the checkpoint's
    headers."""
    from ..model.parallel import DTYPES, build_meta_model, model_source
    from ..model.weights import plan_weights
    from ..output.export_stream import IN_FLIGHT

    ranks = max(1, int(world_size or os.environ.get("WORLD_SIZE") or 1))
    config, weights = model_source(str(cfg.model.model))
    meta = model if model is not None else build_meta_model(config, attn_implementation="sdpa")
    sizes = [p.numel() for p in meta.parameters()]
    if weights is not None and progress is not None:
        progress(f"reading the safetensors headers in {weights} (no tensor data)")
    plan, note = plan_weights(meta, weights) if weights is not None else (None, "random init: rank 0 builds it")
    file_bytes = 4
    carried = 0
    if plan is not None:
        entries = plan.layout.tensors
        file_bytes = max((_FILE_BYTES.get(entries[k].dtype, 4) for k in plan.names.values()), default=4)
        carried = max((math.prod(entries[k].shape) * _FILE_BYTES.get(entries[k].dtype, 4) for k in plan.carried),
                      default=0)
    largest = max(sizes, default=0)
    local = math.ceil(largest / ranks)
    export_item = DTYPES[str(cfg.runtime.param_dtype)].itemsize
    return HostMemory(
        world_size=ranks,
        sharded=plan is not None,
        load_bytes=local * file_bytes,
        rank0_path_bytes=4 * sum(sizes),
        checkpoint_bytes=4 * local + _COPY_AHEAD,
        export_bytes=max(min(IN_FLIGHT, export_item * sum(sizes)), export_item * largest) + carried,
        note=note,
    )

