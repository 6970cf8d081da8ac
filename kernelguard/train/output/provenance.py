"""What a checkpoint carries so that it exports alone, and what an export compares with the run's record.

Every checkpoint holds ``source/`` (sealed by its manifest like every other file): the model's
``config.json`` (and ``generation_config.json`` when the model folder has one), the tokenizer's files as they
were when the run started, the ``--chat-template`` file when one was given, and ``source.json``: the run's
``--model`` / ``--tokenizer`` / ``--chat-template`` as given, and the weight layout the export needs (the
multimodal naming, the tensors copied unchanged from the model folder). ``kernelguard export`` reads these, so
the original folders may move or be deleted; only a layout with carried tensors (a vision tower) still needs
the model folder, and then says so.

A checkpoint written before ``source/`` existed exports from the folders ``train_config.json`` names: their
tokenizer and chat template are fingerprinted and compared with the run's recorded identity, and a difference
is refused unless ``--accept-changed-tokenizer``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError

__all__ = ["SOURCE_DIR", "SOURCE_FILE", "read_source", "tokenizer_changes", "write_source"]

SOURCE_DIR = "source"
SOURCE_FILE = "source.json"
_TEMPLATE_COPY = "chat_template_given.jinja"


def write_source(folder: Path, section: Any, *, plan: Any) -> None:
    """Rank 0, into a checkpoint being written: ``source/`` as the module docstring says (``section``: the
    run's ModelSection: ``model``, ``tokenizer``, ``chat_template``)."""
    from ..inputs.identity import _is_tokenizer_file

    model, tokenizer, chat_template = str(section.model), str(section.tokenizer), section.chat_template

    target = folder / SOURCE_DIR
    (target / "tokenizer").mkdir(parents=True, exist_ok=True)
    model_path = Path(model)
    config = model_path if model_path.is_file() else model_path / "config.json"
    shutil.copyfile(config, target / "config.json")
    if (model_path / "generation_config.json").is_file():
        shutil.copyfile(model_path / "generation_config.json", target / "generation_config.json")
    tok = Path(tokenizer)
    for path in sorted(tok.iterdir()) if tok.is_dir() else ():
        if _is_tokenizer_file(path):
            shutil.copyfile(path, target / "tokenizer" / path.name)
    template_file = None
    if chat_template and Path(chat_template).is_file():
        shutil.copyfile(chat_template, target / _TEMPLATE_COPY)
        template_file = _TEMPLATE_COPY
    record = {
        "model": str(model_path.resolve()),  # export may run from another folder
        "tokenizer": str(tok.resolve()),
        "chat_template": chat_template,
        "chat_template_file": template_file,
        "multimodal": bool(plan is not None and plan.layout.multimodal),
        "tied": bool(plan is not None and plan.tied),
        "carried": list(plan.carried) if plan is not None else [],
    }
    (target / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_source(checkpoint: Path) -> dict[str, Any] | None:
    """``source.json`` of a checkpoint with the paths of its copies; None for a checkpoint without one."""
    folder = checkpoint / SOURCE_DIR
    try:
        record = json.loads((folder / SOURCE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / SOURCE_FILE} cannot be read ({e}).",
                              fix="export an older checkpoint of the run") from e
    record["config_path"] = folder / "config.json"
    record["tokenizer_path"] = folder / "tokenizer"
    given = record.get("chat_template_file")
    record["chat_template_path"] = folder / given if given else record.get("chat_template")
    record["generation_path"] = folder / "generation_config.json"
    return record


def tokenizer_changes(identity: dict[str, Any], *, tokenizer: str, chat_template: str | None) -> list[str]:
    """What differs between the tokenizer / chat template recorded with the checkpoint and those files now."""
    from ..inputs.identity import chat_template_fingerprint, tokenizer_fingerprint

    changes = []
    if "tokenizer_sha256" in identity and tokenizer_fingerprint(tokenizer) != identity["tokenizer_sha256"]:
        changes.append(f"the tokenizer files in {tokenizer} changed since the run trained")
    if "chat_template_sha256" in identity and (
        chat_template_fingerprint(chat_template) != identity["chat_template_sha256"]
    ):
        name = chat_template or "(the tokenizer's own)"
        changes.append(f"the chat template {name} changed since the run trained")
    return changes
