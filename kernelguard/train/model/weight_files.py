"""What the safetensors files of a model folder say about themselves, checked before a byte is loaded.

torch's ``HuggingFaceStorageReader`` (the sharded load) reads *every* ``*.safetensors`` file of the folder and
trusts each header: a tensor found in two files is taken from whichever it lists last, a header whose dtype
does not fit its bytes is read as given, a shard cut short fails deep inside DCP naming no file. So the
headers of every file are read here first (8 bytes, then JSON; tensor data only for a small sample per
tensor) and what cannot be right is collected by problem class, each naming the tensors and their files:

refused (:attr:`FileFindings.refusals`)
  * a file whose header cannot be read, or whose data is shorter than its header says (truncated);
  * a dtype that is not a safetensors dtype, or a byte range that is not ``numel x itemsize`` of its dtype
    and shape (the header lies about what the bytes are);
  * floating-point values that cannot be weights: a sample of the tensor's first elements, read in the
    header's dtype, holds NaN/inf or a magnitude of at least :data:`ABSURD` (bytes of another dtype);
  * a tensor in two files (which one the reader takes is an accident of listing order);
  * an index that names a file lacking the tensor, or a file that is not there.

warned (:attr:`FileFindings.warnings`)
  * a tensor in a file the index does not map it to (the reader still reads it: every file is read).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError

__all__ = [
    "ABSURD",
    "BITS",
    "FileFindings",
    "INDEX_FILE",
    "SHOWN",
    "TensorEntry",
    "WEIGHT_LAYOUTS",
    "listed",
    "read_files",
    "safetensors_header",
    "weight_format",
    "weights_to_load",
]

INDEX_FILE = "model.safetensors.index.json"
SHOWN = 10  # tensors named per problem class; a count says how many more
ABSURD = 1e6  # no trained transformer weight reaches this; bytes of another dtype read as floats often do
_SAMPLE = 256  # elements read per floating-point tensor for the value check
# safetensors dtype codes -> bits per element (the format's whole list, sub-byte floats included).
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
        "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
        "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
FLOATS = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as a safetensors header describes it (no data read)."""

    file: str  # file name inside the folder
    shape: tuple[int, ...]
    dtype: str  # safetensors code: BF16, F32, ...
    offsets: tuple[int, int] = (0, 0)  # byte range inside the file's data section


@dataclass(slots=True)
class FileFindings:
    """Every tensor of the folder's files (first file wins a duplicate) and the problems, by class."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    refusals: dict[str, list[str]] = field(default_factory=dict)
    warnings: dict[str, list[str]] = field(default_factory=dict)

    def refuse(self, problem: str, item: str) -> None:
        self.refusals.setdefault(problem, []).append(item)

    def warn(self, problem: str, item: str) -> None:
        self.warnings.setdefault(problem, []).append(item)


def listed(items: list[str]) -> str:
    """The first :data:`SHOWN` items, one per line, and how many more."""
    more = f"\n  ... and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return "  " + "\n  ".join(items[:SHOWN]) + more


def read_files(folder: Path, files: list[str], *, index: dict[str, str] | None) -> FileFindings:
    """Headers of ``files`` (the index's shards, or ``model.safetensors``) plus every other ``*.safetensors``
    in ``folder`` (the sharded reader reads those too), checked as the module docstring says."""
    found = FileFindings()
    strays = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in files)
    seen: dict[str, list[str]] = {}
    for name in [*files, *strays]:
        path = folder / name
        if not path.is_file():
            found.refuse("files named by the index but not in the folder", f"{name} (in {INDEX_FILE})")
            continue
        for key, entry in _read_file(path, found).items():
            seen.setdefault(key, []).append(name)
            found.tensors.setdefault(key, entry)
    for key, where in seen.items():
        if len(where) > 1:
            named = f"; the index names {index[key]}" if index and key in index else ""
            found.refuse("in more than one file (which one is read is an accident of file order)",
                         f"{key}: in {', '.join(where)}{named}")
    for key, name in (index or {}).items():
        if (folder / name).is_file() and name not in seen.get(key, ()):
            elsewhere = f", the tensor is in {', '.join(seen[key])}" if key in seen else ""
            found.refuse("named by the index in a file that lacks them", f"{key}: the index says {name}{elsewhere}")
    if index is not None:
        for key, where in seen.items():
            if key not in index and len(where) == 1:
                found.warn("in a file but not in the index (read anyway: the loader reads every file)",
                           f"{key} ({where[0]})")
    return found


def safetensors_header(path: Path, *, strict: bool = False) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (its first 8 bytes, little-endian, give the length of the JSON after them)
    and where its tensor data starts; no tensor data is read. ValueError says what is not safetensors about
    it (too short, a length past the end, not a JSON object); ``strict``: a tensor named twice in the header
    too (JSON keeps the last silently). OSError as the file system raises it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{len(raw)} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise ValueError(f"its header claims {length:,} bytes, the file has {size:,}")
        header = json.loads(f.read(length), object_pairs_hook=_pairs if strict else None)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + length


def _read_file(path: Path, found: FileFindings) -> dict[str, TensorEntry]:
    """One file's tensors; its problems go to ``found``."""
    try:
        header, data_start = safetensors_header(path, strict=True)
        size = path.stat().st_size
    except _Duplicate as e:
        found.refuse("named twice in one header (JSON keeps the last silently)", f"{e.args[0]} ({path.name})")
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        found.refuse("files that are not readable safetensors", f"{path.name}: {e}")
        return {}
    entries: dict[str, TensorEntry] = {}
    end = 0
    for key, value in header.items():
        if key == "__metadata__":
            continue
        entry = _entry(key, value, path.name, found)
        if entry is None:
            continue
        entries[key] = entry
        end = max(end, entry.offsets[1])
    _check_tiling(path.name, entries, found)
    if data_start + end > size:
        cut = sum(1 for e in entries.values() if data_start + e.offsets[1] > size)
        found.refuse("files shorter than their header says (truncated: a partial download or copy)",
                     f"{path.name}: {size:,} bytes, its header describes {data_start + end:,}; {cut} tensor(s) "
                     "are cut off")
        return entries
    _check_values(path, data_start, entries, found)
    return entries


class _Duplicate(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _check_tiling(file: str, entries: dict[str, TensorEntry], found: FileFindings) -> None:
    """The byte ranges cover the data section exactly once, in order (what the safetensors library itself
    checks when a file is opened, deep inside the load)."""
    at = 0
    for key, e in sorted(entries.items(), key=lambda kv: kv[1].offsets):
        if e.offsets[0] != at:
            what = "overlaps the tensor before it" if e.offsets[0] < at else f"leaves a gap of {e.offsets[0] - at:,} bytes"
            found.refuse("byte ranges that overlap or leave gaps (a hand-edited or damaged header)",
                         f"{key} ({file}): starts at byte {e.offsets[0]:,}, {what}")
            return
        at = e.offsets[1]


def _entry(key: str, value: Any, file: str, found: FileFindings) -> TensorEntry | None:
    try:
        dtype = str(value["dtype"])
        shape = tuple(int(d) for d in value["shape"])
        begin, end = (int(x) for x in value["data_offsets"])
    except (TypeError, KeyError, ValueError) as e:
        found.refuse("header entries without dtype, shape and data_offsets", f"{key} ({file}): {e!r}")
        return None
    if dtype not in BITS:
        found.refuse("dtypes that safetensors does not define", f"{key} ({file}): {dtype!r}")
        return None
    want = math.ceil(math.prod(shape) * BITS[dtype] / 8)
    if end - begin != want or begin < 0:
        found.refuse(
            "headers whose dtype and shape do not fit the bytes they point at",
            f"{key} ({file}): {dtype} {list(shape)} is {want:,} bytes; the header gives it {end - begin:,}",
        )
        return None
    return TensorEntry(file, shape, dtype, (begin, end))


def _check_values(path: Path, data_start: int, entries: dict[str, TensorEntry], found: FileFindings) -> None:
    """A few elements of each floating-point tensor, read as the header's dtype: weights are finite and small."""
    import torch

    dtypes = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
    with path.open("rb") as f:
        for key, e in entries.items():
            if e.dtype not in FLOATS or e.offsets[1] == e.offsets[0]:
                continue
            width = BITS[e.dtype] // 8
            f.seek(data_start + e.offsets[0])
            raw = f.read(min(e.offsets[1] - e.offsets[0], _SAMPLE * width))
            values = torch.frombuffer(bytearray(raw), dtype=dtypes[e.dtype]).float()
            bad = ~torch.isfinite(values)
            if bool(bad.any()) or float(values.abs().max()) >= ABSURD:
                what = "NaN/inf" if bool(bad.any()) else f"{float(values.abs().max()):.3g}"
                found.refuse(
                    f"values that cannot be weights in their header's dtype (NaN, inf or |x| >= {ABSURD:.0e}: "
                    "bytes of another dtype?)",
                    f"{key} ({path.name}): {e.dtype} values include {what}",
                )


# ---------------------------------------------------------------------------------------------- weights ---
# The layouts transformers' from_pretrained reads, by format. Rank 0 loads either with transformers' own loader
# (kernelguard.train.model.parallel.full_state_on_rank0), so sharded .bin checkpoints train as they would in
# transformers; a reader that only understands safetensors asks weights_to_load which format it got.
WEIGHT_LAYOUTS = {
    "safetensors": ("model.safetensors", "model.safetensors.index.json"),
    "bin": ("pytorch_model.bin", "pytorch_model.bin.index.json"),
}


# Files that hold weights in a form transformers does not load from a folder (named when nothing loadable is).
_OTHER_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".distcp")


def weight_format(folder: Path) -> tuple[str | None, list[str]]:
    """(``safetensors`` / ``bin`` / None, problems): the loadable layout a model folder holds, and what is
    wrong with it (an index naming a shard that is not there) or, without one, the weight-like files found."""
    for fmt, (single, index) in WEIGHT_LAYOUTS.items():
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                return None, [f"{index} is not a readable weight index ({type(e).__name__})"]
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                return None, [f"{index} names {len(missing)} shard(s) that are not there: {', '.join(missing[:3])}"]
            return fmt, []
        if (folder / single).is_file():
            return fmt, []
    found = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in _OTHER_WEIGHTS)
    return None, ([f"found {', '.join(found[:4])} but no {' / '.join(WEIGHT_LAYOUTS['safetensors'])}"]
                  if found else [])


def weights_to_load(model: str, *, init: str | None) -> tuple[Path | None, str | None]:
    """(the folder whose weights rank 0 loads, or None for a seeded random init; a notice to log).

    A fine-tune never starts from random weights by accident: a folder without loadable weights is refused
    unless ``init`` is ``random``; a config.json means random init (``init`` unset or ``random``)."""
    path = Path(model)
    if path.is_file():
        if init == "pretrained":
            raise ConfigError(
                f"--init pretrained: --model {model} is a config.json, which has no weights.",
                fix="pass the model folder that holds the weights, or --init random",
            )
        notice = None if init == "random" else f"--model {path.name} is a config file: random init (--init random)"
        return None, notice
    if init == "random":
        return None, f"--init random: the weights in {model} (if any) are not loaded; training from a seeded random init"
    fmt, problems = weight_format(path)
    if fmt is not None:
        return path, None
    listing = sorted(p.name for p in path.iterdir())[:8]
    raise ConfigError(
        f"--model {model} has no weights transformers can load ({'; '.join(problems) or 'found: ' + ', '.join(listing)}); "
        "a fine-tune would start from random weights.",
        fix="point --model at the folder with model.safetensors (or its index), convert other formats with "
        "transformers' save_pretrained, or pass --init random to train from a random init on purpose",
    )
