"""FLOP accounting for MFU, the metrics JSONL file and the end-of-run plot.

``step_flops(config, seq_lens)`` = 3 x forward FLOPs (backward ~ 2 x forward), where forward is, summed
over the real (non-pad) examples of a step:

- matmuls: ``2 * N_matmul`` per token, N_matmul = weights used by one token in matrix products: attention
  projections (q incl. Qwen3.5's output gate, k, v, o), GDN projections (in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a, out_proj), MLP (gate, up, down; for MoE the top-k routed experts + shared expert
  + router), and the LM head. Embedding lookups are free. The depthwise causal conv adds
  ``2 * conv_dim * kernel`` per token.
- full attention, per example of length L and per full-attention layer: QK^T and AV each cost
  ``2 * L^2 * heads * head_dim``; causal masking halves it: ``2 * 2 * L^2 * heads * head_dim / 2``.
- GDN (chunked gated delta rule, chunk C = 64), per token and per value head:
  ``4 * dk * dv`` for the state update and readout (k^T v into the dk x dv state, q S out of it) plus
  ``2 * C * (dk + dv)`` for the intra-chunk terms (causal QK^T / KK^T within the chunk and their products
  with V) — an estimate of the algorithm's work, not of any kernel's instruction count.
Padding tokens are not counted: MFU reports useful work only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GDN_CHUNK = 64

# bf16 dense tensor-core peaks (no sparsity) from the vendors' datasheets, FLOP/s.
_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    value = getattr(cfg, name, None)
    return default if value is None else value


def _layer_types(cfg: Any) -> list[str]:
    types = _get(cfg, "layer_types")
    if types:
        return list(types)
    return ["full_attention"] * int(_get(cfg, "num_hidden_layers", 0))


def _mlp_params(cfg: Any) -> int:
    h = int(cfg.hidden_size)
    experts = _get(cfg, "num_experts", 0) or 0
    if experts:
        top_k = int(_get(cfg, "num_experts_per_tok", 1))
        moe_i = int(_get(cfg, "moe_intermediate_size", cfg.intermediate_size))
        shared_i = int(_get(cfg, "shared_expert_intermediate_size", 0) or 0)
        shared = 3 * h * shared_i + (h if shared_i else 0)  # shared expert + its sigmoid gate
        return top_k * 3 * h * moe_i + shared + h * int(experts)
    return 3 * h * int(cfg.intermediate_size)


def _attention_dims(cfg: Any) -> tuple[int, int, int]:
    heads = int(cfg.num_attention_heads)
    head_dim = int(_get(cfg, "head_dim", cfg.hidden_size // heads))
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    return heads, kv_heads, head_dim


def _attention_params(cfg: Any) -> int:
    h = int(cfg.hidden_size)
    heads, kv_heads, head_dim = _attention_dims(cfg)
    gate = 2 if _get(cfg, "attn_output_gate", True) and "qwen3" in str(_get(cfg, "model_type", "")) else 1
    return h * heads * head_dim * gate + 2 * h * kv_heads * head_dim + heads * head_dim * h


def _gdn_dims(cfg: Any) -> tuple[int, int, int, int]:
    hk = int(_get(cfg, "linear_num_key_heads", 0))
    hv = int(_get(cfg, "linear_num_value_heads", hk))
    dk = int(_get(cfg, "linear_key_head_dim", 0))
    dv = int(_get(cfg, "linear_value_head_dim", dk))
    return hk, hv, dk, dv


def _gdn_params(cfg: Any) -> int:
    h = int(cfg.hidden_size)
    hk, hv, dk, dv = _gdn_dims(cfg)
    key_dim, value_dim = hk * dk, hv * dv
    return h * (2 * key_dim + value_dim) + h * value_dim + 2 * h * hv + value_dim * h


def _gdn_token_flops(cfg: Any) -> float:
    hk, hv, dk, dv = _gdn_dims(cfg)
    conv = 2 * (2 * hk * dk + hv * dv) * int(_get(cfg, "linear_conv_kernel_dim", 4))
    return float(conv + hv * (4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)))


def forward_flops_per_token(config: Any) -> float:
    """Matmul + conv + GDN FLOPs of one token's forward (everything except the L^2 attention term)."""
    cfg = _text_config(config)
    types = _layer_types(cfg)
    n_full = sum(1 for t in types if t == "full_attention")
    n_linear = sum(1 for t in types if t == "linear_attention")
    matmul = len(types) * _mlp_params(cfg) + n_full * _attention_params(cfg) + n_linear * _gdn_params(cfg)
    matmul += int(cfg.hidden_size) * int(cfg.vocab_size)
    return 2.0 * matmul + n_linear * _gdn_token_flops(cfg)


def step_flops(config: Any, seq_lens: Sequence[int]) -> float:
    """3 x forward FLOPs of one step whose real examples have lengths ``seq_lens`` (see module docstring)."""
    cfg = _text_config(config)
    heads, _, head_dim = _attention_dims(cfg)
    n_full = sum(1 for t in _layer_types(cfg) if t == "full_attention")
    tokens = float(sum(seq_lens))
    attention = n_full * sum(2.0 * 2.0 * float(n) ** 2 * heads * head_dim / 2.0 for n in seq_lens)
    return 3.0 * (tokens * forward_flops_per_token(cfg) + attention)


def peak_flops(device: Any) -> float:
    """Peak dense bf16 FLOP/s of ``device`` (H200: 989e12); 0.0 when unknown (CPU) — MFU is then omitted.
    ``--peak-tflops`` overrides it."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(dev)
    for key, value in _PEAKS:
        if key in name:
            return value
    return 0.0


class MetricsLog:
    """Rank-0 JSONL writer; on resume it keeps only the records up to the resumed step."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        kept: list[str] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", math.inf) <= resume_step:
                    kept.append(line)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(k + "\n" for k in kept))
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(jsonl: Path, png: Path) -> Path:
    """Loss and tokens/s over steps, side by side, next to the JSONL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in read_metrics(jsonl) if "step" in r and "loss" in r]
    steps = [r["step"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["loss"] for r in recs])
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax2.plot(steps, [r["tokens_per_s"] for r in recs])
    ax2.set_xlabel("step")
    ax2.set_ylabel("real tokens/s")
    fig.tight_layout()
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(png)
    return png
