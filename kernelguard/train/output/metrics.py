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

import contextlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import GdnDims, attention_dims, field, gdn_dims, layer_types, text_config

from ..common.logs import logger
from ..common.run_folder import METRICS_FILE, METRICS_PLOT
from ..settings.config_rules import check_trackers

__all__ = [
    "GDN_CHUNK",
    "MetricsLog",
    "forward_flops_per_token",
    "open_metrics",
    "peak_flops",
    "plot_metrics",
    "plot_run_metrics",
    "read_metrics",
    "step_flops",
]

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


def _mlp_params(cfg: Any) -> int:
    h = int(cfg.hidden_size)
    experts = field(cfg, "num_experts", 0) or 0
    if experts:
        top_k = int(field(cfg, "num_experts_per_tok", 1))
        moe_i = int(field(cfg, "moe_intermediate_size", cfg.intermediate_size))
        shared_i = int(field(cfg, "shared_expert_intermediate_size", 0) or 0)
        shared = 3 * h * shared_i + (h if shared_i else 0)  # shared expert + its sigmoid gate
        return top_k * 3 * h * moe_i + shared + h * int(experts)
    return 3 * h * int(cfg.intermediate_size)


def _attention_params(cfg: Any) -> int:
    h = int(cfg.hidden_size)
    dims = attention_dims(cfg)
    heads, kv_heads, head_dim = dims.heads, dims.kv_heads, dims.head_dim
    gate = 2 if field(cfg, "attn_output_gate", True) and "qwen3" in str(field(cfg, "model_type", "")) else 1
    return h * heads * head_dim * gate + 2 * h * kv_heads * head_dim + heads * head_dim * h


def _gdn_params(cfg: Any, gdn: GdnDims) -> int:
    h = int(cfg.hidden_size)
    key_dim, value_dim = gdn.num_k_heads * gdn.key_dim, gdn.num_v_heads * gdn.value_dim
    return h * (2 * key_dim + value_dim) + h * value_dim + 2 * h * gdn.num_v_heads + value_dim * h


def _gdn_token_flops(gdn: GdnDims) -> float:
    dk, dv = gdn.key_dim, gdn.value_dim
    return float(2 * gdn.conv_dim * gdn.conv_kernel + gdn.num_v_heads * (4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)))


def forward_flops_per_token(config: Any) -> float:
    """Matmul + conv + GDN FLOPs of one token's forward (everything except the L^2 attention term)."""
    cfg = text_config(config)
    types = layer_types(cfg)
    n_full = sum(1 for t in types if t == "full_attention")
    n_linear = sum(1 for t in types if t == "linear_attention")
    gdn = gdn_dims(cfg)  # None: no GDN fields, so linear layers add nothing
    matmul = len(types) * _mlp_params(cfg) + n_full * _attention_params(cfg)
    matmul += n_linear * _gdn_params(cfg, gdn) if gdn else 0
    matmul += int(cfg.hidden_size) * int(cfg.vocab_size)
    return 2.0 * matmul + (n_linear * _gdn_token_flops(gdn) if gdn else 0.0)


def step_flops(config: Any, seq_lens: Sequence[int]) -> float:
    """3 x forward FLOPs of one step whose real examples have lengths ``seq_lens`` (see module docstring)."""
    cfg = text_config(config)
    dims = attention_dims(cfg)
    n_full = sum(1 for t in layer_types(cfg) if t == "full_attention")
    tokens = float(sum(seq_lens))
    attention = n_full * sum(2.0 * 2.0 * float(n) ** 2 * dims.heads * dims.head_dim / 2.0 for n in seq_lens)
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


def _tracker_tag(key: str) -> str:
    # Hugging Face Trainer's layout: train/loss next to eval/loss, so dashboards line up.
    return "eval/" + key[len("eval_") :] if key.startswith("eval_") else "train/" + key


class _TensorBoard:
    def __init__(self, output: Path, resume_step: int | None, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run logged after its last checkpoint, as metrics.jsonl does.
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(output / "tensorboard"), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("run_config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(_tracker_tag(key), value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """wandb honours WANDB_MODE=offline (files under OUTPUT/wandb, `wandb sync` later), WANDB_PROJECT,
    WANDB_NAME and WANDB_API_KEY."""

    def __init__(self, output: Path, resume_step: int | None, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "kernelguard"),
            name=os.environ.get("WANDB_NAME", output.name),
            dir=str(output),
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({_tracker_tag(k): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    """trackio logs to a local database by default (offline); TRACKIO_PROJECT names the project."""

    def __init__(self, output: Path, resume_step: int | None, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", "kernelguard"), name=output.name, config=config
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        tagged = {_tracker_tag(k): v for k, v in values.items()}
        try:
            self.trackio.log(tagged, step=step)
        except (
            TypeError
        ):  # older trackio counts steps itself: record ours as a metric, like transformers does
            self.trackio.log({**tagged, "train/global_step": step})

    def close(self) -> None:
        self.trackio.finish()


_TRACKER_CLASSES: dict[str, Any] = {"tensorboard": _TensorBoard, "wandb": _WandB, "trackio": _Trackio}


def _open_tracker(name: str, output: Path, resume_step: int | None, config: dict[str, Any]) -> Any:
    check_trackers([name])
    try:
        return _TRACKER_CLASSES[name](output, resume_step, config)
    except Exception as e:  # noqa: BLE001  # a tracker's own setup error (no login, no network) must not be a traceback
        fix = (
            "set WANDB_MODE=offline or run `wandb login`"
            if name == "wandb"
            else f"leave --report-to {name} out"
        )
        raise ConfigError(
            f"--report-to {name}: could not start it: {type(e).__name__}: {e}", fix=fix
        ) from None


# ------------------------------------------------------------------------------------------ metrics log ---
class MetricsLog:
    """Rank-0 JSONL writer that also fans each record out to the --report-to trackers; on resume it keeps
    only the records up to the resumed step (and TensorBoard purges the later events)."""

    def __init__(
        self,
        path: Path,
        *,
        resume_step: int | None,
        report_to: Sequence[str] = (),
        run_config: dict[str, Any] | None = None,
    ) -> None:
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
        self._trackers = {n: _open_tracker(n, path.parent, resume_step, run_config or {}) for n in report_to}
        path.write_text("".join(k + "\n" for k in kept))
        self._file = path.open("a")
        self._broken = False

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk: one line naming it, the run stops (its checkpoints would fail next)
            raise self._failed(e) from None
        step = record.get("step")
        values = {
            k: float(v)
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if isinstance(step, int) and values:
            for name in list(self._trackers):
                try:
                    self._trackers[name].log(step, values)
                except Exception as e:  # noqa: BLE001  # a tracker outage must not stop training; metrics.jsonl has it all
                    logger.warning(f"--report-to {name} stopped: {type(e).__name__}: {e}")
                    self._trackers.pop(name)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:
            if not self._broken:  # already said by write(): the buffered line fails again on close
                raise self._failed(e) from None
        finally:
            for tracker in self._trackers.values():
                tracker.close()
            self._trackers = {}

    def _failed(self, error: OSError) -> BaseException:
        from ..common.write_errors import write_failure

        self._broken = True
        with contextlib.suppress(OSError):
            self._file.close()
        return write_failure(f"writing {self.path}", error, folder=self.path.parent)


def open_metrics(
    output_dir: Path, *, report_to: Sequence[str], run_config: dict[str, Any], resume_step: int | None
) -> MetricsLog:
    """``OUTPUT/metrics.jsonl`` plus the --report-to trackers, each given the run's resolved configuration."""
    return MetricsLog(
        output_dir / METRICS_FILE, resume_step=resume_step, report_to=report_to, run_config=run_config
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run_metrics(output: Path) -> str | None:
    """``OUTPUT/metrics.png`` from ``OUTPUT/metrics.jsonl``; the line to log when it could not be drawn. The model
    is exported by then: the plot is a convenience, so a failure (no matplotlib, a full disk) is said, not
    raised."""
    from kernelguard.resolution import extra_command

    from ..common.write_errors import describe, disk_free

    try:
        plot_metrics(output / METRICS_FILE, output / METRICS_PLOT)
    except ImportError:
        return f"matplotlib is not installed: no metrics.png ({extra_command('train')})"
    except OSError as e:
        free = disk_free(output)
        room = f"; {free / 2**30:.1f} GiB free there" if free is not None else ""
        return f"warning: metrics.png not written: {describe(e)}{room} (metrics.jsonl holds every figure)"
    return None


def plot_metrics(jsonl: Path, png: Path) -> Path:
    """Loss (and eval loss, when the run has eval records) and tokens/s over steps, next to the JSONL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl)
    recs = [r for r in records if "step" in r and "loss" in r]
    evals = [r for r in records if "step" in r and r.get("eval_loss") is not None]
    steps = [r["step"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(steps, [r["loss"] for r in recs], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        ax1.legend()
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
