"""One rank of the fp32-decay check (kernelguard.train.model.parallel.apply_fsdp under a bf16 policy):
``torchrun --nproc-per-node 2 tests/fp32_decay_worker.py SOURCE_DIR OUT_DIR``.

Loads SOURCE_DIR sharded, runs one optimizer step of kernelguard train's own step functions on this rank's
padded batch (different on each rank) while forward pre-hooks on every GDN layer record the dtype and value
of ``A_log`` / ``dt_bias`` as the forward reads them, then exports with dtype bf16. The same again with
``keep_fp32=()`` (every parameter cast to bf16, the policy before fp32 decay) shows what the hooks see when
the policy is reverted. Each rank writes OUT_DIR/rank{r}.json; all ranks write OUT_DIR/final/."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kernelguard.train.model.build import BuiltModel, make_optimizer
from kernelguard.train.model.parallel import (
    apply_fsdp,
    build_meta_model,
    fp32_params,
    init_distributed,
    mixed_precision,
    model_source,
)
from kernelguard.train.model.weights import load_weights, plan_weights
from kernelguard.train.output.export import export_run
from kernelguard.train.settings.config import OptimizerSection
from kernelguard.train.step.step import clip_gradients, forward_backward


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def one_step(source: Path, info: Any, *, keep_fp32: Any) -> tuple[Any, Any, dict[str, Any]]:
    config, weights = model_source(str(source))
    model = build_meta_model(config, attn_implementation="sdpa")
    plan, note = plan_weights(model, weights)
    mesh = init_device_mesh("cpu", (info.world_size,))
    kw = {} if keep_fp32 is None else {"keep_fp32": keep_fp32}
    apply_fsdp(model, mesh=mesh, mp_policy=mixed_precision("bf16"), **kw)
    load_weights(model, plan=plan, note=note, info=info, config=config, weights=weights, seed=0)
    seen: dict[str, Any] = {}

    def record(name: str) -> Any:
        def hook(module: torch.nn.Module, _args: Any) -> None:
            seen[name] = {
                "A_log": str(module.A_log.dtype), "dt_bias": str(module.dt_bias.dtype),
                "in_proj_qkv": str(module.in_proj_qkv.weight.dtype),
                "A_log_values": module.A_log.detach().float().tolist(),
            }  # fmt: skip

        return hook

    for name, module in model.named_modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.register_forward_pre_hook(record(name))
    opt, _ = make_optimizer(model, optimizer=OptimizerSection(learning_rate=1e-2), device=info.device,
                            schedule_steps=4)  # fmt: skip
    gen = torch.Generator().manual_seed(info.rank)  # each rank its own batch: its own gradients
    ids = torch.randint(3, 200, (2, 12), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    forward_backward(model, [batch], info=info)
    grads = {n: _local(p.grad).tolist() for n, p in fp32_params(model).items() if p.grad is not None}
    # every gradient whole (sharded ones gathered): the norm the ranks' shards and kept parameters must give
    whole = [_local(p.grad).float() for p in model.parameters() if p.grad is not None]
    reference = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in whole])))
    norm = clip_gradients(model, 1.0)
    opt.step()
    after = {n: _local(p.detach()).tolist() for n, p in fp32_params(model).items()}
    result = {
        "seen": seen, "grads": grads, "grad_norm": norm, "reference_norm": reference, "after": after,
        "param_dtypes": {n: str(p.dtype) for n, p in fp32_params(model).items()},
        "groups": [len(g["params"]) for g in opt.param_groups],
    }  # fmt: skip
    return model, config, result


def main(source: Path, out: Path) -> None:
    info = init_distributed()
    model, config, kept = one_step(source, info, keep_fp32=None)
    config_w = model_source(str(source))
    plan, note = plan_weights(build_meta_model(config_w[0], attn_implementation="sdpa"), config_w[1])
    built = BuiltModel(model, config, config_w[1], "sdpa", weight_plan=plan, weight_note=note)
    export_run(out, model=model, built=built, tokenizer=None, dtype=torch.bfloat16, info=info)
    _, _, reverted = one_step(source, info, keep_fp32=())
    (out / f"rank{info.rank}.json").write_text(json.dumps({"kept": kept, "reverted": reverted}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # As `kernelguard train` does (train.__main__.exit_program): the interpreter's teardown can still meet
    # gloo's worker threads after destroy_process_group and abort a rank that finished (SIGABRT, CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
