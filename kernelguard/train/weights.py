"""Sharded Hugging Face weights in: every rank reads only what its FSDP2 shards own, straight from safetensors.

    plan = plan_weights(meta_model, folder)     # headers only: refuses wrong shapes / missing tensors
    load_weights(model, plan=plan, info=info, config=config, seed=seed)   # after fully_shard

The model is built on the meta device and sharded, then ``to_empty`` gives each rank its (uninitialised)
shards and ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` fills them: each rank reads
the row range of each tensor its shard covers, from whichever file the tensor is in, and copies it into the
parameter dtype. Nothing is broadcast and no rank holds a full copy (torchtitan's way of reading HF weights).

Layouts: a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. The multimodal
Qwen3.5 layout (``Qwen3_5ForConditionalGeneration``: text model under ``model.language_model.*``, vision tower
under ``model.visual.*``) is trained text-only: the language-model tensors load by the same prefix rename
transformers applies (``model.language_model.X`` -> ``model.X``), and every tensor the text model does not
have (vision tower, MTP head) is *carried*: copied unchanged, tensor for tensor, into the export
(:mod:`kernelguard.train.export`), so the exported folder loads in the class the user started from. Tied
embeddings are one tensor in the file (``lm_head.weight`` is not stored).

Falls back to the rank-0 path (:func:`kernelguard.train.parallel.materialize`) only for a random init, a
``pytorch_model.bin`` folder, a torch without ``HuggingFaceStorageReader``, or a checkpoint whose tensors
need transformers' load-time conversion (unfused MoE experts): each is said in one log line.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernelguard.errors import CheckpointError

__all__ = [
    "INDEX_FILE",
    "MULTIMODAL_TEXT_PREFIX",
    "SourceLayout",
    "TensorEntry",
    "WeightPlan",
    "load_weights",
    "plan_weights",
    "read_header",
    "read_layout",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MULTIMODAL_TEXT_PREFIX = "model.language_model."
_TEXT_PREFIX = "model."
_SHOWN = 5  # problems named per refusal; the count says how many more


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as a safetensors header describes it (no data read)."""

    file: str  # file name inside the folder
    shape: tuple[int, ...]
    dtype: str  # safetensors code: BF16, F32, ...


@dataclass(frozen=True, slots=True)
class SourceLayout:
    """Every tensor of an HF safetensors folder and whether it is the multimodal layout."""

    folder: Path
    tensors: dict[str, TensorEntry]
    multimodal: bool

    def file_key(self, model_key: str) -> str:
        """The name in the files of a causal-LM state-dict key (``model.X`` or ``lm_head.weight``)."""
        if self.multimodal and model_key.startswith(_TEXT_PREFIX):
            return MULTIMODAL_TEXT_PREFIX + model_key[len(_TEXT_PREFIX) :]
        return model_key


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """What a sharded load reads: model key -> file key, and the file tensors carried into the export."""

    layout: SourceLayout
    names: dict[str, str]
    carried: tuple[str, ...]
    tied: bool


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors header (8-byte little-endian length, then JSON): no tensor data is read."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}).",
            fix="re-download or re-save the checkpoint (save_pretrained)",
        ) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has no safetensors header.", fix="re-save the checkpoint")
    return header


def _weight_files(folder: Path) -> list[str] | None:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a valid safetensors index ({e}).", fix="re-save the checkpoint"
            ) from e
    return [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else None


def read_layout(folder: Path) -> SourceLayout | None:
    """The tensors of ``folder`` from its headers; None when it holds no safetensors (``pytorch_model.bin``)."""
    files = _weight_files(folder)
    if files is None:
        return None
    tensors: dict[str, TensorEntry] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(
                f"{folder / INDEX_FILE} lists {name}, which is not in {folder}.",
                fix="download the missing shard (every file the index names)",
            )
        for key, entry in read_header(path).items():
            if key != "__metadata__":
                tensors[key] = TensorEntry(name, tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))
    multimodal = any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in tensors)
    return SourceLayout(folder, tensors, multimodal)


def _is_tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def plan_weights(model: nn.Module, folder: Path) -> tuple[WeightPlan | None, str | None]:
    """(plan, None) for a sharded load of ``folder`` into ``model`` (meta is fine: only shapes are read), or
    (None, why the rank-0 path loads it). Raises CheckpointError naming each tensor whose shape differs from
    what the config builds, or that is missing, before any memory is used."""
    layout = read_layout(folder)
    if layout is None:
        return None, f"{folder} has no safetensors (pytorch_model.bin): rank 0 loads it and broadcasts"
    tied = _is_tied(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    names = {k: layout.file_key(k) for k in expected}
    missing = [fk for k, fk in names.items() if fk not in layout.tensors]
    wrong = [
        f"{fk} ({layout.tensors[fk].file}): the config builds {list(expected[k])}, the file has "
        f"{list(layout.tensors[fk].shape)}"
        for k, fk in names.items()
        if fk in layout.tensors and layout.tensors[fk].shape != expected[k]
    ]
    if wrong:
        raise CheckpointError(
            f"the weights in {folder} do not match its model config: {len(wrong)} tensor(s) have another "
            f"shape:\n  " + _listed(wrong),
            fix="use the config.json that was saved with these weights (same hidden_size, vocab_size, "
            "num_hidden_layers, heads); nothing was loaded",
        )
    if missing:
        if _needs_conversion(model):
            return None, (
                f"{folder} stores tensors that transformers converts on load (e.g. {missing[0]}): "
                "rank 0 loads it and broadcasts"
            )
        raise CheckpointError(
            f"the weights in {folder} lack {len(missing)} tensor(s) the model config builds:\n  "
            + _listed(missing),
            fix="download every shard of the checkpoint, or use the config.json saved with these weights",
        )
    used = set(names.values())
    carried = tuple(k for k in layout.tensors if k not in used and not (tied and k.endswith("lm_head.weight")))
    return WeightPlan(layout, names, carried, tied), None


def _listed(items: list[str]) -> str:
    more = f"\n  ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return "\n  ".join(items[:_SHOWN]) + more


def _needs_conversion(model: nn.Module) -> bool:
    """True when transformers converts this model's tensors on load beyond a rename (fused MoE experts)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rules = get_checkpoint_conversion_mapping(str(text.model_type)) or []
    return any(type(rule).__name__ == "WeightConverter" for rule in rules)


def hf_reader_available() -> bool:
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401
    except ImportError:
        return False
    return True


def load_weights(model: nn.Module, *, plan: WeightPlan | None, note: str | None, info: Any, config: Any,
                 weights: Path | None, seed: int) -> str:
    """Fill the sharded ``model`` (after ``fully_shard``): from the plan on every rank, else rank 0's path.
    Returns how: ``"sharded"`` (each rank read its own slices), ``"rank0"`` (rank 0 read the files and
    broadcast) or ``"random"`` (rank 0's seeded random init, broadcast)."""
    from .parallel import materialize

    if plan is None or not hf_reader_available():
        if weights is not None and info.is_main:
            why = note or "this torch has no torch.distributed.checkpoint.HuggingFaceStorageReader"
            print(f"kernelguard train: weights: {why}", file=sys.stderr, flush=True)
        materialize(model, info=info, config=config, weights=weights, seed=seed)
        return "random" if weights is None else "rank0"
    load_sharded(model, plan, device=info.device)
    restore_buffers(model, config)
    return "sharded"


def load_sharded(model: nn.Module, plan: WeightPlan, *, device: torch.device) -> None:
    """``to_empty`` then ``dcp.load`` with the HF reader into the DTensor shards (HF key names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model.to_empty(device=device)
    state = get_model_state_dict(model)
    wanted = {plan.names[k]: v for k, v in state.items() if k in plan.names}
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(plan.layout.folder)))


def restore_buffers(model: nn.Module, config: Any) -> None:
    """Recompute the non-persistent buffers (rotary ``inv_freq``) that ``to_empty`` left uninitialised: they
    are in no file. Each owner is rebuilt alone on CPU from its own config (transformers' rotary modules take
    ``config``); buffers are tiny, parameters are not touched."""
    with torch.no_grad():
        for name, module in model.named_modules():
            transient = getattr(module, "_non_persistent_buffers_set", set())
            if not transient:
                continue
            fresh = _rebuilt(module, name)
            for buffer in transient:
                target, value = getattr(module, buffer, None), getattr(fresh, buffer, None)
                if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                    target.copy_(value.to(target.device, target.dtype))


def _rebuilt(module: nn.Module, name: str) -> nn.Module:
    own_config = getattr(module, "config", None)
    try:
        with torch.device("cpu"):
            return type(module)(config=own_config)
    except Exception as e:
        raise CheckpointError(
            f"cannot recompute the non-persistent buffers of {name} ({type(module).__name__}): {e!r}.",
            fix="report the model class; the rank-0 load path (a random init) does not need this",
        ) from e
