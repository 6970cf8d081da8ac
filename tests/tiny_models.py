"""Tiny random-init hybrid models (GDN + full attention) for CPU tests.

``tiny_model(family)`` imports the modeling module at call time, so a model built inside the
``fake_providers`` fixture uses the kernel choice transformers made with the fakes importable.
"""

from __future__ import annotations

import importlib
from typing import Any

# family -> (modeling module, config class, causal-LM class)
_FAMILIES: dict[str, tuple[str, str, str]] = {
    "qwen3_5": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_next": ("transformers.models.qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    # Kimi delta attention (chunk_kda) + MLA attention + MoE: the family kernelguard train does not pack
    "kimi_linear": ("transformers.models.kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM"),
    # Mamba-2 (mamba_split_conv1d_scan_combined): its causal LM drops the batch's keywords before its backbone
    "mamba2": ("transformers.models.mamba2", "Mamba2Config", "Mamba2ForCausalLM"),
    # Mamba-2 + attention + MoE, whose causal LM passes them on: the Mamba family kernelguard train packs
    "nemotron_h": ("transformers.models.nemotron_h", "NemotronHConfig", "NemotronHForCausalLM"),
    # the other Mamba-2 hybrids that pass their keywords on: attention every few layers (Bamba), attention and
    # Mamba-2 side by side in every layer (Falcon-H1), one shared attention block between Mamba-2 layers (Zamba2)
    "bamba": ("transformers.models.bamba", "BambaConfig", "BambaForCausalLM"),
    "falcon_h1": ("transformers.models.falcon_h1", "FalconH1Config", "FalconH1ForCausalLM"),
    "zamba2": ("transformers.models.zamba2", "Zamba2Config", "Zamba2ForCausalLM"),
    # Mamba-1 (selective_scan_fn, no boundary parameter) + attention + MoE: never packed
    "jamba": ("transformers.models.jamba", "JambaConfig", "JambaForCausalLM"),
    # short convolutions around attention and MLP whose decoder layer calls them without its **kwargs
    "inkling": ("transformers.models.inkling", "InklingTextConfig", "InklingForCausalLM"),
    # short convolutions (causal_conv1d_fn) + attention, whose layers hand the conv its seq_idx
    "lfm2": ("transformers.models.lfm2", "Lfm2Config", "Lfm2ForCausalLM"),
}

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")  # the GDN families

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "max_position_embeddings": 512,
    "use_cache": False,
    "tie_word_embeddings": False,
}
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


# Kimi-Linear's own fields (no GDN ones: a config is read as GDN when it has linear_num_key_heads).
_KIMI: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
    "tie_word_embeddings": False,
}


# The Mamba-2 families' own fields (4 heads of 32 = expand 2 x hidden 64; chunk 8: a 17-token row spans chunks).
_MAMBA2: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "expand": 2,
    "n_groups": 1, "state_size": 16, "chunk_size": 8, "use_cache": False, "tie_word_embeddings": False,
    "attn_implementation": "eager",  # it has no attention: transformers refuses to build it asked for sdpa
}
_NEMOTRON_H: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16,
    "chunk_size": 8, "use_cache": False, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 2,
}
_MAMBA2_HYBRID: dict[str, Any] = {  # the fields Bamba, Falcon-H1 and Zamba2 share
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "use_cache": False, "tie_word_embeddings": False, "pad_token_id": 0,
}
_MAMBA_FIELDS = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16,
                 "mamba_chunk_size": 8, "mamba_expand": 2}
_BAMBA = {**_MAMBA2_HYBRID, **_MAMBA_FIELDS, "attn_layer_indices": [3]}
_FALCON_H1 = {**_MAMBA2_HYBRID, **_MAMBA_FIELDS, "num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 128}
_ZAMBA2 = {**_MAMBA2_HYBRID, "num_key_value_heads": 4, "n_mamba_heads": 4, "mamba_headdim": 32, "mamba_ngroups": 1,
           "mamba_d_state": 16, "chunk_size": 8, "mamba_expand": 2, "hybrid_layer_ids": [3],
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "hybrid"], "use_mem_rope": False}
_JAMBA = {**_MAMBA2_HYBRID, "attn_layer_period": 4, "attn_layer_offset": 3, "expert_layer_period": 2,
          "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 16,
          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8}
_INKLING = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
            "num_experts_per_tok": 2, "n_routed_experts": 4, "pad_token_id": 0, "max_position_embeddings": 512,
            "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], "use_cache": False}
_LFM2 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "max_position_embeddings": 512,
         "layer_types": ["conv", "conv", "conv", "full_attention"], "use_cache": False, "tie_word_embeddings": False}
_OWN = {"inkling": _INKLING, "lfm2": _LFM2, "jamba": _JAMBA, "kimi_linear": _KIMI, "mamba2": _MAMBA2, "nemotron_h": _NEMOTRON_H, "bamba": _BAMBA, "falcon_h1": _FALCON_H1,
        "zamba2": _ZAMBA2}


def _classes(family: str) -> tuple[type, type]:
    try:
        package, config_name, model_name = _FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(_FAMILIES)}") from None
    module = importlib.import_module(package)
    return getattr(module, config_name), getattr(module, model_name)


def tiny_config(family: str, **overrides: Any) -> Any:
    """A config with hidden 64, vocab 256, 4 layers (3 linear_attention + 1 full_attention)."""
    config_cls, _ = _classes(family)
    values = dict(_OWN.get(family, _COMMON))
    if family in ("qwen3_next", "qwen3_5_moe"):
        values.update(_MOE)
    values.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        values["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    attn_implementation = values.pop("attn_implementation", "sdpa")
    config = config_cls(**values)
    config._attn_implementation = attn_implementation
    return config


def tiny_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A random-init causal LM of ``family`` in eval mode, float32, on CPU."""
    import torch

    _, model_cls = _classes(family)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    return model_cls(config).eval()


def packed_row(lengths: tuple[int, ...], *, vocab: int = 256, seed: int = 1) -> tuple[Any, dict[str, Any]]:
    """One packed row of examples of ``lengths`` (random ids) with every boundary signal
    DataCollatorWithFlattening writes: (input_ids, the boundary keywords)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, {
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "seq_idx": torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None],
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
    }
