"""Process group, meta-device model construction, activation checkpointing and FSDP2 sharding.

The model is built on the meta device on every rank (so the guard can inspect it before any data work and
models larger than one GPU never exist whole on one), wrapped (AC per decoder layer, ``fully_shard`` per
decoder layer and the root), materialized with ``to_empty`` and filled from a full state dict that only
rank 0 holds (``from_pretrained`` on CPU, or a seeded random init), broadcast shard by shard by
``set_model_state_dict(..., broadcast_from_rank0=True)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernelguard.errors import ConfigError

from ..common.ranks import DistInfo

__all__ = [
    "DTYPES",
    "FP32_PARAM_NAMES",
    "WEIGHT_FILES",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "build_meta_model",
    "decoder_layers",
    "fp32_params",
    "full_state_on_rank0",
    "init_distributed",
    "materialize",
    "mixed_precision",
    "model_source",
]


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# Parameters that stay fp32 in compute whatever --param-dtype says, matched by their own name: the GDN decay of
# Qwen3.5 / Qwen3-Next (checkpoints store them fp32, and NeMo Automodel and Megatron keep them fp32 under FSDP2).
# bf16 keeps 8 significant bits: rounding A_log changes exp(A_log), each head's decay rate, by up to 0.2% x
# |A_log|, and transformers' `A_log.float()` in the forward cannot bring back what the cast dropped.
FP32_PARAM_NAMES = frozenset({"A_log", "dt_bias"})
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def init_distributed() -> DistInfo:
    """torchrun's environment (any rendezvous it was given), else a one-process group for plain `python -m`."""
    use_cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
    else:
        local_rank = 0
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def model_source(model: str) -> tuple[Any, Path | None]:
    """(config, weights directory or None for random init) for a model directory or a config.json."""
    from transformers import AutoConfig

    from kernelguard.resolution import dangling_link, file_kind

    path = Path(model)
    if path.is_file():
        if path.suffix != ".json":
            kind = file_kind(path)
            raise ConfigError(
                f"--model {model} is {kind or 'a file but not a config.json'}.",
                fix="pass a transformers model folder (config.json + safetensors) or its config.json"
                + ("; convert GGUF to a transformers folder first" if kind and "GGUF" in kind else ""),
            )
        return _read_config(path, lambda raw: AutoConfig.for_model(raw.pop("model_type"), **raw)), None
    if path.is_dir() and (path / "config.json").exists():
        config = _read_config(path / "config.json", lambda raw: AutoConfig.from_pretrained(str(path)))
        has_weights = any((path / f).exists() for f in WEIGHT_FILES)
        return config, path if has_weights else None
    if (broken := dangling_link(path)) is not None:
        raise ConfigError(f"--model {broken}.", fix="point --model at an existing model folder or config.json")
    raise ConfigError(
        f"--model {model} is neither a model directory with config.json nor a config.json file.",
        fix="pass a local model directory or a config.json (no downloads are made)",
    )


def _read_config(path: Path, make: Callable[[dict[str, Any]], Any]) -> Any:
    """``make(raw)`` for a config.json read by us first, so every way it can be wrong (not JSON, not an
    object, no or an unknown model_type, a value transformers rejects) is one ConfigError naming the file."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model: {path} is not valid JSON ({e}).", fix=f"fix or restore {path}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise ConfigError(
            f"--model: {path} has no model_type string (found {type(raw).__name__}"
            + (f" with model_type {model_type!r})." if isinstance(raw, dict) else ")."),
            fix=f"restore {path} as saved with its model (it names a model_type such as qwen3_5)",
        )
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"--model: {path} has model_type {model_type!r}, which transformers {__version__} does not know.",
            fix="upgrade transformers (pip install -U transformers), or check the model_type spelling",
        )
    try:
        return make(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--model: transformers rejects {path}: {first}", fix=f"fix {path}") from None


def build_meta_model(config: Any, *, attn_implementation: str) -> nn.Module:
    """The model on the meta device, fp32, ``use_cache=False``, with the chosen attention implementation."""
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                    dtype=torch.float32)
    except ValueError as e:
        # A model with no attention of its own (Mamba2ForCausalLM) accepts only eager, which it never runs; one
        # with attention that refuses this implementation runs eager, and the guard judges that attention.
        if "does not support an attention implementation" not in str(e):
            raise
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def full_state_on_rank0(
    config: Any, weights: Path | None, *, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(persistent state dict, non-persistent buffers) of the initial model, on CPU in fp32."""
    from transformers import AutoModelForCausalLM

    if weights is not None:
        try:
            # use_kernels=False, as the stack check decided (gate.check_stack(hub=False)): the run is checked and
            # guarded on the pip packages, and transformers 5.25+ would otherwise load Hub kernels by default
            # (and raise ValueError without a kernels inside its window).
            model = AutoModelForCausalLM.from_pretrained(str(weights), config=config, dtype=torch.float32,
                                                         use_kernels=False)
        except (RuntimeError, OSError, ValueError) as e:  # a shape mismatch, an unreadable or partial shard
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--model {weights}: transformers could not load the weights: {first}",
                fix="restore the model folder as saved (config.json and weight files together), or --init random",
            ) from None
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    buffers = {name: b for name, b in model.named_buffers() if name not in state}
    return state, buffers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    for name in ("model.layers", "model.language_model.layers", "transformer.h"):
        obj: Any = model
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ConfigError(
        f"could not find the decoder layers of {type(model).__name__}.",
        fix="report the model class; kernelguard train knows model.layers and model.language_model.layers",
    )


def apply_activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=True)


def fp32_params(model: nn.Module, names: Collection[str] = FP32_PARAM_NAMES) -> dict[str, nn.Parameter]:
    """The parameters (by full name) that :data:`FP32_PARAM_NAMES` keeps in fp32."""
    return {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in names}


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: Any,
    mp_policy: Any,
    reshard_after_forward: bool = True,
    keep_fp32: Collection[str] = FP32_PARAM_NAMES,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, LM head).

    The parameters named in ``keep_fp32`` (a few hundred values per layer) are left out of every FSDP2 unit
    when the policy computes in a lower dtype: they stay whole, fp32, on every rank, so the forward reads
    them in fp32. FSDP2 casts a unit's parameters to one dtype, and a unit is a module with everything under
    it not already in a unit: ``A_log`` sits on the GDN module beside its projections, and the GDN forward
    reads ``conv1d.weight`` without calling ``conv1d`` (so its children cannot be units of their own, which
    would leave the GDN unit holding the decay alone). The price of leaving them out is that FSDP2 does not
    reduce their gradients: :func:`sync_replicated_grads` averages them, and the optimizer and the clip treat
    them as plain tensors."""
    from torch.distributed.fsdp import fully_shard

    low = mp_policy.param_dtype is not None and mp_policy.param_dtype.itemsize < torch.float32.itemsize
    kept = set(fp32_params(model, keep_fp32).values()) if low else set()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them unsharded.
        last = i == len(layers) - 1
        fully_shard(
            layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward and not last,
            ignored_params=kept or None,
        )  # fmt: skip
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, ignored_params=kept or None)
    return model


def mixed_precision(param_dtype: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)


def materialize(
    model: nn.Module,
    *,
    info: DistInfo,
    config: Any,
    weights: Path | None,
    seed: int,
) -> None:
    """to_empty on this rank's device, then fill parameters and buffers from rank 0's full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=info.device)
    state: dict[str, Any] = {}
    buffers: dict[str, torch.Tensor] = {}
    if info.is_main:
        state, buffers = full_state_on_rank0(config, weights, seed=seed)
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    # Non-persistent buffers (rotary inv_freq, ...) are not in any state dict: send them as objects.
    box = [buffers]
    dist.broadcast_object_list(box, src=0)
    own = dict(model.named_buffers())
    for name, value in box[0].items():
        target = own.get(name)
        if target is None:
            target = own.get(_wrapped_name(name))
        if target is None:
            raise ConfigError(
                f"buffer {name} of the initial model is missing after wrapping.", fix="report this"
            )
        with torch.no_grad():
            target.copy_(value.to(target.device, target.dtype))


def _wrapped_name(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2] + ["_checkpoint_wrapped_module"] + parts[i + 2 :])
    return name


