"""A model's geometry, read from its transformers config in one place.

Everything that sizes work from a config (``check --run``'s shapes, the trainer's FLOP count, memory probe and
checkpoint-size preflight, the kernel table's key head dim) reads it through here, so a multimodal config's text
config, a missing optional field and a plain ``config.json`` dict are handled the same way everywhere.

Accepts a ``PretrainedConfig``, any object with the same attributes (``SimpleNamespace``) or a mapping (a parsed
``config.json``). Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AttentionDims",
    "GdnDims",
    "attention_dims",
    "delta_rule_dims",
    "estimated_params",
    "field",
    "gdn_dims",
    "kda_dims",
    "key_head_dim",
    "layer_types",
    "model_type",
    "text_config",
]

DEFAULT_CONV_KERNEL = 4  # transformers' default linear_conv_kernel_dim


@dataclass(frozen=True, slots=True)
class GdnDims:
    """One gated-delta-net layer: key/value heads, their head dims, and the short conv's width."""

    num_k_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = DEFAULT_CONV_KERNEL

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short conv: q, k (key heads) and v (value heads) side by side."""
        return 2 * self.num_k_heads * self.key_dim + self.num_v_heads * self.value_dim


@dataclass(frozen=True, slots=True)
class AttentionDims:
    """One full-attention layer: query heads, key/value heads (GQA), head dim."""

    heads: int
    kv_heads: int
    head_dim: int


def field(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` (or ``config[name]`` for a mapping); ``default`` when absent or None."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return default if value is None else value


def text_config(config: Any) -> Any:
    """The text model's config: ``get_text_config()`` of a multimodal config, else ``text_config``, else itself."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter()
        except (AttributeError, TypeError, ValueError):  # odd configs: fall back to the object itself
            pass
    return field(config, "text_config") or config


def model_type(config: Any) -> str | None:
    """The text model's ``model_type``, else the outer config's (e.g. ``qwen3_5_text`` / ``qwen3_5``)."""
    return field(text_config(config), "model_type") or field(config, "model_type") or None


def gdn_dims(config: Any) -> GdnDims | None:
    """The GDN geometry of the (text) config; None when it has no ``linear_num_key_heads`` /
    ``linear_key_head_dim``. Value heads and head dim default to the key ones, as transformers' layers do."""
    text = text_config(config)
    hk, kd = field(text, "linear_num_key_heads"), field(text, "linear_key_head_dim")
    if not hk or not kd:
        return None
    return GdnDims(
        num_k_heads=int(hk),
        num_v_heads=int(field(text, "linear_num_value_heads") or hk),
        key_dim=int(kd),
        value_dim=int(field(text, "linear_value_head_dim") or kd),
        conv_kernel=int(field(text, "linear_conv_kernel_dim") or DEFAULT_CONV_KERNEL),
    )


def kda_dims(config: Any) -> GdnDims | None:
    """A Kimi-delta-attention layer (kimi_linear, glm5_next, bailing_hybrid) as a GDN geometry: q, k and v
    share ``linear_num_heads`` heads of ``linear_head_dim``; None when the config has no such fields."""
    text = text_config(config)
    heads, dim = field(text, "linear_num_heads"), field(text, "linear_head_dim")
    if not heads or not dim:
        return None
    conv = field(text, "linear_conv_kernel_dim") or field(text, "short_conv_kernel_size") or DEFAULT_CONV_KERNEL
    return GdnDims(num_k_heads=int(heads), num_v_heads=int(heads), key_dim=int(dim), value_dim=int(dim),
                   conv_kernel=int(conv))


def delta_rule_dims(config: Any) -> GdnDims | None:
    """The linear-attention layer's geometry, GDN or KDA; None when the config has neither."""
    return gdn_dims(config) or kda_dims(config)


def key_head_dim(config: Any) -> int | None:
    """The linear-attention layer's key head dim (GDN's ``linear_key_head_dim``, KDA's ``linear_head_dim``),
    None when absent or zero."""
    text = text_config(config)
    value = field(text, "linear_key_head_dim") or field(text, "linear_head_dim")
    return int(value) if value else None


def attention_dims(config: Any) -> AttentionDims:
    """Full-attention heads of the (text) config; raises AttributeError without ``num_attention_heads``."""
    text = text_config(config)
    heads = field(text, "num_attention_heads")
    if heads is None:
        raise AttributeError(f"{type(text).__name__} has no num_attention_heads")
    heads = int(heads)
    head_dim = int(field(text, "head_dim", int(field(text, "hidden_size")) // heads))
    return AttentionDims(heads=heads, kv_heads=int(field(text, "num_key_value_heads", heads)), head_dim=head_dim)


def layer_types(config: Any) -> list[str]:
    """``layer_types`` of the (text) config; a config without it is all full attention."""
    text = text_config(config)
    types = field(text, "layer_types")
    if types:
        return list(types)
    return ["full_attention"] * int(field(text, "num_hidden_layers", 0))


def estimated_params(config: Any) -> int:
    """A lower-bound parameter count: embeddings (and an untied head), MLP (all experts), 4 x hidden^2 mixing."""
    text = text_config(config)
    hidden, vocab = int(field(text, "hidden_size")), int(field(text, "vocab_size"))
    layers = int(field(text, "num_hidden_layers", 0) or 0)
    experts = int(field(text, "num_experts", 0) or 0)
    if experts:
        mlp_width = experts * int(field(text, "moe_intermediate_size", 0) or 0)
        mlp_width += int(field(text, "shared_expert_intermediate_size", 0) or 0)
    else:
        mlp_width = int(field(text, "intermediate_size", 0) or 0)
    heads = 1 if field(text, "tie_word_embeddings", False) else 2
    return heads * vocab * hidden + layers * (3 * hidden * mlp_width + 4 * hidden * hidden)
