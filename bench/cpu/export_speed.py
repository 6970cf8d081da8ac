"""Export write paths compared on CPU (gloo), one FSDP2 model, the same shard plan, the same disk:

    python -m torch.distributed.run --nproc-per-node 2 --standalone bench/cpu/export_speed.py OUT_DIR [--mb 256]

- ``gathered``: kernelguard.train.output.export's path: each tensor cast to bf16 on its shards, gathered whole,
  written by its rank's writer thread while the next is gathered (written once);
- ``pieces``: the path before round 4: an fp32 DCP copy of the whole model (``.pieces``), read back one tensor
  at a time and cast (what ``kernelguard export`` still does from a training checkpoint);
- ``from_checkpoint`` / ``from_checkpoint_in_turn``: ``kernelguard export``'s path from a training checkpoint
  (DCP, fp32, saved beforehand and not timed), reading ahead while the writer thread writes, or one tensor at a
  time (read, then write: the order before round 4);
- ``hf_consolidated``: torch DCP's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``
  (torchtitan's way): each rank writes its bf16 shards, then rank 0 consolidates them into full-tensor files.

Prints one JSON line per path (rank 0): seconds, output bytes, MB/s, the peak RSS growth of each rank (host
memory the path itself held), and whether its files hold the same tensors as ``gathered``. ``--mb`` is the
model's fp32 size. Figures from a shared 2-core machine say which path does less work, not disk speed.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def _model(mb: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    width = 1024
    layers = max(1, mb * 2**20 // (4 * width * width * 2))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width, bias=False), nn.Linear(width, width))
                            for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main() -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from kernelguard.train.output import export as ex
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--shard", default="64MB")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args.mb)
    state = get_model_state_dict(model)
    tensors = ex.export_tensors({k: tuple(v.shape) for k, v in state.items()}, plan=None, tied=False,
                                dtype=torch.bfloat16)
    max_bytes = ex.parse_size(args.shard)
    total = sum(t.nbytes for t in tensors)

    def gathered(folder: Path) -> None:
        ex.write_shards(folder, tensors, ex.Gathered(state, None, ex._read_carried), max_bytes=max_bytes, rank=rank, world=world)

    def pieces(folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(folder / ".pieces"))
        dist.barrier()
        ex.write_shards(folder, tensors, ex._Source(folder / ".pieces", None), max_bytes=max_bytes, rank=rank,
                        world=world)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder / ".pieces")

    def hf_consolidated(folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        shards = ex.plan_shards(tensors, max_bytes)
        index = {t.key: i + 1 for i, s in enumerate(shards) for t in s}
        low = {k: v.detach().to(torch.bfloat16) for k, v in state.items()}  # the rank's whole shard, in bf16
        dcp.save(low, storage_writer=HuggingFaceStorageWriter(
            str(folder), fqn_to_index_mapping=index, save_distributed=True, enable_consolidation=True,
            thread_count_consolidation=2))
        del low

    checkpoint = args.out / "checkpoint"  # a training checkpoint's model part, saved once, untimed
    if rank == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)
    dist.barrier()
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(checkpoint))
    dist.barrier()

    def from_checkpoint(folder: Path, budget: int = ex.IN_FLIGHT) -> None:
        ex.write_shards(folder, tensors, ex._Source(checkpoint, None), max_bytes=max_bytes, rank=rank, world=world,
                        budget=budget)

    def from_checkpoint_in_turn(folder: Path) -> None:
        from_checkpoint(folder, budget=0)  # one tensor at a time: read, then write (the pre-round-4 order)

    paths = (("gathered", gathered), ("pieces", pieces), ("hf_consolidated", hf_consolidated),
             ("from_checkpoint", from_checkpoint), ("from_checkpoint_in_turn", from_checkpoint_in_turn))
    reference: dict[str, torch.Tensor] | None = None
    for name, fn in paths:
        folder = args.out / name
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        dist.barrier()
        before = _rss_mb()
        t0 = time.perf_counter()
        fn(folder)
        dist.barrier()
        seconds = time.perf_counter() - t0
        growth = torch.tensor([_rss_mb() - before])
        grown = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(grown, growth)
        if rank == 0:
            got = _tensors(folder)
            if reference is None:
                reference = got
            same = got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
            print(json.dumps({
                "path": name, "ranks": world, "seconds": round(seconds, 2), "bytes": total,
                "mb_per_s": round(total / seconds / 1e6, 1), "files": len(list(folder.glob("*.safetensors"))),
                "peak_rss_growth_mb_per_rank": [round(float(g), 1) for g in grown],
                "same_tensors_as_gathered": same,
            }), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
