"""Discovery: reads the installed transformers' source and the user's model config into catalog types.

No list of model classes: a family is any ``transformers/models/<family>/modeling_<family>.py`` whose functions
are decorated with ``use_kernel_func_from_hub_with_fallback(kernel, package)``. The source is read as text
(never imported) so ``kernelguard check`` stays fast and works when torch is broken. This module and ``env`` /
``providers`` are the probes; everything they return is plain data for the pure resolver.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kernelguard.errors import ConfigError

from .catalog import PACKAGES, Family, HubRepo, KernelRequirement, ModelSpec

__all__ = [
    "TransformersSource",
    "clear_caches",
    "families",
    "families_by_kind",
    "gated_delta_families",
    "kernels_version_window",
    "resolve_model",
    "transformers_min_version",
    "transformers_source",
]


@dataclass(frozen=True, slots=True)
class TransformersSource:
    root: Path
    version: str


def transformers_source() -> TransformersSource:
    """Locate the installed transformers without importing it."""
    from .env import distribution_version

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "transformers is not installed, so there is no model code to inspect.",
            fix="pip install 'transformers>=5.17,<6'",
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return TransformersSource(root, distribution_version("transformers") or "unknown")


_DECORATOR = re.compile(
    r'@use_kernel_func_from_hub_with_fallback\(\s*"(?P<kernel>\w+)"\s*,\s*"(?P<package>\w+)"'
    r'(?:\s*,\s*(?:internal_path\s*=\s*)?"(?P<internal>[\w.]+)")?[^)]*\)\s*\n\s*def\s+(?P<func>\w+)'
)
_INTERNAL_PATHS = re.compile(r'"(?P<kernel>\w+)"\s*:\s*"(?P<path>ops\.[\w.]+)"')
_MODEL_TYPE = re.compile(r'^\s*model_type\s*=\s*"(\w+)"', re.MULTILINE)
# GDN's linear_key_head_dim, or KDA's linear_head_dim (q and k share it).
_KEY_HEAD_DIM = re.compile(r"^\s*linear_(?:key_)?head_dim\s*:\s*int\s*=\s*(\d+)", re.MULTILINE)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


@lru_cache(maxsize=8)
def _hub_mapping(root: str) -> dict[str, HubRepo]:
    """Hub repos transformers maps each kernel to (its ``_build_kernel_mapping``), read from source."""
    text = _read(Path(root) / "integrations" / "hub_kernels.py")
    repos: dict[str, HubRepo] = {}
    for match in re.finditer(r'^\s*"(\w+)"\s*:\s*\{', text, re.MULTILINE):
        window = text[match.end() : match.end() + 900]
        repo = re.search(r'repo_id\s*=\s*"([^"]+)"', window)
        layer = re.search(r'layer_name\s*=\s*"([^"]+)"', window)
        if not repo or not layer:
            continue
        version = re.search(r"version\s*=\s*(\d+)", window)
        revision = re.search(r'revision\s*=\s*"([^"]+)"', window)
        call = re.search(r"Repository\((.*?)\)", window, re.DOTALL)  # the repository the fields above come from
        entry = call.group(1) if call else window
        repos.setdefault(
            match.group(1),
            HubRepo(
                repo.group(1),
                layer.group(1),
                int(version.group(1)) if version else None,
                revision.group(1) if revision else None,
                re.search(r"check_arch\s*=\s*False", entry) is None,
            ),
        )
    for kernel, community in _community_layers(text).items():
        repos.setdefault(kernel, community)
    return repos


# transformers 5.25: add_kernels_community_layers("fla", version=3, entries=[("chunk_gated_delta_rule",
# "chunk_gated_delta_rule", devices, modes), ...]) maps each name to kernels-community/<repo>.
_COMMUNITY_CALL = re.compile(r'add_kernels_community_layers\(\s*"([^"]+)"\s*,\s*version\s*=\s*(\d+)\s*,'
                             r"\s*entries\s*=\s*\[(.*?)\n\s*\],?\s*\)", re.DOTALL)
_COMMUNITY_ENTRY = re.compile(r'\(\s*"(\w+)"\s*,\s*"(\w+)"\s*,\s*\(')  # (name, layer, (devices...), (modes...))


def _community_layers(text: str) -> dict[str, HubRepo]:
    repos: dict[str, HubRepo] = {}
    for call in _COMMUNITY_CALL.finditer(text):
        repo, version, body = f"kernels-community/{call.group(1)}", int(call.group(2)), call.group(3)
        # `(name, name, devices, modes) for name in ("causal_conv1d_fn", ...)`: each layer named as its kernel
        listed = re.search(r"\(\s*(\w+)\s*,\s*\1\s*,.*?\bfor\s+\1\s+in\s*\((.*?)\)", body, re.DOTALL)
        pairs = ([(n, n) for n in re.findall(r'"(\w+)"', listed.group(2))] if listed
                 else [(e.group(1), e.group(2)) for e in _COMMUNITY_ENTRY.finditer(body)])
        for kernel, layer in pairs:
            repos[kernel] = HubRepo(repo, layer, version, None)
    return repos


@lru_cache(maxsize=8)
def _internal_paths(root: str) -> dict[str, str]:
    text = _read(Path(root) / "integrations" / "hub_kernels.py")
    block = text.split("_KERNELS_INTERNAL_PATH_MAPPINGS", 1)
    if len(block) < 2:
        return {}
    body = block[1].split("}", 1)[0]
    return {m.group("kernel"): m.group("path") for m in _INTERNAL_PATHS.finditer(body)}


def _family_from_dir(directory: Path, hub: dict[str, HubRepo], internal: dict[str, str]) -> Family | None:
    modeling = directory / f"modeling_{directory.name}.py"
    text = _read(modeling)
    if "use_kernel_func_from_hub_with_fallback" not in text:
        return None
    kernels: list[KernelRequirement] = []
    seen: set[str] = set()
    for match in _DECORATOR.finditer(text):
        kernel, package = match.group("kernel"), match.group("package")
        if kernel in seen:
            continue
        seen.add(kernel)
        internal_path = internal.get(kernel, match.group("internal"))
        module = package if internal_path is None else f"{package}.{internal_path}"
        kernels.append(KernelRequirement(kernel, match.group("func"), package, module, hub.get(kernel)))
    if not kernels:
        return None
    config_text = "".join(_read(p) for p in sorted(directory.glob("configuration_*.py")))
    model_types = tuple(dict.fromkeys(_MODEL_TYPE.findall(config_text))) or (directory.name,)
    key_dim = _KEY_HEAD_DIM.search(config_text)
    return Family(
        name=directory.name,
        model_types=model_types,
        kernels=tuple(kernels),
        has_attention="ALL_ATTENTION_FUNCTIONS" in text,
        gated_delta=any("gated_delta_rule" in k.kernel for k in kernels),
        default_key_head_dim=int(key_dim.group(1)) if key_dim else None,
        source=str(modeling),
    )


@lru_cache(maxsize=8)
def _families(root: str) -> dict[str, Family]:
    base = Path(root)
    hub, internal = _hub_mapping(root), _internal_paths(root)
    families: dict[str, Family] = {}
    for directory in sorted((base / "models").iterdir()):
        if directory.is_dir():
            family = _family_from_dir(directory, hub, internal)
            if family is not None:
                families[family.name] = family
    return families


def families(source: TransformersSource | None = None) -> dict[str, Family]:
    """Every family whose layers call hub-or-package kernels with a torch fallback, by directory name."""
    source = source or transformers_source()
    return _families(str(source.root))


def gated_delta_families(source: TransformersSource | None = None) -> list[str]:
    return [name for name, fam in families(source).items() if fam.gated_delta]


# What a family's layers need most, by the module of its kernels: the first match names its group.
_KINDS = (("gated delta net (fla)", "fla.ops.gated_delta_rule"), ("Kimi delta attention (fla)", "fla.ops.kda"),
          ("Mamba (mamba-ssm)", "mamba_ssm"))
_CONV_ONLY = "short convolution only (causal-conv1d)"


def families_by_kind(source: TransformersSource | None = None) -> dict[str, list[str]]:
    """Every family, grouped by the kernels its layers need most (the groups in :data:`_KINDS` order, then the
    families whose only fast kernel is causal-conv1d's)."""
    groups: dict[str, list[str]] = {}
    for name, family in sorted(families(source).items()):
        modules = [k.module or "" for k in family.kernels]
        kind = next((label for label, prefix in _KINDS if any(m.startswith(prefix) for m in modules)), _CONV_ONLY)
        groups.setdefault(kind, []).append(name)
    return {kind: groups[kind] for kind in (*(label for label, _ in _KINDS), _CONV_ONLY) if kind in groups}


def _find_family(model_type: str, known: dict[str, Family]) -> Family | None:
    if model_type in known:
        return known[model_type]
    for family in known.values():
        if model_type in family.model_types:
            return family
    return None


def _load_config(path: Path) -> dict:
    from .file_kinds import dangling_link, file_kind

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        named = dangling_link(path) or (f"{path} is {kind}" if (kind := file_kind(path)) else None)
        if named:
            raise ConfigError(f"could not read model config {path}: {named}.",
                              fix="pass the model's config.json, or the transformers model folder that holds it "
                              "(a GGUF file has to be converted to a transformers folder first)") from None
        raise ConfigError(f"could not read model config {path}: {exc}", fix="pass a valid config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(
            f"{path} has no 'model_type', so the model family is unknown.",
            fix="pass the config.json of a transformers model, or a family name such as qwen3_5",
        )
    return data


# Config fields kernelguard reads (head geometry for --run and the key-dim known issues, sizes for the trainer's
# FLOP count), with the range a real model can have. A value outside it is a broken config, not a model.
_INT_FIELDS: dict[str, tuple[int, int]] = {
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "head_dim": (1, 4096),
    "hidden_size": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22),
    "num_hidden_layers": (1, 100_000),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "vocab_size": (1, 1 << 26),
    "num_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1 << 16),
    "moe_intermediate_size": (1, 1 << 22),
    "shared_expert_intermediate_size": (0, 1 << 22),
}


def _validate_config(config: dict, path: Path, where: str = "") -> None:
    """One clear error per bad field: the file, the field, the value and what is allowed."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"{where}model_type in {path} must be a non-empty string, found {model_type!r}.",
            fix="pass the config.json of a transformers model, or a family name such as qwen3_5",
            details={"file": str(path), "field": f"{where}model_type"},
        )
    for name, (low, high) in _INT_FIELDS.items():
        if name not in config or config[name] is None:
            continue
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                f"{where}{name} in {path} must be an integer in [{low}, {high}], found {value!r}.",
                fix=f"fix {name} in {path} (it comes from the model's config.json)",
                details={"file": str(path), "field": f"{where}{name}"},
            )
    layer_types = config.get("layer_types")
    if layer_types is not None and not (
        isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)
    ):
        raise ConfigError(
            f"{where}layer_types in {path} must be a list of strings, found {layer_types!r}.",
            fix=f"fix layer_types in {path}",
            details={"file": str(path), "field": f"{where}layer_types"},
        )


def _model_config(path: Path) -> tuple[dict, dict | None]:
    config = _load_config(path)
    text_config = config.get("text_config")
    if text_config is not None and not isinstance(text_config, dict):
        raise ConfigError(
            f"text_config in {path} must be an object, found {type(text_config).__name__}.",
            fix=f"fix text_config in {path}", details={"file": str(path), "field": "text_config"},
        )
    _validate_config(config, path)
    if text_config is not None and "model_type" in text_config:
        _validate_config(text_config, path, where="text_config.")
    return config, text_config


def _dangling(path: Path) -> str | None:
    from .file_kinds import dangling_link

    return dangling_link(path)


def _unknown_to_transformers(model_type: object) -> str | None:
    """Why transformers cannot build ``model_type`` (it is in no model registry), else None. Read from its
    source like everything else here: importing transformers is not needed to say so."""
    if not isinstance(model_type, str):
        return None
    try:
        source = transformers_source()
        text = _read(source.root / "models" / "auto" / "configuration_auto.py")
    except Exception:  # noqa: BLE001 - no transformers source to read: say nothing rather than guess
        return None
    if f'"{model_type}"' in text or f"'{model_type}'" in text:
        return None
    return f"transformers {source.version} does not know this model type (a newer release, or a typo)"


def resolve_model(model: str, source: TransformersSource | None = None) -> ModelSpec:
    """``model`` is a family name, a model_type, a config.json, or a local model directory."""
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ConfigError(
            f"model must be a family name, a config.json or a model folder, found {model!r}.",
            fix="e.g. --model qwen3_5, --model path/to/config.json or --model path/to/model_folder",
        )
    model = str(model)
    known = families(source)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model} is a directory without config.json.", fix="point --model at a model folder")
    if path.suffix == ".json" or path.is_file():
        config, text_config = _model_config(path)
        # Composite (vision-language) configs keep the text model's settings in text_config.
        for model_type in (config["model_type"], (text_config or {}).get("model_type")):
            family = _find_family(model_type, known) if isinstance(model_type, str) else None
            if family is not None:
                return ModelSpec(family, {**config, **(text_config or {})}, str(path))
        unknown = _unknown_to_transformers(config["model_type"])
        if unknown:
            raise ConfigError(f"model_type {config['model_type']!r} in {path}: {unknown}.",
                              fix="upgrade transformers (pip install -U transformers), or check the model_type spelling")
        raise ConfigError(
            f"model_type {config['model_type']!r} in {path} calls no kernels kernelguard can check "
            f"(families with fallback kernels: {', '.join(sorted(known))}).",
            fix="check a hybrid model such as qwen3_5, qwen3_next or qwen3_5_moe",
        )
    family = _find_family(model, known)
    if family is None and (broken := _dangling(path)):
        raise ConfigError(f"--model {model}: {broken}.", fix="point --model at an existing config.json or folder")
    if family is None:
        from .terms import nearest_slip

        near = nearest_slip(model, sorted(known))
        if near:
            raise ConfigError(
                f"unknown model {model!r}: not a family with fallback kernels in transformers, and not a file; "
                f"did you mean {near}?", fix=f"--model {near}",
                details={"replace": (model, near), "flag": "--model"})
        raise ConfigError(
            f"unknown model {model!r}: not a family with fallback kernels in transformers, and not a file. The "
            "families: " + "; ".join(f"{kind}: {', '.join(names)}" for kind, names in families_by_kind(source).items())
            + "; or pass a config.json or model folder.",
            fix="give a family name from the list above, or the path of a config.json or model folder",
        )
    return ModelSpec(family, None, "family name")


@lru_cache(maxsize=8)
def _import_utils_text(root: str) -> str:
    return _read(Path(root) / "utils" / "import_utils.py")


def transformers_min_version(package: str, source: TransformersSource | None = None) -> str | None:
    """The minimum version transformers' own is_*_available() demands for ``package`` (None if it sets none)."""
    spec = PACKAGES.get(package)
    if spec is None or spec.availability_function is None:
        return None
    text = _import_utils_text(str((source or transformers_source()).root))
    body = text.split(f"def {spec.availability_function}(", 1)
    if len(body) < 2:
        return None
    function = re.split(r"\n(?:@|def )", body[1], maxsplit=1)[0]
    found = re.search(r'>=\s*version\.parse\("([^"]+)"\)', function)
    return found.group(1) if found else None


def kernels_version_window(source: TransformersSource | None = None) -> tuple[str, str] | None:
    """[min, max) of the kernels package that this transformers uses; outside it Hub kernels are off."""
    text = _import_utils_text(str((source or transformers_source()).root))
    low = re.search(r'^KERNELS_MIN_VERSION\s*=\s*"([^"]+)"', text, re.MULTILINE)
    high = re.search(r'^KERNELS_MAX_VERSION\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return (low.group(1), high.group(1)) if low and high else None


def clear_caches() -> None:
    """Forget the tables read from transformers' source (kernelguard.runtime.registry.reset() calls this)."""
    for cached in (_hub_mapping, _internal_paths, _families, _import_utils_text):
        cached.cache_clear()
