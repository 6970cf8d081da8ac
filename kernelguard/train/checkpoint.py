"""Atomic DCP checkpoints, resume, and the final safetensors export.

Layout under ``OUTPUT/checkpoints/``: ``step_N/`` holds the DCP shards (model + optimizer, sharded as
trained), ``trainer.json`` (step, scheduler, data position, world size), ``rng_rank{r}.pt`` and the
``COMPLETE`` marker. Everything is written into ``step_N.tmp/`` first; rank 0 writes the marker last and
renames the folder. A folder without its marker (a crash mid-save) is never resumed from and is removed.
The export is written to ``OUTPUT/final.tmp/`` and renamed to ``OUTPUT/final/``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kernelguard.errors import ConfigError

MARKER = "COMPLETE"
TRAINER_STATE = "trainer.json"


def checkpoint_root(output: Path) -> Path:
    return output / "checkpoints"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or name.endswith(".tmp"):
        return None
    try:
        return int(name[len("step_") :])
    except ValueError:
        return None


def latest_checkpoint(output: Path) -> Path | None:
    root = checkpoint_root(output)
    if not root.is_dir():
        return None
    done = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and (p / MARKER).exists()]
    return max(done)[1] if done else None


def remove_incomplete(output: Path) -> list[Path]:
    """Delete ``*.tmp`` folders and step folders without a marker (rank 0 only)."""
    removed: list[Path] = []
    for root in (checkpoint_root(output), output):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.is_dir() and (
                p.name.endswith(".tmp") or (_step_of(p) is not None and not (p / MARKER).exists())
            ):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    output: Path, *, step: int, model: Any, optimizer: Any, trainer_state: dict[str, Any], is_main: bool
) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint_root(output) / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()
    if is_main:
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
        with open(tmp / MARKER, "w") as f:
            f.write(f"step {step}\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load_checkpoint(path: Path, *, model: Any, optimizer: Any, world_size: int) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG in place; return the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    if trainer_state.get("world_size") != world_size:
        raise ConfigError(
            f"checkpoint {path} was written by {trainer_state.get('world_size')} ranks; this run has {world_size}. "
            "The data order depends on the number of ranks, so it cannot continue exactly.",
            fix="resume with the same --nproc-per-node x --nnodes, or start a new --output",
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def export_final(
    output: Path, *, model: Any, config: Any, tokenizer: Any, dtype: torch.dtype, is_main: bool
) -> Path | None:
    """Gather the full state dict on rank 0 and write ``final/`` (safetensors + config + tokenizer)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict[str, Any] = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    final = output / "final"
    if not is_main:
        dist.barrier()
        return None
    tmp = output / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    tensors = {
        k: v.detach().to(dtype).contiguous() for k, v in full.items() if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.use_cache = True
    config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    dist.barrier()
    return final
