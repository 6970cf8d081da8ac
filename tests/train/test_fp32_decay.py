"""Qwen3.5's GDN decay parameters (``A_log``, ``dt_bias``) stay fp32 under a bf16 FSDP2 policy: loaded from
the checkpoint's fp32 values, read in fp32 by the forward, their gradients averaged over ranks, stepped by
AdamW, exported in fp32 (kernelguard.train.model.parallel.apply_fsdp, step, build, export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import train_helpers as h
from safetensors import safe_open

from kernelguard.train.model.parallel import FP32_PARAM_NAMES
from kernelguard.train.output.export import tensor_dtype


def test_export_dtype_keeps_the_decay_parameters_fp32() -> None:
    assert FP32_PARAM_NAMES == {"A_log", "dt_bias"}
    assert tensor_dtype("model.layers.0.linear_attn.A_log", torch.bfloat16) == torch.float32
    assert tensor_dtype("model.layers.0.linear_attn.dt_bias", torch.float16) == torch.float32
    assert tensor_dtype("model.layers.0.linear_attn.in_proj_qkv.weight", torch.bfloat16) == torch.bfloat16
    assert tensor_dtype("model.layers.0.linear_attn.A_log_scale", torch.bfloat16) == torch.bfloat16


def _source(path: Path) -> dict[str, torch.Tensor]:
    """A tiny Qwen3.5 checkpoint as the Hub ships them: bf16 weights, fp32 decay parameters whose values bf16
    cannot hold."""
    import tiny_models

    torch.manual_seed(0)
    model = tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
    decay = {n: p.detach().clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in FP32_PARAM_NAMES}
    for name, value in decay.items():
        if name.endswith("dt_bias"):
            value += torch.linspace(0.01, 0.3, value.numel())  # ones at init: bf16 holds those exactly
    model.to(torch.bfloat16)
    for name, value in decay.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(module, name.rsplit(".", 1)[1], torch.nn.Parameter(value))
    model.save_pretrained(str(path))
    for value in decay.values():
        assert (value.to(torch.bfloat16).float() != value).all()  # the test would prove nothing otherwise
    return decay


@pytest.mark.slow
def test_decay_parameters_stay_fp32_in_compute_on_two_ranks_and_in_the_export(tmp_path: Path) -> None:
    decay = _source(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(h.REPO), str(h.TESTS_DIR)]), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(h.TESTS_DIR / "fp32_decay_worker.py"), str(tmp_path / "src"), str(out)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    gdn = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]
    for rank in ranks:
        kept, reverted = rank["kept"], rank["reverted"]
        assert sorted(kept["seen"]) == gdn
        for layer, seen in kept["seen"].items():
            assert (seen["A_log"], seen["dt_bias"], seen["in_proj_qkv"]) == ("torch.float32",) * 2 + ("torch.bfloat16",)
            assert torch.equal(torch.tensor(seen["A_log_values"]), decay[f"{layer}.A_log"])  # exact, not rounded
        assert set(kept["param_dtypes"].values()) == {"torch.float32"}
        assert kept["groups"][-1] == 2 * len(gdn)  # AdamW: a group of their own (plain tensors, not DTensors)
        # The same hooks see bf16 when every parameter follows the policy (the behaviour this change fixed).
        assert {s["A_log"] for s in reverted["seen"].values()} == {"torch.bfloat16"}
    # Different batches per rank, one averaged gradient and one update on both.
    assert ranks[0]["kept"]["grads"] == ranks[1]["kept"]["grads"]
    assert ranks[0]["kept"]["after"] == ranks[1]["kept"]["after"]
    assert ranks[0]["kept"]["grad_norm"] == ranks[1]["kept"]["grad_norm"]
    # over both ranks' shards (kernelguard.train.step.grad_norm) and the parameters every rank keeps whole
    assert ranks[0]["kept"]["grad_norm"] == pytest.approx(ranks[0]["kept"]["reference_norm"], rel=1e-5)
    after = {k: torch.tensor(v) for k, v in ranks[0]["kept"]["after"].items()}
    assert all(not torch.equal(after[k], decay[k]) for k in decay)  # AdamW stepped them
    final = out / "final"
    with safe_open(str(next(final.glob("*.safetensors"))), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    for key, value in after.items():
        assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], value), key
    assert tensors["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16


@pytest.mark.slow
def test_bf16_run_with_fp32_decay_checkpoints_resumes_and_exports_on_two_ranks(tmp_path: Path) -> None:
    """The parameters kept whole go through kernelguard train's DCP checkpoint, --resume and export."""
    assets = h.write_train_assets(tmp_path, rows=120)
    args = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--block-size", "128", "--param-dtype", "bf16", "--learning-rate", "1e-2", "--no-progress", "--no-plot",
            "--allow", "attention", "--save-steps", "2", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    first = h.run_train([*args, "--max-steps", "2"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = h.run_train([*args, "--max-steps", "3", "--resume"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    with safe_open(str(next((tmp_path / "out" / "final").glob("*.safetensors"))), framework="pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys() if k.startswith("model.layers.0.linear_attn.")}  # noqa: SIM118
    assert dtypes["model.layers.0.linear_attn.A_log"] == dtypes["model.layers.0.linear_attn.dt_bias"] == torch.float32
    assert dtypes["model.layers.0.linear_attn.in_proj_qkv.weight"] == torch.bfloat16
