"""One rank of a sharded load (kernelguard.train.model.weights) then an export (kernelguard.train.output.export), without
training: ``torchrun --nproc-per-node N tests/weights_worker.py SOURCE_DIR OUT_DIR MAX_SHARD_SIZE``.

Rank 0 writes the loaded parameters, gathered, to OUT_DIR/loaded.safetensors (only for the test to compare);
all ranks write OUT_DIR/final/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from kernelguard.train.model.build import BuiltModel
from kernelguard.train.model.parallel import (
    apply_fsdp,
    build_meta_model,
    init_distributed,
    mixed_precision,
    model_source,
)
from kernelguard.train.model.weights import load_weights, plan_weights
from kernelguard.train.output.export import export_run


def main(source: Path, out: Path, max_shard_size: str) -> None:
    info = init_distributed()
    config, weights = model_source(str(source))
    model = build_meta_model(config, attn_implementation="sdpa")
    plan, note = plan_weights(model, weights)
    assert plan is not None, note
    apply_fsdp(model, mesh=init_device_mesh("cpu", (info.world_size,)), mp_policy=mixed_precision("fp32"))
    load_weights(model, plan=plan, note=note, info=info, config=config, weights=weights, seed=0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(out / "loaded.safetensors"))
        buffers = {k: b.clone() for k, b in model.named_buffers() if k not in full}
        save_file(buffers, str(out / "buffers.safetensors"))
    built = BuiltModel(model, config, weights, "sdpa", weight_plan=plan, weight_note=note)
    export_run(out, model=model, built=built, tokenizer=None, dtype=torch.bfloat16, info=info,
               max_shard_size=max_shard_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
    # As `kernelguard train` does (train.__main__.exit_program): the interpreter's teardown can still meet
    # gloo's worker threads after destroy_process_group and abort a rank that finished (SIGABRT, CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
