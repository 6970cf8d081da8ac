"""One rank of `kernelguard train --init random`'s weight fill (kernelguard.train.model.random_init) on a
config alone: ``torchrun --nproc-per-node N tests/random_init_worker.py CONFIG_DIR OUT_FILE SEED``. Rank 0 writes
the whole initial state, gathered, to OUT_FILE (for the test to compare world sizes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from kernelguard.train.model.parallel import (
    apply_activation_checkpointing,
    apply_fsdp,
    build_meta_model,
    init_distributed,
    mixed_precision,
    model_source,
)
from kernelguard.train.model.weights import load_weights


def _rank0_path(*args: object, **kwargs: object) -> None:
    raise AssertionError("the rank-0 path (parallel.materialize) ran: the shards were not initialised in place")


def main(source: Path, out: Path, seed: int) -> None:
    import kernelguard.train.model.parallel as parallel

    parallel.materialize = _rank0_path  # type: ignore[assignment]
    info = init_distributed()
    config, weights = model_source(str(source))
    assert weights is None
    model = build_meta_model(config, attn_implementation="sdpa")
    if info.world_size > 1:  # the wrapped names of a checkpointed run must not change the numbers
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh=init_device_mesh("cpu", (info.world_size,)), mp_policy=mixed_precision("bf16"))
    how = load_weights(model, plan=None, note=None, info=info, config=config, weights=None, seed=seed)
    assert how == "random", how
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as `kernelguard train` leaves: gloo's threads can abort the interpreter's teardown
