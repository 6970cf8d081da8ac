"""The sharded Hugging Face export: ``final/`` written by every rank in parallel, or later from a checkpoint.

    export_run(output, model=..., built=..., tokenizer=..., dtype=..., info=...)   # end of a run
    export_checkpoint(Path("OUT/checkpoints/step_40"))                             # `kernelguard export`

The tensors are planned into shards of at most ``max_shard_size`` (``model.safetensors`` alone, else
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``, as ``save_pretrained`` names them);
rank ``r`` writes shards ``r, r + world, ...`` in the export dtype. At the end of a run each trained tensor is
cast to the export dtype on its shards and gathered whole (every rank takes part, in one order); only the rank
that writes it keeps it, and a writer thread streams it to disk while the next ones are gathered, so nothing is
written twice and host memory holds at most ``IN_FLIGHT`` bytes (or the largest tensor) per rank. ``kernelguard
export`` reads the same tensors from a training checkpoint (DCP, fp32) instead, cast the same way: both exports
are byte-identical. A parameter the model holds in fp32 while it computes the rest in a lower precision stays
fp32. The names are the source checkpoint's (``model.language_model.*`` for the multimodal Qwen3.5 layout) and
the tensors the text model does not have (vision tower) are copied unchanged from the source files, so the class
the user started from loads the folder. Rank 0 then writes the index, config.json (with ``dtype``), the
tokenizer and its chat template, and renames ``final.tmp/`` to ``final/``: there is never a half-written
``final/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import sys
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kernelguard.errors import (
    CheckpointError,
)

from ..common.run_folder import CONFIG_FILE, FINAL, FINAL_TMP
from ..common.write_errors import write_failure
from ..settings.config_rules import DEFAULT_MAX_SHARD_SIZE, parse_size
from .export_checks import (
    check_destination,
    check_room,
    export_in_use,
    export_source,
    many_shards_warning,
    run_in_use,
)
from .export_stream import IN_FLIGHT, Gathered, feed, held_in_fp32, stream_files

__all__ = [
    "OutTensor",
    "export_checkpoint",
    "export_run",
    "plan_shards",
    "shard_names",
    "tensor_dtype",
    "write_safetensors",
]

GENERATION_CONFIG = "generation_config.json"
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor of the export: its name there, shape and dtype, and where it is read from."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str  # a key of the DCP checkpoint, or of the source files when carried
    carried: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Consecutive tensors, a new shard whenever the next would pass ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[OutTensor]] = []
    size = 0
    for t in tensors:
        if not shards or (size + t.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_safetensors(path: Path, tensors: list[OutTensor], fetch: Callable[[OutTensor], torch.Tensor]) -> None:
    """A safetensors file written tensor by tensor (the header first, from the plan): one tensor in memory."""
    header: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data 8-byte aligned, as safetensors writes it
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            value = fetch(t)
            if tuple(value.shape) != t.shape or value.dtype != t.dtype:
                raise CheckpointError(
                    f"{t.key} is {list(value.shape)} {value.dtype}; the export planned {list(t.shape)} {t.dtype}.",
                    fix="export from the checkpoint of this run (its train_config.json names the model)",
                )
            f.write(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------- the tensors ---
def export_tensors(
    shapes: dict[str, tuple[int, ...]], *, plan: Any, tied: bool, dtype: torch.dtype, key_prefix: str = "",
    keep_fp32: Collection[str] = (),
) -> list[OutTensor]:
    """The trained tensors (named as in the source files) then the carried ones (copied, in their dtype).
    The keys in ``keep_fp32`` (the model's fp32 parameters) and the parameters training keeps in fp32
    (:data:`kernelguard.train.model.parallel.FP32_PARAM_NAMES`, the GDN decay) are written in fp32 whatever ``dtype``
    says, as the checkpoints they come from store them."""
    out = [
        OutTensor(plan.layout.file_key(k) if plan is not None else k, shape,
                  torch.float32 if k in keep_fp32 else tensor_dtype(k, dtype), key_prefix + k)
        for k, shape in shapes.items()
        if not (tied and k == "lm_head.weight")
    ]
    for key in plan.carried if plan is not None else ():
        entry = plan.layout.tensors[key]
        out.append(OutTensor(key, entry.shape, _DTYPES[entry.dtype], key, carried=True))
    return out


def _read_carried(plan: Any, t: OutTensor) -> torch.Tensor:
    from safetensors import safe_open

    entry = plan.layout.tensors[t.key]
    with safe_open(str(plan.layout.folder / entry.file), framework="pt") as f:
        return f.get_tensor(t.key)


def tensor_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    """The export dtype of the trained tensor ``key``: ``dtype``, or fp32 for a parameter kept in fp32."""
    from ..model.parallel import FP32_PARAM_NAMES

    keep = key.rsplit(".", 1)[-1] in FP32_PARAM_NAMES and dtype.itemsize < torch.float32.itemsize
    return torch.float32 if keep else dtype


class _Source:
    """Full tensors by key: trained ones from a DCP checkpoint (this process alone), carried ones from the
    source safetensors."""

    collective = False

    def __init__(self, checkpoint: Path, plan: Any) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.checkpoint = checkpoint
        self.plan = plan
        self.metadata = FileSystemReader(str(checkpoint)).read_metadata()
        self._reader: Any = None

    def __call__(self, t: OutTensor, keep: bool = True) -> torch.Tensor:
        if t.carried:
            return _read_carried(self.plan, t)
        return self._trained(t).to(t.dtype)

    def _trained(self, t: OutTensor) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        stored = self.metadata.state_dict_metadata.get(t.key)
        if stored is None or not hasattr(stored, "size"):
            raise CheckpointError(
                f"{self.checkpoint} has no tensor {t.key}.", fix="export from a checkpoint of this run"
            )
        buffer = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        with warnings.catch_warnings():  # no_dist=True is this process's intent; DCP warns about it anyway
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({t.key: buffer}, storage_reader=self._cached_reader(), no_dist=True)
        return buffer

    def _cached_reader(self) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = self.metadata

        class Cached(FileSystemReader):  # one read of .metadata for every tensor of the export
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return metadata

        if self._reader is None:
            self._reader = Cached(str(self.checkpoint))
        return self._reader


def write_shards(folder: Path, tensors: list[OutTensor], source: Any, *, max_bytes: int, rank: int,
                 world: int, budget: int = IN_FLIGHT) -> list[list[OutTensor]]:
    """This rank's shards of the plan (every rank computes the same plan), written while the next tensors are
    fetched; with a collective ``source`` this rank also takes part in fetching the tensors other ranks write."""
    shards = plan_shards(tensors, max_bytes)
    names = shard_names(len(shards))
    mine = [(folder / names[i], s) for i, s in enumerate(shards) if i % world == rank]
    stream_files(mine, feed(shards, world), source, rank=rank, write=write_safetensors, budget=budget)
    return shards


def finalize(tmp: Path, final: Path, shards: list[list[OutTensor]], *, config: Any, tokenizer: Any,
             dtype: torch.dtype, source: str | Path | None = None) -> Path:
    """Rank 0: index, config.json with ``dtype``, tokenizer + chat template, the source model folder's
    generation_config.json (its sampling defaults and stop tokens, what generate() uses; else one made from the
    tokenizer), the special token ids config.json lacks, then the rename."""
    from .inference_files import fill_special_token_ids, generation_config, save_tokenizer

    names = shard_names(len(shards))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
            "weight_map": {t.name: name for name, s in zip(names, shards) for t in s},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.use_cache = True
    # config.json says what the safetensors hold, so from_pretrained(dtype="auto") is right.
    for target in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        target.dtype = dtype
    if tokenizer is not None:
        fill_special_token_ids(config, tokenizer)
    config.save_pretrained(str(tmp))
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp)  # with the template the run trained with, in its inference form
    generation = Path(source or "") / GENERATION_CONFIG  # a folder --model; a config.json has none
    if source is not None and generation.is_file():
        shutil.copy2(generation, tmp / GENERATION_CONFIG)
    elif tokenizer is not None:
        generation_config(config, tokenizer).save_pretrained(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _all_ok(error: BaseException | None, *, tmp: Path, is_main: bool) -> None:
    """Every rank learns whether every rank's part worked (a rank that failed alone would hang the others);
    on a failure the half-written ``tmp`` goes and each rank raises: its own cause, or that another rank failed."""
    flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = flag.to(device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()):
        return
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written export behind
    raise error if error is not None else CheckpointError(
        f"another rank failed writing the export into {tmp}; its message says why.",
        fix="fix that cause, then `kernelguard export` the last checkpoint or --resume",
    )


# ----------------------------------------------------------------------------------------- entry points ---
def export_run(output: Path, *, model: Any, built: Any, tokenizer: Any, dtype: torch.dtype, info: Any,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, source: str | Path | None = None) -> Path:
    """All ranks: the model's tensors gathered one at a time and written as HF shards in ``final.tmp/``, then
    renamed; ``source`` is the run's --model (its generation_config.json is kept)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tmp, final = output / FINAL_TMP, output / FINAL
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = get_model_state_dict(model)
    tied = bool(getattr(built.config.get_text_config(), "tie_word_embeddings", False))
    tensors = export_tensors({k: tuple(v.shape) for k, v in state.items()}, plan=built.weight_plan, tied=tied,
                             dtype=dtype, keep_fp32=held_in_fp32(model))
    many = many_shards_warning(len(plan_shards(tensors, parse_size(max_shard_size))), parse_size(max_shard_size))
    if many and info.is_main:
        print(f"kernelguard train: warning: {many}", file=sys.stderr, flush=True)
    shards: list[list[OutTensor]] = []
    error: BaseException | None = None
    after = "--resume (the last checkpoint is complete; the resumed run only exports)"
    try:
        shards = write_shards(tmp, tensors, Gathered(state, built.weight_plan, _read_carried),
                              max_bytes=parse_size(max_shard_size), rank=info.rank, world=info.world_size)
    except Exception as e:  # noqa: BLE001 - disk full, permissions, safetensors' own error: every rank hears
        error = _failure(tmp, e, output=output, tensors=tensors, after=after)
    del state
    _all_ok(error, tmp=tmp, is_main=info.is_main)
    if info.is_main:
        try:
            finalize(tmp, final, shards, config=built.config, tokenizer=tokenizer, dtype=dtype, source=source)
        except Exception as e:  # noqa: BLE001
            error = _failure(tmp, e, output=output, tensors=tensors, after=after)
    _all_ok(error, tmp=tmp, is_main=info.is_main)
    dist.barrier()
    return final


def start_warnings(built: Any, checkpoint: Any, *, dtype: torch.dtype) -> list[str]:
    """What a run says before it trains: the weight files' warnings (kernelguard.train.model.weights) and, when it
    will export (``checkpoint``: its CheckpointSection), an export of more than 1,000 files."""
    warnings = [f"weights: {w}" for w in (built.weight_plan.warnings if built.weight_plan is not None else ())]
    many = export_shards_warning(built, dtype=dtype, max_shard_size=checkpoint.max_shard_size)
    return warnings + ([many] if many and checkpoint.export else [])


def export_shards_warning(built: Any, *, dtype: torch.dtype, max_shard_size: str | int) -> str | None:
    """The line the run's final export would print for many small shards (many_shards_warning), from the meta
    model."""
    tied = bool(getattr(built.config.get_text_config(), "tie_word_embeddings", False))
    shapes = {k: tuple(v.shape) for k, v in built.model.state_dict().items()}
    size = parse_size(max_shard_size)
    tensors = export_tensors(shapes, plan=built.weight_plan, tied=tied, dtype=dtype)
    return many_shards_warning(len(plan_shards(tensors, size)), size)


def _failure(tmp: Path, e: BaseException, *, output: Path, tensors: list[OutTensor], after: str) -> BaseException:
    return write_failure(f"exporting the final model to {tmp}", e, folder=output,
                         need_bytes=sum(t.nbytes for t in tensors), after=after)


def export_checkpoint(checkpoint: Path, *, output: Path | None = None,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
                      accept_changed_tokenizer: bool = False, say: Callable[[str], None] | None = None) -> Path:
    """``final/`` (or ``output``) from a verified training checkpoint ``OUTPUT/checkpoints/step_N``, with the
    model config, tokenizer, chat template and weight layout the checkpoint carries (``source/``,
    kernelguard.train.output.provenance; older checkpoints: the folders ``OUTPUT/train_config.json`` names, compared
    with the run's record) and the dtype from ``train_config.json``. Every rank of a process group writes its
    share of the shards; alone, this process writes them all.

    Refused before anything is written: a live run in the checkpoint's folder (its lock, naming its pid),
    another export writing ``output``, an existing ``output`` unless ``overwrite``, a destination that is not
    writable or has no room. A write that fails midway leaves no ``output`` and no ``.tmp`` folder. ``say``: rank 0
    hears what is being read and written, one line per long step (a silent export looks hung)."""
    from .checkpoint import verify_checkpoint
    from .checkpoint_layout import not_a_checkpoint

    checkpoint = Path(checkpoint).expanduser()
    if (refusal := not_a_checkpoint(checkpoint)) is not None:
        raise refusal
    run = checkpoint.parent.parent
    saved = _run_config(run)
    final = Path(output).expanduser() if output is not None else run / FINAL
    max_bytes = parse_size(max_shard_size, source="--max-shard-size")
    check_destination(final, overwrite=overwrite, checkpoint=checkpoint)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with contextlib.ExitStack() as held:
        if rank == 0:
            from ..common.run_folder_lock import acquire

            if os.access(run, os.W_OK):  # a read-only run folder (an archive) has no live run to refuse
                held.enter_context(acquire(run, flag="CHECKPOINT_DIR", refusal=run_in_use))
            held.enter_context(acquire(final.parent, name=f".{final.name}.kernelguard-export.lock",
                                       flag="--output", refusal=export_in_use))
            check_destination(final, overwrite=overwrite)  # again, under the lock: another export just finished
            problem = verify_checkpoint(checkpoint)
            if problem is not None:
                raise CheckpointError(f"checkpoint {checkpoint} is unusable: {problem}",
                                      fix="export an older checkpoint of the run (OUTPUT/checkpoints/step_N)")
        return _export_locked(checkpoint, saved, final, max_bytes=max_bytes, rank=rank, world=world,
                              accept_changed_tokenizer=accept_changed_tokenizer,
                              say=say if say is not None and rank == 0 else lambda _: None)
    raise AssertionError("unreachable")


def _export_locked(checkpoint: Path, saved: dict[str, Any], final: Path, *, max_bytes: int, rank: int,
                   world: int, accept_changed_tokenizer: bool, say: Callable[[str], None]) -> Path:
    from ..model.parallel import DTYPES, build_meta_model

    say(f"reading {checkpoint}: the model config and weight layout it carries")
    source = export_source(checkpoint, saved, accept_changed_tokenizer=accept_changed_tokenizer)
    config = source.config
    meta = build_meta_model(config, attn_implementation="sdpa")
    plan = source.plan(meta)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    dtype = DTYPES[str(saved.get("param_dtype", "bf16"))]
    tensors = export_tensors({k: tuple(v.shape) for k, v in meta.state_dict().items()}, plan=plan, tied=tied,
                             dtype=dtype, key_prefix="model.")  # the checkpoint holds {"model": ..., "optim": ...}
    need = sum(t.nbytes for t in tensors)
    check_room(final, need_bytes=need)
    many = many_shards_warning(shard_count := len(plan_shards(tensors, max_bytes)), max_bytes)
    if many and rank == 0:
        print(f"kernelguard export: warning: {many}", file=sys.stderr, flush=True)
    size = f"{need / 2**30:.2f} GiB" if need >= 2**30 else f"{need / 2**20:.1f} MiB"
    say(f"writing {len(tensors)} tensors ({size}, {str(dtype).removeprefix('torch.')}) in "
        f"{shard_count} safetensors file{'s' * (shard_count != 1)} to {final}")
    tmp = final.with_name(final.name + ".tmp")
    finished = False
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed export's leftovers: under the lock, ours to clear
            tmp.mkdir(parents=True)
        if world > 1:
            dist.barrier()
        shards = write_shards(tmp, tensors, _Source(checkpoint, plan), max_bytes=max_bytes, rank=rank, world=world)
        if world > 1:
            dist.barrier()
        if rank == 0:
            from ..inputs.tokenizer import load_tokenizer

            say("adding the config, tokenizer, chat template and generation config")
            tokenizer = load_tokenizer(str(source.tokenizer), chat_template=source.chat_template)
            finalize(tmp, final, shards, config=config, tokenizer=tokenizer, dtype=dtype, source=source.folder)
        finished = True
    except Exception as e:  # noqa: BLE001 - disk full, permissions: one line naming the cause, nothing left
        raise write_failure(f"exporting {checkpoint} to {final}", e, folder=final.parent, need_bytes=need,
                            after="run the same `kernelguard export` again") from None
    finally:
        if not finished and rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run_config(run: Path) -> dict[str, Any]:
    path = run / CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): it names the run's model and tokenizer.",
                              fix="pass a checkpoint inside a kernelguard train output folder") from e
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointError(f"{path} is not a kernelguard train configuration.",
                              fix="pass a checkpoint inside a kernelguard train output folder")
    return saved
