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
(:mod:`kernelguard.train.output.export`), so the exported folder loads in the class the user started from. Tied
embeddings are one tensor in the file (``lm_head.weight`` is not stored).

Falls back to the rank-0 path (:func:`kernelguard.train.model.parallel.materialize`) only for a random init, a
``pytorch_model.bin`` folder, a torch without ``HuggingFaceStorageReader``, or a checkpoint whose tensors
need transformers' load-time conversion (unfused MoE experts): each is said in one log line.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kernelguard.errors import CheckpointError

from .fresh_buffers import restore_buffers
from .weight_files import BITS, FLOATS, INDEX_FILE, TensorEntry, listed, read_files, safetensors_header

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

SINGLE_FILE = "model.safetensors"
MULTIMODAL_TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
_TEXT_PREFIX = "model."


@dataclass(frozen=True, slots=True)
class SourceLayout:
    """Every tensor of an HF safetensors folder and whether it is the multimodal layout; ``warnings``: what
    the files say that is odd but loadable (kernelguard.train.model.weight_files)."""

    folder: Path
    tensors: dict[str, TensorEntry]
    multimodal: bool
    warnings: tuple[str, ...] = ()

    def file_key(self, model_key: str) -> str:
        """The name in the files of a causal-LM state-dict key (``model.X`` or ``lm_head.weight``)."""
        if self.multimodal and model_key.startswith(_TEXT_PREFIX):
            return MULTIMODAL_TEXT_PREFIX + model_key[len(_TEXT_PREFIX) :]
        return model_key


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """What a sharded load reads: model key -> file key, the file tensors carried into the export, and the
    warnings to print once (rank 0) before training."""

    layout: SourceLayout
    names: dict[str, str]
    carried: tuple[str, ...]
    tied: bool
    warnings: tuple[str, ...] = ()


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors header (8-byte little-endian length, then JSON): no tensor data is read."""
    try:
        header, _ = safetensors_header(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}).",
            fix="re-download or re-save the checkpoint (save_pretrained)",
        ) from e
    return header


def _weight_files(folder: Path) -> tuple[list[str], dict[str, str] | None] | None:
    """(files to read, the index's weight_map or None); None when the folder holds no safetensors layout."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a valid safetensors index ({e}).", fix="re-save the checkpoint"
            ) from e
        return sorted(set(weight_map.values())), weight_map
    return ([SINGLE_FILE], None) if (folder / SINGLE_FILE).is_file() else None


def read_layout(folder: Path) -> SourceLayout | None:
    """The tensors of ``folder`` from its headers; None when it holds no safetensors (``pytorch_model.bin``).
    Raises CheckpointError, one paragraph per problem class, for files that cannot be right."""
    listing = _weight_files(folder)
    if listing is None:
        return None
    files, index = listing
    found = read_files(folder, files, index=index)
    if found.refusals:
        raise _refusal(folder, found.refusals)
    multimodal = any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in found.tensors)
    warnings = tuple(_paragraph(folder, problem, items) for problem, items in found.warnings.items())
    return SourceLayout(folder, found.tensors, multimodal, warnings)


def _paragraph(folder: Path, problem: str, items: list[str]) -> str:
    noun = "file(s)" if problem.startswith("files ") else "tensor(s)"
    return f"{len(items)} {noun} of {folder} {problem.removeprefix('files ')}:\n{listed(items)}"


def _refusal(folder: Path, refusals: dict[str, list[str]], fix: str | None = None) -> CheckpointError:
    text = "\n".join(_paragraph(folder, problem, items) for problem, items in refusals.items())
    return CheckpointError(
        f"the weights in {folder} cannot be loaded as they are; nothing was loaded:\n{text}",
        fix=fix or "re-download the checkpoint (every file the index names, nothing else), or re-save it with "
        "save_pretrained",
    )


def _is_tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def plan_weights(model: nn.Module, folder: Path) -> tuple[WeightPlan | None, str | None]:
    """(plan, None) for a sharded load of ``folder`` into ``model`` (meta is fine: only shapes are read), or
    (None, why the rank-0 path loads it). Before any memory is used, compares every tensor of every file
    with what the model builds and raises CheckpointError (one paragraph per problem class, naming tensors
    and files) for what cannot be right: another shape, a dtype a floating-point weight cannot take, a
    tensor the model needs that no file has, a tied head whose file holds a *different* ``lm_head.weight``,
    a multimodal config whose files have no vision tower. Tensors the model does not build are carried
    into the export; unless transformers itself ignores them silently, the plan warns about them."""
    layout = read_layout(folder)
    if layout is None:
        return None, f"{folder} has no safetensors (pytorch_model.bin): rank 0 loads it and broadcasts"
    tied = _is_tied(model)
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    names = {k: layout.file_key(k) for k in expected}
    refusals: dict[str, list[str]] = {}
    shape_fix = None
    for k, fk in names.items():
        entry = layout.tensors.get(fk)
        if entry is None:
            continue
        if entry.shape != tuple(expected[k].shape):
            refusals.setdefault("have another shape than the config builds", []).append(
                f"{fk} ({entry.file}): the config builds {list(expected[k].shape)}, the file has "
                f"{list(entry.shape)}")
            shape_fix = ("use the config.json that was saved with these weights (same hidden_size, vocab_size, "
                         "num_hidden_layers, heads)")
        elif expected[k].is_floating_point() and entry.dtype not in FLOATS and entry.dtype in BITS:
            refusals.setdefault("have a dtype a floating-point weight cannot take", []).append(
                f"{fk} ({entry.file}): {entry.dtype}; the model trains it as floating point")
    missing = [fk for fk in names.values() if fk not in layout.tensors]
    if missing and not refusals and _needs_conversion(model):
        return None, (
            f"{folder} stores tensors that transformers converts on load (e.g. {missing[0]}): "
            "rank 0 loads it and broadcasts"
        )
    if missing:
        refusals["are built by the model config but in no file (transformers would leave them random: "
                 "MISSING)"] = missing
    if tied:
        _check_tied_head(layout, refusals)
    if _multimodal_config(folder) and not any(k.startswith(VISION_PREFIX) for k in layout.tensors):
        refusals.setdefault("that a multimodal config needs are absent: no vision tower", []).append(
            f"{VISION_PREFIX}* (no file of {folder} has one; config.json is "
            f"{_architecture(folder) or 'multimodal'})")
    if refusals:
        raise _refusal(folder, refusals, fix=shape_fix if len(refusals) == 1 and shape_fix else
                       "use the config.json saved with these weights, and download every shard of the checkpoint "
                       "(see each line above)")
    used = set(names.values())
    carried = tuple(k for k in layout.tensors if k not in used and not (tied and k.endswith("lm_head.weight")))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = [f"{k} ({layout.tensors[k].file})" for k in carried
                  if not (layout.multimodal and not k.startswith(MULTIMODAL_TEXT_PREFIX))
                  and not any(p.search(k) for p in ignored)]
    warnings = list(layout.warnings)
    if unexpected:
        warnings.append(_paragraph(folder, "are not built by the model config (UNEXPECTED): not trained, copied "
                                   "unchanged into the export", unexpected))
    return WeightPlan(layout, names, carried, tied, tuple(warnings)), None


def _check_tied_head(layout: SourceLayout, refusals: dict[str, list[str]]) -> None:
    """A tied model drops a stored ``lm_head.weight``: refuse when it is not the embedding (a trained head)."""
    head, embed = layout.file_key("lm_head.weight"), layout.file_key("model.embed_tokens.weight")
    if head not in layout.tensors or embed not in layout.tensors:
        return
    if not _same_bytes(layout, head, embed):
        refusals.setdefault(
            "contradict tie_word_embeddings: true (the file's head differs from the embeddings; tying would "
            "drop it)", []
        ).append(f"{head} ({layout.tensors[head].file}) differs from {embed} ({layout.tensors[embed].file}); "
                 "set tie_word_embeddings: false in config.json to train both")


def _same_bytes(layout: SourceLayout, a: str, b: str) -> bool:
    ea, eb = layout.tensors[a], layout.tensors[b]
    if (ea.shape, ea.dtype) != (eb.shape, eb.dtype):
        return False
    starts = []
    for e in (ea, eb):
        starts.append(safetensors_header(layout.folder / e.file)[1] + e.offsets[0])
    remaining = ea.offsets[1] - ea.offsets[0]
    with (layout.folder / ea.file).open("rb") as fa, (layout.folder / eb.file).open("rb") as fb:
        fa.seek(starts[0])
        fb.seek(starts[1])
        while remaining > 0:
            n = min(remaining, 1 << 24)
            if fa.read(n) != fb.read(n):
                return False
            remaining -= n
    return True


def _multimodal_config(folder: Path) -> bool:
    """config.json describes an image-text model (a vision_config and a *ForConditionalGeneration class)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("vision_config"), dict) and bool(_architecture(folder))


def _architecture(folder: Path) -> str | None:
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return next((a for a in archs if isinstance(a, str) and a.endswith("ForConditionalGeneration")), None)


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
    broadcast) or ``"random"`` (a seeded random init, each rank its own shards: random_init)."""
    from .parallel import materialize
    from .random_init import init_sharded, supports_sharded_init

    if weights is None and supports_sharded_init(model):
        init_sharded(model, device=info.device, seed=seed)
        restore_buffers(model, config)
        return "random"
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
