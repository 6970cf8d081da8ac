"""Peak host RSS per rank of loading an HF checkpoint into FSDP2 shards on CPU (gloo): the sharded load
(kernelguard.train.model.weights, every rank reads its own slices) vs the rank-0 path (rank 0 builds the full fp32
model with from_pretrained and broadcasts it).

    python bench/cpu/bench_sharded_load.py [--ranks 1 2 4] [--hidden 1024] [--layers 8] [--dir /tmp/kg_bench]

Prints one JSON line per (path, ranks): RSS before the load (imports + meta model + fully_shard), peak RSS
(ru_maxrss) and the load's wall time, per rank. On CPU the parameters themselves are host memory (fp32, 4 N /
world per rank); the memory-mapped safetensors pages a rank reads count in its RSS too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_model(folder: Path, *, hidden: int, layers: int) -> int:
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (folder / "config.json").exists():
        return sum(1 for _ in folder.glob("*.safetensors"))
    config = Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size="100MB")
    return sum(1 for _ in folder.glob("*.safetensors"))


def worker(folder: str, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kernelguard.train.model.parallel import (
        apply_fsdp,
        build_meta_model,
        init_distributed,
        materialize,
        mixed_precision,
        model_source,
    )
    from kernelguard.train.model.weights import load_weights, plan_weights

    info = init_distributed()
    config, weights = model_source(folder)
    model = build_meta_model(config, attn_implementation="sdpa")
    plan, note = plan_weights(model, weights)
    apply_fsdp(model, mesh=init_device_mesh("cpu", (info.world_size,)), mp_policy=mixed_precision("bf16"))
    dist.barrier()
    before = _rss_bytes()
    t0 = time.perf_counter()
    if path == "sharded":
        load_weights(model, plan=plan, note=note, info=info, config=config, weights=weights, seed=0)
    else:
        materialize(model, info=info, config=config, weights=weights, seed=0)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows: list = [None] * info.world_size
    dist.all_gather_object(rows, {"rank": info.rank, "rss_before_gb": before / 1e9, "peak_rss_gb": peak / 1e9,
                                  "load_s": round(seconds, 2)})
    if info.is_main:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"path": path, "ranks": info.world_size, "params_m": round(params / 1e6, 1),
                          "fp32_model_gb": round(4 * params / 1e9, 3), "per_rank": rows}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kg_bench_sharded_load"))
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    files = make_model(args.dir, hidden=args.hidden, layers=args.layers)
    print(f"# {args.dir}: {files} safetensors files", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TRANSFORMERS_VERBOSITY="error")
    for ranks in args.ranks:
        for path in ("sharded", "rank0"):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--standalone",
                   __file__, "--worker", str(args.dir), path]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else f"# {path} x{ranks} failed: {r.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()
